// Prefill matmuls on pipelined TF32 tiles (quantized types; sm_80 or sm_90: ~110 KiB of shared memory a block), in
// two passes, the weights dequantized into a float scratch slab (dequant_tf32_{t}) and a dense GEMM over it
// (gemm_dense), or in one, the GGUF rows staged raw and dequantized beside the multiply (gemm_pipe_{t}, at the end);
// the tile both share: gemm_tc_tile.cuh.
// Contract: kernels/README.md, "gemm_tc.cu"; the wrappers: engine/cuda/k_gemm_tc.py; the rule that picks these over
// gemm.cu: engine/cuda/prefill.py, engine/cuda/dispatch.py.
//
// Why two passes: gemm.cu dequantizes each weight group inside its K loop, once per 64-token tile, through registers,
// two stages deep; at 512 tokens (the Qwen3-0.6B shape, H200) its tiles ran at ~50 TFLOP/s, a tenth of the tensor
// cores' TF32 rate. Dequantized once a launch into scratch (a float per value: 4 bytes written for ~0.6 read, from
// L2 for the GEMM that follows), the matmul becomes a plain dense one, and the dense GEMM can be the usual pipeline:
// both operands copied global -> shared with cp.async, NSTAGE stages in flight, fragments by ldmatrix, mma.sync.
//
// The roundings are gemm.cu's: every operand rounded to tf32 (to nearest, ties away from zero: the weights as they
// are dequantized, A as its fragments are loaded), float32 accumulation in the same k order within a split, on
// m16n8k8 steps where gemm.cu's wmma m16n16k8 is another instruction (its accumulator's rounding inside a step may
// differ). The tests hold both to gemm.cu's bounds (tests/test_cuda_gemm.py).
//
// The scratch layout: one matrix, row i of the slab = weight row r0 + i. A SwiGLU pair (gate, up) interleaved in
// groups of 32 rows: slab row 64 b + j is gate row r0 + 32 b + j, 64 b + 32 + j up row r0 + 32 b + j (j < 32), so one
// 64-row tile of the GEMM holds gate and up of the same 32 outputs; rows past the slab's are zeros.
#include "gemm_tc_tile.cuh"
#include "pdl.cuh"
#include "quant.cuh"
#include "stage.cuh"

namespace {

constexpr int DQ_THREADS = 256;  // dequant: 8 values a thread

template <int T>
__device__ __forceinline__ void dequant_rows(const uint8_t* W, const uint8_t* Wu, long long row_bytes, int R, int K,
                                             int r0, int rows, int slab_rows, float* __restrict__ out) {
    pdl::begin();  // out may still be read by the GEMM before this one (the scratch is shared)
    const long long i = (long long)blockIdx.x * DQ_THREADS + threadIdx.x;  // the 8-value group of the slab
    const int groups = K >> 3;
    if (i >= (long long)slab_rows * groups) return;
    const int s = int(i / groups), g = int(i - (long long)s * groups);  // slab row, group of it
    int r = r0 + s;
    const uint8_t* src = W;
    if (Wu) {  // interleaved pair: 32 gate rows, then the same 32 up rows
        r = r0 + 32 * (s >> 6) + (s & 31);
        src = (s & 32) ? Wu : W;
    }
    float v[8];
    if (r < r0 + rows && r < R) {
        q::Quant<T>::load8(src + (long long)r * row_bytes, g, v);
    } else {
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] = 0.f;
    }
    float4* d = reinterpret_cast<float4*>(out + (long long)s * K + 8 * g);
    d[0] = make_float4(tf32_round(v[0]), tf32_round(v[1]), tf32_round(v[2]), tf32_round(v[3]));
    d[1] = make_float4(tf32_round(v[4]), tf32_round(v[5]), tf32_round(v[6]), tf32_round(v[7]));
}

}  // namespace

// out[s, :] for slab rows s < slab_rows, tf32-rounded; Wu null: one matrix, else the interleaved (W = gate, Wu = up)
// pair. A thread an 8-value group, in row-major order over the slab.
#define DEQUANT_KERNEL(tag, T)                                                                                     \
    extern "C" __global__ void __launch_bounds__(DQ_THREADS)                                                      \
        dequant_tf32_##tag(const uint8_t* __restrict__ W, const uint8_t* __restrict__ Wu, long long row_bytes,     \
                           int R, int K, int r0, int rows, int slab_rows, float* __restrict__ out) {             \
        dequant_rows<T>(W, Wu, row_bytes, R, K, r0, rows, slab_rows, out);                                       \
    }
Q_FOR_EACH_QUANTIZED_TYPE(DEQUANT_KERNEL)
#undef DEQUANT_KERNEL

// ---- the dense GEMM ---------------------------------------------------------------------------------------------
// Output columns [c0, c0 + cols) = A[n, K] . Wd[Rs, K]^T (+ resid), or the SwiGLU of an interleaved pair, into the
// segments (C0, C1, C2) ending at columns e0 <= e1 <= e2 (Out). grid (ceil(Rs / 64), ceil(n / 128), S), block 128,
// dynamic shared memory NSTAGE * (128 + 64) * 36 floats. S > 1 splits K into S spans of whole stages: block z writes
// its raw tile to part[z * tiles + tile][128][64], and the block that takes the tile's last ticket sums the partials
// in z order and writes the output (tiles = grid.x * grid.y).
extern "C" __global__ void __launch_bounds__(THREADS, 2)
    gemm_dense(const float* __restrict__ Wd, int Rs, int K, const float* __restrict__ A, int n, const float* resid,
               float* C0, float* C1, float* C2, int e0, int e1, int e2, int c0, int cols, int pair, float* part,
               int* tickets) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    extern __shared__ __align__(128) float smem[];
    __shared__ int last;
    pdl::begin();
    const int r0 = blockIdx.x * BN, t0 = blockIdx.y * BM, S = gridDim.z;
    const int span = K / S, kbeg = span * int(blockIdx.z), nk = span / BK;
    Acc<> acc;
    acc.zero();
#pragma unroll
    for (int s = 0; s < NSTAGE - 1; ++s) {  // the pipeline's head; a group per stage, empty past the span
        if (s < nk) load_stage(smem + s * STAGE_FLOATS, A, K, t0, n, Wd, Rs, r0, kbeg + s * BK);
        stage::commit();
    }
    for (int kt = 0; kt < nk; ++kt) {
        stage::wait_pending<NSTAGE - 2>();  // stage kt has landed (this thread's copies)
        __syncthreads();                    // everyone's; and every warp is done with stage kt - 1's buffer
        const int next = kt + NSTAGE - 1;
        if (next < nk) load_stage(smem + (next % NSTAGE) * STAGE_FLOATS, A, K, t0, n, Wd, Rs, r0, kbeg + next * BK);
        stage::commit();
        const float* st = smem + (kt % NSTAGE) * STAGE_FLOATS;
        acc.mma_stage(st, st + BM * LD);
    }
    stage::wait_pending<0>();
    __syncthreads();  // every read of the stage buffers is done: sC goes over them
    finish(acc, smem, &last, t0, n, r0, cols, pair, resid, Out{C0, C1, C2, e0, e1, e2}, c0, part, tickets);
#endif
}

// ---- the pipelined GEMM over GGUF blocks ------------------------------------------------------------------------
// gemm_pipe_{t}: gemm_dense's tile, warps and output, with the weights read as GGUF blocks instead of a slab. A block's
// 64 weight rows come to shared memory RAW_K values of K at a time (one K-quant block, or eight blocks of the 32-value
// types: whole blocks, so a decoder indexes its groups from the slice's start), in two raw buffers. During stage kt
// the block dequantizes stage kt + 1's 64 x 32 values from the raw slice into a float tile (tf32-rounded, two
// tiles), which the warps read as gemm_dense reads the slab: the dequantizing happens once a block and beside the
// multiply, and nothing goes through global memory in between. A takes a ring of PIPE_STAGES stages (the raw slices
// take the shared memory a fourth would).
// Shared memory (floats): sA[PIPE_STAGES][BM][LD], sW[2][BN][LD], then the raw slices, raw[2][BN][RAW_PITCH<T>] bytes.
// The rows of tile x: one matrix, rows 64 x + j of W0; a pair, 32 x + j of W0 (j < 32) and of W1 (j >= 32), which
// write_out turns into the outputs 32 x + j, as gemm_dense's interleaved slab.
namespace {

constexpr int RAW_K = 256, PIPE_STAGES = 3;
// Warps a block (Acc): 8, or 4 (the compared form, -DPIPE_WARPS=4): the same tile and the same bits, each warp on 32
// of the 128 tokens, the dequantizing spread over 256 threads. Nsight Compute found the 4-warp tile latency-bound
// with 1-2 warps a scheduler (gemm_tc_tile.cuh, mma_stage). On an H100 (2026-12-05, the Qwen3-0.6B-shaped Q4_K_M
// model, two rounds, bench/results/2026-12-05-h100-session29.md): the 512-token prefill step 9.84 / 9.82 -> 9.08 /
// 9.12 ms (gemm_pipe_q4_k 6.13 -> 5.60 ms a step), engine bench pp512 52.8k / 52.6k -> 56.5k / 57.0k tok/s; a test
// seed that put 4 warps 2.11e-5 from gemm (GEMM_SEED=4320895936405422633) put 8 there too, to the digit.
// k_gemm_tc launches the block the kernel was built for.
#ifndef PIPE_WARPS
#define PIPE_WARPS 8
#endif
constexpr int PIPE_THREADS = 32 * PIPE_WARPS;
constexpr int CHUNKS = RAW_K / BK;  // stages a raw slice serves
constexpr int RAW_PIECES = 4;       // a slice's copies go out in this many pieces of its rows, a stage apart
// A raw row's bytes: stage.cuh's pitch, made an odd number of 16-byte granules, so that the 8 rows a warp's decoders
// read at once (lanes g of a quad-row layout) start in different bank groups.
__host__ __device__ constexpr int odd_granules(int p) { return (p / 16) % 2 ? p : p + 16; }
template <int T>
constexpr int RAW_PITCH = odd_granules(stage::pitch(RAW_K / q::Quant<T>::QK * q::Quant<T>::BYTES));
static_assert(PIPE_STAGES * BM * LD >= BM * CLD, "the output tile is staged over the A ring");

template <int T>
struct Pipe {
    const uint8_t *W0, *W1;
    long long row_bytes;
    int R, r0, kbeg, span;  // weight rows; the tile's first (of W0, or of each of a pair); this split's K values
    bool pair;
    uint8_t* raw;  // raw[2][BN][RAW_PITCH<T>]

    // Tile row j's weight row, its raw slice s's first byte in global memory, and the slice's bytes.
    __device__ __forceinline__ const uint8_t* src(int j, int s, int& bytes) const {
        const int vals = min(RAW_K, span - RAW_K * s);
        bytes = vals / q::Quant<T>::QK * q::Quant<T>::BYTES;
        const int r = min(r0 + (pair ? (j & 31) : j), R - 1);
        const uint8_t* W = pair && j >= 32 ? W1 : W0;
        return W + (long long)r * row_bytes + (long long)(kbeg + RAW_K * s) / q::Quant<T>::QK * q::Quant<T>::BYTES;
    }

    // Piece `piece` of raw slice s's copies (16-byte granules of rows [piece, +1) * BN / RAW_PIECES, spread over the
    // block) into raw buffer s % 2.
    __device__ __forceinline__ void load(int s, int piece) const {
        constexpr int NG = RAW_PITCH<T> / 16, ROWS = BN / RAW_PIECES;  // granules a row at most; rows a piece
        uint8_t* dst = raw + (s & 1) * BN * RAW_PITCH<T>;
        for (int i = threadIdx.x; i < ROWS * NG; i += PIPE_THREADS) {
            const int j = piece * ROWS + i / NG;
            int bytes;
            const uint8_t* from = src(j, s, bytes);
            stage::granule(dst + j * RAW_PITCH<T>, from, bytes, i % NG);
        }
    }

    // Stage kc's 64 x 32 values from its raw slice into sW[BN][LD], tf32-rounded: a thread takes GT = 2 neighbouring
    // 8-value groups of one row (tile row tid / 2, values 16 (tid % 2) .. + 15 of the stage) with 4 warps, both decoded
    // before any store, so that what they share (a K-quant's sub-block scale and minimum: 32 values) is read and
    // decoded once; with 8 warps one group (row tid / 4, values 8 (tid % 4) .. + 7).
    // The stores (4 warps): a quarter-warp's 4 rows x 2 halves fall on 8 distinct 4-bank groups (row pitch 36 floats).
    __device__ __forceinline__ void dequant(int kc, float* sW) const {
        constexpr int GT = BN * BK / 8 / PIPE_THREADS, TR = BK / 8 / GT;  // groups a thread, threads a row
        static_assert(GT * PIPE_THREADS * 8 == BN * BK && (GT == 1 || GT == 2), "one or two groups a thread");
        const int s = kc / CHUNKS, j = threadIdx.x / TR, part = threadIdx.x % TR;
        int bytes;
        const uint8_t* row = stage::landed(raw + (s & 1) * BN * RAW_PITCH<T> + j * RAW_PITCH<T>, src(j, s, bytes));
        const int g0 = (kc % CHUNKS) * (BK / 8) + GT * part;
        float v[GT][8];
#pragma unroll
        for (int h = 0; h < GT; ++h) q::Quant<T>::load8(row, g0 + h, v[h]);
        float4* d = reinterpret_cast<float4*>(sW + j * LD + 8 * GT * part);
#pragma unroll
        for (int h = 0; h < GT; ++h) {
            d[2 * h] = make_float4(tf32_round(v[h][0]), tf32_round(v[h][1]), tf32_round(v[h][2]), tf32_round(v[h][3]));
            d[2 * h + 1] = make_float4(tf32_round(v[h][4]), tf32_round(v[h][5]), tf32_round(v[h][6]),
                                       tf32_round(v[h][7]));
        }
    }
};

template <int T>
constexpr int pipe_smem_bytes() {  // k_gemm_tc.pipe_smem
    return 4 * (PIPE_STAGES * BM * LD + 2 * BN * LD) + 2 * BN * RAW_PITCH<T>;
}

// The loop, group by group (cp.async groups are per thread and complete in order): group 0 = A's stage 0 and raw
// slice 0, group 1 = A's stage 1, group kt + 2 = A's stage kt + 2 (issued in iteration kt) with, where kt % 8 <
// RAW_PIECES, piece kt % 8 of raw slice s = kt / 8 + 1. Iteration kt waits for group kt (A's stage kt), then after
// the barrier issues group kt + 2 into A's buffer of stage kt - 1 and raw buffer s % 2 (slice s - 2's, last read in
// iteration 8 s - 10), dequantizes stage kt + 1 into sW[(kt + 1) % 2] (read in iteration kt - 1), and multiplies
// stage kt. Slice s is first read in iteration 8 s - 1, after groups up to 8 s - 1 have landed; its last piece went
// out in group 8 s - 6 + RAW_PIECES - 1. In pieces, a slice's copies do not all ride in the group of one A stage
// (in order, that stage would wait for the whole slice).
template <int T>
__device__ __forceinline__ void pipe_tile(const uint8_t* W0, const uint8_t* W1, long long row_bytes, int R, int K,
                                          const float* A, int n, const float* resid, float* C, int pair, float* part,
                                          int* tickets) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    extern __shared__ __align__(128) float smem[];
    __shared__ int last;
    pdl::begin();
    const int t0 = blockIdx.y * BM, S = gridDim.z, span = K / S, kbeg = span * int(blockIdx.z), nk = span / BK;
    float* sW = smem + PIPE_STAGES * BM * LD;
    const Pipe<T> w{W0, W1, row_bytes, R, int(blockIdx.x) * (pair ? BN / 2 : BN), kbeg, span, pair != 0,
                    reinterpret_cast<uint8_t*>(sW + 2 * BN * LD)};
    Acc<PIPE_WARPS> acc;
    acc.zero();
    load_a<PIPE_THREADS>(smem, A, K, t0, n, kbeg);
#pragma unroll
    for (int piece = 0; piece < RAW_PIECES; ++piece) w.load(0, piece);
    stage::commit();
    if (nk > 1) load_a<PIPE_THREADS>(smem + BM * LD, A, K, t0, n, kbeg + BK);
    stage::commit();
    stage::wait_pending<1>();  // group 0: raw slice 0
    __syncthreads();
    w.dequant(0, sW);
    for (int kt = 0; kt < nk; ++kt) {
        stage::wait_pending<1>();  // group kt: A's stage kt
        __syncthreads();           // everyone's copies, and sW[kt % 2]; every warp is done with iteration kt - 1
        if (kt + 2 < nk)
            load_a<PIPE_THREADS>(smem + (kt + 2) % PIPE_STAGES * BM * LD, A, K, t0, n, kbeg + (kt + 2) * BK);
        if (kt % CHUNKS < RAW_PIECES && RAW_K * (kt / CHUNKS + 1) < span) w.load(kt / CHUNKS + 1, kt % CHUNKS);
        stage::commit();
        if (kt + 1 < nk) w.dequant(kt + 1, sW + (kt + 1) % 2 * BN * LD);
        acc.mma_stage(smem + kt % PIPE_STAGES * BM * LD, sW + kt % 2 * BN * LD);
    }
    stage::wait_pending<0>();
    __syncthreads();  // every read of the A ring is done: sC goes over it
    finish(acc, smem, &last, t0, n, int(blockIdx.x) * BN, R, pair, resid, Out{C, C, C, R, R, R}, 0, part, tickets);
#endif
}

}  // namespace

// C[n, R] = A . W0^T (+ resid), or with pair: silu(A . W0^T) * (A . W1^T) (W1 of W0's type and shape), W0 / W1 GGUF
// rows of type t. grid (ceil(R / 64) or, a pair, ceil(R / 32), ceil(n / 128), S), block PIPE_THREADS (256, or 128
// built with -DPIPE_WARPS=4; the kernel's maxThreadsPerBlock says which), dynamic shared memory
// pipe_smem_bytes<T>() (k_gemm_tc.pipe_smem). S > 1 splits K into spans of whole RAW_K slices (whole blocks) and of
// BK stages, summed as gemm_dense's.
// A 256-token tile (8 warps a block, each weight tile dequantized once for twice the tokens, 136-164 KiB of shared
// memory: one block an SM) measured slower on an H100 (2026-12-05, Qwen3-0.6B shape, two rounds, bit-equal to
// gemm_dense unsplit): the prefill step at 512 tokens 9.90 / 9.83 -> 11.02 / 11.01 ms (gemm_pipe_q4_k 6.15 -> 7.22 ms
// of it), pp512 52.4k / 53.5k -> 48.3k / 48.4k tok/s. Half the blocks, one an SM, hid less latency than the halved
// dequantizing saved. Not kept.
#define PIPE_KERNEL(tag, T)                                                                                        \
    extern "C" __global__ void __launch_bounds__(PIPE_THREADS, 2)                                                 \
        gemm_pipe_##tag(const uint8_t* __restrict__ W0, const uint8_t* __restrict__ W1, long long row_bytes, int R, \
                        int K, const float* __restrict__ A, int n, const float* resid, float* C, int pair,         \
                        float* part, int* tickets) {                                                             \
        pipe_tile<T>(W0, W1, row_bytes, R, K, A, n, resid, C, pair, part, tickets);                              \
    }
Q_FOR_EACH_QUANTIZED_TYPE(PIPE_KERNEL)
#undef PIPE_KERNEL

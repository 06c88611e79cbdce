// Prefill matmuls on pipelined TF32 tiles (quantized types; sm_80 or sm_90: 110 KiB of shared memory a block), in
// two passes, the weights dequantized into a float scratch slab (dequant_tf32_{t}) and a dense GEMM over it
// (gemm_dense), or in one, the GGUF rows staged raw and dequantized beside the multiply (gemm_pipe_{t}, at the end).
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
#include "pdl.cuh"
#include "quant.cuh"
#include "stage.cuh"
#include "tf32.cuh"

namespace {

constexpr int DQ_THREADS = 256;  // dequant: 8 values a thread

// v's bits rounded to tf32 (to nearest, ties away from zero): cvt.rna, the conversion gemm.cu's operands go through
// (nvcuda::wmma::__float_to_tf32). Not tf32.cuh's add-and-mask, which turns the GPU's NaN (0x7fffffff) into -0 and
// would hide a non-finite activation from the logits' check.
__device__ __forceinline__ uint32_t tf32_rna(uint32_t bits) {
    uint32_t r = bits;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(__uint_as_float(bits)));
#endif
    return r;
}
__device__ __forceinline__ float tf32_round(float v) { return __uint_as_float(tf32_rna(__float_as_uint(v))); }

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
// Block: 128 threads (4 warps), tile BM = 128 tokens x BN = 64 slab rows, K in stages of BK = 32 values, NSTAGE stages
// in flight. Warp (wm, wn) = (warp / 2, warp % 2) computes tokens 64 wm + [0, 64) x rows 32 wn + [0, 32): 4 x 4
// m16n8k8 tiles, 64 accumulators a thread. Shared memory, a stage (floats, row stride LD = BK + 4 = 36: the 8 rows of
// an ldmatrix phase, 144 bytes apart, fall in distinct 16-byte bank groups):
//   sA[128][LD]  A[t0 + i, k0 + k]      sW[64][LD]  Wd[r0 + j, k0 + k]
// ldmatrix.x4 on 32-bit values: an 8 x 8 b16 matrix is 8 rows of 4 floats, and lane l gets the float at (l / 4, l % 4),
// which is the tf32 fragment element (g, q). A's four matrices are rows +0 / +8 at k +0 / +4 (a0..a3), W's two n-tiles
// at k +0 / +4 (b0, b1 of each). Tokens past n read token n - 1 and rows past Rs row Rs - 1: never written.
namespace {

constexpr int BM = 128, BN = 64, BK = 32, LD = BK + 4, THREADS = 128;
constexpr int NSTAGE = 4;  // engine/cuda/k_gemm_tc.py's SMEM follows (tests/test_layout.py holds them together)
constexpr int STAGE_FLOATS = (BM + BN) * LD;
constexpr int CLD = BN + 8;  // the staged output tile sC[BM][CLD], over the stage buffers (72: stage_out's float2
                             // stores of rows g, g + 1 fall in distinct banks)
static_assert(NSTAGE >= 2 && NSTAGE * STAGE_FLOATS >= BM * CLD, "the output tile is staged over the stage buffers");

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void ldmatrix4(uint32_t (&r)[4], unsigned addr) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
#endif
}

__device__ __forceinline__ float silu(float x) { return x / (1.f + expf(-x)); }

// A's copies for the stage at k: its 128 x 32 values (8 granules of 16 bytes a thread) into sA[BM][LD].
__device__ __forceinline__ void load_a(float* sA, const float* A, int K, int t0, int n, int k) {
#pragma unroll
    for (int p = 0; p < BM * BK / 4 / THREADS; ++p) {
        const int i = threadIdx.x + THREADS * p, row = i >> 3, c = i & 7;
        const long long t = min(t0 + row, n - 1);
        stage::copy16(reinterpret_cast<uint8_t*>(sA + row * LD + 4 * c),
                      reinterpret_cast<const uint8_t*>(A + t * K + k + 4 * c));
    }
}

// The dense kernel's stage at k: A's copies, and Wd's 64 x 32 (4 granules a thread) into the tile after sA.
__device__ __forceinline__ void load_stage(float* s, const float* A, int K, int t0, int n, const float* Wd, int Rs,
                                           int r0, int k) {
    load_a(s, A, K, t0, n, k);
#pragma unroll
    for (int p = 0; p < BN * BK / 4 / THREADS; ++p) {
        const int i = threadIdx.x + THREADS * p, row = i >> 3, c = i & 7;
        const long long r = min(r0 + row, Rs - 1);
        stage::copy16(reinterpret_cast<uint8_t*>(s + (BM + row) * LD + 4 * c),
                      reinterpret_cast<const uint8_t*>(Wd + r * K + k + 4 * c));
    }
}

struct Acc {
    float d[4][4][4];  // [m-tile][n-tile][fragment element]

    __device__ __forceinline__ void zero() {
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) d[i][j][e] = 0.f;
    }

    // The 4 k8 steps of a stage: A's tile sA[BM][LD], W's (tf32 already) sW[BN][LD], in shared memory.
    __device__ __forceinline__ void mma_stage(const float* sA, const float* sW) {
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, wm = warp >> 1, wn = warp & 1, mi = lane >> 3;
        // this lane's row address for the ldmatrix of A's m-tile 0 and of W's n-tiles (0, 1), at k step 0
        const float* a0 = sA + (64 * wm + (lane & 7) + 8 * (mi & 1)) * LD + 4 * (mi >> 1);
        const float* w0 = sW + (32 * wn + 8 * (mi >> 1) + (lane & 7)) * LD + 4 * (mi & 1);
#pragma unroll
        for (int kk = 0; kk < BK; kk += 8) {
            uint32_t a[4][4], b[4][2];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                ldmatrix4(a[i], smem_addr(a0 + 16 * i * LD + kk));
#pragma unroll
                for (int e = 0; e < 4; ++e) a[i][e] = tf32_rna(a[i][e]);
            }
#pragma unroll
            for (int j = 0; j < 4; j += 2) {
                uint32_t r[4];
                ldmatrix4(r, smem_addr(w0 + 8 * j * LD + kk));
                b[j][0] = r[0], b[j][1] = r[1], b[j + 1][0] = r[2], b[j + 1][1] = r[3];
            }
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) mma_tf32(d[i][j], a[i], b[j][0], b[j][1]);
        }
    }

    // The tile into sC[BM][CLD]: element e of (i, j) is token 64 wm + 16 i + g (+ 8 for e >= 2), row 32 wn + 8 j + 2q
    // (+ 1 for odd e).
    __device__ __forceinline__ void stage_out(float* sC) const {
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, wm = warp >> 1, wn = warp & 1;
        const int g = lane >> 2, q = lane & 3;
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                float* p = sC + (64 * wm + 16 * i + g) * CLD + 32 * wn + 8 * j + 2 * q;
                *reinterpret_cast<float2*>(p) = make_float2(d[i][j][0], d[i][j][1]);
                *reinterpret_cast<float2*>(p + 8 * CLD) = make_float2(d[i][j][2], d[i][j][3]);
            }
    }
};

// Where output columns go: global column c (c0 + a slab row of one matrix, or an output of a pair) of segment m,
// [e(m-1), e(m)) with e(-1) = 0, is Cm[t, c - e(m-1)], rows e(m) - e(m-1) apart. One matrix: one segment (e0 = e1 =
// e2 = R); q/k/v in one slab: three.
struct Out {
    float *C0, *C1, *C2;
    int e0, e1, e2;

    // Column c's segment: its array, first column and end (selects, not indexing: no local memory).
    __device__ __forceinline__ void seg(int c, float*& C, int& s, int& e) const {
        const bool a = c < e0, b = c < e1;
        C = a ? C0 : b ? C1 : C2;
        s = a ? 0 : b ? e0 : e1;
        e = a ? e0 : b ? e1 : e2;
    }
    __device__ __forceinline__ float* at(int t, int c) const {
        float* C;
        int s, e;
        seg(c, C, s, e);
        return C + (long long)t * (e - s) + (c - s);
    }
    // Columns c .. c + 3 in one segment, at a 16-byte aligned place of it (C0..C2 are).
    __device__ __forceinline__ bool vec4(int c) const {
        float* C;
        int s, e;
        seg(c, C, s, e);
        return c + 4 <= e && (((e - s) | (c - s)) & 3) == 0;
    }
};

// The staged tile sC to the output: one matrix, column c0 + r0 + j (+ resid, laid out as segment 0) for j < 64 within
// `cols`; a pair, column c0 + r0 / 2 + j = silu(sC[.][j]) * sC[.][32 + j] for j < 32 within `cols`.
__device__ __forceinline__ void write_out(const float* sC, int t0, int n, int r0, int cols, int pair,
                                          const float* resid, const Out& out, int c0) {
    const int per = pair ? BN / 2 : BN, o0 = pair ? r0 >> 1 : r0;  // outputs a tile row, the tile's first
#pragma unroll 4
    for (int p = 0; p < BM * (BN / 2) / 4 / THREADS * (pair ? 1 : 2); ++p) {
        const int i = threadIdx.x + THREADS * p, tok = i / (per / 4), c4 = 4 * (i % (per / 4));
        const int t = t0 + tok, r = o0 + c4;
        if (t >= n || r >= cols) continue;
        const float4 g = *reinterpret_cast<const float4*>(sC + tok * CLD + c4);
        float e[4] = {g.x, g.y, g.z, g.w};
        if (pair) {
            const float4 u = *reinterpret_cast<const float4*>(sC + tok * CLD + 32 + c4);
            e[0] = silu(g.x) * u.x, e[1] = silu(g.y) * u.y, e[2] = silu(g.z) * u.z, e[3] = silu(g.w) * u.w;
        }
        const int c = c0 + r;
        if (r + 4 <= cols && out.vec4(c)) {
            float4 v = make_float4(e[0], e[1], e[2], e[3]);
            if (resid) {
                const float4 q = *reinterpret_cast<const float4*>(resid + (long long)t * out.e0 + c);
                v.x += q.x, v.y += q.y, v.z += q.z, v.w += q.w;
            }
            *reinterpret_cast<float4*>(out.at(t, c)) = v;
        } else {
#pragma unroll
            for (int u = 0; u < 4; ++u)
                if (r + u < cols) *out.at(t, c + u) = resid ? e[u] + resid[(long long)t * out.e0 + c + u] : e[u];
        }
    }
}

// After the K loop (every stage buffer free): the tile to the output, or, split, to its partial slot, and the
// tile's last block (its ticket, `last` in shared memory) sums the partials in z order and writes the output.
__device__ __forceinline__ void finish(const Acc& acc, float* smem, int* last, int t0, int n, int r0, int cols,
                                       int pair, const float* resid, const Out& out, int c0, float* part,
                                       int* tickets) {
    acc.stage_out(smem);
    __syncthreads();
    const int S = gridDim.z;
    if (S == 1) {
        write_out(smem, t0, n, r0, cols, pair, resid, out, c0);
        return;
    }
    const int tiles = gridDim.x * gridDim.y, tile = blockIdx.y * gridDim.x + blockIdx.x;
    float* mine = part + ((long long)blockIdx.z * tiles + tile) * (BM * BN);
    for (int i = threadIdx.x; i < BM * BN / 4; i += THREADS) {
        const int tok = i >> 4, c4 = 4 * (i & 15);
        *reinterpret_cast<float4*>(mine + tok * BN + c4) = *reinterpret_cast<const float4*>(smem + tok * CLD + c4);
    }
    __threadfence();  // this block's partial is visible to whichever block takes the last ticket
    __syncthreads();
    if (threadIdx.x == 0) *last = atomicAdd(tickets + tile, 1) == S - 1;
    __syncthreads();
    if (!*last) return;
    __threadfence();
    for (int i = threadIdx.x; i < BM * BN / 4; i += THREADS) {
        const int tok = i >> 4, c4 = 4 * (i & 15);
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int z = 0; z < S; ++z) {  // z order: the sum does not depend on which block came last
            const float4 a = __ldcg(reinterpret_cast<const float4*>(part + ((long long)z * tiles + tile) * (BM * BN)
                                                                     + tok * BN + c4));
            v.x += a.x, v.y += a.y, v.z += a.z, v.w += a.w;
        }
        *reinterpret_cast<float4*>(smem + tok * CLD + c4) = v;
    }
    __syncthreads();
    write_out(smem, t0, n, r0, cols, pair, resid, out, c0);
    if (threadIdx.x == 0) tickets[tile] = 0;  // for the next launch
}

}  // namespace

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
    Acc acc;
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
        for (int i = threadIdx.x; i < ROWS * NG; i += THREADS) {
            const int j = piece * ROWS + i / NG;
            int bytes;
            const uint8_t* from = src(j, s, bytes);
            stage::granule(dst + j * RAW_PITCH<T>, from, bytes, i % NG);
        }
    }

    // Stage kc's 64 x 32 values from its raw slice into sW[BN][LD], tf32-rounded: a thread takes two neighbouring
    // 8-value groups of one row (tile row tid / 2, values 16 (tid % 2) .. + 15 of the stage), both decoded before any
    // store, so that what they share (a K-quant's sub-block scale and minimum: 32 values) is read and decoded once.
    // The stores: a quarter-warp's 4 rows x 2 halves fall on 8 distinct 4-bank groups (row pitch 36 floats).
    __device__ __forceinline__ void dequant(int kc, float* sW) const {
        const int s = kc / CHUNKS, j = threadIdx.x >> 1, half = threadIdx.x & 1;
        static_assert(BN * BK == THREADS * 16, "two groups a thread");
        int bytes;
        const uint8_t* row = stage::landed(raw + (s & 1) * BN * RAW_PITCH<T> + j * RAW_PITCH<T>, src(j, s, bytes));
        const int g0 = (kc % CHUNKS) * (BK / 8) + 2 * half;
        float v[2][8];
        q::Quant<T>::load8(row, g0, v[0]);
        q::Quant<T>::load8(row, g0 + 1, v[1]);
        float4* d = reinterpret_cast<float4*>(sW + j * LD + 16 * half);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
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
    Acc acc;
    acc.zero();
    load_a(smem, A, K, t0, n, kbeg);
#pragma unroll
    for (int piece = 0; piece < RAW_PIECES; ++piece) w.load(0, piece);
    stage::commit();
    if (nk > 1) load_a(smem + BM * LD, A, K, t0, n, kbeg + BK);
    stage::commit();
    stage::wait_pending<1>();  // group 0: raw slice 0
    __syncthreads();
    w.dequant(0, sW);
    for (int kt = 0; kt < nk; ++kt) {
        stage::wait_pending<1>();  // group kt: A's stage kt
        __syncthreads();           // everyone's copies, and sW[kt % 2]; every warp is done with iteration kt - 1
        if (kt + 2 < nk) load_a(smem + (kt + 2) % PIPE_STAGES * BM * LD, A, K, t0, n, kbeg + (kt + 2) * BK);
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
// rows of type t. grid (ceil(R / 64) or, a pair, ceil(R / 32), ceil(n / 128), S), block 128, dynamic shared memory
// pipe_smem_bytes<T>() (k_gemm_tc.pipe_smem). S > 1 splits K into spans of whole RAW_K slices (whole blocks) and of
// BK stages, summed as gemm_dense's.
#define PIPE_KERNEL(tag, T)                                                                                        \
    extern "C" __global__ void __launch_bounds__(THREADS, 2)                                                      \
        gemm_pipe_##tag(const uint8_t* __restrict__ W0, const uint8_t* __restrict__ W1, long long row_bytes, int R, \
                        int K, const float* __restrict__ A, int n, const float* resid, float* C, int pair,         \
                        float* part, int* tickets) {                                                             \
        pipe_tile<T>(W0, W1, row_bytes, R, K, A, n, resid, C, pair, part, tickets);                              \
    }
Q_FOR_EACH_QUANTIZED_TYPE(PIPE_KERNEL)
#undef PIPE_KERNEL

// Decode matvecs (n <= 8 tokens) straight from GGUF blocks, and gathered row dots (LM head rows for system1).
// Contract (names, arguments, grid/block): kernels/README.md, "matvec.cu".
//
// matvec / matvec_swiglu: the block of matvec_block.cuh, one launch a matrix (pair).
#include "pdl.cuh"
#include "matvec_block.cuh"
#include "matvec_stream.cuh"

namespace {

using mv::ROWS;
using mv::THREADS;
using mv::matvec_block;

// matvec3: one token through up to three matrices of one width that read the same x (and RMSNorm), in one launch:
// blocks [0, B0) compute W0's rows, [B0, B0 + B1) W1's, the rest W2's, Bm = ceil(Rm / 8) (Rm = 0: none). W0 and W1
// are of type TA, W2 of type TB (a Q4_K_M file's Q6_K attn_v beside Q4_K q and k). The choice is per block and
// uniform, and each block runs matvec_block unchanged: the results are bit for bit those of three matvec launches.
template <int TA, int TB, bool I16 = false>
__device__ __forceinline__ void matvec3_block(const uint8_t* W0, const uint8_t* W1, const uint8_t* W2, long long rb0,
                                              long long rb1, long long rb2, int R0, int R1, int R2, int K,
                                              const float* x, const float* norm_w, float eps, float* y0, float* y1,
                                              float* y2) {
    constexpr int A = mv::STAGE_BYTES<TA, 1>, B = mv::STAGE_BYTES<TB, 1>;
    __shared__ __align__(16) uint8_t buf[A > B ? A : B];  // either type's staging
    const int b0 = (R0 + ROWS - 1) / ROWS, b1 = (R1 + ROWS - 1) / ROWS;
    int blk = blockIdx.x;
    if (blk < b0) {
        mv::matvec_block_in<TA, 1, 1, I16>(W0, W0, rb0, R0, K, x, 1, norm_w, eps, nullptr, y0, buf, blk);
    } else if (blk < b0 + b1) {
        blk -= b0;
        mv::matvec_block_in<TA, 1, 1, I16>(W1, W1, rb1, R1, K, x, 1, norm_w, eps, nullptr, y1, buf, blk);
    } else {
        blk -= b0 + b1;
        mv::matvec_block_in<TB, 1, 1, I16>(W2, W2, rb2, R2, K, x, 1, norm_w, eps, nullptr, y2, buf, blk);
    }
}

// Before the wait (pdl.cuh): the block's weight rows into L2, while the kernel that computes x may still run.
__device__ __forceinline__ void prefetch_rows(const uint8_t* W, long long row_bytes, int R, int blk) {
    const int r0 = blk * ROWS;
    if (r0 < R) pdl::prefetch_l2(W + r0 * row_bytes, min(ROWS, R - r0) * row_bytes);
}

__device__ __forceinline__ void prefetch_rows3(const uint8_t* W0, const uint8_t* W1, const uint8_t* W2, long long rb0,
                                               long long rb1, long long rb2, int R0, int R1, int R2) {
    const int b0 = (R0 + ROWS - 1) / ROWS, b1 = (R1 + ROWS - 1) / ROWS, blk = blockIdx.x;
    if (blk < b0) prefetch_rows(W0, rb0, R0, blk);
    else if (blk < b0 + b1) prefetch_rows(W1, rb1, R1, blk - b0);
    else prefetch_rows(W2, rb2, R2, blk - b0 - b1);
}

// gather_dot: warp w of block b computes out[8b + w] = dot(W[rows[o]], x + o * x_stride); lanes stride over groups.
template <int T>
__device__ __forceinline__ void gather_dot_warp(const uint8_t* __restrict__ W, long long row_bytes, int K,
                                                const float* __restrict__ x, long long x_stride,
                                                const int* __restrict__ rows, int n, float* __restrict__ out) {
    const int o = blockIdx.x * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (o >= n) return;  // o is the same for the whole warp: no shuffle below loses a lane
    const uint8_t* row = W + (long long)rows[o] * row_bytes;
    const float* xo = x + o * x_stride;
    float acc = 0.f;
#pragma unroll 4
    for (int g = lane; g < (K >> 3); g += 32) {
        float xv[1][8], xs[1];
        cm::load8f(xo + 8 * g, xv[0]);
        q::xsums<T, 1>(xv, xs);
        q::dot8_acc<T, 1>(row, g, xv, xs, &acc);
    }
    acc = cm::warp_sum(acc);
    if (lane == 0) out[o] = acc;
}

}  // namespace

// The low-bit and codebook types' 1-token matvecs and gathered dots ask for 3 blocks an SM (at most 85 registers;
// IQ3_XXS's swiglu spilled 8 bytes at 80 on sm_75/80 and asks for 2, at most 128): under the plain bound ptxas
// (nvcc 13.0) settled on 40 or 64 registers for some of them (iq3_s on sm_86/89, iq2_xxs and iq2_s on sm_120) and
// spilled 8-56 bytes; bounded, they spill nothing. Their 8-token kernels need ~250 registers and keep the plain bound,
// as every kernel of the other types does.
// IQ2_XS's swiglu spilled 4 bytes at 85 registers on sm_120 and asks for 2 there as well.
#define MV_BOUNDS __launch_bounds__(THREADS)
#define MV_BOUNDS_N1(T) __launch_bounds__(THREADS, q::SPLIT<T> ? 2 : 1)
// The 2-token kernels ask for 2 blocks an SM (at most 128 registers): with weights staged (stage.cuh), ptxas (nvcc
// 13.0) gave matvec_swiglu_q4_0_n2 64 registers on sm_86/89 under the plain bound and spilled 24 bytes.
#define MV_BOUNDS_N2 __launch_bounds__(THREADS, 2)
// The 4-token kernels state a minimum of 1 block an SM: under the plain bound ptxas (nvcc 13.0) held matvec_q5_k_n4
// to 128 registers on sm_90 and spilled 8 bytes; stated, it takes 160 and spills nothing.
#define MV_BOUNDS_N4 __launch_bounds__(THREADS, 1)
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1200
#define MV_BOUNDS_LOWBIT(T) __launch_bounds__(THREADS, T == q::IQ3_XXS || T == q::IQ2_XS ? 2 : 3)
#else
#define MV_BOUNDS_LOWBIT(T) __launch_bounds__(THREADS, T == q::IQ3_XXS ? 2 : 3)
#endif

// matvec{form}_{t}_n{N} and matvec_swiglu{form}_{t}_n{N}: form empty (float dots) or 16 (I16, 1 token; below).
#define MATVEC_FORM(tag, T, N, BOUNDS, FORM, I16)                                                                   \
    extern "C" __global__ void BOUNDS                                                                               \
        matvec##FORM##_##tag##_n##N(const uint8_t* W, long long row_bytes, int R, int K, const float* x, int n,     \
                                    const float* norm_w, float eps, const float* resid, float* y) {                 \
        pdl::launch_dependents();                                                                                    \
        prefetch_rows(W, row_bytes, R, blockIdx.x);                                                                  \
        pdl::wait();                                                                                                 \
        matvec_block<T, N, 1, I16>(W, W, row_bytes, R, K, x, n, norm_w, eps, resid, y, -1);                         \
    }                                                                                                               \
    extern "C" __global__ void BOUNDS                                                                               \
        matvec_swiglu##FORM##_##tag##_n##N(const uint8_t* Wg, const uint8_t* Wu, long long row_bytes, int R, int K,\
                                           const float* x, int n, const float* norm_w, float eps, float* y) {       \
        pdl::launch_dependents();                                                                                   \
        prefetch_rows(Wg, row_bytes, R, blockIdx.x);                                                                \
        prefetch_rows(Wu, row_bytes, R, blockIdx.x);                                                                \
        pdl::wait();                                                                                                \
        matvec_block<T, N, 2, I16>(Wg, Wu, row_bytes, R, K, x, n, norm_w, eps, nullptr, y, -1);                     \
    }
#define MATVEC_N(tag, T, N, BOUNDS) MATVEC_FORM(tag, T, N, BOUNDS, , false)

#define GATHER_DOT(tag, T, BOUNDS)                                                                                  \
    extern "C" __global__ void BOUNDS                                                                               \
        gather_dot_##tag(const uint8_t* W, long long row_bytes, int K, const float* x, long long x_stride,          \
                         const int* rows, int n, float* out) {                                                      \
        pdl::begin();                                                                                               \
        gather_dot_warp<T>(W, row_bytes, K, x, x_stride, rows, n, out);                                             \
    }
// matvec3 (one token, up to three matrices a launch): the common types only (k_matvec.has_matvec3).
// On sm_90 matvec3 asks for 4 blocks an SM (at most 64 registers; F32's spilled 104 bytes there and keeps 1): measured
// on an H200 (30B-A3B shape, q/k/v of 5120 rows in 640 blocks) 9.23 -> 8.62 us a launch, full decode 327.8 -> 340.3
// tok/s.
// The 16-bit Q4_K q/k with Q6_K v asks for 3 there: at 4, 4 bytes spilled (sm_90, nvcc 13.0) once the Q4_K blocks
// took the sub-block form (matvec_block.cuh).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900
#define MATVEC3_MIN_BLOCKS(T) (T == q::F32 ? 1 : 4)
#define MATVEC3_16_MIXED_BLOCKS 3
#else
#define MATVEC3_MIN_BLOCKS(T) 1
#define MATVEC3_16_MIXED_BLOCKS 1
#endif
#define MATVEC3_BLOCKS(TA, TB) \
    (MATVEC3_MIN_BLOCKS(TA) < MATVEC3_MIN_BLOCKS(TB) ? MATVEC3_MIN_BLOCKS(TA) : MATVEC3_MIN_BLOCKS(TB))
#define MATVEC3_KERNEL(name, TA, TB) MATVEC3_FORM(name, TA, TB, false, MATVEC3_BLOCKS(TA, TB))
#define MATVEC3_FORM(name, TA, TB, I16, BLOCKS)                                                                     \
    extern "C" __global__ void __launch_bounds__(THREADS, BLOCKS)                                                   \
        name(const uint8_t* W0, const uint8_t* W1, const uint8_t* W2, long long rb0, long long rb1, long long rb2,   \
             int R0, int R1, int R2, int K, const float* x, const float* norm_w, float eps, float* y0, float* y1,    \
             float* y2) {                                                                                            \
        pdl::launch_dependents();                                                                                   \
        prefetch_rows3(W0, W1, W2, rb0, rb1, rb2, R0, R1, R2);                                                      \
        pdl::wait();                                                                                                \
        matvec3_block<TA, TB, I16>(W0, W1, W2, rb0, rb1, rb2, R0, R1, R2, K, x, norm_w, eps, y0, y1, y2);            \
    }
#define MATVEC3(tag, T) MATVEC3_KERNEL(matvec3_##tag##_n1, T, T)
// The split-form 1-token matvec and swiglu kernels ask for 2 blocks an SM (at most 128 registers): under the plain
// bound ptxas (nvcc 13.0) spilled 8 bytes of matvec_swiglu_q4_k_n1 on sm_86/89/120. matvec3 states a minimum of 1
// block an SM but on sm_90 (above): with 2, matvec3_q6_k_n1 spilled on sm_100/120, and with no minimum on sm_120.
#define MATVEC_KERNELS(tag, T)                                                                                      \
    MATVEC_N(tag, T, 1, MV_BOUNDS_N1(T)) MATVEC_N(tag, T, 2, MV_BOUNDS_N2) MATVEC_N(tag, T, 4, MV_BOUNDS_N4)                    \
    MATVEC_N(tag, T, 8, MV_BOUNDS) GATHER_DOT(tag, T, MV_BOUNDS) MATVEC3(tag, T)
// The low-bit and codebook types: N = 1 and 8 only (2..7 tokens take the 8-token kernel, k_matvec.py).
#define MATVEC_KERNELS_1_8(tag, T) \
    MATVEC_N(tag, T, 1, MV_BOUNDS_LOWBIT(T)) MATVEC_N(tag, T, 8, MV_BOUNDS) GATHER_DOT(tag, T, MV_BOUNDS_LOWBIT(T))

Q_FOR_EACH_COMMON_TYPE(MATVEC_KERNELS)
Q_FOR_EACH_LOWBIT_TYPE(MATVEC_KERNELS_1_8)

// matvec3_{a}_{b}_n1: W0 and W1 of type a, W2 of type b, for the pairs k_matvec.MATVEC3_PAIRS lists (the K-quant
// mixes llama.cpp's _M files give q/k and v). On an H200 (2026-12-04) the 30B-A3B shape's Q4_K q/k and Q6_K v took
// 8.2 + 3.9 us as two launches and 8.4 as one: its 4-layer step 0.368 -> 0.353 ms, its full decode 337.8 -> 354.3
// tok/s; the Qwen3-0.6B shape's step 1.017 -> 0.964 ms.
// 16 rows a block (row blocks 2b and 2b + 1 of one matrix staged together, 320 blocks: one wave where 640 are 1.2)
// measured slower on an H200 (2026-12-04, 30B-A3B shape): 8.4 -> 9.3 us a launch, 4-layer steps 0.3262 / 0.3259 ->
// 0.3299 / 0.3294 ms, full decode 359.8 / 359.5 -> 358.2 / 358.2 tok/s. The second row block's dots and reduction
// follow the first's in one block, and that costs more than the second wave did. Not kept.
MATVEC3_KERNEL(matvec3_q4_k_q6_k_n1, q::Q4_K, q::Q6_K)
MATVEC3_KERNEL(matvec3_q5_k_q6_k_n1, q::Q5_K, q::Q6_K)
MATVEC3_KERNEL(matvec3_q4_k_q5_k_n1, q::Q4_K, q::Q5_K)

// The 16-bit forms of the 1-token kernels (matvec16_{t}_n1, matvec_swiglu16_{t}_n1, matvec3_16_{t}_n1 and
// matvec3_16_q4_k_q6_k_n1; t in quant_i16.cuh's types): x times norm_w rounded to 16 bits a group of 8 and dotted in
// integers (matvec_block.cuh's I16), the arguments, grid and block of the float forms. Why: Nsight Compute on an H200
// (2026-12-04, 30B-A3B shape) found the float 1-token kernels bound by issue, not memory: matvec3_q4_k_n1 at 8% of
// DRAM bandwidth, an instruction every 1.9 cycles a scheduler, 13 instructions a weight. On an H200 (2026-12-04,
// engine profile, two rounds) the 30B-A3B shape's 4-layer step 0.3248 -> 0.3173 ms, the 0.6B shape's 0.8935 ->
// 0.8560; full decode 361.5 -> 372.3 and 1084 -> 1120 tok/s. The matvec and SwiGLU forms keep MV_BOUNDS_N1: asking
// for 3 or 4 blocks an SM (80 or 64 registers, no spills) made the 0.6B SwiGLU launch 6.4 -> 5.5 us but its step
// 0.856 -> 0.878 (3) and 1.005 ms (4), the 30B-A3B step 0.317 -> 0.327 and 0.336: blocks that fill the SMs leave no
// room for the next kernel's to start early.
#define MATVEC16_KERNELS(tag, T)                      \
    MATVEC_FORM(tag, T, 1, MV_BOUNDS_N1(T), 16, true) \
    MATVEC3_FORM(matvec3_16_##tag##_n1, T, T, true, MATVEC3_BLOCKS(T, T))
Q16_FOR_EACH_TYPE(MATVEC16_KERNELS)
MATVEC3_FORM(matvec3_16_q4_k_q6_k_n1, q::Q4_K, q::Q6_K, true, MATVEC3_16_MIXED_BLOCKS)

// matvec_stream (matvec_stream.cuh): one token through a tall matrix; the quantized common types. _{t}: K <= 2048
// (8 groups of x a lane, ~100 registers); _{t}_k1024: K <= 1024 (4 groups, 63 registers: twice the warps an SM).
// matvec_stream16_{t}[_k1024]: the same with the integer dots (matvec_stream.cuh, I16), for the types llama.cpp's files
// keep their LM heads in (k_matvec.STREAM16_TYPES: Q6_K in the K-quant and legacy mixes, Q8_0). Q5_0's wider form
// spilled 4 bytes on sm_90 and Q4_K's 16 on sm_80 (nvcc 13.0), so they keep the float form.
#define MATVEC_STREAM_FORM(name, T, I16)                                                                            \
    extern "C" __global__ void __launch_bounds__(mvs::THREADS)                                                      \
        name(const uint8_t* W, long long row_bytes, int R, int K, const float* x, const float* norm_w, float eps,   \
             const float* resid, float* y, unsigned long long* best) {                                              \
        pdl::launch_dependents();                                                                                   \
        mvs::matvec_stream<T, mvs::WARPS, mvs::ROWS, mvs::STAGES, mvs::MAXG, I16>(W, row_bytes, R, K, x, norm_w, eps,\
                                                                                  resid, y, best);                  \
    }                                                                                                               \
    extern "C" __global__ void __launch_bounds__(mvs::THREADS)                                                      \
        name##_k1024(const uint8_t* W, long long row_bytes, int R, int K, const float* x, const float* norm_w,      \
                     float eps, const float* resid, float* y, unsigned long long* best) {                           \
        pdl::launch_dependents();                                                                                   \
        mvs::matvec_stream<T, mvs::WARPS, mvs::ROWS, mvs::STAGES, mvs::MAXG / 2, I16>(W, row_bytes, R, K, x, norm_w,\
                                                                                      eps, resid, y, best);         \
    }
#define MATVEC_STREAM(tag, T) MATVEC_STREAM_FORM(matvec_stream_##tag, T, false)
#define MATVEC_STREAM16(tag, T) MATVEC_STREAM_FORM(matvec_stream16_##tag, T, true)
MATVEC_STREAM(q8_0, q::Q8_0) MATVEC_STREAM(q4_0, q::Q4_0) MATVEC_STREAM(q4_1, q::Q4_1) MATVEC_STREAM(q5_0, q::Q5_0)
MATVEC_STREAM(q5_1, q::Q5_1) MATVEC_STREAM(q4_k, q::Q4_K) MATVEC_STREAM(q5_k, q::Q5_K) MATVEC_STREAM(q6_k, q::Q6_K)
MATVEC_STREAM16(q6_k, q::Q6_K) MATVEC_STREAM16(q8_0, q::Q8_0)

// Decode matvecs (n <= 8 tokens) straight from GGUF blocks, and gathered row dots (LM head rows for system1).
// Contract (names, arguments, grid/block): kernels/README.md, "matvec.cu".
//
// matvec: a block of 256 threads computes rows [8 * blockIdx.x, +8) for all n tokens. The threads split K rather
// than the rows: a "slice" of threads takes RPT = 8 / S of the rows, and its thread j dequantizes the 8-value groups
// j, j + span, ... (span = threads per slice) of those rows, reading the n tokens' x for a group once into registers
// and reusing it for every row. So x crosses L1 once per slice (not once per row, which would cost as many L1 bytes as
// a 4-bit weight row costs DRAM bytes) and consecutive lanes read consecutive groups of a row (a warp reads one
// Q4_K/Q6_K block, or 8 Q4_0/Q8_0 blocks, per row and step). S = 1 (8 rows a thread) is the default; S = 2 when a row
// has at most span / 2 groups (K <= 1024 for N <= 4: otherwise half the threads would idle).
// matvec_swiglu: the same with the block split into two teams of 4 warps, team 0 on Wg and team 1 on Wu.
// The RPT * N per-thread sums are reduced by a warp reduce-scatter (common.cuh), then across the slice's warps
// through shared memory.
// Fused RMSNorm: W.(x * s * nw) = s * (W.(x * nw)) with s = rsqrt(mean(x^2) + eps): each thread accumulates its
// groups' sum of squares alongside, the block reduces it with the dot products, and s scales the final sums.
// Last block: rows past R re-read row R - 1 (never written); tokens past n re-read token n - 1 (never written). All
// accesses stay inside the buffers, with no branches around the loads.
#include "common.cuh"
#include "quant.cuh"
#include "quant_dot.cuh"

namespace {

constexpr int ROWS = 8;       // output rows per block
constexpr int THREADS = 256;  // 8 warps

// Quantized rows: a group's bytes come in several small loads whose decoding needs registers, and the compiler keeps
// few of them in flight (about one row's per thread). So first touch one byte of each row's group (at its
// proportional position: a warp's 32 lanes then cover every 32-byte sector of the warp's contiguous span) and make the
// row pointers depend on all of them (through a zero the compiler cannot see): the rows' DRAM requests go out
// together, and load8 then reads L1.
template <int T>
constexpr bool TOUCH = T != q::F32 && T != q::F16 && T != q::BF16;  // float rows: one 16-byte load per group

template <int T, int RPT>
__device__ __forceinline__ void touch_rows(const uint8_t* (&rp)[RPT], int g, int n) {
    using Q = q::Quant<T>;
    const int off = g * Q::BYTES / (Q::QK / 8);  // a byte of group g's share of its block (< row_bytes)
    uint32_t z = 0;
#pragma unroll
    for (int r = 0; r < RPT; ++r) z ^= rp[r][off];
    z &= uint32_t(n) >> 30;  // n <= 8: always 0
#pragma unroll
    for (int r = 0; r < RPT; ++r) rp[r] += z;
}

// The split form (quant_dot.cuh) for up to 4 tokens: at 8, the extra registers would spill.
template <int T, int N>
constexpr bool SPLIT_N = q::SPLIT<T> && N <= 4;

// acc[t * RPT + r] += dot(row r values [8g, +8), token t values [8g, +8) times norm_w) for the RPT rows at rp.
template <int T, int N, int RPT>
__device__ __forceinline__ void dot_group(const uint8_t* const (&rp)[RPT], int g, const float* __restrict__ x,
                                          const int (&xo)[N], const float* __restrict__ norm_w,
                                          float (&acc)[RPT * N], float (&ss)[N]) {
    float xv[N][8];  // values [8g, 8g + 8) of each token, times norm_w when normed (the rsqrt scale comes last)
#pragma unroll
    for (int t = 0; t < N; ++t) cm::load8f(x + xo[t] + 8 * g, xv[t]);
    if (norm_w) {
        float nw[8];
        cm::load8f(norm_w + 8 * g, nw);
#pragma unroll
        for (int t = 0; t < N; ++t)
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                ss[t] = fmaf(xv[t][k], xv[t][k], ss[t]);
                xv[t][k] *= nw[k];
            }
    }
    float xs[N];  // quant_dot.cuh's split form: the x sums, once for all RPT rows
    q::xsums<T, N>(xv, xs);
#pragma unroll
    for (int r = 0; r < RPT; ++r) q::dot8_acc<T, N, RPT, SPLIT_N<T, N>>(rp[r], g, xv, xs, &acc[r]);
}

// Per-thread partial dot products of the block's rows with N tokens, reduced over each warp into
// red[warp][t * RPT + r] (and the sums of squares of x into red_ss[warp][t]).
template <int T, int N, int NM, int S>
__device__ __forceinline__ void partial_dots(const uint8_t* __restrict__ W0, const uint8_t* __restrict__ W1,
                                             long long row_bytes, int R, int K, const float* __restrict__ x, int n,
                                             const float* __restrict__ norm_w, float* red, float* red_ss, int blk) {
    constexpr int TEAM = THREADS / NM, SPAN = TEAM / S, RPT = ROWS / S;  // threads per matrix, per slice; rows
    constexpr int V = RPT * N;  // sums per thread: acc[t * RPT + r] is token t, row r of the slice
    static_assert(SPAN % 32 == 0, "a slice is whole warps");
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, tt = tid % TEAM;
    const int row0 = (blk < 0 ? int(blockIdx.x) : blk) * ROWS + (tt / SPAN) * RPT;  // this slice's first row
    const uint8_t* W = (NM == 2 && tid >= TEAM) ? W1 : W0;

    int xo[N];  // offset of token t's x row, clamped to the last token (n*K < 2^31: n <= 8, K < 2^28)
#pragma unroll
    for (int t = 0; t < N; ++t) xo[t] = min(t, n - 1) * K;
    float acc[V], ss[N];
#pragma unroll
    for (int i = 0; i < V; ++i) acc[i] = 0.f;
#pragma unroll
    for (int t = 0; t < N; ++t) ss[t] = 0.f;
    const uint8_t* rowp[RPT];  // the slice's rows, clamped to the last row of the matrix
#pragma unroll
    for (int r = 0; r < RPT; ++r) rowp[r] = W + (long long)min(row0 + r, R - 1) * row_bytes;

    for (int g = tt % SPAN; g < (K >> 3); g += SPAN) {
        const uint8_t* rp[RPT];
#pragma unroll
        for (int r = 0; r < RPT; ++r) rp[r] = rowp[r];
        if constexpr (TOUCH<T>) touch_rows<T, RPT>(rp, g, n);
        dot_group<T, N, RPT>(rp, g, x, xo, norm_w, acc, ss);
    }

    // Warp totals: lane L holds those of values [L*V/32, +max(V/32, 1)) (common.cuh); one lane per index writes.
    cm::warp_reduce_scatter(acc);
    if constexpr (V >= 32) {
#pragma unroll
        for (int i = 0; i < V / 32; ++i) red[warp * V + lane * (V / 32) + i] = acc[i];
    } else if (lane % (32 / V) == 0) {
        red[warp * V + lane / (32 / V)] = acc[0];
    }
    if (norm_w) {
        cm::warp_reduce_scatter(ss);  // N <= 8 < 32 values
        if (lane % (32 / N) == 0) red_ss[warp * N + lane / (32 / N)] = ss[0];
    }
    __syncthreads();
}

// Thread i < 8 * N finishes output (token i / 8, row 8 * blk + i % 8) from the warps' totals: the row's
// slice is warps [m * WT + s * WS, +WS) of team m (WT warps a team, WS a slice); sums of squares come from the warps
// of team 0, slice 0, which together covered every group of x once.
template <int N, int NM, int S>
__device__ __forceinline__ void finish(int R, int K, int n, const float* norm_w, float eps, const float* resid,
                                       float* y, const float* red, const float* red_ss, int blk) {
    constexpr int RPT = ROWS / S, V = RPT * N, WT = 8 / NM, WS = WT / S;
    const int i = threadIdx.x, t = i / ROWS, r = i % ROWS, row = (blk < 0 ? int(blockIdx.x) : blk) * ROWS + r;
    if (i >= ROWS * N || t >= n || row >= R) return;
    const int j = t * RPT + r % RPT, w0 = (r / RPT) * WS;  // the value's index in its warps, the slice's first warp
    float a = 0.f, b = 0.f, s = 1.f;
#pragma unroll
    for (int w = 0; w < WS; ++w) a += red[(w0 + w) * V + j];
    if constexpr (NM == 2) {
#pragma unroll
        for (int w = 0; w < WS; ++w) b += red[(WT + w0 + w) * V + j];
    }
    if (norm_w) {
        float q = 0.f;
#pragma unroll
        for (int w = 0; w < WS; ++w) q += red_ss[w * N + t];
        s = rsqrtf(q / float(K) + eps);
    }
    const long long o = (long long)t * R + row;  // y[t, row]
    if constexpr (NM == 1) {
        y[o] = resid ? resid[o] + s * a : s * a;  // resid may be y: this thread alone reads and writes y[o]
    } else {
        const float gate = s * a, up = s * b;
        y[o] = gate / (1.f + expf(-gate)) * up;
    }
}

template <int T, int N, int NM, int S>
__device__ __forceinline__ void matvec_sliced(const uint8_t* W0, const uint8_t* W1, long long row_bytes, int R, int K,
                                              const float* x, int n, const float* norm_w, float eps,
                                              const float* resid, float* y, int blk) {
    __shared__ float red[8 * ROWS * N];  // [warp][token * RPT + row of the slice]
    __shared__ float red_ss[8 * N];      // [warp][token]
    partial_dots<T, N, NM, S>(W0, W1, row_bytes, R, K, x, n, norm_w, red, red_ss, blk);
    finish<N, NM, S>(R, K, n, norm_w, eps, resid, y, red, red_ss, blk);
}

// Rows [8 * blk, +8) of the matrix (blk: the block's index among those of this matrix; -1: blockIdx.x, read where it
// is used, so a plain launch keeps no register for it).
template <int T, int N, int NM>
__device__ __forceinline__ void matvec_block(const uint8_t* W0, const uint8_t* W1, long long row_bytes, int R, int K,
                                             const float* x, int n, const float* norm_w, float eps,
                                             const float* resid, float* y, int blk) {
    // N = 8 with 8 rows a thread needs 230-255 registers; Q5_K swiglu spilled there (sm_75/86/89, nvcc 13.0), so
    // Q5_K halves its rows instead (about 1.5x slower at N = 8: x is then read by both slices).
    constexpr bool N8_SPLIT = N == 8 && T == q::Q5_K;
    if (N8_SPLIT || (N < 8 && 2 * (K >> 3) <= THREADS / NM))
        matvec_sliced<T, N, NM, 2>(W0, W1, row_bytes, R, K, x, n, norm_w, eps, resid, y, blk);
    else if constexpr (!N8_SPLIT)
        matvec_sliced<T, N, NM, 1>(W0, W1, row_bytes, R, K, x, n, norm_w, eps, resid, y, blk);
}

// matvec3: one token through up to three matrices of one type and width that read the same x (and RMSNorm), in one
// launch: blocks [0, B0) compute W0's rows, [B0, B0 + B1) W1's, the rest W2's, Bm = ceil(Rm / 8) (Rm = 0: none).
// The choice is per block and uniform, and each block runs matvec_block unchanged: the results are bit for bit
// those of three matvec launches.
template <int T>
__device__ __forceinline__ void matvec3_block(const uint8_t* W0, const uint8_t* W1, const uint8_t* W2, long long rb0,
                                              long long rb1, long long rb2, int R0, int R1, int R2, int K,
                                              const float* x, const float* norm_w, float eps, float* y0, float* y1,
                                              float* y2) {
    const int b0 = (R0 + ROWS - 1) / ROWS, b1 = (R1 + ROWS - 1) / ROWS;
    int blk = blockIdx.x;
    if (blk < b0) {
        matvec_block<T, 1, 1>(W0, W0, rb0, R0, K, x, 1, norm_w, eps, nullptr, y0, blk);
    } else if (blk < b0 + b1) {
        blk -= b0;
        matvec_block<T, 1, 1>(W1, W1, rb1, R1, K, x, 1, norm_w, eps, nullptr, y1, blk);
    } else {
        blk -= b0 + b1;
        matvec_block<T, 1, 1>(W2, W2, rb2, R2, K, x, 1, norm_w, eps, nullptr, y2, blk);
    }
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
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1200
#define MV_BOUNDS_LOWBIT(T) __launch_bounds__(THREADS, T == q::IQ3_XXS || T == q::IQ2_XS ? 2 : 3)
#else
#define MV_BOUNDS_LOWBIT(T) __launch_bounds__(THREADS, T == q::IQ3_XXS ? 2 : 3)
#endif

#define MATVEC_N(tag, T, N, BOUNDS)                                                                                 \
    extern "C" __global__ void BOUNDS                                                                               \
        matvec_##tag##_n##N(const uint8_t* W, long long row_bytes, int R, int K, const float* x, int n,             \
                            const float* norm_w, float eps, const float* resid, float* y) {                          \
        matvec_block<T, N, 1>(W, W, row_bytes, R, K, x, n, norm_w, eps, resid, y, -1);                              \
    }                                                                                                               \
    extern "C" __global__ void BOUNDS                                                                               \
        matvec_swiglu_##tag##_n##N(const uint8_t* Wg, const uint8_t* Wu, long long row_bytes, int R, int K,        \
                                   const float* x, int n, const float* norm_w, float eps, float* y) {               \
        matvec_block<T, N, 2>(Wg, Wu, row_bytes, R, K, x, n, norm_w, eps, nullptr, y, -1);                          \
    }

#define GATHER_DOT(tag, T, BOUNDS)                                                                                  \
    extern "C" __global__ void BOUNDS                                                                               \
        gather_dot_##tag(const uint8_t* W, long long row_bytes, int K, const float* x, long long x_stride,          \
                         const int* rows, int n, float* out) {                                                      \
        gather_dot_warp<T>(W, row_bytes, K, x, x_stride, rows, n, out);                                             \
    }
// matvec3 (one token, up to three matrices a launch): the common types only (k_matvec.has_matvec3).
#define MATVEC3(tag, T)                                                                                             \
    extern "C" __global__ void __launch_bounds__(THREADS, 1)                                                        \
        matvec3_##tag##_n1(const uint8_t* W0, const uint8_t* W1, const uint8_t* W2, long long rb0, long long rb1,   \
                           long long rb2, int R0, int R1, int R2, int K, const float* x, const float* norm_w,       \
                           float eps, float* y0, float* y1, float* y2) {                                            \
        matvec3_block<T>(W0, W1, W2, rb0, rb1, rb2, R0, R1, R2, K, x, norm_w, eps, y0, y1, y2);                      \
    }
// The split-form 1-token matvec and swiglu kernels ask for 2 blocks an SM (at most 128 registers): under the plain
// bound ptxas (nvcc 13.0) spilled 8 bytes of matvec_swiglu_q4_k_n1 on sm_86/89/120. matvec3 states a minimum of 1
// block an SM: with 2, matvec3_q6_k_n1 spilled on sm_100/120, and with no minimum on sm_120.
#define MATVEC_KERNELS(tag, T)                                                                                      \
    MATVEC_N(tag, T, 1, MV_BOUNDS_N1(T)) MATVEC_N(tag, T, 2, MV_BOUNDS) MATVEC_N(tag, T, 4, MV_BOUNDS)                    \
    MATVEC_N(tag, T, 8, MV_BOUNDS) GATHER_DOT(tag, T, MV_BOUNDS) MATVEC3(tag, T)
// The low-bit and codebook types: N = 1 and 8 only (2..7 tokens take the 8-token kernel, k_matvec.py).
#define MATVEC_KERNELS_1_8(tag, T) \
    MATVEC_N(tag, T, 1, MV_BOUNDS_LOWBIT(T)) MATVEC_N(tag, T, 8, MV_BOUNDS) GATHER_DOT(tag, T, MV_BOUNDS_LOWBIT(T))

Q_FOR_EACH_COMMON_TYPE(MATVEC_KERNELS)
Q_FOR_EACH_LOWBIT_TYPE(MATVEC_KERNELS_1_8)

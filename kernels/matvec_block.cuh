// The matvec block (matvec.cu, moe_expert.cuh): rows [8 * blk, +8) of one or two matrices for n <= 8 tokens,
// straight from GGUF blocks.
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
// Quantized rows are staged through shared memory a chunk at a time (stage.cuh), so global memory sees only
// 16-byte granules; the decoders then read the chunk there.
#pragma once
#include "common.cuh"
#include "quant.cuh"
#include "quant_dot.cuh"
#include "quant_i16.cuh"
#include "stage.cuh"

namespace mv {

constexpr int ROWS = 8;       // output rows per block
constexpr int THREADS = 256;  // 8 warps

// Quantized rows of at most CHUNK_GROUPS groups go through shared memory (stage.cuh) when a thread takes all 8 rows
// (S = 1): all threads copy the block's rows in 16-byte granules, then decode them there. Measured on the H200 (30B-A3B
// shape, K = 2048): the MoE gate/up 15.2 -> 14.7 us, DeepSeek-V2-Lite's shared-expert SwiGLU 14.3 -> 12.7, q/k/v
// 8.5 -> 8.1. Staged, the 1024-wide rows of the sliced form (S = 2) and rows of several chunks (K = 4096) were slower
// (5-20%): those read global memory directly, each group's bytes touched first.
// The low-bit and codebook types read global memory directly: staged, their 1-token kernels needed more registers than
// their bounds give (matvec.cu) and spilled.
template <int T>
constexpr bool STAGED = T == q::Q8_0 || T == q::Q4_0 || T == q::Q4_1 || T == q::Q5_0 || T == q::Q5_1 || T == q::Q4_K ||
                        T == q::Q5_K || T == q::Q6_K;
template <int T>
constexpr bool TOUCH = T != q::F32 && T != q::F16 && T != q::BF16;  // float rows: one 16-byte load a group

// A row's bytes are whole blocks (QK <= 256). One block's buffer: each of its NM * 8 rows, at a 16-byte pitch.
constexpr int CHUNK_GROUPS = 256;
template <int T>
constexpr int STAGE_PITCH = stage::pitch(CHUNK_GROUPS * 8 / q::Quant<T>::QK * q::Quant<T>::BYTES);
template <int T, int NM>
constexpr int STAGE_BYTES = STAGED<T> ? NM * ROWS * STAGE_PITCH<T> : 16;

// Quantized rows not staged: a group's bytes come in several small loads whose decoding needs registers, and the
// compiler keeps few of them in flight (about one row's per thread). So first touch one byte of each row's group (at
// its proportional position: a warp's 32 lanes then cover every 32-byte sector of the warp's contiguous span) and make
// the row pointers depend on all of them (through a zero the compiler cannot see): the rows' DRAM requests go out
// together, and load8 then reads L1.
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

// Copies rows [row0, row0 + 8) of each of the NM matrices (past R: row R - 1) into buf, [matrix * ROWS + row][P], in
// 16-byte granules (stage.cuh); the caller waits (stage::wait) and syncs before reading them.
template <int T, int NM>
__device__ __forceinline__ void stage_rows(const uint8_t* W0, const uint8_t* W1, long long row_bytes, int R, int row0,
                                           uint8_t* buf) {
    constexpr int P = STAGE_PITCH<T>, NG = P / 16;  // granules a row
    const int nb = int(row_bytes);                   // at most CHUNK_GROUPS groups: a few KB
    for (int i = threadIdx.x; i < NM * ROWS * NG; i += THREADS) {
        const int s = i / NG;  // the staged row: matrix s / ROWS, row row0 + s % ROWS
        const uint8_t* src = (s < ROWS ? W0 : W1) + (long long)min(row0 + s % ROWS, R - 1) * row_bytes;
        stage::granule(buf + s * P, src, nb, i - s * NG);
    }
}

// The split form (quant_dot.cuh) for up to 4 tokens: at 8, the extra registers would spill.
template <int T, int N>
constexpr bool SPLIT_N = q::SPLIT<T> && N <= 4;

// xv *= nw, the squares of xv (before) added to ss: one group of x times norm_w (the rsqrt scale comes last).
__device__ __forceinline__ void times_norm(float (&xv)[8], const float (&nw)[8], float& ss) {
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        ss = fmaf(xv[k], xv[k], ss);
        xv[k] *= nw[k];
    }
}

// acc[t * RPT + r] += dot(row r values [8g, +8), token t values [8g, +8) times norm_w) for the RPT rows at rp.
// (gw: the group's index in the rows at rp, gx: in x.) I16: the values times norm_w rounded to 16 bits and dotted in
// integers (quant_i16.cuh), once a group for all RPT rows.
template <int T, int N, int RPT, bool I16 = false>
__device__ __forceinline__ void dot_group(const uint8_t* const (&rp)[RPT], int gw, int gx, const float* __restrict__ x,
                                          const int (&xo)[N], const float* __restrict__ norm_w,
                                          float (&acc)[RPT * N], float (&ss)[N]) {
    float xv[N][8];  // values [8g, 8g + 8) of each token, times norm_w when normed (the rsqrt scale comes last)
#pragma unroll
    for (int t = 0; t < N; ++t) cm::load8f(x + xo[t] + 8 * gx, xv[t]);
    if (norm_w) {
        float nw[8];
        cm::load8f(norm_w + 8 * gx, nw);
#pragma unroll
        for (int t = 0; t < N; ++t) times_norm(xv[t], nw, ss[t]);
    }
    if constexpr (I16) {
        q16::Group a[N];
#pragma unroll
        for (int t = 0; t < N; ++t) a[t] = q16::quantize8(xv[t]);
#pragma unroll
        for (int r = 0; r < RPT; ++r)
#pragma unroll
            for (int t = 0; t < N; ++t) acc[t * RPT + r] = fmaf(a[t].s, q16::dot8<T>(rp[r], gw, a[t]), acc[t * RPT + r]);
    } else {
        float xs[N];  // quant_dot.cuh's split form: the x sums, once for all RPT rows
        q::xsums<T, N>(xv, xs);
#pragma unroll
        for (int r = 0; r < RPT; ++r) q::dot8_acc<T, N, RPT, SPLIT_N<T, N>>(rp[r], gw, xv, xs, &acc[r]);
    }
}

// Per-thread partial dot products of the block's rows with N tokens, reduced over each warp into
// red[warp][t * RPT + r] (and the sums of squares of x into red_ss[warp][t]).
template <int T, int N, int NM, int S, bool I16>
__device__ __forceinline__ void partial_dots(const uint8_t* __restrict__ W0, const uint8_t* __restrict__ W1,
                                             long long row_bytes, int R, int K, const float* __restrict__ x, int n,
                                             const float* __restrict__ norm_w, float* red, float* red_ss, uint8_t* buf,
                                             int blk) {
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
    const int G = K >> 3;
    bool staged = false;
    if constexpr (STAGED<T> && S == 1) {
        staged = G <= CHUNK_GROUPS;
        if (staged) {
            constexpr int P = STAGE_PITCH<T>;  // buf: [matrix * ROWS + row][P]
            const int blk_row0 = (blk < 0 ? int(blockIdx.x) : blk) * ROWS;
            stage_rows<T, NM>(W0, W1, row_bytes, R, blk_row0, buf);
            stage::wait();
            __syncthreads();
            const int s0 = (NM == 2 && tid >= TEAM ? ROWS : 0) + row0 - blk_row0;  // the slice's first staged row
            const uint8_t* rp[RPT];
#pragma unroll
            for (int r = 0; r < RPT; ++r)
                rp[r] = stage::landed(buf + (s0 + r) * P, W + (long long)min(row0 + r, R - 1) * row_bytes);
            for (int g = tt; g < G; g += SPAN) dot_group<T, N, RPT, I16>(rp, g, g, x, xo, norm_w, acc, ss);
        }
    }
    if (!staged) {
        const uint8_t* rowp[RPT];  // the slice's rows, clamped to the last row of the matrix
#pragma unroll
        for (int r = 0; r < RPT; ++r) rowp[r] = W + (long long)min(row0 + r, R - 1) * row_bytes;
        for (int g = tt % SPAN; g < G; g += SPAN) {
            const uint8_t* rp[RPT];
#pragma unroll
            for (int r = 0; r < RPT; ++r) rp[r] = rowp[r];
            if constexpr (TOUCH<T>) touch_rows<T, RPT>(rp, g, n);
            dot_group<T, N, RPT, I16>(rp, g, g, x, xo, norm_w, acc, ss);
        }
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

// The sub-block form of partial_dots (1 token, I16, q16::SUB<T>, K <= SUB_MAX_K): x times norm_w is rounded to
// 16-bit groups once for the whole block, into shared memory (a group or two a thread, their sums of squares
// alongside); then thread j of a slice takes the whole 32-value sub-blocks j, j + span, ... of its RPT = 8 / S rows
// (quant_i16.cuh, dot32), reading each sub-block's 4 groups once for all RPT rows and decoding each row's scales once
// a sub-block instead of once a group: the group form's thread takes one group of all 8 rows, and its ~50
// instructions for 8 weights of Q4_K (sm_90 SASS) are mostly the scales'. Warp sums as partial_dots' (red); the
// squares in red_ss[warp] for all 8 warps (finish's SS_ALL).
// Group g = 4 j + i is kept at [i][j], so that a warp's loads of group i of 32 consecutive sub-blocks are
// consecutive. x's groups live at namespace scope: one allocation a kernel, however many forms it inlines.
// Measured on an H200 (2026-12-04, same machine, alternating; bench/results/2026-12-04-h200-session18.md): the 30B-A3B
// shape's q/k/v 7.55 -> 7.05 us a launch, MoE gate/up 11.6 -> 9.1, 4-layer step 0.3195 -> 0.3006 ms, decode 369.9 ->
// 404.0 tok/s; the 0.6B shape's step 0.857 -> 0.826 ms, decode 1117 -> 1160. Not kept: x at [g] (4-way bank conflicts
// on every x load: q/k/v 8.8 us, the 0.6B decode 1079 tok/s); each thread rounding its own 4 groups (each group
// rounded 4-8 times over: q/k/v 18.3 us); the form for unstaged rows only (decode 374.3). Q6_K keeps the group form:
// its sub-blocks come in 2-byte loads, and its MoE down took 8.2 -> 8.6 us.
constexpr int SUB_MAX_K = 4096, SUB_MAX_SB = SUB_MAX_K / 32;
__shared__ uint4 sub_xq[4 * SUB_MAX_SB];      // [i][j]: group 4 j + i's values, rounded (q16::Group's p)
__shared__ q16::Meta sub_xm[4 * SUB_MAX_SB];  // [i][j]: its step and sum

template <int T, int NM, int S>
__device__ __forceinline__ void partial_dots_sub(const uint8_t* __restrict__ W0, const uint8_t* __restrict__ W1,
                                                 long long row_bytes, int R, int K, const float* __restrict__ x,
                                                 const float* __restrict__ norm_w, float* red, float* red_ss,
                                                 uint8_t* buf, int blk) {
    constexpr int TEAM = THREADS / NM, SPAN = TEAM / S, RPT = ROWS / S;
    static_assert(SPAN % 32 == 0, "a slice is whole warps");
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, tt = tid % TEAM;
    const int b = blk < 0 ? int(blockIdx.x) : blk, row0 = b * ROWS + (tt / SPAN) * RPT;  // this slice's first row
    const uint8_t* W = (NM == 2 && tid >= TEAM) ? W1 : W0;
    const int G = K >> 3, SB = K >> 5;
    constexpr int P = STAGE_PITCH<T>;  // buf: [matrix * ROWS + row][P]
    const bool staged = G <= CHUNK_GROUPS;
    if (staged) stage_rows<T, NM>(W0, W1, row_bytes, R, b * ROWS, buf);
    float ss = 0.f;
    for (int g = tid; g < G; g += THREADS) {
        float xv[8];
        cm::load8f(x + 8 * g, xv);
        if (norm_w) {
            float nw[8];
            cm::load8f(norm_w + 8 * g, nw);
            times_norm(xv, nw, ss);
        }
        const q16::Group a = q16::quantize8(xv);
        const int at = (g & 3) * SUB_MAX_SB + (g >> 2);
        sub_xq[at] = make_uint4(a.p[0], a.p[1], a.p[2], a.p[3]);
        sub_xm[at] = q16::Meta{a.s, a.qsum};
    }
    if (staged) stage::wait();
    __syncthreads();
    const uint8_t* rp[RPT];  // the slice's rows (clamped to the last row of the matrix), staged or in global memory
    const int s0 = (NM == 2 && tid >= TEAM ? ROWS : 0) + row0 - b * ROWS;  // the slice's first staged row
#pragma unroll
    for (int r = 0; r < RPT; ++r) {
        const uint8_t* src = W + (long long)min(row0 + r, R - 1) * row_bytes;
        rp[r] = staged ? stage::landed(buf + (s0 + r) * P, src) : src;
    }
    float acc[RPT];
#pragma unroll
    for (int r = 0; r < RPT; ++r) acc[r] = 0.f;
    for (int j = tt % SPAN; j < SB; j += SPAN) {
        q16::Group a[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const uint4 v = sub_xq[i * SUB_MAX_SB + j];
            const q16::Meta m = sub_xm[i * SUB_MAX_SB + j];
            a[i] = q16::Group{{v.x, v.y, v.z, v.w}, m.s, m.qsum};
        }
        const float xs = q16::sub_xs(a);
#pragma unroll
        for (int r = 0; r < RPT; ++r) acc[r] += q16::dot32<T>(rp[r], j, a, xs);
    }
    cm::warp_reduce_scatter(acc);  // lane L holds the warp's total of value L / (32 / RPT)
    if (lane % (32 / RPT) == 0) red[warp * RPT + lane / (32 / RPT)] = acc[0];
    if (norm_w) {
        ss = cm::warp_sum(ss);
        if (lane == 0) red_ss[warp] = ss;
    }
    __syncthreads();
}

// Thread i < 8 * N finishes output (token i / 8, row 8 * blk + i % 8) from the warps' totals: the row's
// slice is warps [m * WT + s * WS, +WS) of team m (WT warps a team, WS a slice); sums of squares come from the warps
// of team 0, slice 0, which together covered every group of x once (SS_ALL: from all 8 warps). yq (SwiGLU, N = 1,
// R % 8 == 0): the 8 outputs, one group, rounded to 16 bits into yq[row] and ym[row / 8] (quant_i16.cuh) instead of y.
template <int N, int NM, int S, bool SS_ALL = false>
__device__ __forceinline__ void finish(int R, int K, int n, const float* norm_w, float eps, const float* resid,
                                       float* y, const float* red, const float* red_ss, int blk,
                                       int16_t* yq = nullptr, q16::Meta* ym = nullptr) {
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
        for (int w = 0; w < (SS_ALL ? 8 : WS); ++w) q += red_ss[w * N + t];
        s = rsqrtf(q / float(K) + eps);
    }
    const long long o = (long long)t * R + row;  // y[t, row]
    if constexpr (NM == 1) {
        y[o] = resid ? resid[o] + s * a : s * a;  // resid may be y: this thread alone reads and writes y[o]
    } else {
        const float gate = s * a, up = s * b, v = gate / (1.f + expf(-gate)) * up;
        if (N == 1 && yq) {
            q16::Meta m;
            yq[o] = q16::quantize_lanes8(v, m);  // threads 0..7: lanes 0..7 of warp 0
            if (r == 0) ym[o >> 3] = m;
        } else {
            y[o] = v;
        }
    }
}

template <int T, int N, int NM, int S, bool I16>
__device__ __forceinline__ void matvec_sliced(const uint8_t* W0, const uint8_t* W1, long long row_bytes, int R, int K,
                                              const float* x, int n, const float* norm_w, float eps,
                                              const float* resid, float* y, uint8_t* buf, int blk, int16_t* yq,
                                              q16::Meta* ym) {
    __shared__ float red[8 * ROWS * N];  // [warp][token * RPT + row of the slice]
    __shared__ float red_ss[8 * N];      // [warp][token]
    partial_dots<T, N, NM, S, I16>(W0, W1, row_bytes, R, K, x, n, norm_w, red, red_ss, buf, blk);
    finish<N, NM, S>(R, K, n, norm_w, eps, resid, y, red, red_ss, blk, yq, ym);
}

// The sub-block form: rows [8 * blk, +8) through partial_dots_sub and finish, with S = 4 slices (2 rows a thread for
// one matrix, 1 for two), or 8 (a row a thread) where 32 threads have a sub-block each. 4 rows a thread spilled under
// the 64-register bounds of matvec3 and the MoE gate/up (sm_90, nvcc 13.0).
template <int T, int NM, int S>
__device__ __forceinline__ void matvec_sub(const uint8_t* W0, const uint8_t* W1, long long row_bytes, int R, int K,
                                           const float* x, const float* norm_w, float eps, const float* resid,
                                           float* y, uint8_t* buf, int blk, int16_t* yq, q16::Meta* ym) {
    __shared__ float red[8 * ROWS];  // [warp][row of the slice]
    __shared__ float red_ss[8];      // [warp]
    partial_dots_sub<T, NM, S>(W0, W1, row_bytes, R, K, x, norm_w, red, red_ss, buf, blk);
    finish<1, NM, S, true>(R, K, 1, norm_w, eps, resid, y, red, red_ss, blk, yq, ym);
}

// Rows [8 * blk, +8) of the matrix (blk: the block's index among those of this matrix; -1: blockIdx.x, read where it
// is used, so a plain launch keeps no register for it). buf: STAGE_BYTES<T, NM> of shared memory, 16-byte aligned.
// I16: integer dots with x rounded to 16 bits (q16::HAS<T>); yq, ym: finish's 16-bit output.
template <int T, int N, int NM, bool I16 = false>
__device__ __forceinline__ void matvec_block_in(const uint8_t* W0, const uint8_t* W1, long long row_bytes, int R,
                                                int K, const float* x, int n, const float* norm_w, float eps,
                                                const float* resid, float* y, uint8_t* buf, int blk,
                                                int16_t* yq = nullptr, q16::Meta* ym = nullptr) {
    // N = 8 with 8 rows a thread needs 230-255 registers; Q5_K swiglu spilled there (sm_75/86/89, nvcc 13.0), so
    // Q5_K halves its rows instead (about 1.5x slower at N = 8: x is then read by both slices).
    constexpr bool N8_SPLIT = N == 8 && T == q::Q5_K;
    if constexpr (N == 1 && I16 && q16::SUB<T>) {
        if (K <= SUB_MAX_K) {
            if constexpr (NM == 1) {
                if (THREADS / 8 >= (K >> 5)) {  // a slice of 32 threads has a sub-block each
                    matvec_sub<T, 1, 8>(W0, W1, row_bytes, R, K, x, norm_w, eps, resid, y, buf, blk, yq, ym);
                    return;
                }
            }
            matvec_sub<T, NM, 4>(W0, W1, row_bytes, R, K, x, norm_w, eps, resid, y, buf, blk, yq, ym);
            return;
        }
    }
    if (N8_SPLIT || (N < 8 && 2 * (K >> 3) <= THREADS / NM))
        matvec_sliced<T, N, NM, 2, I16>(W0, W1, row_bytes, R, K, x, n, norm_w, eps, resid, y, buf, blk, yq, ym);
    else if constexpr (!N8_SPLIT)
        matvec_sliced<T, N, NM, 1, I16>(W0, W1, row_bytes, R, K, x, n, norm_w, eps, resid, y, buf, blk, yq, ym);
}

// matvec_block_in with its own staging buffer.
template <int T, int N, int NM, bool I16 = false>
__device__ __forceinline__ void matvec_block(const uint8_t* W0, const uint8_t* W1, long long row_bytes, int R, int K,
                                             const float* x, int n, const float* norm_w, float eps,
                                             const float* resid, float* y, int blk) {
    __shared__ __align__(16) uint8_t buf[STAGE_BYTES<T, NM>];
    matvec_block_in<T, N, NM, I16>(W0, W1, row_bytes, R, K, x, n, norm_w, eps, resid, y, buf, blk);
}

}  // namespace mv

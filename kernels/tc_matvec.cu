// Small-batch matmuls on tensor cores (9..64 tokens, one weight read for all of them), float32-exact in effect.
// Contract (names, arguments, grid/block): kernels/README.md, "tc_matvec.cu".
//
// tcmv_{t}_m{M}: y[t, r] = (resid[t, r] +) W[r] . xn[t] for n <= M tokens (M = 16, 32, 64), xn = x or RMSNorm(x);
// tcmv_swiglu_{t}_m{M}: y = silu(Wg . xn) * (Wu . xn). The quantized common types (q8_0 ... q6_k).
//
// A block (WARPS warps) owns weight rows [8 RT b, +8 RT) and every token; its warps split K in chunks of 32 values,
// chunk c to warp c mod (warps a matrix), and reduce over shared memory in a fixed order at the end. A SwiGLU's warps
// each take both matrices (JOIN), or half of them each one. A chunk is four mma.m16n8k8 tf32 steps (or two
// m16n8k16 f16 steps) per 16 tokens and 8 rows: the tokens are the M side (A, row major), 8 rows the N side (B,
// column major), so one weight fragment serves all the token tiles and one split of x every fragment of the warp.
//
// K order inside a chunk. mma wants lane (g, q) = (lane / 4, lane % 4) to hold, for A's rows g and g + 8 and B's
// column g, k slots {q, q + 4} of a tf32 k8 step, or {2q, 2q+1, 2q+8, 2q+9} of an f16 k16 step. The sum over k does
// not care which value sits in which slot, as long as A and B agree, so lane (g, q) takes the chunk's values
// [8q, 8q + 8): tf32 step s puts value 8q + 2s in slot q and 8q + 2s + 1 in slot q + 4; f16 step s puts values
// 8q + 4s + {0,1} in slots 2q + {0,1} and 8q + 4s + {2,3} in 2q + {8,9}. Then every lane reads whole 8-value groups:
// one Quant<T>::load8 of its row g, and 32 contiguous bytes of x per token.
//
// Precision: each operand is split into two halves and a step is three mma (hi.hi, hi.lo, lo.hi; lo.lo is below
// float32 rounding): about 21 bits of each operand, products exact, float32 sums. tf32 halves (sm_80 and later, up to
// two fragments of 16 tokens or one of 32, TF32): hi = v rounded to 10 mantissa bits, lo = v - hi, float's exponent
// range, so x goes in as it is. f16 halves (sm_75, and the larger tiles, whose tf32 fragments would spill):
// v = hi + lo * 2^-11 (lo = f16((v - hi) * 2^11)), two accumulators (hi.hi; hi.lo + lo.hi, scaled by 2^-11 at the
// end of the chunk), and x scaled by a power of two per (token, chunk) (|x| < 2 after it: no f16 overflow, and the
// scale is undone exactly on the chunk's sums). RMSNorm's rsqrt scale factors out of the dot products and is applied
// last, as in matvec_block.cuh. Agreement with the float32 matvec is at the level of float32 rounding
// (tests/test_cuda_tc_matvec.py).
//
// Weight rows of at most STAGE_MAX_K values are staged through shared memory first (stage.cuh; matvec_block.cuh's
// reasons), longer ones are read from global memory directly. Rows past R re-read row R - 1 and tokens past n token
// n - 1; neither is written.
#include "common.cuh"
#include "pdl.cuh"
#include "quant.cuh"
#include "stage.cuh"
#include "tf32.cuh"

namespace {

constexpr int ROWS = 8;
// The shape of a block (k_tc_matvec.rows_per_block, WARPS_*). A launch takes about one warp's chunk loop, back to
// back (Nsight Compute, H200, 16 tokens: a warp issues every ~6 cycles, ~4 warps a scheduler), and the split of x is
// as many instructions as a Q4_K fragment's decode and split; fewer warps in flight cost more than they save. So
// tcmv3 (q/k/v: the most rows) takes RT_WIDE = 2 fragments a block at 16 and 32 tokens, a split of x serving two
// (RT = 2 spills at 64); tcmv_swiglu's warps each take both matrices there (JOIN_SWIGLU: a split of x for gate and
// up, every warp on K, as many blocks); tcmv (o, down: the fewest rows, the longest K) takes 16 warps (32 at 16
// tokens, below) sharing the chunks. On an H200 (2026-12-04, Qwen3-0.6B shape, engine profile --batch 13,
// two rounds, from 8 rows x 8 warps everywhere, bench/results/2026-12-04-h200-session20.md): tcmv3 12.5 -> 9.5 us,
// tcmv_swiglu 14.7 -> 11.8, tcmv Q4_K 8.3 -> 7.1, Q6_K down 10.7 -> 9.4. Not kept: 16 rows a block for tcmv_swiglu
// (14.2), 16 warps for tcmv3 / tcmv_swiglu (15.9 / 17.6 at 8 rows, 11.5 / 15.6 at 16).
// tcmv takes 32 warps at 16 tokens (TCMV_ONE16; 16 is the compared form), each with a share of the chunks: Nsight
// Compute on an H100 (2026-12-05, 13 tokens, 16 warps) had tcmv_q4_k_m16 latency-bound, one block an SM, 0.41
// instructions issued a scheduler and cycle, each warp's ~1,000 instructions (4 chunks at K = 2048) a chain at ~9
// cycles apiece. Halving the chains, on that H100 (engine profile --batch 13 / 16, two rounds each): tcmv_q4_k_m16
// 7.19 / 7.11 -> 6.84 / 6.69 us, tcmv_q6_k_m16 8.53 / 8.48 -> 8.33 / 8.17, the 13-token step 1.304 / 1.310 -> 1.279 /
// 1.280 ms, 16 tokens 1.307 / 1.308 -> 1.286 / 1.286, engine bench pp16 12.9k / 12.9k -> 13.1k / 13.2k tok/s. At 32
// and 64 tokens 16 warps stay (more would need more registers than 1,024 threads have).
template <int MT>
constexpr int RT_WIDE = MT >= 4 ? 1 : 2;
template <int MT>
constexpr bool JOIN_SWIGLU = MT < 4;
#ifndef TCMV_ONE16
#define TCMV_ONE16 32
#endif
constexpr int WARPS_WIDE = 8;
template <int MT>
constexpr int WARPS_ONE = MT == 1 ? TCMV_ONE16 : 16;
constexpr float LO_UP = 2048.f, LO_DOWN = 1.f / 2048.f;  // 2^11: lo halves are kept scaled up into f16's range

constexpr int STAGE_MAX_K = 2048;  // longer rows are read from global memory
__host__ __device__ constexpr int cmax(int a, int b) { return a > b ? a : b; }

template <int T>
constexpr int PITCH = stage::pitch(STAGE_MAX_K / q::Quant<T>::QK * q::Quant<T>::BYTES);

// A value's two f16 halves, packed with its neighbour's: hi = (f16(a), f16(b)), lo = the remainders times 2^11.
__device__ __forceinline__ void split2(float a, float b, uint32_t& hi, uint32_t& lo) {
    const __half2 h = __floats2half2_rn(a, b);
    const float2 hf = __half22float2(h);
    const __half2 l = __floats2half2_rn((a - hf.x) * LO_UP, (b - hf.y) * LO_UP);
    hi = *reinterpret_cast<const uint32_t*>(&h);
    lo = *reinterpret_cast<const uint32_t*>(&l);
}

// d += A (16 x 16, row major) . B (16 x 8, column major), f16 operands, f32 accumulators. sm_75 has no k16 form:
// two k8 steps, A's registers {0, 1} with B's 0 (slots 2q + {0,1}), then {2, 3} with B's 1 (slots 2q + {8,9}).
__device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    asm("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a[0]), "r"(a[1]), "r"(b0));
    asm("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a[2]), "r"(a[3]), "r"(b1));
#endif
}

// (down, up) = (2^-e, 2^e) for the power of two 2^e <= amax < 2^(e+1): amax * down < 2. amax = 0 (or denormal) takes
// e = -126; e is capped below infinity's exponent.
__device__ __forceinline__ void pow2_scale(float amax, float& down, float& up) {
    const int e = min(max((__float_as_int(amax) >> 23) & 0xff, 1), 253);  // biased exponent
    down = __int_as_float((254 - e) << 23);
    up = __int_as_float(e << 23);
}

__device__ __forceinline__ void load8(const float* p, float (&v)[8]) {  // plain loads: activations, after the wait
    const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}

// Operands as tf32 halves (m16n8k8, sm_80 and later) for MT 16-token tiles and F fragments a warp with MT * F <= 2;
// f16 halves on sm_75 and beyond that, where the tf32 fragments' registers (twice the f16 ones) spill.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
constexpr bool TF32_ARCH = true;
#else
constexpr bool TF32_ARCH = false;
#endif
template <int MT, int F>
constexpr bool TF32 = TF32_ARCH && MT * F <= 2;

// One 8-row weight fragment's share of a chunk in this lane: its 8 values' hi and lo halves, in the mma's form:
// tf32 halves of value i, or (TF = false) f16 halves of values (2i, 2i + 1).
template <bool TF>
struct Frag {
    static constexpr int N = TF ? 8 : 4;
    uint32_t hi[N], lo[N];
};

template <bool TF>
__device__ __forceinline__ void make_frag(const float (&w)[8], Frag<TF>& f) {
    if constexpr (TF) {
#pragma unroll
        for (int i = 0; i < 8; ++i) split_tf32(w[i], f.hi[i], f.lo[i]);
    } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) split2(w[2 * i], w[2 * i + 1], f.hi[i], f.lo[i]);
    }
}

// The sum over the quad (lanes 4g .. 4g + 3, which hold a chunk's 32 values of the same tokens), in every lane of it.
__device__ __forceinline__ float quad_sum(float v) {
    v += __shfl_xor_sync(cm::FULL, v, 1);
    return v + __shfl_xor_sync(cm::FULL, v, 2);
}

// A tf32 step's A operand (k8 step s): this lane's values 2s and 2s + 1 of tokens g (x0) and g + 8 (x1), in halves.
__device__ __forceinline__ void split_step(const float (&x0)[8], const float (&x1)[8], int s, uint32_t (&ah)[4],
                                           uint32_t (&al)[4]) {
    split_tf32(x0[2 * s], ah[0], al[0]);
    split_tf32(x1[2 * s], ah[1], al[1]);
    split_tf32(x0[2 * s + 1], ah[2], al[2]);
    split_tf32(x1[2 * s + 1], ah[3], al[3]);
}

// TCMV_X3 = 0 (an A/B form, compile time): one mma a product on the hi halves alone (operands rounded to tf32, or to
// f16 after the power-of-two scale: the prefill GEMM's precision, for quantized weights only as it is), the lo halves
// never made. It trades the float32-level agreement with the matvec (tests/test_cuda_tc_matvec.py) for a third of
// the mma and half the splitting; the model tests hold it to the fixtures' bounds. Measured on an H100 (2026-12-05,
// bench/results/2026-12-05-h100-session29.md): the Qwen3-0.6B shape's 13-token step 1.310 / 1.297 -> 1.115 / 1.105 ms,
// 32 tokens 1.851 / 1.855 -> 1.634 / 1.626, engine bench pp16 12.8k / 13.0k -> 15.1k / 14.8k tok/s; the model tests
// pass, and scripts/conformance_report.py puts the quantized fixtures 1.8e-3 .. 5.6e-3 from exact math (3e-6 ..
// 6.6e-5 with three mma; llama.cpp 7e-2 .. 8.5e-1). Not the default: docs/design.md §7 wants a float32-accumulating
// path near 1e-3, and the three-mma form is that at 3e-6; taking it is a product decision (a tf32 switch).
#ifndef TCMV_X3
#define TCMV_X3 1
#endif

// One 16-token tile through one chunk for F weight fragments (8 rows each): x0, x1 are this lane's 8 values of
// tokens g and g + 8 (times norm_w when normed), split once for all F; acc[f][0..1] are token g's sums for fragment
// f's rows 2q, 2q + 1, acc[f][2..3] token g + 8's.
template <int F, bool TF>
__device__ __forceinline__ void tile_chunk(const float (&x0)[8], const float (&x1)[8], const Frag<TF> (&b)[F],
                                           float (&acc)[F][4]) {
    if constexpr (TF) {
        // Step s (k8): slot q holds value 2s, slot q + 4 value 2s + 1 of the lane's 8.
#pragma unroll
        for (int s = 0; s < 4; ++s) {
            uint32_t ah[4], al[4];
            split_step(x0, x1, s, ah, al);
#pragma unroll
            for (int f = 0; f < F; ++f) {
                if (TCMV_X3)
                    mma_tf32x3(acc[f], ah, al, b[f].hi[2 * s], b[f].hi[2 * s + 1], b[f].lo[2 * s], b[f].lo[2 * s + 1]);
                else
                    mma_tf32(acc[f], ah, b[f].hi[2 * s], b[f].hi[2 * s + 1]);
            }
        }
    } else {
        float am0 = 0.f, am1 = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) am0 = fmaxf(am0, fabsf(x0[i])), am1 = fmaxf(am1, fabsf(x1[i]));
#pragma unroll
        for (int o = 1; o <= 2; o <<= 1) {  // the quad (lanes 4g .. 4g + 3) holds the chunk's 32 values of both tokens
            am0 = fmaxf(am0, __shfl_xor_sync(cm::FULL, am0, o));
            am1 = fmaxf(am1, __shfl_xor_sync(cm::FULL, am1, o));
        }
        float down0, up0, down1, up1;
        pow2_scale(am0, down0, up0);
        pow2_scale(am1, down1, up1);
        float hh[F][4] = {}, side[F][4] = {};  // hi.hi; hi.lo + lo.hi (times 2^11)
#pragma unroll
        for (int s = 0; s < 2; ++s) {  // step s: values 4s + {0,1} in slots 2q + {0,1}, 4s + {2,3} in 2q + {8,9}
            uint32_t ah[4], al[4];
            split2(x0[4 * s] * down0, x0[4 * s + 1] * down0, ah[0], al[0]);
            split2(x1[4 * s] * down1, x1[4 * s + 1] * down1, ah[1], al[1]);
            split2(x0[4 * s + 2] * down0, x0[4 * s + 3] * down0, ah[2], al[2]);
            split2(x1[4 * s + 2] * down1, x1[4 * s + 3] * down1, ah[3], al[3]);
#pragma unroll
            for (int f = 0; f < F; ++f) {
                mma(hh[f], ah, b[f].hi[2 * s], b[f].hi[2 * s + 1]);
                if (TCMV_X3) {
                    mma(side[f], ah, b[f].lo[2 * s], b[f].lo[2 * s + 1]);
                    mma(side[f], al, b[f].hi[2 * s], b[f].hi[2 * s + 1]);
                }
            }
        }
#pragma unroll
        for (int f = 0; f < F; ++f) {
            acc[f][0] = fmaf(up0, fmaf(side[f][0], LO_DOWN, hh[f][0]), acc[f][0]);
            acc[f][1] = fmaf(up0, fmaf(side[f][1], LO_DOWN, hh[f][1]), acc[f][1]);
            acc[f][2] = fmaf(up1, fmaf(side[f][2], LO_DOWN, hh[f][2]), acc[f][2]);
            acc[f][3] = fmaf(up1, fmaf(side[f][3], LO_DOWN, hh[f][3]), acc[f][3]);
        }
    }
}

// Matrices a warp computes: all NM when JOIN (one split of x serves both SwiGLU matrices), else one (teams of warps).
template <int NM, bool JOIN>
constexpr int MATS_A_WARP = JOIN ? NM : 1;

// Shared memory of tcmv_block: the staged rows, then (after a barrier) the warps' partial sums and sums of squares.
template <int T, int MT, int NM, int RT, int WARPS, bool JOIN>
constexpr int SMEM_BYTES = cmax(NM * ROWS * RT * PITCH<T>,
                                4 * (WARPS * 16 * MT * ROWS * RT * MATS_A_WARP<NM, JOIN> + WARPS * 16 * MT));

// The block's rows for MT 16-token tiles and NM matrices (1: W0; 2: silu(W0 .) * (W1 .)), RT fragments of 8 rows
// each, K split among WARPS warps: row block rb is rows [8 RT rb, +8 RT). A warp takes RT fragments of one matrix, or
// of each matrix when JOIN, and a lane splits its x once a chunk for all of them. smem: SMEM_BYTES<...> bytes,
// 16-byte aligned.
template <int T, int MT, int NM, int RT, int WARPS, bool JOIN>
__device__ __forceinline__ void tcmv_block(const uint8_t* W0, const uint8_t* W1, long long row_bytes, int R, int K,
                                           const float* x, int n, const float* norm_w, float eps, const float* resid,
                                           float* y, int rb, uint8_t* smem) {
    constexpr int MW = MATS_A_WARP<NM, JOIN>, F = MW * RT;  // matrices and fragments a warp
    constexpr int THREADS = 32 * WARPS, TEAM = WARPS * MW / NM, NTOK = 16 * MT, BR = ROWS * RT, WR = MW * BR;
    constexpr int P = PITCH<T>;
    float* red = reinterpret_cast<float*>(smem);  // [warp][token * WR + matrix of the warp * BR + row]
    float* red_ss = red + WARPS * NTOK * WR;      // [slice][token]: sums of squares of x from team 0
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, qd = lane & 3;
    const int team = warp / TEAM, slice = warp % TEAM, r0 = rb * BR;
    const uint8_t* row[F];  // fragment f: matrix team + f / RT, row r0 + 8 (f % RT) + g
#pragma unroll
    for (int f = 0; f < F; ++f)
        row[f] = (team + f / RT ? W1 : W0) + (long long)min(r0 + ROWS * (f % RT) + g, R - 1) * row_bytes;

    const bool staged = K <= STAGE_MAX_K;
    if (staged) {
        constexpr int NG = P / 16;  // granules a staged row
        for (int i = tid; i < NM * BR * NG; i += THREADS) {
            const int s = i / NG;  // staged row s: matrix s / BR, row r0 + s % BR
            const uint8_t* src = (s < BR ? W0 : W1) + (long long)min(r0 + s % BR, R - 1) * row_bytes;
            stage::granule(smem + s * P, src, int(row_bytes), i - s * NG);
        }
        stage::wait();
        __syncthreads();
#pragma unroll
        for (int f = 0; f < F; ++f)
            row[f] = stage::landed(smem + ((team + f / RT) * BR + ROWS * (f % RT) + g) * P, row[f]);
    }

    int xo[MT][2];  // this lane's tokens g and g + 8 of each tile, clamped to the last (n * K < 2^31: n <= 64)
#pragma unroll
    for (int m = 0; m < MT; ++m) xo[m][0] = min(16 * m + g, n - 1) * K, xo[m][1] = min(16 * m + g + 8, n - 1) * K;
    float acc[MT][F][4] = {}, ss[MT][2] = {};
    const int chunks = K >> 5;
    // Not unrolled: two chunks in flight for the 16- and 32-token tiles measured no faster on an H200 (2026-12-03,
    // scripts/bench_small_batch.py, a Qwen3-0.6B layer: n = 16 47.4 -> 47.0 us, n = 32 67.1 -> 70.2).
    for (int c = slice; c < chunks; c += TEAM) {
        const int k = 32 * c + 8 * qd;  // this lane's 8 values of the chunk
        Frag<TF32<MT, F>> b[F];
#pragma unroll
        for (int f = 0; f < F; ++f) {
            float w[8];
            q::Quant<T>::load8(row[f], k >> 3, w);
            make_frag(w, b[f]);
        }
        float nw[8];
        if (norm_w) load8(norm_w + k, nw);
#pragma unroll
        for (int m = 0; m < MT; ++m) {
            float x0[8], x1[8];
            load8(x + xo[m][0] + k, x0);
            load8(x + xo[m][1] + k, x1);
            if (norm_w) {
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    ss[m][0] = fmaf(x0[i], x0[i], ss[m][0]);
                    ss[m][1] = fmaf(x1[i], x1[i], ss[m][1]);
                    x0[i] *= nw[i];
                    x1[i] *= nw[i];
                }
            }
            tile_chunk<F, TF32<MT, F>>(x0, x1, b, acc[m]);
        }
    }

    if (staged) __syncthreads();  // every warp is done with the staged rows: red goes over them
#pragma unroll
    for (int m = 0; m < MT; ++m) {
        const int t0 = 16 * m + g;  // acc[m][f][0..1]: token t0, fragment f's rows 2q, +1; acc[m][f][2..3]: t0 + 8
        float* out = red + warp * NTOK * WR + 2 * qd;
#pragma unroll
        for (int f = 0; f < F; ++f) {
            *reinterpret_cast<float2*>(out + t0 * WR + ROWS * f) = make_float2(acc[m][f][0], acc[m][f][1]);
            *reinterpret_cast<float2*>(out + (t0 + 8) * WR + ROWS * f) = make_float2(acc[m][f][2], acc[m][f][3]);
        }
        if (norm_w) {
            ss[m][0] = quad_sum(ss[m][0]), ss[m][1] = quad_sum(ss[m][1]);
            if (team == 0 && qd == 0) red_ss[slice * NTOK + t0] = ss[m][0], red_ss[slice * NTOK + t0 + 8] = ss[m][1];
        }
    }
    __syncthreads();

    for (int i = tid; i < NTOK * BR; i += THREADS) {  // output (token i / BR, row r0 + i % BR)
        const int t = i / BR, r = r0 + i % BR;
        if (t >= n || r >= R) continue;
        float a = 0.f, b = 0.f, s = 1.f;
        const float* part = red + t * WR + i % BR;  // matrix 0's partials; matrix 1's BR further (JOIN) or a team on
#pragma unroll
        for (int w = 0; w < TEAM; ++w) a += part[w * NTOK * WR];
        if constexpr (NM == 2) {
            part += JOIN ? BR : TEAM * NTOK * WR;
#pragma unroll
            for (int w = 0; w < TEAM; ++w) b += part[w * NTOK * WR];
        }
        if (norm_w) {
            float q = 0.f;
#pragma unroll
            for (int w = 0; w < TEAM; ++w) q += red_ss[w * NTOK + t];
            s = rsqrtf(q / float(K) + eps);
        }
        const long long o = (long long)t * R + r;
        if constexpr (NM == 1) {
            y[o] = resid ? resid[o] + s * a : s * a;  // resid may be y: this thread alone reads and writes y[o]
        } else {
            const float gate = s * a;
            y[o] = gate / (1.f + expf(-gate)) * (s * b);
        }
    }
}

// Before the wait (pdl.cuh): row block rb's rows (BR of them) into L2, while the kernel that computes x may still run.
__device__ __forceinline__ void prefetch_rows(const uint8_t* W, long long row_bytes, int R, int rb, int BR) {
    const int r0 = rb * BR;
    if (r0 < R) pdl::prefetch_l2(W + r0 * row_bytes, min(BR, R - r0) * row_bytes);
}

// Up to three matrices of one width through one launch (q/k/v): matrix m's row blocks follow those of the matrices
// before it; matrices 0 and 1 are of type T0, matrix 2 of T1. Each block computes what it would in a launch of its
// own matrix, bit for bit (blocks of 8 RT rows and WARPS_WIDE warps, as tcmv_swiglu's). R_m = 0: no blocks.
template <int T0, int T1, int MT>
__device__ __forceinline__ void tcmv3_block(const uint8_t* W0, const uint8_t* W1, const uint8_t* W2, long long bytes0,
                                            long long bytes1, long long bytes2, int R0, int R1, int R2, int K,
                                            const float* x, int n, const float* norm_w, float eps, float* y0,
                                            float* y1, float* y2) {
    constexpr int RT = RT_WIDE<MT>, BR = ROWS * RT, WA = WARPS_WIDE;
    const int b0 = (R0 + BR - 1) / BR, b1 = (R1 + BR - 1) / BR, b = blockIdx.x;
    const int m = b < b0 ? 0 : b < b0 + b1 ? 1 : 2, rb = b - (m == 0 ? 0 : m == 1 ? b0 : b0 + b1);
    const uint8_t* W = m == 0 ? W0 : m == 1 ? W1 : W2;
    const long long row_bytes = m == 0 ? bytes0 : m == 1 ? bytes1 : bytes2;
    const int R = m == 0 ? R0 : m == 1 ? R1 : R2;
    float* y = m == 0 ? y0 : m == 1 ? y1 : y2;
    __shared__ __align__(16) uint8_t smem[cmax(SMEM_BYTES<T0, MT, 1, RT, WA, false>,
                                               SMEM_BYTES<T1, MT, 1, RT, WA, false>)];  // either type's block
    prefetch_rows(W, row_bytes, R, rb, BR);
    pdl::wait();
    if constexpr (T0 == T1) {
        tcmv_block<T0, MT, 1, RT, WA, false>(W, W, row_bytes, R, K, x, n, norm_w, eps, nullptr, y, rb, smem);
    } else {
        if (m < 2) tcmv_block<T0, MT, 1, RT, WA, false>(W, W, row_bytes, R, K, x, n, norm_w, eps, nullptr, y, rb, smem);
        else tcmv_block<T1, MT, 1, RT, WA, false>(W, W, row_bytes, R, K, x, n, norm_w, eps, nullptr, y, rb, smem);
    }
}

}  // namespace

#define TCMV(tag, T, M)                                                                                             \
    extern "C" __global__ void __launch_bounds__(32 * WARPS_ONE<M / 16>, cmax(1, 16 / WARPS_ONE<M / 16>))          \
        tcmv_##tag##_m##M(const uint8_t* W, long long row_bytes, int R, int K, const float* x, int n,               \
                          const float* norm_w, float eps, const float* resid, float* y) {                           \
        pdl::launch_dependents();                                                                                   \
        constexpr int WO = WARPS_ONE<M / 16>;                                                                       \
        __shared__ __align__(16) uint8_t smem[SMEM_BYTES<T, M / 16, 1, 1, WO, false>];                              \
        prefetch_rows(W, row_bytes, R, blockIdx.x, ROWS);                                                           \
        pdl::wait();                                                                                                \
        tcmv_block<T, M / 16, 1, 1, WO, false>(W, W, row_bytes, R, K, x, n, norm_w, eps, resid, y, blockIdx.x,      \
                                               smem);                                                               \
    }                                                                                                               \
    extern "C" __global__ void __launch_bounds__(32 * WARPS_WIDE, 16 / WARPS_WIDE)                                  \
        tcmv_swiglu_##tag##_m##M(const uint8_t* Wg, const uint8_t* Wu, long long row_bytes, int R, int K,           \
                                 const float* x, int n, const float* norm_w, float eps, float* y) {                 \
        pdl::launch_dependents();                                                                                   \
        constexpr bool JOIN = JOIN_SWIGLU<M / 16>;                                                                  \
        __shared__ __align__(16) uint8_t smem[SMEM_BYTES<T, M / 16, 2, 1, WARPS_WIDE, JOIN>];                       \
        prefetch_rows(Wg, row_bytes, R, blockIdx.x, ROWS);                                                          \
        prefetch_rows(Wu, row_bytes, R, blockIdx.x, ROWS);                                                          \
        pdl::wait();                                                                                                \
        tcmv_block<T, M / 16, 2, 1, WARPS_WIDE, JOIN>(Wg, Wu, row_bytes, R, K, x, n, norm_w, eps, nullptr, y,       \
                                                      blockIdx.x, smem);                                            \
    }
#define TCMV_KERNELS(tag, T) TCMV(tag, T, 16) TCMV(tag, T, 32) TCMV(tag, T, 64)

// tcmv3_{tag}_m{M}: q/k/v of one type; tcmv3_{a}_{b}_m{M}: two of type a, the last of b (k_matvec.MATVEC3_PAIRS).
#define TCMV3(tag, T0, T1, M)                                                                                       \
    extern "C" __global__ void __launch_bounds__(32 * WARPS_WIDE, 16 / WARPS_WIDE)                                  \
        tcmv3_##tag##_m##M(const uint8_t* W0, const uint8_t* W1, const uint8_t* W2, long long bytes0,               \
                           long long bytes1, long long bytes2, int R0, int R1, int R2, int K, const float* x, int n, \
                           const float* norm_w, float eps, float* y0, float* y1, float* y2) {                       \
        pdl::launch_dependents();                                                                                   \
        tcmv3_block<T0, T1, M / 16>(W0, W1, W2, bytes0, bytes1, bytes2, R0, R1, R2, K, x, n, norm_w, eps, y0, y1,   \
                                    y2);                                                                            \
    }
#define TCMV3_KERNELS(tag, T0, T1) TCMV3(tag, T0, T1, 16) TCMV3(tag, T0, T1, 32) TCMV3(tag, T0, T1, 64)

TCMV_KERNELS(q8_0, q::Q8_0) TCMV_KERNELS(q4_0, q::Q4_0) TCMV_KERNELS(q4_1, q::Q4_1) TCMV_KERNELS(q5_0, q::Q5_0)
TCMV_KERNELS(q5_1, q::Q5_1) TCMV_KERNELS(q4_k, q::Q4_K) TCMV_KERNELS(q5_k, q::Q5_K) TCMV_KERNELS(q6_k, q::Q6_K)

TCMV3_KERNELS(q8_0, q::Q8_0, q::Q8_0) TCMV3_KERNELS(q4_0, q::Q4_0, q::Q4_0) TCMV3_KERNELS(q4_1, q::Q4_1, q::Q4_1)
TCMV3_KERNELS(q5_0, q::Q5_0, q::Q5_0) TCMV3_KERNELS(q5_1, q::Q5_1, q::Q5_1) TCMV3_KERNELS(q4_k, q::Q4_K, q::Q4_K)
TCMV3_KERNELS(q5_k, q::Q5_K, q::Q5_K) TCMV3_KERNELS(q6_k, q::Q6_K, q::Q6_K) TCMV3_KERNELS(q4_k_q6_k, q::Q4_K, q::Q6_K)
TCMV3_KERNELS(q5_k_q6_k, q::Q5_K, q::Q6_K) TCMV3_KERNELS(q4_k_q5_k, q::Q4_K, q::Q5_K)

// Mixture-of-experts FFN: routing, decode expert matvecs, and the grouped prefill GEMM over rows sorted by expert.
// Contract (names, arguments, grid/block): kernels/README.md, "moe.cu". Routing and grouping: moe_route.cuh; decode
// matvecs: moe_expert.cuh; the GEMM tile: gemm_tile.cuh.
//
// Prefill (n > 8 tokens): moe_route -> moe_group (rows sorted by expert, tile list) -> moe_gather (normed rows in
// that order) -> moe_gemm_swiglu_{t} (gate/up) -> moe_gemm_{t} (down) -> moe_combine (weighted sum per token, in slot
// order, plus the shared expert, into the residual). Every grid is fixed by n alone; no host read of expert ids.
#include "pdl.cuh"
#include "gemm_tile.cuh"
#include "moe_expert.cuh"
#include "moe_route.cuh"

// Grouped GEMM: block (x, y) computes weight rows [64x, +64) of tile y = (e, start, end) of the tile list, i.e.
// C[p] = W_e . A[p] for permuted rows p in [start, min(start + 64, end)). gemm::tile addresses tokens as
// blockIdx.y * 64 + i and guards them against its n, so it is handed A and C shifted by start - 64y and
// n = 64y + (end - start): its token 64y + i is permuted row start + i, and rows at or past end are never written
// (their reads clamp to row end - 1, inside A).
template <int T, int NW>
__device__ __forceinline__ void grouped_tile(const uint8_t* const (&W)[NW], long long row_bytes, long long expert_bytes,
                                             int R, int K, const float* __restrict__ A, const int* __restrict__ tiles,
                                             float* C) {
    const int y = blockIdx.y, e = tiles[3 * y], start = tiles[3 * y + 1], end = tiles[3 * y + 2];
    if (e < 0) return;  // past the last tile: the whole block leaves before any barrier
    const long long shift = (long long)start - (long long)y * gemm::BM;
    const uint8_t* We[NW];
#pragma unroll
    for (int m = 0; m < NW; ++m) We[m] = W[m] + e * expert_bytes;
    gemm::tile<T, NW>(We, row_bytes, R, K, A + shift * K, y * gemm::BM + (end - start), nullptr, C + shift * R);
}

#define MOE_GEMM_BOUNDS __launch_bounds__(gemm::THREADS, 2)  // as gemm.cu: room for a stage in registers
// gate_up runs matvec_block.cuh's block, under matvec.cu's 1-token bound: 2 blocks an SM (at most 128 registers) for
// the split-form types, else the plain bound. (The warp-a-row kernel before it spilled on sm_100 under the plain
// bound and asked for 3.)
#define MOE_GATE_UP_BOUNDS(T) __launch_bounds__(moe::MV_THREADS, q::SPLIT<T> ? 2 : 1)

// The low-bit and codebook types' decode kernels state a minimum of blocks an SM on every arch, gate_up 1 and down 3:
// under the plain bound ptxas (nvcc 13.0) gave the warp-a-row moe_gate_up_iq3_s 64 registers on sm_120 and spilled
// 24 bytes (and moe_down_iq2_s, before moe_down took 4 warps a row, 40 on sm_90). gate_up, now matvec_block's, asked
// for 2 and spilled on sm_100/120 (q3_k 228-244 bytes, iq2_xs 52, iq3_s 24, iq2_s 8); at 1, none spills.
#define MOE_DOWN_BOUNDS __launch_bounds__(moe::MV_THREADS)
#define MOE_LOWBIT_GATE_UP_BOUNDS(T) __launch_bounds__(moe::MV_THREADS, 1)
#define MOE_LOWBIT_DOWN_BOUNDS __launch_bounds__(moe::MV_THREADS, 3)

#define MOE_KERNELS(tag, T, GATE_UP_BOUNDS, DOWN_BOUNDS)                                                              \
    /* y[p, r] = silu(Wg_e[r] . x[p / k]) * (Wu_e[r] . x[p / k]) (Wu null: Wg_e[r] . x[p / k]), e = ids[p]; */        \
    /* items past n_items: the shared expert's SwiGLU into hs (Sg, Su of `parts` * R rows; moe_expert.cuh) */         \
    extern "C" __global__ void GATE_UP_BOUNDS(T)                                                                      \
        moe_gate_up_##tag(const uint8_t* Wg, const uint8_t* Wu, long long row_bytes, long long expert_bytes, int R,   \
                          int K, const float* x, const int* ids, int k, float* y, int n_items, const uint8_t* Sg,     \
                          const uint8_t* Su, int parts, float* hs) {                                                  \
        pdl::begin();                                                                                                 \
        moe::gate_up<T>(Wg, Wu, row_bytes, expert_bytes, R, K, x, ids, k, y, n_items, Sg, Su, parts, hs);             \
    }                                                                                                                 \
    /* x[t, r] += sum_j w[t, j] * (W_{ids[t, j]}[r] . h[t * k + j]) (+ g_t * shared[t, r]) */                         \
    extern "C" __global__ void DOWN_BOUNDS                                                                            \
        moe_down_##tag(const uint8_t* W, long long row_bytes, long long expert_bytes, int R, int K, const float* h,   \
                       const int* ids, const float* w, int k, const float* shared, const float* sgate, float* x) {    \
        pdl::begin();                                                                                                 \
        moe::down<T>(W, row_bytes, expert_bytes, R, K, h, ids, w, k, shared, sgate, x);                               \
    }                                                                                                                 \
    /* C[p] = W_e . A[p] over the tile list */                                                                        \
    extern "C" __global__ void MOE_GEMM_BOUNDS moe_gemm_##tag(const uint8_t* __restrict__ W, long long row_bytes,     \
                                                              long long expert_bytes, int R, int K,                   \
                                                              const float* __restrict__ A, const int* tiles,          \
                                                              float* C) {                                             \
        pdl::begin();                                                                                                 \
        const uint8_t* const w[1] = {W};                                                                              \
        grouped_tile<T, 1>(w, row_bytes, expert_bytes, R, K, A, tiles, C);                                            \
    }                                                                                                                 \
    /* C[p] = silu(Wg_e . A[p]) * (Wu_e . A[p]) over the tile list */                                                 \
    extern "C" __global__ void MOE_GEMM_BOUNDS moe_gemm_swiglu_##tag(                                                 \
        const uint8_t* __restrict__ Wg, const uint8_t* __restrict__ Wu, long long row_bytes, long long expert_bytes,  \
        int R, int K, const float* __restrict__ A, const int* tiles, float* C) {                                      \
        pdl::begin();                                                                                                 \
        const uint8_t* const w[2] = {Wg, Wu};                                                                         \
        grouped_tile<T, 2>(w, row_bytes, expert_bytes, R, K, A, tiles, C);                                            \
    }

#define MOE_COMMON_KERNELS(tag, T) MOE_KERNELS(tag, T, MOE_GATE_UP_BOUNDS, MOE_DOWN_BOUNDS)
#define MOE_LOWBIT_KERNELS(tag, T) MOE_KERNELS(tag, T, MOE_LOWBIT_GATE_UP_BOUNDS, MOE_LOWBIT_DOWN_BOUNDS)
Q_FOR_EACH_COMMON_TYPE(MOE_COMMON_KERNELS)
Q_FOR_EACH_LOWBIT_TYPE(MOE_LOWBIT_KERNELS)

// The 16-bit forms (moe_expert.cuh), as moe_gate_up / moe_down with the experts' SwiGLU outputs as 16-bit groups:
// yq [n_items, R] int16 and ym [n_items, R / 8] q16::Meta (R % 8 == 0; Wu given). gate_up: MOE_I16_BLOCKS blocks an
// SM, at most 64 registers (none spills). Measured on the H200 (4-layer profiles): 4 against 2 (128 registers),
// Q4_K gate/up 13.0 -> 11.7 us a layer on the 30B-A3B shape, 21.8 -> 18.7 on DeepSeek-V2-Lite's. Q6_K asks for 1:
// at 2 it spilled 4 bytes on sm_75/80 and 40 on sm_100 (nvcc 13.0).
#ifndef MOE_I16_BLOCKS
#define MOE_I16_BLOCKS 4
#endif
#define MOE_I16_KERNELS(tag, T)                                                                                       \
    extern "C" __global__ void __launch_bounds__(moe::MV_THREADS, T == q::Q6_K ? 1 : MOE_I16_BLOCKS)                  \
        moe_gate_up16_##tag(const uint8_t* Wg, const uint8_t* Wu, long long row_bytes, long long expert_bytes, int R, \
                            int K, const float* x, const int* ids, int k, int16_t* yq, q16::Meta* ym, int n_items,    \
                            const uint8_t* Sg, const uint8_t* Su, int parts, float* hs) {                             \
        pdl::begin();                                                                                                 \
        moe::gate_up<T, true>(Wg, Wu, row_bytes, expert_bytes, R, K, x, ids, k, nullptr, n_items, Sg, Su, parts, hs,  \
                              yq, ym);                                                                                \
    }                                                                                                                 \
    extern "C" __global__ void MOE_DOWN_BOUNDS                                                                        \
        moe_down16_##tag(const uint8_t* W, long long row_bytes, long long expert_bytes, int R, int K,                 \
                         const int16_t* hq, const q16::Meta* hm, const int* ids, const float* w, int k,               \
                         const float* shared, const float* sgate, float* x) {                                         \
        pdl::begin();                                                                                                 \
        moe::down<T, true>(W, row_bytes, expert_bytes, R, K, nullptr, ids, w, k, shared, sgate, x, hq, hm);           \
    }                                                                                                                 \
    /* moe_down16's sum with the rows staged (moe_expert.cuh, down_staged): grid (ceil(R / 8), n) */                  \
    extern "C" __global__ void __launch_bounds__(moe::MV_THREADS, 2)                                                  \
        moe_down16s_##tag(const uint8_t* W, long long row_bytes, long long expert_bytes, int R, int K,                \
                          const int16_t* hq, const q16::Meta* hm, const int* ids, const float* w, int k,              \
                          const float* shared, const float* sgate, float* x) {                                        \
        pdl::begin();                                                                                                 \
        moe::down_staged<T>(W, row_bytes, expert_bytes, R, K, ids, w, k, shared, sgate, x, hq, hm);                   \
    }
Q16_FOR_EACH_TYPE(MOE_I16_KERNELS)

// Block 256, grid.x = n (one token a block).
extern "C" __global__ void __launch_bounds__(moe::ROUTE_THREADS)
    moe_route(const float* logits,              // [n, E] router logits, E <= 1024
              int E, int k,                     // 1 <= k <= min(E, 32)
              int sigmoid,                      // gating: 0 softmax over E, 1 sigmoid of each
              const float* bias,                // optional [E] exp_probs_b: for the choice only
              int n_groups, int n_groups_used,  // E / n_groups experts a group; 1: no groups
              int norm, float scale,            // w /= max(sum, 2^-14) when norm; w *= scale
              const float* xn, int dim,         // [n, dim] normed rows, for the shared expert's gate
              const float* gate_shexp,          // optional [dim]: sgate[t] = sigmoid(gate_shexp . xn[t])
              int* ids, float* w,               // [n, k] out: experts best first, their weights
              float* sgate) {                   // [n] out (only with gate_shexp)
    pdl::begin();
    moe::route_token<false>(blockIdx.x, logits, E, k, sigmoid, bias, n_groups, n_groups_used, norm, scale, xn, dim,
                            gate_shexp, ids, w, sgate);
}

// One token, block 256, grid E + (gate_shexp ? 1 : 0) (a block a router row): moe_route's arguments with the norm and
// an F32 router in front (moe_route.cuh, route_decode).
extern "C" __global__ void __launch_bounds__(moe::ROUTE_THREADS)
    moe_route_decode(const float* x,           // [dim] the residual; dim % 4 == 0, dim <= 8192
                     const float* norm_w, float eps, int dim,
                     const float* W,           // [E, dim] F32 router rows (ffn_gate_inp), 16-byte aligned
                     int E, int k, int sigmoid, const float* bias, int n_groups, int n_groups_used, int norm,
                     float scale,
                     const float* gate_shexp,  // optional [dim] F32: sgate[0] = sigmoid(gate_shexp . xn)
                     float* xn,                // [dim] out: RMSNorm(x) * norm_w
                     float* logits,            // [E] out
                     int* counter,             // [1] zero before the first launch; every launch leaves it zero
                     int* ids, float* w,       // [k] out each, best first
                     float* sgate) {           // [1] out (with gate_shexp)
    pdl::launch_dependents();  // route_decode waits once its router rows are on their way (pdl.cuh)
    moe::route_decode(x, norm_w, eps, dim, W, E, k, sigmoid, bias, n_groups, n_groups_used, norm, scale, gate_shexp,
                      xn, logits, counter, ids, w, sgate);
}

// Block 1024, grid 1.
extern "C" __global__ void __launch_bounds__(moe::GROUP_THREADS)
    moe_group(const int* ids,   // [n_items] expert of item i = token i / k, slot i % k
              int n_items, int k, int E,
              int max_tiles,    // length of the tile list (k_moe.max_tiles: a bound fixed by n_items and E)
              int* offsets,     // [E + 1] out: expert e's sorted rows are [offsets[e], offsets[e + 1])
              int* perm_tok,    // [n_items] out: token of sorted row p
              int* inv,         // [n_items] out: sorted row of item i
              int* tiles) {     // [max_tiles, 3] out: (e, start, end) per 64-row tile, then (-1, 0, 0)
    pdl::begin();
    moe::group_rows(ids, n_items, k, E, max_tiles, offsets, perm_tok, inv, tiles);
}

// xp[p, :] = xn[perm_tok[p], :], block p; dim a multiple of 4, rows 16-byte aligned.
extern "C" __global__ void __launch_bounds__(256)
    moe_gather(const float* __restrict__ xn, int dim, const int* __restrict__ perm_tok, float* __restrict__ xp) {
    pdl::begin();
    const int p = blockIdx.x, d4 = dim >> 2;
    const float4* src = reinterpret_cast<const float4*>(xn) + (long long)perm_tok[p] * d4;
    float4* dst = reinterpret_cast<float4*>(xp) + (long long)p * d4;
    for (int c = threadIdx.x; c < d4; c += blockDim.x) dst[c] = src[c];
}

// x[t, :] += sum_j w[t, j] * y[inv[t * k + j], :] (slot order) + g_t * shared[t, :] (g_t = sgate[t], or 1), block t.
extern "C" __global__ void __launch_bounds__(256)
    moe_combine(const float* __restrict__ y, const int* __restrict__ inv, const float* __restrict__ w, int k, int dim,
                const float* __restrict__ shared, const float* __restrict__ sgate, float* __restrict__ x) {
    pdl::begin();
    const int t = blockIdx.x, d4 = dim >> 2;
    const float g = shared && sgate ? sgate[t] : 1.f;
    float4* xt = reinterpret_cast<float4*>(x) + (long long)t * d4;
    for (int c = threadIdx.x; c < d4; c += blockDim.x) {
        float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int j = 0; j < k; ++j) {
            const float wj = w[(long long)t * k + j];
            const float4 v = reinterpret_cast<const float4*>(y)[(long long)inv[(long long)t * k + j] * d4 + c];
            a.x = fmaf(wj, v.x, a.x), a.y = fmaf(wj, v.y, a.y), a.z = fmaf(wj, v.z, a.z), a.w = fmaf(wj, v.w, a.w);
        }
        if (shared) {
            const float4 s = reinterpret_cast<const float4*>(shared)[(long long)t * d4 + c];
            a.x = fmaf(g, s.x, a.x), a.y = fmaf(g, s.y, a.y), a.z = fmaf(g, s.z, a.z), a.w = fmaf(g, s.w, a.w);
        }
        float4 r = xt[c];
        r.x += a.x, r.y += a.y, r.z += a.z, r.w += a.w;
        xt[c] = r;
    }
}

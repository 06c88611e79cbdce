// Routing on the device, and the grouping of routed rows by expert for the prefill GEMM. Contract: kernels/README.md,
// "moe.cu". Kernels: moe.cu.
//
// route_token (one block per token; route_decode fuses the norm and the router matvec in front for one token) is
// engine/models/moe.py's `route` step for step, in float32: softmax or sigmoid
// of the router logits, `exp_probs_b` added for the choice only, expert groups (keep the n_groups_used groups whose
// two best scores sum highest), then top-k. The order is NumPy's stable argsort of -select: larger first, ties to the
// lower index (groups too), NaN after every number. Equal logits give equal probabilities here and in NumPy, so ties
// are chosen the same way.
//
// group_rows (one block) sorts the n*k routed rows by expert, stably: expert e's rows are [off[e], off[e+1]) in token
// order. Counting uses integer shared atomics (an order-free result); the placement is one warp walking the rows in
// order, 32 at a time, ranking lanes that share an expert with __match_any_sync. It also lists the 64-row tiles of
// the grouped GEMM: tile y covers permuted rows [start, min(start + 64, end)) of expert e, as tiles[y] = (e, start,
// end); the tiles past the last are (-1, 0, 0), so the GEMM's fixed grid needs no host read.
#pragma once
#include <math.h>
#include <stdint.h>

#include "common.cuh"
#include "pdl.cuh"

namespace moe {

constexpr int MAX_EXPERTS = 1024;
constexpr int MAX_K = 32;       // experts used per token
constexpr int MAX_GROUPS = 64;  // expert groups
constexpr int ROUTE_THREADS = 256;
constexpr int GROUP_THREADS = 1024;
constexpr int TILE_ROWS = 64;  // rows of a grouped-GEMM tile: gemm::BM

// Whether (v, i) sorts before (w, j) in NumPy's stable argsort of -select.
__device__ __forceinline__ bool before(float v, int i, float w, int j) {
    const bool vn = v != v, wn = w != w;
    if (vn != wn) return wn;  // a number before a NaN
    if (!vn && v != w) return v > w;
    return i < j;
}

template <int NW>
__device__ __forceinline__ float block_max(float v, float* scratch) {
    v = cm::warp_max(v);
    if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
    __syncthreads();
    float m = scratch[0];
#pragma unroll
    for (int w = 1; w < NW; ++w) m = fmaxf(m, scratch[w]);
    __syncthreads();
    return m;
}

// chosen[j] = the expert of rank j < k by `before` (a strict total order, so the ranks are 0..E-1, each once): the
// first k of NumPy's stable argsort of -sel, as choosing the best not yet taken k times would give. P lanes of a warp
// rank each expert (P the largest power of 2 up to 32 with P * E <= the block's threads), each against every P-th
// competitor in shared memory (broadcasts), and add their counts; one barrier in all.
__device__ __forceinline__ void top_k(const float* sel, int E, int k, int* chosen) {
    int P = 1;
    while (P < 32 && 2 * P * E <= ROUTE_THREADS) P *= 2;
    for (int base = 0; base < E * P; base += ROUTE_THREADS) {  // uniform over the block: shuffles below are safe
        const int slot = base + threadIdx.x, e = slot / P, part = slot % P;
        int rank = 0;
        if (e < E) {
            const float v = sel[e];
#pragma unroll 8  // the shared-memory reads in flight together
            for (int f = part; f < E; f += P) rank += before(sel[f], f, v, e);
        }
        for (int o = 1; o < P; o <<= 1) rank += __shfl_xor_sync(cm::FULL, rank, o);
        if (e < E && part == 0 && rank < k) chosen[rank] = e;
    }
    __syncthreads();
}

// Group g's score: the sum of its two best choice scores (a repeated value counts twice).
__device__ __forceinline__ float group_score(const float* sel, int g, int per) {
    float a = -INFINITY, b = -INFINITY;  // the two largest, a >= b
    for (int i = 0; i < per; ++i) {
        const float v = sel[g * per + i];
        if (v > a) b = a, a = v;
        else if (v > b) b = v;
    }
    return b + a;
}

// Whether group g is outside the n_used best by `before` over the groups' scores.
__device__ __forceinline__ bool group_dropped(const float* gscore, int n_groups, int g, int n_used) {
    int rank = 0;
    for (int h = 0; h < n_groups; ++h) rank += before(gscore[h], h, gscore[g], g);
    return rank >= n_used;
}

// Experts of groups outside the n_used best (by the sum of their two best scores) get -inf.
__device__ __forceinline__ void drop_groups(float* sel, int E, int n_groups, int n_used, float* gscore,
                                            unsigned char* gdrop) {
    const int per = E / n_groups, tid = threadIdx.x;
    if (tid < n_groups) gscore[tid] = group_score(sel, tid, per);
    __syncthreads();
    if (tid < n_groups) gdrop[tid] = group_dropped(gscore, n_groups, tid, n_used);
    __syncthreads();
    for (int e = tid; e < E; e += ROUTE_THREADS)
        if (gdrop[e / per]) sel[e] = -INFINITY;
    __syncthreads();
}

// Logits another block of this launch wrote (CG, after the ticket's fence) are read through L2 only.
template <bool CG>
__device__ __forceinline__ float ld_logit(const float* p) {
    if constexpr (CG) return __ldcg(p);
    return *p;
}

template <bool CG>
__device__ __forceinline__ void route_token(int t, const float* __restrict__ logits, int E, int k, int sigmoid,
                                            const float* __restrict__ bias, int n_groups, int n_groups_used, int norm,
                                            float scale, const float* __restrict__ xn, int dim,
                                            const float* __restrict__ gate_shexp, int* __restrict__ ids,
                                            float* __restrict__ w, float* __restrict__ sgate) {
    constexpr int NW = ROUTE_THREADS / 32;
    __shared__ float prob[MAX_EXPERTS], sel[MAX_EXPERTS];  // gating output; choice scores
    __shared__ float gscore[MAX_GROUPS];
    __shared__ unsigned char gdrop[MAX_GROUPS];
    __shared__ float scratch[NW];
    __shared__ int chosen[MAX_K];
    const int tid = threadIdx.x;
    const float* z = logits + (long long)t * E;

    // probs = softmax(z) = exp(z - max) / sum, or sigmoid(z) = 1 / (1 + exp(-z)), as engine/cpu/ops.py. Each
    // thread's logits (e = tid + 256 j) are read once, together.
    constexpr int EPT = MAX_EXPERTS / ROUTE_THREADS;
    float zv[EPT], bv[EPT];
#pragma unroll
    for (int j = 0; j < EPT; ++j) {
        const int e = tid + ROUTE_THREADS * j;
        zv[j] = e < E ? ld_logit<CG>(z + e) : -INFINITY;
        bv[j] = bias && e < E ? bias[e] : 0.f;
    }
    float m = -INFINITY, s = 0.f;
    if (!sigmoid) {
#pragma unroll
        for (int j = 0; j < EPT; ++j) m = fmaxf(m, zv[j]);
        m = block_max<NW>(m, scratch);
    }
#pragma unroll
    for (int j = 0; j < EPT; ++j) {
        if (tid + ROUTE_THREADS * j < E) {
            zv[j] = sigmoid ? 1.f / (1.f + expf(-zv[j])) : expf(zv[j] - m);  // zv now holds the probabilities
            s += zv[j];
        }
    }
    if (!sigmoid) s = cm::block_sum<NW>(s, scratch);
#pragma unroll
    for (int j = 0; j < EPT; ++j) {
        const int e = tid + ROUTE_THREADS * j;
        if (e < E) {
            const float p = sigmoid ? zv[j] : zv[j] / s;
            prob[e] = p;
            sel[e] = bias ? p + bv[j] : p;
        }
    }
    __syncthreads();
    if (n_groups > 1) drop_groups(sel, E, n_groups, n_groups_used, gscore, gdrop);
    top_k(sel, E, k, chosen);  // k <= E: every slot is filled

    // weights = probs of the chosen (/ max(sum, 2^-14), when norm) (* scale): thread j < k writes slot j, each
    // adding the sum in slot order.
    if (tid < k) {
        float sum = 0.f;
        for (int j = 0; j < k; ++j) sum += prob[chosen[j]];
        const float d = fmaxf(sum, 6.103515625e-5f);
        float v = prob[chosen[tid]];
        if (norm) v = v / d;
        if (scale != 1.f) v = v * scale;
        ids[(long long)t * k + tid] = chosen[tid];
        w[(long long)t * k + tid] = v;
    }
    // The shared expert's gate: sigmoid(gate_shexp . xn[t]).
    if (gate_shexp) {
        float d = 0.f;
        for (int c = tid; c < dim; c += ROUTE_THREADS) d = fmaf(xn[(long long)t * dim + c], gate_shexp[c], d);
        d = cm::block_sum<NW>(d, scratch);
        if (tid == 0) sgate[t] = 1.f / (1.f + expf(-d));
    }
}

// One decode token from the residual, a block a row: block b < E computes xn = RMSNorm(x) * norm_w (as norm_rope.cu's
// rmsnorm_rows does, though its sum of squares goes in another order: every block adds the same values in the same
// order, so all agree, and each writes its share of xn) and logit b = W[b] . xn; block E, when gate_shexp is given,
// sgate = sigmoid(gate_shexp . xn). Thread t holds the float4 granules t + 256 j of the row, of norm_w and of x, in
// registers. The last block to finish (a ticket from *counter, which it sets back to 0) routes the token as
// route_token does. The weights (the row, norm_w) are loaded before the wait, so their round trip overlaps the kernel
// before; after it, one round trip for x. On an H200, for the 30B-A3B shape, 7.9 us a launch; a warp a row (16
// blocks, half of each row loaded after the norm, the weights sunk below the wait by ptxas) took 11.1. One launch
// instead of rmsnorm_rows, the router matvec and moe_route took 12.3 against 3.5 + 3.9 + 8.7. The last block pulling
// the chosen experts' gate and up matrices into L2 once it knew them (cp.async.bulk.prefetch.L2 in 32 KiB pieces over
// its threads) made the launch 64 us on an H200 (2026-12-04, 30B-A3B shape; 98 with down too): one SM's bulk
// prefetches went out at ~0.2 TB/s and the block did not finish before them. Not kept.
constexpr int ROUTE_MAX_DIM = 8192;
constexpr int ROUTE_GRANULES = ROUTE_MAX_DIM / 4 / ROUTE_THREADS;  // float4 granules a thread

__device__ __forceinline__ void route_decode(const float* x, const float* norm_w, float eps,
                                             int dim, const float* W, int E, int k, int sigmoid,
                                             const float* __restrict__ bias, int n_groups, int n_groups_used,
                                             int norm, float scale, const float* gate_shexp,
                                             float* __restrict__ xn, float* logits, int* counter,
                                             int* __restrict__ ids, float* __restrict__ w, float* __restrict__ sgate) {
    constexpr int NW = ROUTE_THREADS / 32, NG = ROUTE_GRANULES;
    __shared__ float red[NW];
    __shared__ int ticket;
    const int tid = threadIdx.x, row = blockIdx.x, n4 = dim >> 2;
    const float4* w4 = reinterpret_cast<const float4*>(row < E ? W + (long long)row * dim : gate_shexp);
    const float4* nw4 = reinterpret_cast<const float4*>(norm_w);
    const float4 z4 = make_float4(0.f, 0.f, 0.f, 0.f);
    float4 wv[NG], nv[NG], xv[NG];
#pragma unroll
    for (int j = 0; j < NG; ++j) {
        const int f = tid + ROUTE_THREADS * j;
        wv[j] = f < n4 ? w4[f] : z4;   // pre-wait: the router row, a weight
        nv[j] = f < n4 ? nw4[f] : z4;  // pre-wait: norm_w, a weight
    }
    // x, norm_w, W and gate_shexp are not __restrict__: ptxas schedules read-only (.nc) loads freely about the wait,
    // sinking the weights' below it (nothing then overlaps the kernel before) or hoisting x's above it (pdl.cuh).
    pdl::wait();
    const float4* x4 = reinterpret_cast<const float4*>(x);
#pragma unroll
    for (int j = 0; j < NG; ++j) xv[j] = tid + ROUTE_THREADS * j < n4 ? x4[tid + ROUTE_THREADS * j] : z4;
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < NG; ++j) {  // zeros past dim
        ss = fmaf(xv[j].x, xv[j].x, ss);
        ss = fmaf(xv[j].y, xv[j].y, ss);
        ss = fmaf(xv[j].z, xv[j].z, ss);
        ss = fmaf(xv[j].w, xv[j].w, ss);
    }
    ss = cm::block_sum<NW>(ss, red);
    const float r = 1.0f / sqrtf(ss / float(dim) + eps);  // not rsqrtf: as rmsnorm_rows
    const int share = (n4 + gridDim.x - 1) / gridDim.x, f0 = row * share;  // this block's granules of xn
    float d = 0.f;
#pragma unroll
    for (int j = 0; j < NG; ++j) {
        const int f = tid + ROUTE_THREADS * j;
        const float4 v = make_float4((xv[j].x * r) * nv[j].x, (xv[j].y * r) * nv[j].y, (xv[j].z * r) * nv[j].z,
                                     (xv[j].w * r) * nv[j].w);
        if (f < n4 && f - f0 >= 0 && f - f0 < share) reinterpret_cast<float4*>(xn)[f] = v;
        d = fmaf(wv[j].x, v.x, d);  // zeros past dim
        d = fmaf(wv[j].y, v.y, d);
        d = fmaf(wv[j].z, v.z, d);
        d = fmaf(wv[j].w, v.w, d);
    }
    d = cm::block_sum<NW>(d, red);
    if (tid == 0) {
        if (row < E) logits[row] = d;
        else sgate[0] = 1.f / (1.f + expf(-d));
        __threadfence();  // the logit before the ticket
        ticket = atomicAdd(counter, 1);
    }
    __syncthreads();
    if (ticket != int(gridDim.x) - 1) return;
    __threadfence();
    // The block's route: a one-warp form (warp reductions, top-k as k rounds of a warp-wide best) measured slower on
    // the H200, 12.3 -> 14.2 us a launch for the 30B-A3B shape.
    route_token<true>(0, logits, E, k, sigmoid, bias, n_groups, n_groups_used, norm, scale, nullptr, 0, nullptr, ids,
                      w, nullptr);
    if (tid == 0) *counter = 0;  // for the next launch
}

__device__ __forceinline__ void group_rows(const int* __restrict__ ids, int n_items, int k, int E, int max_tiles,
                                           int* __restrict__ offsets, int* __restrict__ perm_tok,
                                           int* __restrict__ inv, int* __restrict__ tiles) {
    __shared__ int cnt[MAX_EXPERTS], fill[MAX_EXPERTS], tstart[MAX_EXPERTS];
    __shared__ int n_tiles;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    for (int e = tid; e < E; e += GROUP_THREADS) cnt[e] = 0;
    __syncthreads();
    for (int i = tid; i < n_items; i += GROUP_THREADS) atomicAdd(&cnt[ids[i]], 1);
    __syncthreads();
    if (warp == 0) {  // exclusive scans of the rows and of the tiles per expert, 32 experts a step
        int rows = 0, tls = 0;
        for (int e0 = 0; e0 < E; e0 += 32) {
            const int e = e0 + lane, c = e < E ? cnt[e] : 0, nt = (c + TILE_ROWS - 1) / TILE_ROWS;
            int rc = c, rt = nt;  // inclusive scans over the lanes
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const int a = __shfl_up_sync(cm::FULL, rc, o), b = __shfl_up_sync(cm::FULL, rt, o);
                if (lane >= o) rc += a, rt += b;
            }
            if (e < E) {
                fill[e] = rows + rc - c;
                tstart[e] = tls + rt - nt;
                offsets[e] = rows + rc - c;
            }
            rows += __shfl_sync(cm::FULL, rc, 31);
            tls += __shfl_sync(cm::FULL, rt, 31);
        }
        if (lane == 0) offsets[E] = rows, n_tiles = tls;
    }
    __syncthreads();
    for (int e = tid; e < E; e += GROUP_THREADS)
        for (int m = 0; m * TILE_ROWS < cnt[e]; ++m) {
            int* tl = tiles + 3LL * (tstart[e] + m);
            tl[0] = e, tl[1] = fill[e] + m * TILE_ROWS, tl[2] = fill[e] + cnt[e];
        }
    for (int y = n_tiles + tid; y < max_tiles; y += GROUP_THREADS) {
        int* tl = tiles + 3LL * y;
        tl[0] = -1, tl[1] = 0, tl[2] = 0;
    }
    __syncthreads();  // fill[] is the tiles' row offsets until here; the placement below advances it
    if (warp == 0) {
        for (int i0 = 0; i0 < n_items; i0 += 32) {
            const int i = i0 + lane;
            const bool ok = i < n_items;
            const int e = ok ? ids[i] : -1;
            const unsigned peers = __match_any_sync(cm::FULL, e);
            const int rank = __popc(peers & ((1u << lane) - 1u));  // earlier lanes with the same expert
            const int base = ok ? fill[e] : 0;
            __syncwarp();
            if (ok && rank == 0) fill[e] = base + __popc(peers);
            __syncwarp();
            if (ok) {
                perm_tok[base + rank] = i / k;
                inv[i] = base + rank;
            }
        }
    }
}

}  // namespace moe

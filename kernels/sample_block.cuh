// Block-wide building blocks of kernels/sample.cu (one block of NT = 1024 threads): its shared memory, streaming
// the logits from L2, argmax, order-preserving float keys, candidate lists, histograms and block scans.
#pragma once
#include <stdint.h>

namespace {

typedef unsigned long long u64;
constexpr int NT = 1024, BITS = 11, NBIN = 1 << BITS, CAP = 2048, NTH = 8;
constexpr unsigned NONE = 0xFFFFFFFFu, FULL = 0xFFFFFFFFu;

struct Smem {
    unsigned wlo[NBIN], whi[NBIN];  // weight per digit of a radix pass: low 32 bits and the rest (64-bit shared
    unsigned cbin[NBIN];            // atomics would be compare-and-swap loops); tokens per digit
    u64 cand[CAP];                  // candidates (unordered): logit bits << 32 | id; or the draw's round masses
    u64 scan_w[32], scan_c[32], wsum[32];
    float fred[32], wm[32][NTH];
    int ired[32];
    unsigned sel;  // the digit a pass selected, with the weight and count above it and in it
    u64 sel_w, sel_c, sel_cbin;
    int ncand;  // < 0: every token is in play (read the logits); else the candidates
    int nfill;
};

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }
__device__ __forceinline__ int lane_id() { return threadIdx.x & 31; }

// Logits i .. i+3 (0 past V): one 16-byte load where the row allows it.
__device__ __forceinline__ void load4(const float* __restrict__ x, int i, int V, bool vec, float* out) {
    if (vec && i + 3 < V) {
        const float4 v = __ldg(reinterpret_cast<const float4*>(x + i));
        out[0] = v.x, out[1] = v.y, out[2] = v.z, out[3] = v.w;
    } else {
#pragma unroll
        for (int e = 0; e < 4; ++e) out[e] = i + e < V ? __ldg(x + i + e) : 0.0f;
    }
}

// fn(ok, id, x) for every logit with the block converged, 4Q per thread per round (Q = 2: 32 KiB in flight; more
// would not fit 64 registers): thread t reads quads 4t + 4*NT*q of each round. ok is false past V.
template <int Q = 2, class Fn>
__device__ __forceinline__ void stream(const float* __restrict__ logits, int V, Fn fn) {
    const bool vec = (reinterpret_cast<uintptr_t>(logits) & 15) == 0;
    for (int b = 0; b < V; b += 4 * Q * NT) {
        float x[4 * Q];
#pragma unroll
        for (int q = 0; q < Q; ++q) load4(logits, b + 4 * (NT * q + threadIdx.x), V, vec, x + 4 * q);
#pragma unroll
        for (int q = 0; q < Q; ++q)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int i = b + 4 * (NT * q + threadIdx.x) + e;
                fn(i < V, i, x[4 * q + e]);
            }
    }
}

// (a, ia) before (b, ib) in argmax order: NaN first (as numpy), then larger value, then lower index.
__device__ __forceinline__ bool better(float a, int ia, float b, int ib) {
    const bool na = a != a, nb = b != b;
    if (na != nb) return na;
    if (!na && a != b) return a > b;
    return ia < ib;
}

// NaN or +-inf: the exponent bits all set (one AND and compare, on a value already in a register).
__device__ __forceinline__ bool nonfinite(float x) { return (__float_as_uint(x) & 0x7f800000u) == 0x7f800000u; }

// Every thread returns the block-wide result, or -1 when any logit is not finite (a broken model: no token is
// chosen from NaNs). fred / ired: 32 entries each of shared memory. Streaming 8 quads a thread a round instead of 2
// (5 rounds of loads over 151,936 logits instead of 19, 60 registers) was no faster on an H200 (2026-12-02, the
// 0.6B shape's chained decode 1.057 vs 1.054 ms a token): the argmax sits behind the LM head in the step's graph.
__device__ int block_argmax(const float* __restrict__ logits, int V, float* fred, int* ired) {
    float bv = neg_inf();
    int bi = V;  // beaten by any real element, -inf included
    bool bad = false;
    stream(logits, V, [&](bool ok, int i, float x) {
        bad |= ok && nonfinite(x);
        if (ok && better(x, i, bv, bi)) bv = x, bi = i;
    });
    if (__syncthreads_or(bad)) return -1;  // uniform: every thread sees the same answer
    for (int round = 0; round < 2; ++round) {  // warp, then block
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float v = __shfl_xor_sync(FULL, bv, o);
            const int i = __shfl_xor_sync(FULL, bi, o);
            if (better(v, i, bv, bi)) bv = v, bi = i;
        }
        if (round == 0) {
            if (lane_id() == 0) fred[threadIdx.x >> 5] = bv, ired[threadIdx.x >> 5] = bi;
            __syncthreads();
            bv = fred[lane_id()], bi = ired[lane_id()];
        }
    }
    return bi;
}

// Order-preserving key of a float: negative floats bit-inverted, positive ones with the sign bit set. -0 is
// mapped to +0 first so keys compare exactly like the floats (numpy's z >= threshold treats them as equal).
__device__ __forceinline__ unsigned xkey(float x) {
    const unsigned u = __float_as_uint(x == 0.0f ? 0.0f : x);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float key_float(unsigned k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7FFFFFFFu) : ~k);
}
__device__ __forceinline__ u64 fixed45(float p) { return __float2ull_rn(p * 35184372088832.0f); }  // p * 2^45

// Append (id, x) to the candidates where `take`, from a converged warp; past CAP only the count grows.
__device__ __forceinline__ void append(Smem& sh, bool take, int id, float x) {
    const unsigned m = __ballot_sync(FULL, take);
    int base = 0;
    if (lane_id() == 0 && m) base = atomicAdd(&sh.nfill, __popc(m));
    base = __shfl_sync(FULL, base, 0) + __popc(m & ((1u << lane_id()) - 1));
    if (take && base < CAP) sh.cand[base] = (u64(__float_as_uint(x)) << 32) | unsigned(id);
}

// 64-bit add to a digit's weight from 32-bit atomics: the carry out of the low word is seen in its old value.
__device__ __forceinline__ void add_weight(Smem& sh, unsigned d, u64 w) {
    const unsigned lo = unsigned(w), old = atomicAdd(&sh.wlo[d], lo);
    const unsigned hi = unsigned(w >> 32) + (old + lo < old ? 1u : 0u);
    if (hi) atomicAdd(&sh.whi[d], hi);
}

// Histogram update from a converged warp (digit NONE: nothing; WEIGHTED false: counts only). Lanes sharing a digit
// are summed first, so a hot digit costs one shared atomic per warp; w < 2^46 is summed in two 23-bit halves.
template <bool WEIGHTED>
__device__ __forceinline__ void hist_add(Smem& sh, unsigned d, u64 w) {
#if __CUDA_ARCH__ >= 800
    const unsigned peers = __match_any_sync(FULL, d);
    u64 sum = 0;
    if (WEIGHTED)
        sum = (u64(__reduce_add_sync(peers, unsigned(w >> 23))) << 23) + __reduce_add_sync(peers, unsigned(w) & 0x7FFFFFu);
    if (d != NONE && lane_id() == __ffs(peers) - 1) {
        atomicAdd(&sh.cbin[d], unsigned(__popc(peers)));
        if (WEIGHTED) add_weight(sh, d, sum);
    }
#else
    if (d != NONE) {
        atomicAdd(&sh.cbin[d], 1u);
        if (WEIGHTED) add_weight(sh, d, w);
    }
#endif
}

__device__ __forceinline__ u64 warp_sum(u64 v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
    return v;
}

// Inclusive prefix sums of (a, b) over the block in thread order.
__device__ __forceinline__ void block_scan2(u64& a, u64& b, Smem& sh) {
    const int warp = threadIdx.x >> 5, lane = lane_id();
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const u64 ta = __shfl_up_sync(FULL, a, o), tb = __shfl_up_sync(FULL, b, o);
        if (lane >= o) a += ta, b += tb;
    }
    if (lane == 31) sh.scan_w[warp] = a, sh.scan_c[warp] = b;
    __syncthreads();
    if (warp == 0) {
        u64 x = sh.scan_w[lane], y = sh.scan_c[lane];
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const u64 tx = __shfl_up_sync(FULL, x, o), ty = __shfl_up_sync(FULL, y, o);
            if (lane >= o) x += tx, y += ty;
        }
        sh.scan_w[lane] = x, sh.scan_c[lane] = y;
    }
    __syncthreads();
    if (warp > 0) a += sh.scan_w[warp - 1], b += sh.scan_c[warp - 1];
}

// Given per-thread (w0, c0) for entry e0 and (w1, c1) for the entry after it, in the order the block scans them,
// record in sh.sel* the entry where the running weight first reaches `target` (tf(total) when target is 0).
template <class TargetFn>
__device__ __forceinline__ u64 crossing(Smem& sh, int e0, u64 w0, u64 w1, u64 c0, u64 c1, u64 target, TargetFn tf) {
    u64 w = w0 + w1, c = c0 + c1;
    block_scan2(w, c, sh);
    if (target == 0) target = tf(sh.scan_w[31]);  // the block's total weight
    const u64 we = w - w0 - w1, ce = c - c0 - c1;
    if (we < target && target <= we + w0) sh.sel = e0, sh.sel_w = we, sh.sel_c = ce + c0, sh.sel_cbin = c0;
    if (we + w0 < target && target <= w) sh.sel = e0 + 1, sh.sel_w = we + w0, sh.sel_c = c, sh.sel_cbin = c1;
    __syncthreads();
    return target;
}

}  // namespace

// Token choice on the device: greedy argmax, and engine/sampling.py's temperature / top-k / top-p draw, so that
// only the token id crosses PCIe and a decode step stays one CUDA graph. One block of 1024 threads.
//
// Every threshold of sampling.py is "the largest value v whose weight at or above v reaches a target", found by
// radix selection (11 bits per pass, shared-memory histograms) over 32-bit keys that order like the values:
//   top-k:  keys of the logits x (z = x / T is monotone in x), weight 1, target k   -> the k-th largest z
//   top-p:  bits of p = exp(z - max z), weight p, target top_p * kept mass          -> the smallest p kept
//   draw:   key V-1-id (descending key = ascending id), weight p, target u * mass + 1 unit -> the first id whose
//           cumulative probability in id order exceeds u * mass
// Weights are 64-bit fixed point (p * 2^45; p <= 1 and V <= 2^18 keep every sum below 2^63), so sums are exact
// and independent of the order atomics land in: a draw is reproducible from (seed, step). One block is one SM, so
// the logits are read as few times as possible: a bounding pass counts the tokens within a few fixed distances of
// the top and copies the few that top-k / top-p can keep into shared memory, where the selections then run; a
// plain temperature draw reads the logits once more (per-warp, id-ordered masses) and rescans one 128-id stretch.
// p is computed as exp2((x - max x) * log2(e) / T): within a few ulps of numpy's exp(x / T - max z).
#include "argmax_key.cuh"
#include "pdl.cuh"
#include "sample_block.cuh"

namespace {

// The bounding pass's distances below the top, in z: p = e^-d. Past 34, p < 2^-46 has no weight at all.
__constant__ float DZ[NTH] = {1.0f, 2.0f, 3.0f, 5.0f, 8.0f, 13.0f, 21.0f, 34.0f};
enum Stage { TOPK, TOPP, DRAW };

struct Filter {
    float xmax, kT;  // max logit; log2(e) / T
    unsigned kkey;   // top-k keeps logits x with xkey(x) >= kkey (0: all)
    unsigned pthr;   // top-p keeps p with bits >= pthr (0: all)
    int V;
};
__device__ __forceinline__ float prob(const Filter& f, float x) { return exp2f((x - f.xmax) * f.kT); }

// Whether token (id, logit x) is still in play at stage ST, and its key and weight there.
template <int ST>
__device__ __forceinline__ bool item(const Filter& f, int id, float x, unsigned& key, u64& w) {
    const unsigned xk = xkey(x);
    if (xk < f.kkey) return false;
    if (ST == TOPK) {
        key = xk, w = 1;
        return true;
    }
    const float p = prob(f, x);
    const unsigned pk = __float_as_uint(p);  // p >= 0: its bits order like its value
    if (ST == DRAW && pk < f.pthr) return false;
    key = ST == TOPP ? pk : unsigned(f.V - 1 - id), w = fixed45(p);
    return true;
}

// fn(ok, id, x) over the tokens in play: all logits, or the candidates.
template <class Fn>
__device__ __forceinline__ void for_each(const float* __restrict__ logits, int V, const Smem& sh, Fn fn) {
    if (sh.ncand < 0) return stream(logits, V, fn);  // uniform: ncand changes only between barriers
    for (int b = 0; b < sh.ncand; b += NT) {
        const bool ok = b + int(threadIdx.x) < sh.ncand;
        const u64 c = ok ? sh.cand[b + threadIdx.x] : 0;
        fn(ok, int(unsigned(c)), __uint_as_float(unsigned(c >> 32)));
    }
}

// The largest key v (of nbits bits) with W(key >= v) >= target = tf(total weight) over the tokens in play at
// stage ST. Pass by pass (top digits first) it keeps the digit where the weight summed from the top reaches the
// target, then looks inside it for what remains. `compact`: once the tokens at or above the kept digit number
// <= CAP, copy them into the candidates for the passes that follow.
template <int ST, class TargetFn>
__device__ unsigned select(Smem& sh, const float* __restrict__ logits, const Filter& f, int nbits, TargetFn tf,
                           bool compact) {
    unsigned prefix = 0;
    u64 target = 0, c_above = 0;
    for (int hi = nbits; hi > 0;) {
        const int width = min(BITS, hi), shift = hi - width, nb = 1 << width;
        __syncthreads();  // the previous pass's sh.sel* and histograms have been read by everyone
        for (int b = threadIdx.x; b < NBIN; b += NT) sh.wlo[b] = 0, sh.whi[b] = 0, sh.cbin[b] = 0;
        if (threadIdx.x == 0) sh.sel = 0, sh.sel_w = 0, sh.sel_c = 0, sh.sel_cbin = 0;
        __syncthreads();
        for_each(logits, f.V, sh, [&](bool ok, int id, float x) {
            unsigned key = 0;
            u64 w = 0;
            ok = ok && item<ST>(f, id, x, key, w) && (hi >= 32 || (key >> hi) == prefix);
            hist_add<ST != TOPK>(sh, ok ? (key >> shift) & unsigned(nb - 1) : NONE, ok ? w : 0);
        });
        __syncthreads();
        // Thread t owns digits nb-1-2t and nb-2-2t, so the scan runs from the top digit down (entry = nb-1-digit).
        const int b0 = nb - 1 - 2 * threadIdx.x, b1 = b0 - 1;
        const u64 c0 = b0 >= 0 ? sh.cbin[b0] : 0, c1 = b1 >= 0 ? sh.cbin[b1] : 0;
        const u64 w0 = ST == TOPK ? c0 : b0 >= 0 ? (u64(sh.whi[b0]) << 32) + sh.wlo[b0] : 0;  // top-k: weight 1
        const u64 w1 = ST == TOPK ? c1 : b1 >= 0 ? (u64(sh.whi[b1]) << 32) + sh.wlo[b1] : 0;
        target = crossing(sh, 2 * threadIdx.x, w0, w1, c0, c1, target, tf);
        prefix = (prefix << width) | unsigned(nb - 1 - int(sh.sel));
        target -= sh.sel_w;
        const u64 c_ge = c_above + sh.sel_c;  // tokens with key >= prefix << shift
        c_above = c_ge - sh.sel_cbin;
        hi = shift;
        if (compact && hi > 0 && sh.ncand < 0 && c_ge <= CAP) {  // c_ge is uniform: from shared values
            if (threadIdx.x == 0) sh.nfill = 0;
            __syncthreads();
            for_each(logits, f.V, sh, [&](bool ok, int id, float x) {
                unsigned key = 0;
                u64 w = 0;
                append(sh, ok && item<ST>(f, id, x, key, w) && (key >> hi) >= prefix, id, x);
            });
            __syncthreads();
            if (threadIdx.x == 0) sh.ncand = sh.nfill;  // read by the others only after the next barrier
        }
    }
    __syncthreads();
    return prefix;
}

// The bounding pass: for each distance d_j, the tokens with z >= max z - d_j: their count (top-k), or their
// probability mass and the exact total mass in sh.wsum[0] (MASS: top-p without top-k). The nearest distance that
// k tokens, or top_p of the mass (with a margin for the float sums), needs bounds every token the selections can
// keep; those, less a margin in x that covers ties after rounding, become the candidates if there are <= CAP.
template <bool MASS>
__device__ void bound(Smem& sh, const float* __restrict__ logits, const Filter& f, float T, int top_k, float top_p) {
    const int warp = threadIdx.x >> 5, lane = lane_id();
    float X[NTH], acc[NTH];  // acc: count or mass at each distance
#pragma unroll
    for (int j = 0; j < NTH; ++j) X[j] = f.xmax - DZ[j] * T, acc[j] = 0.0f;
    u64 total = 0;
    stream(logits, f.V, [&](bool ok, int, float x) {
        const float p = MASS ? prob(f, x) : 1.0f;
        if (MASS && ok) total += fixed45(p);
#pragma unroll
        for (int j = 0; j < NTH; ++j) acc[j] += ok && x >= X[j] ? p : 0.0f;  // counts < 2^24: exact in a float
    });
#pragma unroll
    for (int j = 0; j < NTH; ++j) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) acc[j] += __shfl_xor_sync(FULL, acc[j], o);
        if (lane == 0) sh.wm[warp][j] = acc[j];
    }
    if (MASS) total = warp_sum(total);
    if (lane == 0) sh.wsum[warp] = total;
    __syncthreads();
    if (warp == 0) {  // totals over the warps, in lane j < NTH (and the exact mass in lane 0 of wsum)
        float m = 0.0f;
        for (int w = 0; w < 32; ++w) m += lane < NTH ? sh.wm[w][lane] : 0.0f;
        const u64 s = warp_sum(sh.wsum[lane]);
        __syncwarp();
        if (lane < NTH) sh.wm[0][lane] = m;
        if (lane == 0) sh.wsum[0] = s;
    }
    __syncthreads();
    int j = 0;  // uniform
    const float need = MASS ? top_p * sh.wm[0][NTH - 1] * 1.0001f : float(top_k);
    while (j < NTH - 1 && sh.wm[0][j] < need) ++j;
    if (!MASS && sh.wm[0][j] > float(CAP)) return;  // too many: the selections read the logits
    const float xj = f.xmax - DZ[j] * T, xc = xj - (1e-3f * T + 1e-6f * fabsf(xj));
    if (threadIdx.x == 0) sh.nfill = 0;
    __syncthreads();
    stream(logits, f.V, [&](bool ok, int id, float x) { append(sh, ok && x >= xc, id, x); });
    __syncthreads();
    if (threadIdx.x == 0) sh.ncand = sh.nfill <= CAP ? sh.nfill : -1;  // more than CAP: read the logits
    __syncthreads();
}

// The draw over every logit, in one pass: warp w sums the weights of its stretch of ids in rounds of 128 (lane l:
// ids 4l .. 4l+3 of the round), the block scan finds the round where the id-ordered mass reaches the target, and
// warp 0 rescans those 128 ids. Returns the id.
__device__ int draw_all(Smem& sh, const float* __restrict__ logits, const Filter& f, u64 r) {
    const int warp = threadIdx.x >> 5, lane = lane_id();
    const int per_warp = (f.V + 32 * 128 - 1) / (32 * 128) * 128;  // <= 64 rounds for V <= 2^18
    const bool vec = (reinterpret_cast<uintptr_t>(logits) & 15) == 0;
    auto weight = [&](int id, float x) -> u64 {
        unsigned key;
        u64 w;
        return id < f.V && item<DRAW>(f, id, x, key, w) ? w : 0;
    };
    for (int r0 = 0; r0 < 64; r0 += 2) {
        float x[8];
#pragma unroll
        for (int q = 0; q < 2; ++q) {
            const int base = warp * per_warp + (r0 + q) * 128 + 4 * lane;
            if ((r0 + q) * 128 < per_warp) load4(logits, base, f.V, vec, x + 4 * q);
        }
#pragma unroll
        for (int q = 0; q < 2; ++q) {
            const int base = warp * per_warp + (r0 + q) * 128 + 4 * lane;
            u64 s = 0;
            if ((r0 + q) * 128 < per_warp)
#pragma unroll
                for (int e = 0; e < 4; ++e) s += weight(base + e, x[4 * q + e]);
            s = warp_sum(s);
            if (lane == 0) sh.cand[warp * 64 + r0 + q] = s;  // round masses, in id order
        }
    }
    if (threadIdx.x == 0) sh.sel = 0, sh.sel_w = 0;
    __syncthreads();
    const u64 target = crossing(sh, 2 * threadIdx.x, sh.cand[2 * threadIdx.x], sh.cand[2 * threadIdx.x + 1], 0, 0,
                                0, [&](u64 total) { return __umul64hi(r << 40, total) + 1; });
    if (warp != 0) return 0;
    const int base = int(sh.sel / 64) * per_warp + int(sh.sel % 64) * 128 + 4 * lane;
    float x[4];
    load4(logits, base, f.V, vec, x);
    u64 w[4], s = 0;
#pragma unroll
    for (int e = 0; e < 4; ++e) w[e] = weight(base + e, x[e]), s += w[e];
    u64 c = s;  // inclusive scan over the lanes, then back to this lane's start
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const u64 t = __shfl_up_sync(FULL, c, o);
        if (lane >= o) c += t;
    }
    c += sh.sel_w - s;
    int hit = -1;
#pragma unroll
    for (int e = 3; e >= 0; --e) {
        c += w[3 - e];
        if (hit < 0 && c >= target) hit = base + 3 - e;
    }
    const unsigned m = __ballot_sync(FULL, hit >= 0);
    return m ? __shfl_sync(FULL, hit, __ffs(m) - 1) : f.V - 1;
}

}  // namespace

// out[0] = lowest index among the maxima of logits[0:V], or -1 if any is NaN or infinite. Block 1024, grid 1.
// The decode chain's hand-off, by thread 0 once the id is chosen (chain null: a lone step). chain is the model's
// control block [pos, step, out, n, id, ...]: the id becomes the next step's input chain[4] (0 for the -1 mark of
// non-finite logits, which reaches the host through the ring as it is), the position moves on by one, and the id is
// written to ring[n % ring_len] (page-locked host memory the host reads after the step's event), n += 1.
__device__ __forceinline__ void hand_off(int id, int* chain, int* ring, int ring_len) {
    if (!chain) return;
    chain[4] = id < 0 ? 0 : id;
    chain[0] += 1;
    const int n = chain[3];
    ring[n % ring_len] = id;
    chain[3] = n + 1;
    __threadfence_system();
}

extern "C" __global__ void __launch_bounds__(1024)
argmax_f32(const float* __restrict__ logits, int V, int* out, int* chain, int* ring, int ring_len) {
    pdl::begin();
    __shared__ float fred[32];
    __shared__ int ired[32];
    const int a = block_argmax(logits, V, fred, ired);
    if (threadIdx.x == 0) *out = a, hand_off(a, chain, ring, ring_len);
}

// out[0] = the id of the argmax key an LM head folded into *best (matvec_stream.cuh), -1 for a NaN or infinite
// logit, as argmax_f32 over its logits would; *best = 0 for the next head. Then the hand-off. Block 32, grid 1.
extern "C" __global__ void __launch_bounds__(32)
argmax_key(unsigned long long* best, int* out, int* chain, int* ring, int ring_len) {
    pdl::begin();
    if (threadIdx.x != 0) return;
    const int a = amk::id(*best);
    *best = amk::EMPTY;
    *out = a, hand_off(a, chain, ring, ring_len);
}

// engine.sampling.sample on the device (out[0] = -1 if any logit is NaN or infinite), then *step += 1. Block 1024,
// grid 1.
extern "C" __global__ void __launch_bounds__(1024)
sample_f32(const float* __restrict__ logits, int V, float temperature, int top_k, float top_p,
           unsigned long long seed, int* step, int* out, int* chain, int* ring, int ring_len) {
    pdl::begin();
    __shared__ Smem sh;
    int id;
    if (temperature == 0.0f || top_k == 1) {
        id = block_argmax(logits, V, sh.fred, sh.ired);
    } else {
        float xmax = neg_inf();  // max z = max(logits) / T: division by T > 0 is monotone
        bool bad = false;        // a NaN or infinite logit anywhere: no draw, id -1 (block_argmax does the same)
        stream(logits, V, [&](bool ok, int, float x) {
            xmax = ok ? fmaxf(xmax, x) : xmax;
            bad |= ok && nonfinite(x);
        });
        for (int o = 16; o > 0; o >>= 1) xmax = fmaxf(xmax, __shfl_xor_sync(FULL, xmax, o));
        if (lane_id() == 0) sh.fred[threadIdx.x >> 5] = xmax;
        if (threadIdx.x == 0) sh.ncand = -1;
        if (__syncthreads_or(bad)) {  // uniform
            if (threadIdx.x == 0) *out = -1, *step += 1, hand_off(-1, chain, ring, ring_len);
            return;
        }
        xmax = sh.fred[lane_id()];
        for (int o = 16; o > 0; o >>= 1) xmax = fmaxf(xmax, __shfl_xor_sync(FULL, xmax, o));
        Filter f{xmax, 1.4426950408889634f / temperature, 0u, 0u, V};
        const bool topk = top_k > 0 && top_k < V, topp = top_p < 1.0f;
        if (topk) bound<false>(sh, logits, f, temperature, top_k, top_p);
        else if (topp) bound<true>(sh, logits, f, temperature, top_k, top_p);
        if (topk) {
            unsigned k = select<TOPK>(sh, logits, f, 32, [&](u64) { return u64(top_k); }, true);
            // Keep z >= z_k = x_k / T: also the few logits just below x_k that divide to the same z.
            const float zk = key_float(k) / temperature;
            for (int s = 0; s < 8 && k > 0 && key_float(k - 1) / temperature >= zk; ++s) --k;
            f.kkey = k;
        }
        if (topp) {
            // Candidates from the bounding pass without top-k hold only part of the mass: the target is of all.
            const u64 all = !topk && sh.ncand >= 0 ? sh.wsum[0] : 0;
            f.pthr = select<TOPP>(sh, logits, f, 32, [&](u64 total) {
                const u64 m = all ? all : total;
                const u64 t = u64(ceil(double(top_p) * double(m)));  // W >= top_p * mass, W an integer
                return t < 1 ? u64(1) : t > m ? m : t;
            }, true);
        }
        // SplitMix64 of (seed, step) exactly as engine.sampling.uniform; u = r / 2^24. Every thread reads *step
        // before the draw's barriers; thread 0 writes it after the last one.
        u64 z = seed + u64(*step + 1) * 0x9E3779B97F4A7C15ull;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        const u64 r = z >> 40;
        if (sh.ncand >= 0) {  // first id whose cumulative mass exceeds u * mass = floor(r * mass / 2^24)
            const int nbits = V > 1 ? 32 - __clz(V - 1) : 0;
            id = V - 1 - int(select<DRAW>(sh, logits, f, nbits,
                                          [&](u64 total) { return __umul64hi(r << 40, total) + 1; }, false));
        } else {
            id = draw_all(sh, logits, f, r);
        }
    }
    if (threadIdx.x == 0) *out = id, *step += 1, hand_off(id, chain, ring, ring_len);
}

// *pos += n: the decode graph's position advance. Block 1, grid 1.
extern "C" __global__ void advance(int* pos, int n) { pdl::begin(); *pos += n; }

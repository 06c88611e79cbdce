// attn_decode's work, included by kernels/attention.cu (contract: kernels/README.md): the split-key decode of one
// or more query tokens, its folded combine and the L2 prefetch of its keys.
#pragma once
#include "attention_common.cuh"
#include "pdl.cuh"

#ifndef ATTN_DECODE_TILE16
#define ATTN_DECODE_TILE16 1  // 0: 32-key tiles always, for comparisons (decode below)
#endif

namespace {

// decode's shared floats: decode_heads' tiles, accumulators and maxima ([4 warps][32][8] + [4][8][128] + [4][8][2];
// 8 warps of 4 heads fit the same), then the folded combine's weights
constexpr int FOLD_FLOATS = 4 * 32 * 8 + 4 * 8 * 128 + 4 * 8 * 2;

// ---- decode ----------------------------------------------------------------------------------------------------
// Block (b, split s), DW warps (4; 8 in attn_decode_w8): b = g * parts + part takes q heads [b * G, +G) of kv head
// g (G = H / KVH / parts). The split's keys are dealt to warps in tiles of tk = 32 or 16 keys (warp w: tiles w, w+DW, ...); every warp keeps
// its own online softmax for GC q heads at once and the DW are merged at the end, so a block reads each K/V row once
// from memory.
// Lane `lane` owns dims 4*lane + 128*i (i < NI) of q, k, v and of the accumulators. Scores of a tile come in GC
// groups of KG = 32/GC keys: each lane forms the KG x GC partial dot products of its dims, and one transpose_sum
// leaves lane L holding score (key j*KG + L/GC, head L%GC) of group j in sc[j]. Heads beyond GC are done in further
// passes over the keys (more than 8 heads a block, or 4 with 256-wide heads); padding heads (q = 0) are computed and
// dropped.
template <int NI, int GC, int DW, typename KV>
__device__ __forceinline__ void decode_heads(const float* __restrict__ q, const KV* __restrict__ kc,
                                             const KV* __restrict__ vc, int G, int parts, int KVH, int hd, int vd,
                                             float scale, int n_splits, int k0, int k1, int tk,
                                             float* __restrict__ part_o, float* __restrict__ part_ml,
                                             float* __restrict__ direct, float* sm) {
    constexpr int KG = 32 / GC;
    static_assert(DW * (32 * GC + GC * NI * 128 + GC * 2) <= FOLD_FLOATS, "the merge's shared floats");
    // Rows of V in flight: 16 where the registers hold them (f16 rows; float rows with GC <= 2), else 8. On an H200
    // (2026-12-04, the Qwen3-0.6B shape, float cache, 64-key context) 16 against 8: attn_decode 8.1 -> 6.9 us a
    // launch, the decode step 0.789 -> 0.757 ms; float rows with GC = 4 or 8 spill at 16.
    constexpr int V_AHEAD = sizeof(KV) == 2 || GC <= 2 ? 16 : 8;
    const int b = blockIdx.x, g = b / parts, s = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const long long krow = (long long)KVH * hd, vrow = (long long)KVH * vd;  // floats between positions
    const KV* kg = kc + (long long)g * hd;
    const KV* vg = vc + (long long)g * vd;
    float* sp = sm + warp * 32 * GC;         // [32 keys][GC heads]: probabilities of this warp's current tile
    float* sacc = sm + DW * 32 * GC;         // [DW warps][GC][NI * 128]: accumulators, for the merge
    float* sml = sacc + DW * GC * NI * 128;  // [DW warps][GC][2]: max (log2 units) and sum
    const float qscale = scale * LOG2E;

    for (int c0 = 0; c0 < G; c0 += GC) {
        float4 qr[GC][NI], acc[GC][NI];
#pragma unroll
        for (int h = 0; h < GC; ++h)
#pragma unroll
            for (int i = 0; i < NI; ++i) {
                const int d = 128 * i + 4 * lane;
                qr[h][i] = c0 + h < G && d < hd ? ldg4(q + (long long)(b * G + c0 + h) * hd + d) : zero4();
                scale4(qr[h][i], qscale);
                acc[h][i] = zero4();
            }
        float m = neg_inf(), l = 0.0f;  // for head lane % GC: running max, and this lane's share of the sum

        for (int kt = k0 + tk * warp; kt < k1; kt += DW * tk) {
            const int nk = min(tk, k1 - kt);  // a group past it (16-key tiles: the second half) skips as past a split
            // Raw scores go to sp (sp[j*32 + lane] for group j) so the group loop need not be unrolled: unrolled,
            // the compiler hoists every group's loads and runs out of registers.
#pragma unroll 1
            for (int j = 0; j < GC; ++j) {
                if (j * KG >= nk) {  // no key of the group is in the split (warp-uniform): skip its loads and sums
                    sp[j * 32 + lane] = neg_inf();
                    continue;
                }
                float part[32];  // part[u * GC + h]: this lane's share of q_h . k_(j*KG + u)
#pragma unroll
                for (int u = 0; u < KG; ++u) {
                    const int key = j * KG + u;
                    float4 kv[NI];
#pragma unroll
                    for (int i = 0; i < NI; ++i) {
                        const int d = 128 * i + 4 * lane;
                        kv[i] = ldkv4_if(key < nk && d < hd, kg + (long long)(kt + key) * krow + d);
                    }
#pragma unroll
                    for (int h = 0; h < GC; ++h) {
                        float a = 0.0f;
#pragma unroll
                        for (int i = 0; i < NI; ++i) a = dot4(qr[h][i], kv[i], a);
                        part[u * GC + h] = a;
                    }
                }
                const float sj = transpose_sum<16>(part, lane);
                sp[j * 32 + lane] = j * KG + lane / GC < nk ? sj : neg_inf();
            }
            float sc[GC];
#pragma unroll
            for (int j = 0; j < GC; ++j) sc[j] = sp[j * 32 + lane];  // written by this same lane
            // Online softmax of head lane % GC over the tile; lanes sharing a head differ only in bits >= GC.
            float mt = sc[0];
#pragma unroll
            for (int j = 1; j < GC; ++j) mt = fmaxf(mt, sc[j]);
#pragma unroll
            for (int o = GC; o < 32; o <<= 1) mt = shfl_max(mt, o);
            const float mn = fmaxf(m, mt);  // finite: key 0 of the tile is valid
            const float corr = exp2f(m - mn);
            m = mn;
            float psum = 0.0f;
#pragma unroll
            for (int j = 0; j < GC; ++j) {
                const float p = exp2f(sc[j] - mn);
                psum += p;
                sp[j * 32 + lane] = p;  // = sp[key * GC + head] for key j*KG + lane/GC
            }
            l = l * corr + psum;
#pragma unroll
            for (int h = 0; h < GC; ++h) {
                const float ch = __shfl_sync(0xffffffffu, corr, h);  // lane h holds head h
#pragma unroll
                for (int i = 0; i < NI; ++i) scale4(acc[h][i], ch);
            }
            __syncwarp();
#pragma unroll V_AHEAD
            for (int t = 0; t < nk; ++t) {
                float4 vv[NI];
#pragma unroll
                for (int i = 0; i < NI; ++i) {
                    const int d = 128 * i + 4 * lane;
                    vv[i] = ldkv4_if(d < vd, vg + (long long)(kt + t) * vrow + d);
                }
#pragma unroll
                for (int h = 0; h < GC; ++h) {
                    const float p = sp[t * GC + h];
#pragma unroll
                    for (int i = 0; i < NI; ++i) axpy4(acc[h][i], p, vv[i]);
                }
            }
            __syncwarp();  // sp is rewritten by the next tile
        }

        // Merge the DW warps: o = sum_w acc_w * 2^(m_w - M), sum likewise; an empty warp has m = -inf, weight 0.
#pragma unroll
        for (int o = GC; o < 32; o <<= 1) l += __shfl_xor_sync(0xffffffffu, l, o);
        if (lane < GC) {
            sml[(warp * GC + lane) * 2] = m;
            sml[(warp * GC + lane) * 2 + 1] = l;
        }
#pragma unroll
        for (int h = 0; h < GC; ++h)
#pragma unroll
            for (int i = 0; i < NI; ++i) sts4(sacc + (warp * GC + h) * NI * 128 + 128 * i + 4 * lane, acc[h][i]);
        __syncthreads();
        for (int idx = threadIdx.x; idx < GC * vd; idx += 32 * DW) {
            const int h = idx / vd, e = idx - h * vd;
            if (c0 + h >= G) break;  // idx only grows, so every later idx is a padding head too
            float M = neg_inf();
#pragma unroll
            for (int w = 0; w < DW; ++w) M = fmaxf(M, sml[(w * GC + h) * 2]);
            float o = 0.0f, L = 0.0f;
#pragma unroll
            for (int w = 0; w < DW; ++w) {
                const float mw = sml[(w * GC + h) * 2];
                const float f = mw == neg_inf() ? 0.0f : exp2f(mw - M);
                o = fmaf(f, sacc[(w * GC + h) * NI * 128 + e], o);
                L = fmaf(f, sml[(w * GC + h) * 2 + 1], L);
            }
            if (direct) {  // the only split: combine_heads would compute this same quotient
                direct[(long long)(b * G + c0 + h) * vd + e] = o / L;
                continue;
            }
            const long long r = (long long)(b * G + c0 + h) * n_splits + s;  // row of part_*: (q head, split)
            part_o[r * vd + e] = o;
            if (e == 0) {
                part_ml[2 * r] = M == neg_inf() ? M : M * LN2;
                part_ml[2 * r + 1] = L;
            }
        }
        __syncthreads();  // sacc / sml are reused by the next head chunk
    }
}

// out[h, :] for the G q heads [b * G, +G) of block row b, from the partials of splits [0, active), which other blocks
// of this launch wrote (visible through L2 after their fence: read with __ldcg, never through this L1): M = max_s m_s,
// w_s = exp(m_s - M) (0 for an empty split), out = sum_s w_s * part_o[h, s, :] / sum_s w_s * l_s, each sum in a fixed
// order whatever order the blocks ran in.
// ATTN_FOLD_WEIGHTS = 0: each thread finds M and then sums its element over the splits in split order (L too), one
// split after another: with 32 active splits (4,096 keys) 32 dependent trips to L2, and on an H200 (2026-12-05,
// scripts/bench_attention.py, the Qwen3-0.6B shape) the folded launch took 17.9 us against 12.6 for attn_decode and
// attn_combine as two launches (10.9 / 9.6 at 1,024 keys; 7.1 / 8.1 at 128, one split). 1 (the default):
// attn_combine's way, the weights first (warp w for heads w, w + 4, ...: lanes over the splits, L summed in the warp's
// tree order) into shared memory, then each element's sum in split order with its loads independent (unrolled by 8).
// On an H100 (2026-12-05, Qwen3-0.6B shape, engine profile after 4,000 tokens, two rounds) attn_decode 19.7 -> 15.7 us
// a launch, the decode step 1.316 / 1.323 -> 1.196 / 1.192 ms, the 13-token step 4.083 / 4.116 -> 4.052 / 4.062; at
// a short context (engine bench) decode 1,227 / 1,226 -> 1,224 / 1,225 tok/s. 0 stays for comparisons.
#ifndef ATTN_FOLD_WEIGHTS
#define ATTN_FOLD_WEIGHTS 1
#endif

template <int DW>
__device__ __forceinline__ void combine_heads(const float* part_o, const float* part_ml, int b, int G, int n_splits,
                                              int active, int vd, float* __restrict__ out, float* sm) {
#if ATTN_FOLD_WEIGHTS
    float* ws = sm;               // [G][active]: w_s of each head (G * (active + 1) <= FOLD_FLOATS: k_attention checks)
    float* ls = sm + G * active;  // [G]: sum_s w_s * l_s
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int h = warp; h < G; h += DW) {
        const float* ml = part_ml + (long long)(b * G + h) * n_splits * 2;
        float M = neg_inf();
        for (int s = lane; s < active; s += 32) M = fmaxf(M, __ldcg(ml + 2 * s));
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) M = shfl_max(M, o);
        float L = 0.0f;
        for (int s = lane; s < active; s += 32) {
            const float m = __ldcg(ml + 2 * s), w = m == neg_inf() ? 0.0f : expf(m - M);
            ws[h * active + s] = w;
            L = fmaf(w, __ldcg(ml + 2 * s + 1), L);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) L += __shfl_xor_sync(0xffffffffu, L, o);
        if (lane == 0) ls[h] = L;
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < G * vd; idx += blockDim.x) {
        const int h = idx / vd, e = idx - h * vd;
        const float* po = part_o + (long long)(b * G + h) * n_splits * vd + e;
        const float* w = ws + h * active;
        float o = 0.0f;
#pragma unroll 8
        for (int s = 0; s < active; ++s) o = fmaf(w[s], __ldcg(po + (long long)s * vd), o);
        out[(long long)(b * G + h) * vd + e] = o / ls[h];
    }
#else
    for (int idx = threadIdx.x; idx < G * vd; idx += blockDim.x) {
        const int h = b * G + idx / vd, e = idx % vd;
        const float* ml = part_ml + (long long)h * n_splits * 2;
        float M = neg_inf();
        for (int s = 0; s < active; ++s) M = fmaxf(M, __ldcg(ml + 2 * s));
        float o = 0.0f, L = 0.0f;
        for (int s = 0; s < active; ++s) {
            const float m = __ldcg(ml + 2 * s), w = m == neg_inf() ? 0.0f : expf(m - M);
            o = fmaf(w, __ldcg(part_o + ((long long)h * n_splits + s) * vd + e), o);
            L = fmaf(w, __ldcg(ml + 2 * s + 1), L);
        }
        out[(long long)h * vd + e] = o / L;
    }
#endif
}

// Before the wait: the cache rows of this block's keys into L2, so that its chain of dependent reads after the wait
// (a group of keys' K rows, their scores, the V rows) meets L2 rather than DRAM: the rows were written by earlier steps
// and the weights streamed since have pushed them out. The range is the one the position gives before the wait (a
// hint alone: every row the block uses is chosen again from the position read after it). Each row's lines from its
// first byte to its last (rows need not start on a line).
template <typename KV>
__device__ __forceinline__ void prefetch_keys(const KV* kc, const KV* vc, const int* pos, int t, int KVH, int hd,
                                              int vd, int n_splits, int min_chunk, int parts) {
    const int L = *pos + 1 + t;  // pre-wait: the position, for the prefetch's range alone (a hint; see above)
    const int chunk = max((L + n_splits - 1) / n_splits, min_chunk);
    const int k0 = min(int(blockIdx.y) * chunk, L), k1 = min(k0 + chunk, L), g = blockIdx.x / parts;
    const int kb = hd * int(sizeof(KV)), vb = vd * int(sizeof(KV));  // bytes of a row
    const int kl = kb / 128 + 1, per = kl + vb / 128 + 1;            // prefetches a row: its lines, and its last byte
    for (int i = threadIdx.x; i < (k1 - k0) * per; i += blockDim.x) {
        const long long key = k0 + i / per;
        const int j = i % per;
        const char* k = reinterpret_cast<const char*>(kc + (key * KVH + g) * hd);
        const char* v = reinterpret_cast<const char*>(vc + (key * KVH + g) * vd);
        pdl::prefetch_line(j < kl ? k + min(128 * j, kb - 1) : v + min(128 * (j - kl), vb - 1));
    }
}

// grid (KVH * parts, n_splits, n), block 128: block row b = g * parts + part takes q heads [b * G, +G) of kv head g,
// G = H / KVH / parts, of query token t = blockIdx.z, which reads q[t] and has its own partials, counters and out[t].
// With L = *pos + 1 + t keys (causal), chunk = max(ceil(L / n_splits), min_chunk) and active =
// ceil(L / chunk) splits; split s < active covers keys [s*chunk, min((s+1)*chunk, L)).
// With counters (the fold): the other splits return at once, and the last block of row b to finish (a ticket from
// counters[b], which it sets back to 0) combines the heads of b into out over splits [0, active): no second launch,
// and the order of the sum is fixed whatever order the blocks ran in. With one active split (L <= min_chunk) that
// block writes out directly, bit for bit what the combine would (weight exp(0) = 1). Without (counters null): every
// split writes its partials (empty ones m = -inf, l = 0) for attn_combine over all n_splits. dispatch.decode_attention
// picks.
template <int DW, typename KV>
__device__ __forceinline__ void decode(const float* __restrict__ q, const KV* __restrict__ k_cache,
                                       const KV* __restrict__ v_cache, const int* pos, int H, int KVH, int hd, int vd,
                                       float scale, int n_splits, int min_chunk, int parts, float* __restrict__ part_o,
                                       float* __restrict__ part_ml, int* __restrict__ counters,
                                       float* __restrict__ out, int prefetch) {
    __shared__ float4 sm4[FOLD_FLOATS / 4];
    __shared__ int ticket;
    float* sm = reinterpret_cast<float*>(sm4);
    const int t = blockIdx.z;
    if (prefetch) prefetch_keys(k_cache, v_cache, pos, t, KVH, hd, vd, n_splits, min_chunk, parts);
    pdl::wait();  // q and the new key's row are the kernels before's (pdl.cuh); so is the position
    const int L = *pos + 1 + t;
    const int chunk = max((L + n_splits - 1) / n_splits, min_chunk), active = (L + chunk - 1) / chunk;
    if (counters && int(blockIdx.y) >= active) return;
    const int k0 = min(int(blockIdx.y) * chunk, L), k1 = min(k0 + chunk, L);
    const int G = H / KVH / parts;  // q heads of this block
    // One active split (folded): its block writes out itself, with no partials, ticket or second pass.
    const int th = t * H;  // heads of the tokens before t (n * H * max(hd, n_splits * vd) < 2^31)
    float* direct = counters && active == 1 ? out + th * vd : nullptr;
    // Keys a warp's tile: 16 where the block's keys fit DW of them (ATTN_DECODE_TILE16), else 32. A short split (a
    // decode step's first 64 keys, a system1 prompt's tokens) then spreads over all the warps, each with half the chain
    // of dependent reads (one group of K rows, 16 V rows) instead of one or two warps with two of each. On an H200
    // (2026-12-05, the Qwen3-0.6B shape after 16 cached tokens, two interleaved rounds): the decode step 0.7445 /
    // 0.7437 -> 0.7198 / 0.7176 ms, the 13-token step 1.305 / 1.304 -> 1.257 / 1.262, 32 tokens (keys past 64)
    // 1.733 / 1.732 -> 1.732 / 1.731; engine bench decode 1,223 / 1,223 -> 1,245 / 1,246 tok/s.
    const int tk = ATTN_DECODE_TILE16 && k1 - k0 <= 16 * DW ? 16 : 32;
#define DECODE(NI, GC)                                                                                         \
    decode_heads<NI, GC, DW>(q + th * hd, k_cache, v_cache, G, parts, KVH, hd, vd, scale, n_splits, k0, k1, tk, \
                         part_o + th * n_splits * vd, part_ml + th * n_splits * 2, direct, sm)
    // GC heads a pass, a kv head's q heads rounded up to 2, 4 or 8 (the rest padded with zero heads); rows wider than
    // 128 take 4 (GC = 2 there would hold 16 keys' 256-wide loads in flight a group). GC = 2 has 16 keys' loads in
    // flight a group and no padding heads for 2 q heads a kv head: over a float cache on an H200 (2026-12-04, the
    // Qwen3-0.6B shape, against GC = 4 with 2 padding heads) attn_decode 8.6 -> 8.1 us a launch at a 64-key context,
    // the decode step 0.8174 -> 0.7900 ms, the attention of a step at 4,096 keys 0.727 -> 0.708 ms and at 16,384
    // 1.728 -> 1.716 (168 registers either way, no spills; 8 V rows in flight then, see decode_heads).
    if constexpr (DW > 4) {  // attn_decode_w8: at most 4 q heads a block, rows at most 128 wide (k_attention checks)
        if (G > 2) DECODE(1, 4); else DECODE(1, 2);
    } else if (max(hd, vd) <= 128) {
        if (G > 4) DECODE(1, 8); else if (G > 2) DECODE(1, 4); else DECODE(1, 2);
    } else {
        DECODE(2, 4);
    }
#undef DECODE
    if (!counters || direct) return;
    __threadfence();  // this block's partials before its ticket
    int* counter = counters + t * gridDim.x + blockIdx.x;
    if (threadIdx.x == 0) ticket = atomicAdd(counter, 1);
    __syncthreads();
    if (ticket != active - 1) return;
    __threadfence();
    combine_heads<DW>(part_o + th * n_splits * vd, part_ml + th * n_splits * 2, blockIdx.x, G, n_splits, active, vd,
                  out + th * vd, sm);
    if (threadIdx.x == 0) *counter = 0;  // for the next launch
}
}  // namespace

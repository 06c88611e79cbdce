// attn_prefill_tc's work, included by kernels/attention.cu (contract: kernels/README.md): attn_prefill's causal
// attention on tensor cores (sm_80 and later), for head dims hd = vd = 64 or 128.
#pragma once
#include "attention_common.cuh"
#include "tf32.cuh"

namespace {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
constexpr bool TC_ATTENTION = false;  // no tf32 mma
#else
constexpr bool TC_ATTENTION = true;
#endif

// Block: 64 queries (rows q0 .. q0+63 of the chunk) of q head h, warp w owning rows 16w .. 16w+15: the M side of
// every mma. Keys go through shared memory in tiles of 32. Lane (g, c) = (lane / 4, lane % 4) (tf32.cuh's layout).
//   S = Q K^T: per 8 dims one A fragment of q (rows g, g + 8; dims c, c + 4) against 4 B fragments of k (keys
//   8j + g), so s[j] holds rows g, g + 8 x keys 8j + 2c, 8j + 2c + 1 of the tile.
//   O += P V: the k side is the tile's keys, and an mma sums over k in whatever order A and B agree on, so step j
//   puts key 8j + 2c in slot c and key 8j + 2c + 1 in slot c + 4: then s[j], after the softmax, is P's A fragment
//   as it stands ({s0, s2, s1, s3}), and B reads v rows 8j + 2c, 8j + 2c + 1 at columns 8i + g.
// Every operand is split in tf32 halves and each product is three mma (tf32.cuh, mma_tf32x3): float32-level sums,
// as attn_prefill's. Row strides of HD + 4 and VD + 4 floats (4 mod 32): the fragment loads of q, k (rows g, dims
// c) and v (rows 2c, columns g) fall on 32 distinct banks.
// Shared: qs[64][HD+4] (pre-scaled q), ks[32][HD+4], vs[32][VD+4]: prefill_tc_smem_floats.
// KS = 2 (the default; REFLEX_ATTN_TC_KEYS=1 takes KS = 1): a block of 8 warps, warp w on rows 16 (w % 4) .. +15
// against keys [16 (w / 4), +16) of every tile (two of the four 8-key fragments), each key group with its own
// online softmax; at the end group 1 leaves its rows' max, sum and accumulators in shared memory (over q's tile) and
// group 0 merges them: twice the warps an SM where a block is all an SM has (128 blocks at 512 tokens and 16 heads),
// half the mma a warp a tile.
template <int HD, int VD>
constexpr int prefill_tc_smem_floats() {
    return 64 * (HD + 4) + 32 * (HD + 4) + 32 * (VD + 4);
}

template <int HD, int VD, int KS, typename KV>
__device__ __forceinline__ void prefill_tc(const float* __restrict__ q, const KV* __restrict__ kc,
                                           const KV* __restrict__ vc, int p0, int n, int H, int KVH, float scale,
                                           float* __restrict__ out, float* sm) {
    constexpr int HP = HD + 4, VP = VD + 4, NV = VD / 8;  // NV: the value columns' 8-wide fragments
    constexpr int THREADS = 128 * KS, JF = 4 / KS;         // JF: the warp's 8-key fragments of a tile
    static_assert(HD % 8 == 0 && VD % 8 == 0 && HP % 32 == 4 && VP % 32 == 4, "whole k8 steps, padded rows");
    static_assert((KS == 1 || KS == 2) && VP <= HP, "one or two key groups; group 1's rows fit over q's tile");
    int qt, h;
    heaviest_first(H, qt, h);
    const int kvh = h / (H / KVH);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int grp = KS > 1 ? warp >> 2 : 0, k0 = 8 * JF * grp;  // this warp's key group, its first key of a tile
    const int q0 = qt * 64, nq = min(64, n - q0);
    float* qs = sm;
    float* ks = qs + 64 * HP;
    float* vs = ks + 32 * HP;
    const long long krow = (long long)KVH * HD, vrow = (long long)KVH * VD;
    const KV* kg = kc + (long long)kvh * HD;
    const KV* vg = vc + (long long)kvh * VD;

    const float qscale = scale * LOG2E;  // scores in log2 units: the softmax takes exp2f
    for (int idx = threadIdx.x; idx < 64 * HD / 4; idx += THREADS) {
        const int r = idx / (HD / 4), d = 4 * (idx % (HD / 4));
        float4 x = r < nq ? ldg4(q + ((long long)(q0 + r) * H + h) * HD + d) : zero4();
        scale4(x, qscale);
        sts4(qs + r * HP + d, x);
    }
    const int wq = 16 * (KS > 1 ? warp & 3 : warp), wlast = min(wq + 15, nq - 1);  // its rows (none: wlast < wq)
    const int wmax = p0 + q0 + wlast;                         // the last key any of them sees
    const int qp[2] = {p0 + q0 + min(wq + g, nq - 1), p0 + q0 + min(wq + g + 8, nq - 1)};  // padding rows clamp
    const int kend = p0 + q0 + nq;                            // the block needs keys [0, kend)
    float o[NV][4];  // rows g (o[i][0..1]: columns 8i + 2c, +1) and g + 8 (o[i][2..3])
#pragma unroll
    for (int i = 0; i < NV; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    float m[2] = {neg_inf(), neg_inf()}, l[2] = {0.0f, 0.0f};  // l: this lane's share of its rows' sums

    for (int kt = 0; kt < kend; kt += 32) {
        const int nk = min(32, kend - kt);
        __syncthreads();  // the previous tile has been read by every warp
#pragma unroll 4
        for (int idx = threadIdx.x; idx < 32 * HD / 4; idx += THREADS) {
            const int r = idx / (HD / 4), d = 4 * (idx % (HD / 4));
            sts4(ks + r * HP + d, ldkv4_if(r < nk, kg + (long long)(kt + r) * krow + d));
        }
#pragma unroll 4
        for (int idx = threadIdx.x; idx < 32 * VD / 4; idx += THREADS) {
            const int r = idx / (VD / 4), d = 4 * (idx % (VD / 4));
            sts4(vs + r * VP + d, ldkv4_if(r < nk, vg + (long long)(kt + r) * vrow + d));
        }
        __syncthreads();
        if (wlast < wq || kt + k0 > wmax) continue;  // warp-uniform; the barriers above are still reached

        float s[JF][4] = {};
        const float* qa = qs + (wq + g) * HP + c;
        const float* kb = ks + (k0 + g) * HP + c;
#pragma unroll 4
        for (int d = 0; d < HD; d += 8) {
            uint32_t ah[4], al[4];
            split_tf32(qa[d], ah[0], al[0]);
            split_tf32(qa[8 * HP + d], ah[1], al[1]);
            split_tf32(qa[d + 4], ah[2], al[2]);
            split_tf32(qa[8 * HP + d + 4], ah[3], al[3]);
#pragma unroll
            for (int j = 0; j < JF; ++j) {
                uint32_t bh[2], bl[2];
                split_tf32(kb[8 * j * HP + d], bh[0], bl[0]);
                split_tf32(kb[8 * j * HP + d + 4], bh[1], bl[1]);
                mma_tf32x3(s[j], ah, al, bh[0], bh[1], bl[0], bl[1]);
            }
        }
        float corr[2];
#pragma unroll
        for (int a = 0; a < 2; ++a) {  // online softmax of row g + 8a; its keys of the tile live on the quad's 4 lanes
            float mt = neg_inf();
#pragma unroll
            for (int j = 0; j < JF; ++j)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int key = k0 + 8 * j + 2 * c + e;
                    if (key >= nk || kt + key > qp[a]) s[j][2 * a + e] = neg_inf();  // causal mask
                    mt = fmaxf(mt, s[j][2 * a + e]);
                }
            mt = shfl_max(shfl_max(mt, 1), 2);
            // Finite with one key group: key 0 is in the first tile, which every row sees. Group 1 may not have seen a
            // key of a row yet (its keys of the first tile all past the row): then its row stays empty (m = -inf).
            const float mn = fmaxf(m[a], mt);
            const float base = KS > 1 && mn == neg_inf() ? 0.0f : mn;  // an empty row: corr and every p are 0
            corr[a] = exp2f(m[a] - base);
            m[a] = mn;
            float sum = 0.0f;
#pragma unroll
            for (int j = 0; j < JF; ++j)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const float p = exp2f(s[j][2 * a + e] - base);
                    s[j][2 * a + e] = p;
                    sum += p;
                }
            l[a] = l[a] * corr[a] + sum;
        }
#pragma unroll
        for (int i = 0; i < NV; ++i) o[i][0] *= corr[0], o[i][1] *= corr[0], o[i][2] *= corr[1], o[i][3] *= corr[1];
#pragma unroll
        for (int j = 0; j < JF; ++j) {
            uint32_t ah[4], al[4];
            split_tf32(s[j][0], ah[0], al[0]);  // (row g, key k0 + 8j + 2c): slot c
            split_tf32(s[j][2], ah[1], al[1]);  // (row g + 8, key 8j + 2c)
            split_tf32(s[j][1], ah[2], al[2]);  // (row g, key 8j + 2c + 1): slot c + 4
            split_tf32(s[j][3], ah[3], al[3]);
            const float* vb = vs + (k0 + 8 * j + 2 * c) * VP + g;
#pragma unroll
            for (int i = 0; i < NV; ++i) {
                uint32_t bh[2], bl[2];
                split_tf32(vb[8 * i], bh[0], bl[0]);
                split_tf32(vb[VP + 8 * i], bh[1], bl[1]);
                mma_tf32x3(o[i], ah, al, bh[0], bh[1], bl[0], bl[1]);
            }
        }
    }
    float* mo = qs;            // [64][VP]: group 1's accumulators, over q's tile once every warp is done with it
    float* ml = qs + 64 * HP;  // [64][2]: group 1's max and sum of each row, over k's tile
    if constexpr (KS > 1) {
        __syncthreads();  // the last tile has been read by every warp
        if (grp == 1 && wlast >= wq) {
#pragma unroll
            for (int a = 0; a < 2; ++a) {
                const int row = wq + g + 8 * a;
                float sum = l[a] + __shfl_xor_sync(0xffffffffu, l[a], 1);
                sum += __shfl_xor_sync(0xffffffffu, sum, 2);
                if (c == 0) ml[2 * row] = m[a], ml[2 * row + 1] = sum;
                float* r = mo + row * VP + 2 * c;
#pragma unroll
                for (int i = 0; i < NV; ++i)
                    *reinterpret_cast<float2*>(r + 8 * i) = make_float2(o[i][2 * a], o[i][2 * a + 1]);
            }
        }
        __syncthreads();
        if (grp == 1) return;
    }
    if (wlast < wq) return;
#pragma unroll
    for (int a = 0; a < 2; ++a) {
        const int row = wq + g + 8 * a;
        float sum = l[a] + __shfl_xor_sync(0xffffffffu, l[a], 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        if (row > wlast) continue;
        float f0 = 1.0f, f1 = 0.0f;  // group 0's and group 1's weights (group 0's max is finite: it sees key 0)
        if constexpr (KS > 1) {
            const float m1 = ml[2 * row], mx = fmaxf(m[a], m1);
            f0 = exp2f(m[a] - mx);
            f1 = m1 == neg_inf() ? 0.0f : exp2f(m1 - mx);
            sum = sum * f0 + ml[2 * row + 1] * f1;
        }
        const float inv = 1.0f / sum;
        float* y = out + ((long long)(q0 + row) * H + h) * VD + 2 * c;
#pragma unroll
        for (int i = 0; i < NV; ++i) {
            float2 v = make_float2(o[i][2 * a], o[i][2 * a + 1]);
            if constexpr (KS > 1) {
                const float2 w = *reinterpret_cast<const float2*>(mo + row * VP + 8 * i + 2 * c);
                v = make_float2(fmaf(w.x, f1, v.x * f0), fmaf(w.y, f1, v.y * f0));
            }
            *reinterpret_cast<float2*>(y + 8 * i) = make_float2(v.x * inv, v.y * inv);
        }
    }
}

}  // namespace

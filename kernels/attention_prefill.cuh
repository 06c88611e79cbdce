// attn_prefill's work, included by kernels/attention.cu (contract: kernels/README.md).
#pragma once
#include "attention_common.cuh"

namespace {

// Block: 32 queries (rows q0 .. q0+31 of the chunk) of q head h; warp w owns rows 8w .. 8w+7. Keys go through
// shared memory in tiles of 32. For S = Q K^T a lane owns rows (8w + qa, 8w + qa + 4) x keys (kb + 8j, j < 4), with
// kb = lane & 7 and qa = lane >> 3: per 4 dims a warp then reads 4 distinct q rows and 8 distinct k rows (one
// wavefront each, the rows padded by 4 floats so they fall on different banks) for 32 FMAs per lane. For O += P V a
// lane owns dims 4*lane + 128*i of all 8 rows, with P and the row rescale factors broadcast from shared memory.
// Shared: qs[32][hd+4] (pre-scaled q), ks[32][hd+4], vs[32][vd], ps[4 warps][32 keys][8 rows], cs[4][8].
template <int NI, typename KV>
__device__ __forceinline__ void prefill_rows(const float* __restrict__ q, const KV* __restrict__ kc,
                                             const KV* __restrict__ vc, int p0, int n, int H, int KVH, int hd,
                                             int vd, float scale, float* __restrict__ out, float* sm) {
    int qt, h;
    heaviest_first(H, qt, h);
    const int g = h / (H / KVH);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, kb = lane & 7, qa = lane >> 3;
    const int hdp = hd + 4, q0 = qt * 32, nq = min(32, n - q0);
    float* qs = sm;
    float* ks = qs + 32 * hdp;
    float* vs = ks + 32 * hdp;
    float* ps = vs + 32 * vd + warp * 256;
    float* cs = vs + 32 * vd + 4 * 256 + warp * 8;
    const long long krow = (long long)KVH * hd, vrow = (long long)KVH * vd;
    const KV* kg = kc + (long long)g * hd;
    const KV* vg = vc + (long long)g * vd;

    // Tiles are staged as float4 number idx = row * (dim/4) + column; row = idx / (dim/4) by a multiply-high with
    // ceil(2^32 / (dim/4)), exact for idx < 2^26 (a run-time integer division would cost ~20 instructions).
    const unsigned hd4 = hd >> 2, vd4 = vd >> 2, hmag = 0xFFFFFFFFu / hd4 + 1, vmag = 0xFFFFFFFFu / vd4 + 1;
    const float qscale = scale * LOG2E;
    for (int idx = threadIdx.x; idx < 8 * hd; idx += 128) {  // 32 rows x hd/4 float4
        const int r = __umulhi(idx, hmag), d = 4 * (idx - r * hd4);
        float4 x = r < nq ? ldg4(q + ((long long)(q0 + r) * H + h) * hd + d) : zero4();
        scale4(x, qscale);
        sts4(qs + r * hdp + d, x);
    }
    const int wq = 8 * warp, wlast = min(wq + 7, nq - 1);    // this warp's rows (none when wlast < wq)
    const int wmax = p0 + q0 + wlast;                         // the last key any of them sees
    const int qp[2] = {p0 + q0 + min(wq + qa, nq - 1), p0 + q0 + min(wq + qa + 4, nq - 1)};  // padding rows clamp
    const int kend = p0 + q0 + nq;                            // the block needs keys [0, kend)
    float4 acc[8][NI];
#pragma unroll
    for (int r = 0; r < 8; ++r)
#pragma unroll
        for (int i = 0; i < NI; ++i) acc[r][i] = zero4();
    float m[2] = {neg_inf(), neg_inf()}, l[2] = {0.0f, 0.0f};

    for (int kt = 0; kt < kend; kt += 32) {
        const int nk = min(32, kend - kt);
        __syncthreads();  // the previous tile has been read by every warp
#pragma unroll 4
        for (int idx = threadIdx.x; idx < 8 * hd; idx += 128) {
            const int r = __umulhi(idx, hmag), d = 4 * (idx - r * hd4);
            sts4(ks + r * hdp + d, ldkv4_if(r < nk, kg + (long long)(kt + r) * krow + d));
        }
#pragma unroll 4
        for (int idx = threadIdx.x; idx < 8 * vd; idx += 128) {
            const int r = __umulhi(idx, vmag), d = 4 * (idx - r * vd4);
            sts4(vs + r * vd + d, ldkv4_if(r < nk, vg + (long long)(kt + r) * vrow + d));
        }
        __syncthreads();
        if (wlast < wq || kt > wmax) continue;  // warp-uniform; the barriers above are still reached

        float s[2][4] = {};
        const float* q0r = qs + (wq + qa) * hdp;
        const float* kr = ks + kb * hdp;
#pragma unroll 2
        for (int d = 0; d < hd; d += 4) {
            const float4 x0 = lds4(q0r + d), x1 = lds4(q0r + 4 * hdp + d);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const float4 k4 = lds4(kr + 8 * j * hdp + d);
                s[0][j] = dot4(x0, k4, s[0][j]);
                s[1][j] = dot4(x1, k4, s[1][j]);
            }
        }
#pragma unroll
        for (int a = 0; a < 2; ++a) {  // online softmax of row wq + qa + 4a; its 32 keys live on lanes kb = 0..7
            float mt = neg_inf();
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                if (kb + 8 * j >= nk || kt + kb + 8 * j > qp[a]) s[a][j] = neg_inf();  // causal mask
                mt = fmaxf(mt, s[a][j]);
            }
            mt = shfl_max(shfl_max(shfl_max(mt, 1), 2), 4);
            const float mn = fmaxf(m[a], mt);  // finite: key 0 is in the first tile, which every row sees
            const float corr = exp2f(m[a] - mn);
            m[a] = mn;
            float sum = 0.0f;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const float p = exp2f(s[a][j] - mn);
                sum += p;
                ps[(kb + 8 * j) * 8 + qa + 4 * a] = p;
            }
            l[a] = l[a] * corr + sum;
            if (kb == 0) cs[qa + 4 * a] = corr;
        }
        __syncwarp();
        const float4 c0 = lds4(cs), c1 = lds4(cs + 4);
        const float cr[8] = {c0.x, c0.y, c0.z, c0.w, c1.x, c1.y, c1.z, c1.w};
#pragma unroll
        for (int r = 0; r < 8; ++r)
#pragma unroll
            for (int i = 0; i < NI; ++i) scale4(acc[r][i], cr[r]);
#pragma unroll 2
        for (int t = 0; t < nk; ++t) {
            const float4 pa = lds4(ps + t * 8), pb = lds4(ps + t * 8 + 4);
            const float pr[8] = {pa.x, pa.y, pa.z, pa.w, pb.x, pb.y, pb.z, pb.w};
#pragma unroll
            for (int i = 0; i < NI; ++i) {
                if (128 * i + 4 * lane >= vd) break;
                const float4 v4 = lds4(vs + t * vd + 128 * i + 4 * lane);
#pragma unroll
                for (int r = 0; r < 8; ++r) axpy4(acc[r][i], pr[r], v4);
            }
        }
        __syncwarp();  // ps / cs are rewritten by the next tile
    }
    if (wlast < wq) return;
#pragma unroll
    for (int a = 0; a < 2; ++a) {
        const float sum = l[a] + __shfl_xor_sync(0xffffffffu, l[a], 1);
        const float s2 = sum + __shfl_xor_sync(0xffffffffu, sum, 2);
        const float s4 = s2 + __shfl_xor_sync(0xffffffffu, s2, 4);
        if (kb == 0) cs[qa + 4 * a] = 1.0f / s4;
    }
    __syncwarp();
#pragma unroll
    for (int r = 0; r < 8; ++r) {
        if (wq + r > wlast) break;
        const float inv = cs[r];
        float* o = out + ((long long)(q0 + wq + r) * H + h) * vd;
#pragma unroll
        for (int i = 0; i < NI; ++i) {
            const int d = 128 * i + 4 * lane;
            if (d >= vd) break;
            float4 y = acc[r][i];
            scale4(y, inv);
            sts4(o + d, y);
        }
    }
}

}  // namespace

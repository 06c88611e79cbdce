// RMSNorm of activation rows, and the per-token attention preamble: QK-norm, RoPE, K/V into the cache (qk_rope_kv),
// or for MLA the latent norm, RoPE and the latent row into the cache (mla_kv_rope).
// Reference math: engine/cpu/ops.py (rmsnorm, rope_angles, apply_rope), engine/models/mla.py. Contract:
// kernels/README.md.
#include "pdl.cuh"
#include <stdint.h>

#include "kv_cache.cuh"

namespace {

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Sum over a block of 256 threads, returned to every thread. `red` holds 8 floats.
__device__ __forceinline__ float block_sum_256(float v, float* red) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    v = warp_sum(v);
    if (lane == 0) red[warp] = v;
    __syncthreads();
    v = lane < 8 ? red[lane] : 0.0f;
    return warp_sum(v);
}

// cos / sin of the rope_dim / 2 pairs at position p into cs / sn (the caller syncs before reading them), as
// engine/cpu/ops.rope_angles: pair i turns by p * freq_scale * theta^(-2i / rope_dim) / freq_factors[i]; with YaRN
// (ext_factor != 0) the angle mixes back the unscaled one, a * (1 - mix) + p * inv * mix with
// mix = ext_factor * (1 - clamp((i - lo) / max(0.001, hi - lo), 0, 1)) (high-frequency pairs keep their angle); cos
// and sin are multiplied by mscale. Float32 powf / sincosf (accurate library versions, not the intrinsics). Without
// YaRN and with mscale 1 every value is bit-identical to the plain formula (x * 1.0f is exact). rope_table is
// rope_inv then rope_pair for each pair; qk_rope_kv calls the two apart.
//
// The position-free part of pair i's angle: theta^(-2i / rope_dim) / freq_factors[i] (freq_factors is a weight).
__device__ __forceinline__ float rope_inv(int i, int rope_dim, float theta, const float* freq_factors) {
    float inv = powf(theta, -2.0f * float(i) / float(rope_dim));
    if (freq_factors) inv /= freq_factors[i];  // pre-wait: a weight (qk_rope_kv calls this before its wait)
    return inv;
}

// cos / sin of pair i at position p from its rope_inv into cs[i] / sn[i].
__device__ __forceinline__ void rope_pair(int i, float inv, int p, float freq_scale, float ext_factor, float corr_lo,
                                          float corr_hi, float mscale, float* cs, float* sn) {
    float a = float(p) * freq_scale * inv;
    if (ext_factor != 0.0f) {
        const float ramp = fminf(fmaxf((float(i) - corr_lo) / fmaxf(0.001f, corr_hi - corr_lo), 0.0f), 1.0f);
        const float mix = ext_factor * (1.0f - ramp);
        a = a * (1.0f - mix) + float(p) * inv * mix;
    }
    float s, c;
    sincosf(a, &s, &c);
    sn[i] = s * mscale;
    cs[i] = c * mscale;
}

__device__ __forceinline__ void rope_table(int p, int rope_dim, float theta, float freq_scale, float ext_factor,
                                           float corr_lo, float corr_hi, float mscale,
                                           const float* __restrict__ freq_factors, float* cs, float* sn) {
    for (int i = threadIdx.x; i < (rope_dim >> 1); i += blockDim.x)
        rope_pair(i, rope_inv(i, rope_dim, theta, freq_factors), p, freq_scale, ext_factor, corr_lo, corr_hi, mscale,
                  cs, sn);
}

// Element j < rope_dim of x rotated with normal pairs (2i, 2i + 1) (the pairs deepseek2 uses).
__device__ __forceinline__ float rotate_pair(const float* x, int j, const float* cs, const float* sn) {
    const int i = j >> 1;
    const float a = x[2 * i], b = x[2 * i + 1];
    return (j & 1) ? b * cs[i] + a * sn[i] : a * cs[i] - b * sn[i];
}

}  // namespace

// y[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * w. Block 256, grid.x = n (one row per block). y may equal x:
// every element is read in the first loop (before the block-wide sum) and again, by the same thread, just
// before that thread overwrites it.
extern "C" __global__ void __launch_bounds__(256)
rmsnorm_rows(const float* x, const float* __restrict__ w, float eps, float* y, int n, int K) {
    pdl::begin();
    __shared__ float red[8];
    const long long row = blockIdx.x;
    const float* xr = x + row * K;
    float* yr = y + row * K;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < K; i += 256) {
        const float v = xr[i];
        ss = fmaf(v, v, ss);
    }
    ss = block_sum_256(ss, red);
    const float r = 1.0f / sqrtf(ss / float(K) + eps);  // not rsqrtf: ops.py divides by a correctly rounded sqrt
    for (int i = threadIdx.x; i < K; i += 256) yr[i] = (xr[i] * r) * w[i];
}

// Block (c, t) = 8 warps on token t (at position p = *pos + t), grid (ceil((H + KVH) / 8), n): warp w takes head slot
// hh = 8c + w of [0, H + KVH), a q head (hh < H, rewritten in place) or a k head (written to k_cache[p, hh - H, :]),
// so the heads of a token go in parallel, one memory round trip each. A lane loads its values of the head (<= 256)
// together with the position, optionally RMS-normalises them, and puts them in the warp's shared row; after the
// block's one barrier (the cos / sin table) the warp writes the rotated values, reading rotation partners back from
// the row, so in-place q is safe. The norm weights and the position-free part of each angle (rope_inv) come before
// the wait (pdl.cuh), beside the kernel before's end. The blocks of token t share out the copy of v to v_cache[p],
// unchanged. Every block builds the same cos / sin table, so results do not depend on the split. KV: the cache's
// element (kv_cache.cuh).
namespace {
template <typename KV>
__device__ __forceinline__ void qk_rope_kv_rows(float* q, const float* k, const float* v, int n, int H, int KVH,
                                                int hd, int vd, const float* q_norm, const float* k_norm, float eps,
                                                int rope_dim, float theta, float freq_scale, float ext_factor,
                                                float corr_lo, float corr_hi, float mscale, const float* freq_factors,
                                                int rope_neox, const int* pos, KV* __restrict__ k_cache,
                                                KV* __restrict__ v_cache) {
    __shared__ float cs[128], sn[128];  // cos / sin of pair i (rope_dim / 2 <= 128)
    __shared__ float row[8][256];       // one head per warp
    const int t = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int half = rope_dim >> 1;
    const int hh = blockIdx.x * 8 + warp;
    const bool active = hh < H + KVH, is_q = hh < H;
    const int head = is_q ? hh : hh - H;
    const float* nw = is_q ? q_norm : k_norm;
    // Before the wait (pdl.cuh), what needs no activation: this thread's pair angle without the position, and the
    // lane's norm weights (values j = lane + 32 u of the head, hd <= 256). Through plain pointers: read-only loads
    // would be sunk below the wait.
    const float inv = threadIdx.x < half ? rope_inv(threadIdx.x, rope_dim, theta, freq_factors) : 0.f;
    float wv[8], xv[8];
#pragma unroll
    for (int u = 0; u < 8; ++u)
        wv[u] = active && nw && lane + 32 * u < hd ? nw[lane + 32 * u] : 0.f;  // pre-wait: the norm weights
    pdl::wait();
    const int p = *pos + t;
    const float* src = is_q ? q + ((long long)t * H + head) * hd : k + ((long long)t * KVH + head) * hd;
#pragma unroll
    for (int u = 0; u < 8; ++u) xv[u] = active && lane + 32 * u < hd ? src[lane + 32 * u] : 0.f;  // with *pos
    if (threadIdx.x < half) rope_pair(threadIdx.x, inv, p, freq_scale, ext_factor, corr_lo, corr_hi, mscale, cs, sn);

    float* b = row[warp];
    if (active) {
        float ss = 0.0f;
#pragma unroll
        for (int u = 0; u < 8; ++u) ss = fmaf(xv[u], xv[u], ss);  // zeros past hd
        if (nw) {  // QK-norm over this head's hd values (uniform across the warp)
            const float r = 1.0f / sqrtf(warp_sum(ss) / float(hd) + eps);
#pragma unroll
            for (int u = 0; u < 8; ++u) xv[u] = (xv[u] * r) * wv[u];
        }
#pragma unroll
        for (int u = 0; u < 8; ++u)
            if (lane + 32 * u < hd) b[lane + 32 * u] = xv[u];
    }
    __syncthreads();  // the rows and the cos / sin table
    if (active) {
        float* qh = q + ((long long)t * H + head) * hd;
        KV* kh = k_cache + ((long long)p * KVH + head) * hd;
        for (int j = lane; j < hd; j += 32) {
            float o = b[j];
            if (j < rope_dim) {
                // NEOX pairs (i, i + half); normal pairs (2i, 2i + 1). `second`: j is the pair's second element.
                const bool second = rope_neox ? j >= half : (j & 1);
                const int i = rope_neox ? (second ? j - half : j) : (j >> 1);
                const int ia = rope_neox ? i : 2 * i, ib = rope_neox ? i + half : 2 * i + 1;
                const float a = b[ia], c = b[ib];
                o = second ? c * cs[i] + a * sn[i] : a * cs[i] - c * sn[i];
            }
            if (is_q) qh[j] = o;  // warp-uniform
            else stkv(kh + j, o);
        }
    }

    const long long kv = (long long)KVH * vd;  // values per position of v and of v_cache
    for (int i = blockIdx.x * 256 + threadIdx.x; i < KVH * vd; i += gridDim.x * 256)
        stkv(v_cache + (long long)p * kv + i, v[(long long)t * kv + i]);
}
}  // namespace

// qk_rope_kv writes a float cache, qk_rope_kv_f16 a __half one (KV_CACHE_TYPE=f16): the same arguments.
#define QK_ROPE_KV(NAME, KV)                                                                                       \
    extern "C" __global__ void __launch_bounds__(256)                                                              \
        NAME(float* q, const float* k, const float* v, int n, int H, int KVH, int hd, int vd, const float* q_norm, \
             const float* k_norm, float eps, int rope_dim, float theta, float freq_scale, float ext_factor,        \
             float corr_lo, float corr_hi, float mscale, const float* freq_factors, int rope_neox, const int* pos,  \
             KV* __restrict__ k_cache, KV* __restrict__ v_cache) {                                                 \
        pdl::launch_dependents();                                                                                  \
        qk_rope_kv_rows<KV>(q, k, v, n, H, KVH, hd, vd, q_norm, k_norm, eps, rope_dim, theta, freq_scale,          \
                            ext_factor, corr_lo, corr_hi, mscale, freq_factors, rope_neox, pos, k_cache, v_cache); \
    }
QK_ROPE_KV(qk_rope_kv, float)
QK_ROPE_KV(qk_rope_kv_f16, __half)
#undef QK_ROPE_KV

// MLA (deepseek2), one token per block (grid.x = n, block 256); token t sits at position p = *pos + t. The latent
// row of p in this layer's cache becomes [RMSNorm(kva[t, :R]) * kv_norm | RoPE(kva[t, R:R+P])], and every head's
// q_pe = q[t, h, nope:nope+P] is rotated into qa[t, h, R:R+P] (beside the absorbed q_nope that mla.cu writes to
// qa[t, h, :R]). Normal pairs only (2i, 2i + 1), as deepseek2 uses. KV: the cache's element (kv_cache.cuh).
namespace {
template <typename KV>
__device__ __forceinline__ void mla_kv_rope_rows(const float* __restrict__ kva, const float* __restrict__ kv_norm,
                                                 float eps, const float* __restrict__ q, float* __restrict__ qa, int n,
                                                 int H, int R, int P, int nope, float theta, float freq_scale,
                                                 float ext_factor, float corr_lo, float corr_hi, float mscale,
                                                 const int* pos, KV* __restrict__ cache) {
    __shared__ float cs[128], sn[128];  // cos / sin of pair i (P / 2 <= 128)
    __shared__ float red[8];
    const int t = blockIdx.x, p = *pos + t, D = R + P;
    rope_table(p, P, theta, freq_scale, ext_factor, corr_lo, corr_hi, mscale, nullptr, cs, sn);

    const float* kv = kva + (long long)t * D;
    KV* row = cache + (long long)p * D;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < R; i += 256) {
        const float x = kv[i];
        ss = fmaf(x, x, ss);
    }
    ss = block_sum_256(ss, red);  // its barrier also publishes cs / sn
    const float r = 1.0f / sqrtf(ss / float(R) + eps);  // as rmsnorm_rows
    for (int i = threadIdx.x; i < R; i += 256) stkv(row + i, (kv[i] * r) * kv_norm[i]);
    for (int j = threadIdx.x; j < P; j += 256) stkv(row + R + j, rotate_pair(kv + R, j, cs, sn));

    const long long qd = nope + P;  // floats per head of q
    for (int idx = threadIdx.x; idx < H * P; idx += 256) {
        const int h = idx / P, j = idx - h * P;
        const long long th = (long long)t * H + h;
        qa[th * D + R + j] = rotate_pair(q + th * qd + nope, j, cs, sn);
    }
}
}  // namespace

// mla_kv_rope writes a float latent cache, mla_kv_rope_f16 a __half one: the same arguments.
#define MLA_KV_ROPE(NAME, KV)                                                                                      \
    extern "C" __global__ void __launch_bounds__(256)                                                              \
        NAME(const float* __restrict__ kva, const float* __restrict__ kv_norm, float eps,                          \
             const float* __restrict__ q, float* __restrict__ qa, int n, int H, int R, int P, int nope, float theta, \
             float freq_scale, float ext_factor, float corr_lo, float corr_hi, float mscale, const int* pos,       \
             KV* __restrict__ cache) {                                                                             \
        pdl::begin();                                                                                              \
        mla_kv_rope_rows<KV>(kva, kv_norm, eps, q, qa, n, H, R, P, nope, theta, freq_scale, ext_factor, corr_lo,   \
                             corr_hi, mscale, pos, cache);                                                         \
    }
MLA_KV_ROPE(mla_kv_rope, float)
MLA_KV_ROPE(mla_kv_rope_f16, __half)
#undef MLA_KV_ROPE

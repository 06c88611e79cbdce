// RoPE's angles and one attention head's QK-norm + rotation by one warp: qk_rope_kv (norm_rope.cu) and the q/k/v
// matvec with the preamble folded in (matvec.cu, matvec3_rope16) both call these, so their results agree bit for bit.
// Reference math: engine/cpu/ops.py (rmsnorm, rope_angles, apply_rope).
//
// cos / sin of the rope_dim / 2 pairs at position p, as engine/cpu/ops.rope_angles: pair i turns by
// p * freq_scale * theta^(-2i / rope_dim) / freq_factors[i]; with YaRN (ext_factor != 0) the angle mixes back the
// unscaled one, a * (1 - mix) + p * inv * mix with mix = ext_factor * (1 - clamp((i - lo) / max(0.001, hi - lo), 0,
// 1)) (high-frequency pairs keep their angle); cos and sin are multiplied by mscale. Float32 powf / sincosf (accurate
// library versions, not the intrinsics). Without YaRN and with mscale 1 every value is bit-identical to the plain
// formula (x * 1.0f is exact). Sums of products are fmaf calls as written, so no kernel's contraction choice differs. rope_inv is the position-free part, rope_pair the rest (the caller syncs before
// reading cs / sn).
#pragma once
#include "common.cuh"
#include "kv_cache.cuh"

namespace rope {

constexpr int MAX_HD = 256;  // values of a head: 8 a lane

// The position-free part of pair i's angle: theta^(-2i / rope_dim) / freq_factors[i] (freq_factors is a weight).
__device__ __forceinline__ float inv_freq(int i, int rope_dim, float theta, const float* freq_factors) {
    float inv = powf(theta, -2.0f * float(i) / float(rope_dim));
    if (freq_factors) inv /= freq_factors[i];  // pre-wait: a weight (qk_rope_kv calls this before its wait)
    return inv;
}

// cos / sin of pair i at position p from its inv_freq into cs[i] / sn[i].
__device__ __forceinline__ void pair(int i, float inv, int p, float freq_scale, float ext_factor, float corr_lo,
                                     float corr_hi, float mscale, float* cs, float* sn) {
    float a = float(p) * freq_scale * inv;
    if (ext_factor != 0.0f) {
        const float ramp = fminf(fmaxf((float(i) - corr_lo) / fmaxf(0.001f, corr_hi - corr_lo), 0.0f), 1.0f);
        const float mix = ext_factor * (1.0f - ramp);
        a = fmaf(float(p) * inv, mix, a * (1.0f - mix));  // the contraction nvcc chose, written out
    }
    float s, c;
    sincosf(a, &s, &c);
    sn[i] = s * mscale;
    cs[i] = c * mscale;
}

// A warp's head of hd <= MAX_HD values, lane holding xv[u] = value lane + 32 u (zeros past hd): RMS-normalised times
// wv (the norm weights, same layout) when norm, then into row[0, hd). The sum of squares runs over u, then across the
// warp (common.cuh's butterfly), then 1 / sqrt (correctly rounded, as ops.rmsnorm).
__device__ __forceinline__ void norm_head(float (&xv)[8], const float (&wv)[8], bool norm, int hd, float eps,
                                          int lane, float* row) {
    if (norm) {
        float ss = 0.0f;
#pragma unroll
        for (int u = 0; u < 8; ++u) ss = fmaf(xv[u], xv[u], ss);
        const float r = 1.0f / sqrtf(cm::warp_sum(ss) / float(hd) + eps);
#pragma unroll
        for (int u = 0; u < 8; ++u) xv[u] = (xv[u] * r) * wv[u];
    }
#pragma unroll
    for (int u = 0; u < 8; ++u)
        if (lane + 32 * u < hd) row[lane + 32 * u] = xv[u];
}

// The head in row rotated by the warp (after the barrier that published row, cs and sn), value j to store(j, v):
// NEOX pairs (i, i + rope_dim / 2) or normal pairs (2i, 2i + 1) over the first rope_dim values, the rest as they are.
// Partners come from row, so store may overwrite the head's source.
template <typename Store>
__device__ __forceinline__ void rotate_head(const float* row, int hd, int rope_dim, int neox, const float* cs,
                                            const float* sn, int lane, Store store) {
    const int half = rope_dim >> 1;
    for (int j = lane; j < hd; j += 32) {
        float o = row[j];
        if (j < rope_dim) {
            const bool second = neox ? j >= half : (j & 1);  // j is its pair's second element
            const int i = neox ? (second ? j - half : j) : (j >> 1);
            const float a = row[neox ? i : 2 * i], c = row[neox ? i + half : 2 * i + 1];
            o = second ? fmaf(c, cs[i], a * sn[i]) : fmaf(a, cs[i], -(c * sn[i]));
        }
        store(j, o);
    }
}

}  // namespace rope

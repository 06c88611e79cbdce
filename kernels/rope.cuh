// The per-token attention preamble's math, shared by norm_rope.cu's qk_rope_kv and attention.cu's attn_decode_rope
// so both give the same bits: the cos / sin table of a position, and one head QK-normed and rotated by a warp.
// Reference math: engine/cpu/ops.py (rmsnorm, rope_angles, apply_rope).
#pragma once

namespace rope {

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// cos / sin of the rope_dim / 2 pairs at position p into cs / sn (the caller syncs before reading them), as
// engine/cpu/ops.rope_angles: pair i turns by p * freq_scale * theta^(-2i / rope_dim) / freq_factors[i]; with YaRN
// (ext_factor != 0) the angle mixes back the unscaled one, a * (1 - mix) + p * inv * mix with
// mix = ext_factor * (1 - clamp((i - lo) / max(0.001, hi - lo), 0, 1)) (high-frequency pairs keep their angle); cos
// and sin are multiplied by mscale. Float32 powf / sincosf (accurate library versions, not the intrinsics). Without
// YaRN and with mscale 1 every value is bit-identical to the plain formula (x * 1.0f is exact).
__device__ __forceinline__ void table(int p, int rope_dim, float theta, float freq_scale, float ext_factor,
                                      float corr_lo, float corr_hi, float mscale,
                                      const float* __restrict__ freq_factors, float* cs, float* sn) {
    for (int i = threadIdx.x; i < (rope_dim >> 1); i += blockDim.x) {
        float inv = powf(theta, -2.0f * float(i) / float(rope_dim));
        if (freq_factors) inv /= freq_factors[i];
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
}

// One warp: dst[0..hd) = RoPE(RMSNorm(src) * nw) (no norm when nw is null) for a head of hd <= 256 values, through
// the warp's own shared row b (partners are read back from it, so dst may be src). Rotation of the first rope_dim
// values: NEOX pairs (i, i + rope_dim/2), or normal pairs (2i, 2i + 1). The table is cs / sn (`table`, synced).
__device__ __forceinline__ void head(const float* src, float* b, const float* __restrict__ nw, float eps, int hd,
                                     int rope_dim, int neox, const float* cs, const float* sn, float* dst) {
    const int lane = threadIdx.x & 31, half = rope_dim >> 1;
    float ss = 0.0f;
    for (int j = lane; j < hd; j += 32) {
        const float x = src[j];
        b[j] = x;
        ss = fmaf(x, x, ss);
    }
    if (nw) {  // QK-norm over this head's hd values (uniform across the warp)
        const float r = 1.0f / sqrtf(warp_sum(ss) / float(hd) + eps);
        for (int j = lane; j < hd; j += 32) b[j] = (b[j] * r) * nw[j];
    }
    __syncwarp();
    for (int j = lane; j < hd; j += 32) {
        float o = b[j];
        if (j < rope_dim) {
            // `second`: j is the pair's second element.
            const bool second = neox ? j >= half : (j & 1);
            const int i = neox ? (second ? j - half : j) : (j >> 1);
            const int ia = neox ? i : 2 * i, ib = neox ? i + half : 2 * i + 1;
            const float a = b[ia], c = b[ib];
            o = second ? c * cs[i] + a * sn[i] : a * cs[i] - c * sn[i];
        }
        dst[j] = o;
    }
    __syncwarp();  // b is free for the warp's next head
}

}  // namespace rope

// The codebook types: Quant<T> for the i-quants (IQ1_S ... IQ4_XS) and MXFP4 (the contract: quant.cuh). Their values
// come from fixed tables (iq_tables.cuh, generated from gguf-py; why the grids sit in global memory is said there).
// engine/cpu/dequant_iq.py decodes the same layouts; each diagram below names a block's fields in order. A group of 8
// values is one 8-value grid entry (IQ2_*, IQ1_*) or two 4-value ones (IQ3_*), with its sign bits; every load8 is
// branch-free (selects, not branches), so the GEMM's stage loop keeps one straight-line body.
#pragma once
#include "iq_tables.cuh"
#include "quant_common.cuh"

namespace q {

// An 8-value grid entry (value j in byte j) as two words, through the read-only data cache.
__device__ __forceinline__ uint2 grid8(const unsigned long long* grid, uint32_t i) {
    const unsigned long long v = __ldg(grid + i);
    return make_uint2(uint32_t(v), uint32_t(v >> 32));
}

__device__ __forceinline__ uint32_t ksigns(uint32_t i) { return __ldg(KSIGNS + i); }  // 7-bit index -> 8 sign bits

// out[j] = d * (int8 byte j of lo, hi), negated where bit j of signs is set (both steps exact).
__device__ __forceinline__ void grid_values(uint32_t lo, uint32_t hi, uint32_t signs, float d, float* out) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const float a = d * float(int8_t(lo >> (8 * j))), c = d * float(int8_t(hi >> (8 * j)));
        out[j] = (signs >> j) & 1 ? -a : a;
        out[4 + j] = (signs >> (4 + j)) & 1 ? -c : c;
    }
}

// IQ2_XXS, 66 bytes: | d: f16 | qs: u16[32] |
// 8 groups of 32 values, each 8 qs bytes read as two u32: the first is 4 grid indices (a byte each, one 8-value
// IQ2_XXS_GRID entry apiece), the second 4 seven-bit sign indices (bits 0-27) and a 4-bit scale s (bits 28-31).
// y = d * (0.5 + s) * 0.25 * grid * sign.
template <> struct Quant<IQ2_XXS> {
    static constexpr int QK = 256, BYTES = 66;
    __device__ static void load8(const uint8_t* row, int g, float* out) {
        const uint8_t* b = row + (g >> 5) * BYTES;
        const int gi = g & 31, e = gi & 3;
        const uint8_t* qs = b + 2 + 8 * (gi >> 2);
        const uint32_t aux = u16x2(qs + 4);
        const float d = h2f(b) * (0.5f + float(aux >> 28)) * 0.25f;
        const uint2 v = grid8(IQ2_XXS_GRID, qs[e]);
        grid_values(v.x, v.y, ksigns((aux >> (7 * e)) & 127), d, out);
    }
};

// IQ2_XS, 74 bytes: | d: f16 | qs: u16[32] | scales: u8[8] |
// qs[t] (values 8t..8t+7): bits 0-8 index IQ2_XS_GRID, bits 9-15 are a sign index. Sub-block j (16 values) has scale
// s = the low (j even) or high nibble of scales[j / 2]. y = d * (0.5 + s) * 0.25 * grid * sign.
template <> struct Quant<IQ2_XS> {
    static constexpr int QK = 256, BYTES = 74;
    __device__ static void load8(const uint8_t* row, int g, float* out) {
        const uint8_t* b = row + (g >> 5) * BYTES;
        const int gi = g & 31;
        const uint32_t qs = u16(b + 2 + 2 * gi), s = (b[66 + (gi >> 2)] >> (4 * ((gi >> 1) & 1))) & 0xF;
        const float d = h2f(b) * (0.5f + float(s)) * 0.25f;
        const uint2 v = grid8(IQ2_XS_GRID, qs & 511);
        grid_values(v.x, v.y, ksigns(qs >> 9), d, out);
    }
};

// IQ2_S, 82 bytes: | d: f16 | qs: u8[32] | signs: u8[32] | qh: u8[8] | scales: u8[8] |
// Entry t (values 8t..8t+7) indexes IQ2_S_GRID with qs[t] plus bits 2(t % 4)..+1 of qh[t / 4] as bits 8-9; signs[t]
// holds its 8 sign bits. Scales as IQ2_XS. y = d * (0.5 + s) * 0.25 * grid * sign.
template <> struct Quant<IQ2_S> {
    static constexpr int QK = 256, BYTES = 82;
    __device__ static void load8(const uint8_t* row, int g, float* out) {
        const uint8_t* b = row + (g >> 5) * BYTES;
        const int gi = g & 31;
        const uint32_t idx = b[2 + gi] | (((b[66 + (gi >> 2)] >> (2 * (gi & 3))) & 3) << 8);
        const uint32_t s = (u16x2(b + 74 + 4 * (gi >> 4)) >> (4 * ((gi >> 1) & 7))) & 0xF;  // scales: nibble gi / 2
        const float d = h2f(b) * (0.5f + float(s)) * 0.25f;
        const uint2 v = grid8(IQ2_S_GRID, idx);
        grid_values(v.x, v.y, b[34 + gi], d, out);
    }
};

// IQ3_XXS, 98 bytes: | d: f16 | qs: u8[64] | scales_and_signs: u32[8] |
// qs[t] indexes IQ3_XXS_GRID (values 4t..4t+3). Group j (32 values): scales_and_signs[j] holds 4 seven-bit sign
// indices (bits 0-27, 8 values each) and a 4-bit scale s (bits 28-31). y = d * (0.5 + s) * 0.5 * grid * sign.
template <> struct Quant<IQ3_XXS> {
    static constexpr int QK = 256, BYTES = 98;
    __device__ static void load8(const uint8_t* row, int g, float* out) {
        const uint8_t* b = row + (g >> 5) * BYTES;
        const int gi = g & 31;
        const uint32_t aux = u16x2(b + 66 + 4 * (gi >> 2)), idx = u16(b + 2 + 2 * gi);
        const float d = h2f(b) * (0.5f + float(aux >> 28)) * 0.5f;
        const uint32_t lo = __ldg(IQ3_XXS_GRID + (idx & 0xFF)), hi = __ldg(IQ3_XXS_GRID + (idx >> 8));
        grid_values(lo, hi, ksigns((aux >> (7 * (gi & 3))) & 127), d, out);
    }
};

// IQ3_S, 110 bytes: | d: f16 | qs: u8[64] | qh: u8[8] | signs: u8[32] | scales: u8[4] |
// Entry t (values 4t..4t+3) indexes IQ3_S_GRID with qs[t] plus bit t % 8 of qh[t / 8] as bit 8; bit j of signs[t'] is
// the sign of value 8t' + j. Sub-block j (32 values) has scale s = the low (j even) or high nibble of scales[j / 2].
// y = d * (1 + 2s) * grid * sign.
template <> struct Quant<IQ3_S> {
    static constexpr int QK = 256, BYTES = 110;
    __device__ static void load8(const uint8_t* row, int g, float* out) {
        const uint8_t* b = row + (g >> 5) * BYTES;
        const int gi = g & 31;
        const uint32_t idx = u16(b + 2 + 2 * gi), qh = b[66 + (gi >> 2)] >> (2 * (gi & 3));
        const uint32_t s = (u16x2(b + 106) >> (4 * (gi >> 2))) & 0xF;  // nibble j of the 4 scale bytes
        const float d = h2f(b) * float(1 + 2 * s);
        const uint32_t lo = __ldg(IQ3_S_GRID + ((idx & 0xFF) | ((qh & 1) << 8)));
        const uint32_t hi = __ldg(IQ3_S_GRID + ((idx >> 8) | ((qh & 2) << 7)));
        grid_values(lo, hi, b[74 + gi], d, out);
    }
};

// out[j] = dl * (int8 byte j of the IQ1_S_GRID entry + delta)   (exact: dl has at most 15 significant bits)
__device__ __forceinline__ void iq1_values(uint32_t idx, float dl, float delta, float* out) {
    const uint2 v = grid8(IQ1_S_GRID, idx);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        out[j] = dl * (float(int8_t(v.x >> (8 * j))) + delta);
        out[4 + j] = dl * (float(int8_t(v.y >> (8 * j))) + delta);
    }
}

// IQ1_S, 50 bytes: | d: f16 | qs: u8[32] | qh: u16[8] |
// Sub-block j (32 values) is entries 4j..4j+3 of 8 values; entry 4j + k indexes IQ1_S_GRID (values -1, 0, 1) with
// qs[4j + k] plus bits 3k..3k+2 of qh[j] as bits 8-10; qh[j] bits 12-14 are the scale s, bit 15 the sign of delta.
// y = d * (2s + 1) * (grid + delta), delta = +-0.125.
template <> struct Quant<IQ1_S> {
    static constexpr int QK = 256, BYTES = 50;
    __device__ static void load8(const uint8_t* row, int g, float* out) {
        const uint8_t* b = row + (g >> 5) * BYTES;
        const int gi = g & 31;
        const uint32_t qh = u16(b + 34 + 2 * (gi >> 2));
        const uint32_t idx = b[2 + gi] | (((qh >> (3 * (gi & 3))) & 7) << 8);
        iq1_values(idx, h2f(b) * float(2 * ((qh >> 12) & 7) + 1), qh & 0x8000 ? -0.125f : 0.125f, out);
    }
};

// IQ1_M, 56 bytes: | qs: u8[32] | qh: u8[16] | scales: u16[4] |   (blocks 8-byte aligned)
// The f16 d is split over the top nibbles of the 4 scales (scales[i] >> 12 is bits 4i..4i+3); their low 12 bits hold
// 16 three-bit scales s (bits 3k..3k+2 of scales[i]: sub-block 4i + k of 16 values). Entry t (8 values) indexes
// IQ1_S_GRID with qs[t] plus the low 3 bits of nibble t % 2 of qh[t / 2] as bits 8-10; that nibble's bit 3 is the sign
// of delta. y = d * (2s + 1) * (grid + delta), delta = +-0.125.
template <> struct Quant<IQ1_M> {
    static constexpr int QK = 256, BYTES = 56;
    __device__ static void load8(const uint8_t* row, int g, float* out) {
        const uint8_t* b = row + (g >> 5) * BYTES;
        const int gi = g & 31;
        const uint2 sc = *reinterpret_cast<const uint2*>(b + 48);  // scales[0] | scales[1] << 16, scales[2..3]
        const uint32_t d_bits = ((sc.x >> 12) & 0xF) | ((sc.x >> 24) & 0xF0) | ((sc.y >> 4) & 0xF00) |
                                ((sc.y >> 16) & 0xF000);
        const uint32_t s = (((gi & 16) ? sc.y : sc.x) >> (16 * ((gi >> 3) & 1) + 3 * ((gi >> 1) & 3))) & 7;
        const uint32_t nib = (b[32 + (gi >> 1)] >> (4 * (gi & 1))) & 0xF;
        const float d = __half2float(__ushort_as_half(uint16_t(d_bits)));
        iq1_values(b[gi] | ((nib & 7) << 8), d * float(2 * s + 1), nib & 8 ? -0.125f : 0.125f, out);
    }
};

// out[0..7] = d * level[nibble], the nibbles being the four bytes of w0 then of w1, shifted right by `shift`; the
// levels are IQ4_NL_VALUES, or MXFP4_VALUES for MXFP4 (T).
template <int T>
__device__ __forceinline__ void levels8(uint32_t w0, uint32_t w1, int shift, float d, float* out) {
    constexpr bool fp4 = T == MXFP4;
    const uint32_t t0 = fp4 ? MXFP4_VALUES[0] : IQ4_NL_VALUES[0], t1 = fp4 ? MXFP4_VALUES[1] : IQ4_NL_VALUES[1];
    const uint32_t t2 = fp4 ? MXFP4_VALUES[2] : IQ4_NL_VALUES[2], t3 = fp4 ? MXFP4_VALUES[3] : IQ4_NL_VALUES[3];
    const uint32_t v0 = lut16x4((w0 >> shift) & 0x0F0F0F0Fu, t0, t1, t2, t3);
    const uint32_t v1 = lut16x4((w1 >> shift) & 0x0F0F0F0Fu, t0, t1, t2, t3);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        out[i] = d * float(int8_t(v0 >> (8 * i)));
        out[4 + i] = d * float(int8_t(v1 >> (8 * i)));
    }
}

// IQ4_NL, 18 bytes: | d: f16 | qs: u8[16] |
// Nibble order as Q4_0 (value j < 16 is lo(qs[j]), value 16 + j hi(qs[j])); each nibble indexes the 16 non-linear
// levels IQ4_NL_VALUES. y = d * level.
template <> struct Quant<IQ4_NL> {
    static constexpr int QK = 32, BYTES = 18;
    __device__ static void load8(const uint8_t* row, int g, float* out) {
        const uint8_t* b = row + (g >> 2) * BYTES;
        const int part = g & 3;  // groups 0,1: low nibbles of qs[0..7], qs[8..15]; 2,3: high nibbles
        const uint8_t* qs = b + 2 + 8 * (part & 1);
        levels8<IQ4_NL>(u16x2(qs), u16x2(qs + 4), 4 * (part >> 1), h2f(b), out);
    }
};

// IQ4_XS, 136 bytes: | d: f16 | scales_h: u16 | scales_l: u8[4] | qs: u8[128] |   (blocks 8-byte aligned)
// Sub-block j (32 values) is qs[16j..16j+15] in Q4_0's nibble order, levels as IQ4_NL. Its six-bit scale: low 4 bits
// the low (j even) or high nibble of scales_l[j / 2], top 2 bits bits 2j..2j+1 of scales_h. y = d * (s - 32) * level.
template <> struct Quant<IQ4_XS> {
    static constexpr int QK = 256, BYTES = 136;
    __device__ static void load8(const uint8_t* row, int g, float* out) {
        const uint8_t* b = row + (g >> 5) * BYTES;
        const int gi = g & 31, j = gi >> 2, part = gi & 3;
        const uint2 h = *reinterpret_cast<const uint2*>(b);  // d | scales_h << 16, scales_l
        const uint32_t s = ((h.y >> (4 * j)) & 0xF) | (((h.x >> (16 + 2 * j)) & 3) << 4);
        const float d = h2f(b) * float(int(s) - 32);
        const uint2 w = *reinterpret_cast<const uint2*>(b + 8 + 16 * j + 8 * (part & 1));
        levels8<IQ4_XS>(w.x, w.y, 4 * (part >> 1), d, out);
    }
};

// MXFP4, 17 bytes: | e: u8 | qs: u8[16] |   (blocks byte-aligned: byte loads only)
// Nibble order as Q4_0; each nibble an E2M1 value from MXFP4_VALUES (doubled), the shared scale 2^(e - 127) halved
// to match: d = 2^(e - 128), built as float32 bits (a subnormal for e < 2; the kernels do not flush subnormals).
template <> struct Quant<MXFP4> {
    static constexpr int QK = 32, BYTES = 17;
    __device__ static void load8(const uint8_t* row, int g, float* out) {
        const uint8_t* b = row + (g >> 2) * BYTES;
        const int part = g & 3;
        const uint32_t e = b[0];
        const float d = __uint_as_float(e < 2 ? 0x00200000u << e : (e - 1) << 23);
        const uint8_t* qs = b + 1 + 8 * (part & 1);
        levels8<MXFP4>(u8x4(qs), u8x4(qs + 4), 4 * (part >> 1), d, out);
    }
};

}  // namespace q

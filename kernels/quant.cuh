// GGUF block formats, dequantized in registers, 8 values at a time.
//
// A weight row of K values is K/QK blocks of BYTES bytes, exactly as stored in the GGUF file (the engine uploads the
// file's tensor data section unchanged). `Quant<T>::load8(row, g, out)` writes values [8g, 8g+8) of the row to
// out[0..7] as float32, bit-identical to gguf-py's dequantize (every product here is exact in float32: an f16 scale
// has 11 significant bits, a sub-scale times a quant or grid value at most 12 more; engine/cpu/dequant.py has the
// argument). Loads are no wider than each block's alignment within a row allows (Q8_0, Q4_0, Q5_0, Q6_K, Q3_K, the
// IQ2/IQ3 types, IQ1_S, IQ4_NL, TQ1_0 and TQ2_0 blocks are only 2-byte aligned, MXFP4's 17-byte ones not at all).
// Q8_0, Q4_K and Q5_K also have `load8_affine(row, g, q, scale, offset)`: the same 8 values as small integers q[0..7]
// (exact in float and in tf32) with the scale and offset their 32-value group shares, value = scale * q + offset
// (load8 is that, in one rounding).
// This file: the float types, the 32-value legacy types and Q4_K..Q6_K; quant_lowbit.cuh: Q2_K, Q3_K, TQ1_0, TQ2_0;
// quant_iq.cuh: the codebook types (i-quants, MXFP4).
#pragma once
#include "quant_common.cuh"
#include "quant_iq.cuh"
#include "quant_lowbit.cuh"

namespace q {

// 6-bit scale and min of sub-block j (0..7) from the 12 packed bytes of a Q4_K / Q5_K block.
// Written without a branch so the scale math never waits on a divergent path between a load and its use.
__device__ __forceinline__ void scale_min_k4(const uint8_t* s, int j, float& sc, float& m) {
    const uint32_t x = s[j], y = s[j + 4], z = s[j & 3];  // z = s[j - 4] when j >= 4
    const bool lo = j < 4;
    sc = float(lo ? (x & 63) : ((y & 0xF) | ((z >> 6) << 4)));
    m = float(lo ? (y & 63) : ((y >> 4) | ((x >> 6) << 4)));
}

// F32: plain floats. A "block" of 32 values is only a unit of iteration.
template <> struct Quant<F32> {
    static constexpr int QK = 32, BYTES = 128;
    __device__ static void load8(const uint8_t* row, int g, float* out) {
        const float4* p = reinterpret_cast<const float4*>(row + 32 * g);
        float4 a = p[0], b = p[1];
        out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w;
        out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
    }
};

template <> struct Quant<F16> {
    static constexpr int QK = 32, BYTES = 64;
    __device__ static void load8(const uint8_t* row, int g, float* out) {
        uint4 v = *reinterpret_cast<const uint4*>(row + 16 * g);
        const __half2* h = reinterpret_cast<const __half2*>(&v);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            float2 f = __half22float2(h[i]);
            out[2 * i] = f.x;
            out[2 * i + 1] = f.y;
        }
    }
};

// BF16: the top 16 bits of a float32.
template <> struct Quant<BF16> {
    static constexpr int QK = 32, BYTES = 64;
    __device__ static void load8(const uint8_t* row, int g, float* out) {
        uint4 v = *reinterpret_cast<const uint4*>(row + 16 * g);
        const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            out[2 * i] = __uint_as_float(w[i] << 16);
            out[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
        }
    }
};

// Q8_0, 34 bytes: | d: f16 | qs: int8[32] |            y[i] = d * qs[i]
template <> struct Quant<Q8_0> {
    static constexpr int QK = 32, BYTES = 34;
    __device__ static void load8_affine(const uint8_t* row, int g, float* q, float& scale, float& offset) {
        const uint8_t* b = row + (g >> 2) * BYTES;
        const uint8_t* qs = b + 2 + 8 * (g & 3);
        uint32_t w0 = u16x2(qs), w1 = u16x2(qs + 4);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            q[i] = float(int8_t(w0 >> (8 * i)));
            q[4 + i] = float(int8_t(w1 >> (8 * i)));
        }
        scale = h2f(b), offset = 0.f;
    }
    __device__ static void load8(const uint8_t* row, int g, float* out) {
        float d, zero;
        load8_affine(row, g, out, d, zero);
#pragma unroll
        for (int i = 0; i < 8; ++i) out[i] *= d;
    }
};

// Q4_0, 18 bytes: | d: f16 | qs: u8[16] |   y[j] = d*(lo(qs[j]) - 8), y[j+16] = d*(hi(qs[j]) - 8), j < 16
template <> struct Quant<Q4_0> {
    static constexpr int QK = 32, BYTES = 18;
    __device__ static void load8(const uint8_t* row, int g, float* out) {
        const uint8_t* b = row + (g >> 2) * BYTES;
        const float d = h2f(b);
        const int part = g & 3, shift = (part >> 1) * 4;  // groups 0,1: low nibbles; 2,3: high nibbles
        const uint8_t* qs = b + 2 + 8 * (part & 1);
        uint32_t w0 = u16x2(qs), w1 = u16x2(qs + 4);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            out[i] = d * float(int((w0 >> (8 * i + shift)) & 0xF) - 8);
            out[4 + i] = d * float(int((w1 >> (8 * i + shift)) & 0xF) - 8);
        }
    }
};

// Q4_1, 20 bytes: | d: f16 | m: f16 | qs: u8[16] |   y = d*nibble + m (low nibbles first half, high second)
template <> struct Quant<Q4_1> {
    static constexpr int QK = 32, BYTES = 20;
    __device__ static void load8(const uint8_t* row, int g, float* out) {
        const uint8_t* b = row + (g >> 2) * BYTES;
        const float d = h2f(b), m = h2f(b + 2);
        const int part = g & 3, shift = (part >> 1) * 4;
        const uint32_t* qs = reinterpret_cast<const uint32_t*>(b + 4 + 8 * (part & 1));
        uint32_t w0 = qs[0], w1 = qs[1];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            out[i] = d * float((w0 >> (8 * i + shift)) & 0xF) + m;
            out[4 + i] = d * float((w1 >> (8 * i + shift)) & 0xF) + m;
        }
    }
};

// Q5_0, 22 bytes: | d: f16 | qh: u8[4] | qs: u8[16] |   5th bit of value j is bit j of qh (little-endian u32)
//   y[j] = d*((lo(qs[j]) | bit_j << 4) - 16), y[j+16] = d*((hi(qs[j]) | bit_{j+16} << 4) - 16)
template <> struct Quant<Q5_0> {
    static constexpr int QK = 32, BYTES = 22;
    __device__ static void load8(const uint8_t* row, int g, float* out) {
        const uint8_t* b = row + (g >> 2) * BYTES;
        const float d = h2f(b);
        const uint32_t qh = u16x2(b + 2) >> (8 * (g & 3));  // bits of values 8*(g&3) ...
        const int part = g & 3, shift = (part >> 1) * 4;
        const uint8_t* qs = b + 6 + 8 * (part & 1);
        uint32_t w0 = u16x2(qs), w1 = u16x2(qs + 4);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            out[i] = d * float(int(((w0 >> (8 * i + shift)) & 0xF) | (((qh >> i) & 1) << 4)) - 16);
            out[4 + i] = d * float(int(((w1 >> (8 * i + shift)) & 0xF) | (((qh >> (4 + i)) & 1) << 4)) - 16);
        }
    }
};

// Q5_1, 24 bytes: | d: f16 | m: f16 | qh: u8[4] | qs: u8[16] |   y = d*q5 + m
template <> struct Quant<Q5_1> {
    static constexpr int QK = 32, BYTES = 24;
    __device__ static void load8(const uint8_t* row, int g, float* out) {
        const uint8_t* b = row + (g >> 2) * BYTES;
        const float d = h2f(b), m = h2f(b + 2);
        const uint32_t qh = *reinterpret_cast<const uint32_t*>(b + 4) >> (8 * (g & 3));
        const int part = g & 3, shift = (part >> 1) * 4;
        const uint32_t* qs = reinterpret_cast<const uint32_t*>(b + 8 + 8 * (part & 1));
        uint32_t w0 = qs[0], w1 = qs[1];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            out[i] = d * float(((w0 >> (8 * i + shift)) & 0xF) | (((qh >> i) & 1) << 4)) + m;
            out[4 + i] = d * float(((w1 >> (8 * i + shift)) & 0xF) | (((qh >> (4 + i)) & 1) << 4)) + m;
        }
    }
};

// Q4_K, 144 bytes: | d: f16 | dmin: f16 | scales: u8[12] | qs: u8[128] |
// Chunk c (64 values) uses qs[32c..32c+31]: low nibbles are values 64c+l (sub-block 2c), high nibbles 64c+32+l
// (sub-block 2c+1); y = d*sc*q - dmin*m with the sub-block's 6-bit scale and min.
template <> struct Quant<Q4_K> {
    static constexpr int QK = 256, BYTES = 144;
    __device__ static void load8_affine(const uint8_t* row, int g, float* q, float& scale, float& offset) {
        const uint8_t* b = row + (g >> 5) * BYTES;
        const int gi = g & 31, c = gi >> 3, sub = (gi >> 2) & 1, l0 = (gi & 3) * 8;
        float sc, m;
        scale_min_k4(b + 4, 2 * c + sub, sc, m);
        scale = h2f(b) * sc, offset = -(h2f(b + 2) * m);
        const uint2 w = *reinterpret_cast<const uint2*>(b + 16 + 32 * c + l0);
        const int shift = 4 * sub;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            q[i] = float((w.x >> (8 * i + shift)) & 0xF);
            q[4 + i] = float((w.y >> (8 * i + shift)) & 0xF);
        }
    }
    __device__ static void load8(const uint8_t* row, int g, float* out) {
        float d, o;
        load8_affine(row, g, out, d, o);
#pragma unroll
        for (int i = 0; i < 8; ++i) out[i] = fmaf(d, out[i], o);
    }
};

// Q5_K, 176 bytes: | d: f16 | dmin: f16 | scales: u8[12] | qh: u8[32] | qs: u8[128] |
// As Q4_K, plus a 5th bit: value 64c+l takes bit 2c of qh[l], value 64c+32+l bit 2c+1.
template <> struct Quant<Q5_K> {
    static constexpr int QK = 256, BYTES = 176;
    __device__ static void load8_affine(const uint8_t* row, int g, float* q, float& scale, float& offset) {
        const uint8_t* b = row + (g >> 5) * BYTES;
        const int gi = g & 31, c = gi >> 3, sub = (gi >> 2) & 1, l0 = (gi & 3) * 8;
        float sc, m;
        scale_min_k4(b + 4, 2 * c + sub, sc, m);
        scale = h2f(b) * sc, offset = -(h2f(b + 2) * m);
        const uint2 w = *reinterpret_cast<const uint2*>(b + 48 + 32 * c + l0);
        const uint2 h = *reinterpret_cast<const uint2*>(b + 16 + l0);
        const int shift = 4 * sub, hbit = 2 * c + sub;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            q[i] = float(((w.x >> (8 * i + shift)) & 0xF) | (((h.x >> (8 * i + hbit)) & 1) << 4));
            q[4 + i] = float(((w.y >> (8 * i + shift)) & 0xF) | (((h.y >> (8 * i + hbit)) & 1) << 4));
        }
    }
    __device__ static void load8(const uint8_t* row, int g, float* out) {
        float d, o;
        load8_affine(row, g, out, d, o);
#pragma unroll
        for (int i = 0; i < 8; ++i) out[i] = fmaf(d, out[i], o);
    }
};

// Q6_K, 210 bytes: | ql: u8[128] | qh: u8[64] | scales: int8[16] | d: f16 |
// Half n (128 values) uses ql[64n..], qh[32n..], scales[8n..]. Its quarter t (32 values, l < 32) is
//   t=0: lo(ql[l])    | bits 0-1 of qh[l] << 4      t=1: lo(ql[l+32]) | bits 2-3 of qh[l] << 4
//   t=2: hi(ql[l])    | bits 4-5 of qh[l] << 4      t=3: hi(ql[l+32]) | bits 6-7 of qh[l] << 4
// with scale scales[8n + 2t + l/16]; y = d * scale * (q - 32).
template <> struct Quant<Q6_K> {
    static constexpr int QK = 256, BYTES = 210;
    __device__ static void load8(const uint8_t* row, int g, float* out) {
        const uint8_t* b = row + (g >> 5) * BYTES;
        const int gi = g & 31, n = gi >> 4, t = (gi >> 2) & 3, l0 = (gi & 3) * 8;
        const uint8_t* ql = b + 64 * n + 32 * (t & 1) + l0;
        const uint8_t* qh = b + 128 + 32 * n + l0;
        const float d = h2f(b + 208) * float(int8_t(b[192 + 8 * n + 2 * t + (l0 >> 4)]));
        const uint32_t q0 = u16x2(ql), q1 = u16x2(ql + 4), h0 = u16x2(qh), h1 = u16x2(qh + 4);
        const int lshift = 4 * (t >> 1), hshift = 2 * t;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            out[i] = d * float(int(((q0 >> (8 * i + lshift)) & 0xF) | (((h0 >> (8 * i + hshift)) & 3) << 4)) - 32);
            out[4 + i] = d * float(int(((q1 >> (8 * i + lshift)) & 0xF) | (((h1 >> (8 * i + hshift)) & 3) << 4)) - 32);
        }
    }
};

}  // namespace q

// Instantiate a kernel template for every supported weight type: X(tag, type_id) for each. The low-bit and codebook
// types are also listed on their own, for a kernel family that builds fewer variants of them (matvec.cu: only the 1-
// and 8-token matvecs, which halves their share of the build; engine/quants.py LOWBIT_TYPES), and the quantized types
// without the float ones, for kernels that only take those (gemm_tc.cu).
#define Q_FOR_EACH_FLOAT_TYPE(X) X(f32, q::F32) X(f16, q::F16) X(bf16, q::BF16)
#define Q_FOR_EACH_QUANT_COMMON_TYPE(X) \
    X(q8_0, q::Q8_0) X(q4_0, q::Q4_0) X(q4_1, q::Q4_1) X(q5_0, q::Q5_0) X(q5_1, q::Q5_1) X(q4_k, q::Q4_K) \
    X(q5_k, q::Q5_K) X(q6_k, q::Q6_K)
#define Q_FOR_EACH_COMMON_TYPE(X) Q_FOR_EACH_FLOAT_TYPE(X) Q_FOR_EACH_QUANT_COMMON_TYPE(X)
#define Q_FOR_EACH_LOWBIT_TYPE(X) \
    X(q2_k, q::Q2_K) X(q3_k, q::Q3_K) X(tq1_0, q::TQ1_0) X(tq2_0, q::TQ2_0) X(iq1_s, q::IQ1_S) X(iq1_m, q::IQ1_M) \
    X(iq2_xxs, q::IQ2_XXS) X(iq2_xs, q::IQ2_XS) X(iq2_s, q::IQ2_S) X(iq3_xxs, q::IQ3_XXS) X(iq3_s, q::IQ3_S) \
    X(iq4_nl, q::IQ4_NL) X(iq4_xs, q::IQ4_XS) X(mxfp4, q::MXFP4)
#define Q_FOR_EACH_TYPE(X) Q_FOR_EACH_COMMON_TYPE(X) Q_FOR_EACH_LOWBIT_TYPE(X)
#define Q_FOR_EACH_QUANTIZED_TYPE(X) Q_FOR_EACH_QUANT_COMMON_TYPE(X) Q_FOR_EACH_LOWBIT_TYPE(X)

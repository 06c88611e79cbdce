// Dot products of one weight row's values [8g, 8g + 8) with N activation vectors, for the matvec-shaped kernels
// (matvec.cu, moe_expert.cuh). Q4_K, Q6_K and Q8_0 (`SPLIT<T>`) take the split form
//   sum_k (d * q_k - m) * x_k = d * sum_k q_k * x_k - m * sum_k x_k,
// with the group's small integers q_k, scale d and offset m (0 for Q6_K and Q8_0) as quant.cuh decodes them: the
// scale and offset multiply once per group instead of once per value, and each q_k reaches float without an
// int-to-float conversion (a quarter-rate instruction on sm_90): its byte goes into the low mantissa of 2^23, and
// 2^23 (plus the type's bias) is subtracted, which is exact for q_k < 256. The caller passes the x sums (xsums).
// Every product and the sums are float32; only the order of the sum differs from dequantize-then-dot. The other
// types dequantize with Quant<T>::load8 and take the plain dot.
#pragma once
#include "quant.cuh"

namespace q {

template <int T>
constexpr bool SPLIT = T == Q4_K || T == Q6_K || T == Q8_0;
template <int T>
constexpr bool SPLIT_MIN = T == Q4_K;  // whether m is ever non-zero (the caller then needs sum_k x_k)

// Byte i of v as float, minus `bias`: 0x4B0000vv is 2^23 + vv exactly.
__device__ __forceinline__ float byte_f(uint32_t v, int i, float bias) {
    return __uint_as_float(__byte_perm(v, 0x4B000000u, 0x7540u | i)) - (8388608.0f + bias);
}

// The split form's raw material: the group's 8 small integers as bytes (values 0-3 in v0, 4-7 in v1, each q_k + BIAS
// as a byte), its scale d and offset m.
template <int T>
struct Split;

// Q4_K (layout: quant.cuh): q = the nibble, d = d * sc, m = dmin * min of the sub-block.
template <>
struct Split<Q4_K> {
    static constexpr float BIAS = 0.0f;
    __device__ static __forceinline__ void bytes8(const uint8_t* row, int g, uint32_t& v0, uint32_t& v1, float& d,
                                                  float& m) {
        const uint8_t* b = row + (g >> 5) * Quant<Q4_K>::BYTES;
        const int gi = g & 31, c = gi >> 3, sub = (gi >> 2) & 1, l0 = (gi & 3) * 8;
        float sc, mn;
        scale_min_k4(b + 4, 2 * c + sub, sc, mn);
        d = h2f(b) * sc;
        m = h2f(b + 2) * mn;
        const uint2 w = *reinterpret_cast<const uint2*>(b + 16 + 32 * c + l0);
        v0 = (w.x >> (4 * sub)) & 0x0F0F0F0Fu, v1 = (w.y >> (4 * sub)) & 0x0F0F0F0Fu;
    }
};

// Q6_K: q = (4 low bits | 2 high bits << 4) - 32, d = d * the 16-value scale, m = 0.
template <>
struct Split<Q6_K> {
    static constexpr float BIAS = 32.0f;
    __device__ static __forceinline__ void bytes8(const uint8_t* row, int g, uint32_t& v0, uint32_t& v1, float& d,
                                                  float& m) {
        const uint8_t* b = row + (g >> 5) * Quant<Q6_K>::BYTES;
        const int gi = g & 31, n = gi >> 4, t = (gi >> 2) & 3, l0 = (gi & 3) * 8;
        const uint8_t* ql = b + 64 * n + 32 * (t & 1) + l0;
        const uint8_t* qh = b + 128 + 32 * n + l0;
        d = h2f(b + 208) * float(int8_t(b[192 + 8 * n + 2 * t + (l0 >> 4)]));
        m = 0.0f;
        const int lshift = 4 * (t >> 1), hshift = 2 * t;
        v0 = ((u16x2(ql) >> lshift) & 0x0F0F0F0Fu) | (((u16x2(qh) >> hshift) & 0x03030303u) << 4);
        v1 = ((u16x2(ql + 4) >> lshift) & 0x0F0F0F0Fu) | (((u16x2(qh + 4) >> hshift) & 0x03030303u) << 4);
    }
};

// Q8_0: q = the int8 (its byte xor 0x80 is q + 128), d = the block's scale, m = 0.
template <>
struct Split<Q8_0> {
    static constexpr float BIAS = 128.0f;
    __device__ static __forceinline__ void bytes8(const uint8_t* row, int g, uint32_t& v0, uint32_t& v1, float& d,
                                                  float& m) {
        const uint8_t* b = row + (g >> 2) * Quant<Q8_0>::BYTES;
        d = h2f(b);
        m = 0.0f;
        const uint8_t* qs = b + 2 + 8 * (g & 3);
        v0 = u16x2(qs) ^ 0x80808080u, v1 = u16x2(qs + 4) ^ 0x80808080u;
    }
};

// The group's q_k as floats, with d and m.
template <int T>
__device__ __forceinline__ void split8(const uint8_t* row, int g, float (&qv)[8], float& d, float& m) {
    uint32_t v0, v1;
    Split<T>::bytes8(row, g, v0, v1, d, m);
#pragma unroll
    for (int i = 0; i < 4; ++i) qv[i] = byte_f(v0, i, Split<T>::BIAS), qv[4 + i] = byte_f(v1, i, Split<T>::BIAS);
}

// xs[t] = sum of xv[t]'s 8 values, in a fixed order, where dot8_acc reads it (SPLIT_MIN<T>); 0 otherwise.
template <int T, int N>
__device__ __forceinline__ void xsums(const float (&xv)[N][8], float (&xs)[N]) {
#pragma unroll
    for (int t = 0; t < N; ++t)
        xs[t] = SPLIT_MIN<T> ? ((xv[t][0] + xv[t][1]) + (xv[t][2] + xv[t][3])) +
                                   ((xv[t][4] + xv[t][5]) + (xv[t][6] + xv[t][7]))
                             : 0.f;
}

// acc[t * S] += dot(row values [8g, +8), xv[t]) for t < N (N accumulators S apart), xs from xsums. USE_SPLIT (the
// default where the type has it): the split form, the group's dot added once; otherwise Quant<T>::load8 and one fma
// a value into each accumulator.
template <int T, int N, int S = 1, bool USE_SPLIT = SPLIT<T>>
__device__ __forceinline__ void dot8_acc(const uint8_t* row, int g, const float (&xv)[N][8], const float (&xs)[N],
                                         float* acc) {
    if constexpr (USE_SPLIT) {
        float qv[8], d, m;
        split8<T>(row, g, qv, d, m);
#pragma unroll
        for (int t = 0; t < N; ++t) {
            float s = 0.0f;
#pragma unroll
            for (int k = 0; k < 8; ++k) s = fmaf(qv[k], xv[t][k], s);
            acc[t * S] += SPLIT_MIN<T> ? fmaf(d, s, -m * xs[t]) : d * s;
        }
    } else {
        float w[8];
        Quant<T>::load8(row, g, w);
#pragma unroll
        for (int t = 0; t < N; ++t)
#pragma unroll
            for (int k = 0; k < 8; ++k) acc[t * S] = fmaf(w[k], xv[t][k], acc[t * S]);
    }
}

}  // namespace q

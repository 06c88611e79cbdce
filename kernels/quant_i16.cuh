// Integer dot products of one weight row's values [8g, 8g + 8) with 8 activations rounded to 16 bits, for the MoE
// expert kernels (moe_expert.cuh, through matvec_block.cuh's I16 form).
//
// A group of 8 activations x_k becomes q_k = rint(x_k / s) with s = max_k |x_k| / 32767 (per group), so that
// |x_k - s q_k| <= 0.504 s (s / 2, plus q_k times the float32 rounding of s and 1 / s): 1.5e-5 of the group's largest
// value, where llama.cpp's 8-bit activations (one scale per 32
// values) are off by up to 2e-3 of theirs. The weights' small integers w_k (as quant.cuh decodes them, before their
// scale) meet the q_k in __dp2a_lo/hi (two int16 x int8 products a instruction, int32 sums, exact), and the block's
// scales multiply once per group: 4 integer instructions for 8 products instead of 8 byte-to-float conversions and 8
// fma. The result is the float32 dot of the dequantized row with s q (only the rounding of x and the order of the
// float sums differ from dequantize-then-dot).
//
// Overflow: |q_k| <= 32767, the unsigned weight integers below 64 (Q6_K before its -32), so a group's sum is below
// 8 * 64 * 32767 < 2^24 and its product with a 6- or 8-bit scale below 2^31.
#pragma once
#include "quant.cuh"

namespace q16 {

using q::Q4_K;
using q::Q5_0;
using q::Q6_K;
using q::Q8_0;

template <int T>
constexpr bool HAS = T == Q4_K || T == Q6_K || T == Q8_0 || T == Q5_0;
#define Q16_FOR_EACH_TYPE(X) X(q4_k, q::Q4_K) X(q6_k, q::Q6_K) X(q8_0, q::Q8_0) X(q5_0, q::Q5_0)

// 8 activations, rounded: p[i] holds q_{2i} (low half) and q_{2i+1} (high half); s the step; qsum = sum_k q_k.
struct Group {
    uint32_t p[4];
    float s;
    int qsum;
};

// x rounded to 16 bits: each q_k from one fma, x_k * (1 / s) + 1.5 * 2^23, whose low 16 bits are q_k in two's
// complement (the float's unit in the last place is 1 there, so the add rounds to the nearest integer, ties to even).
// An all-zero group (or one below 1e-30) gives q = 0; NaN or infinity gives NaN from every dot with it.
__device__ __forceinline__ Group quantize8(const float (&x)[8]) {
    float amax = 0.f, bad = 0.f;  // bad: NaN when a value is NaN or infinite (fmaxf would drop a NaN)
#pragma unroll
    for (int k = 0; k < 8; ++k) amax = fmaxf(amax, fabsf(x[k])), bad = fmaf(x[k], 0.f, bad);
    const float inv = amax > 1e-30f ? __fdividef(32767.f, amax) : 0.f;
    Group a;
    a.s = fmaf(amax, 1.f / 32767.f, bad);
    uint32_t b[8];
    int sum = 0;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        b[k] = __float_as_uint(fmaf(x[k], inv, 12582912.f));
        sum += int(b[k]) - 0x4B400000;
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) a.p[i] = __byte_perm(b[2 * i], b[2 * i + 1], 0x5410);
    a.qsum = sum;
    return a;
}

// A group kept in memory (moe_gate_up16 writes them, moe_down16 reads them): its 8 q_k as int16 in a row of their own,
// and beside them this, 8 bytes.
struct Meta {
    float s;
    int qsum;
};

__device__ __forceinline__ Group load(const int16_t* q, const Meta* m) {  // q 16-byte aligned
    const uint4 v = *reinterpret_cast<const uint4*>(q);
    const Meta mm = *m;
    return Group{{v.x, v.y, v.z, v.w}, mm.s, mm.qsum};
}

// quantize8 across the lanes [8m, 8m + 8) of a warp, each holding one value v (all 8 call it, the other lanes need
// not): this lane's q (returned) and, the same on each of the 8, the group's Meta. The same arithmetic as quantize8.
__device__ __forceinline__ int16_t quantize_lanes8(float v, Meta& meta) {
    const unsigned mask = 0xFFu << (threadIdx.x & 24);
    float amax = fabsf(v), bad = fmaf(v, 0.f, 0.f);
#pragma unroll
    for (int o = 1; o < 8; o <<= 1) {
        amax = fmaxf(amax, __shfl_xor_sync(mask, amax, o, 8));
        bad += __shfl_xor_sync(mask, bad, o, 8);
    }
    const float inv = amax > 1e-30f ? __fdividef(32767.f, amax) : 0.f;
    const int qv = int(__float_as_uint(fmaf(v, inv, 12582912.f))) - 0x4B400000;
    int sum = qv;
#pragma unroll
    for (int o = 1; o < 8; o <<= 1) sum += __shfl_xor_sync(mask, sum, o, 8);
    meta.s = fmaf(amax, 1.f / 32767.f, bad);
    meta.qsum = sum;
    return int16_t(qv);
}

// sum_k q_k * (byte k of the two words v0 (k < 4), v1), the bytes read as int8.
__device__ __forceinline__ int idot8(const Group& a, uint32_t v0, uint32_t v1) {
    int s = __dp2a_lo(int(a.p[0]), int(v0), 0);
    s = __dp2a_hi(int(a.p[1]), int(v0), s);
    s = __dp2a_lo(int(a.p[2]), int(v1), s);
    return __dp2a_hi(int(a.p[3]), int(v1), s);
}

// sum_k w_k q_k for the row's values [8g, 8g + 8) (w_k dequantized), in units of a.s: the caller multiplies by a.s.
template <int T>
__device__ __forceinline__ float dot8(const uint8_t* row, int g, const Group& a);

// Q4_K: w = d * sc * n - dmin * m, n the nibble.
template <>
__device__ __forceinline__ float dot8<Q4_K>(const uint8_t* row, int g, const Group& a) {
    const uint8_t* b = row + (g >> 5) * q::Quant<Q4_K>::BYTES;
    const int gi = g & 31, c = gi >> 3, sub = (gi >> 2) & 1, l0 = (gi & 3) * 8, j = 2 * c + sub;
    const uint8_t* s = b + 4;  // the 6-bit scale and min of sub-block j (quant.cuh's scale_min_k4, as integers)
    const int x = s[j], y = s[j + 4], z = s[j & 3];
    const bool lo = j < 4;
    const int sc = lo ? (x & 63) : ((y & 0xF) | ((z >> 6) << 4));
    const int m = lo ? (y & 63) : ((y >> 4) | ((x >> 6) << 4));
    const uint2 w = *reinterpret_cast<const uint2*>(b + 16 + 32 * c + l0);
    const int n = idot8(a, (w.x >> (4 * sub)) & 0x0F0F0F0Fu, (w.y >> (4 * sub)) & 0x0F0F0F0Fu);
    return fmaf(q::h2f(b), float(sc * n), -q::h2f(b + 2) * float(m * a.qsum));
}

// Q6_K: w = d * sc * (n - 32), n the 6-bit value, sc the int8 scale of its 16 values.
template <>
__device__ __forceinline__ float dot8<Q6_K>(const uint8_t* row, int g, const Group& a) {
    const uint8_t* b = row + (g >> 5) * q::Quant<Q6_K>::BYTES;
    const int gi = g & 31, n = gi >> 4, t = (gi >> 2) & 3, l0 = (gi & 3) * 8;
    const uint8_t* ql = b + 64 * n + 32 * (t & 1) + l0;
    const uint8_t* qh = b + 128 + 32 * n + l0;
    const int sc = int8_t(b[192 + 8 * n + 2 * t + (l0 >> 4)]);
    const int lshift = 4 * (t >> 1), hshift = 2 * t;
    const uint32_t v0 = ((q::u16x2(ql) >> lshift) & 0x0F0F0F0Fu) | (((q::u16x2(qh) >> hshift) & 0x03030303u) << 4);
    const uint32_t v1 =
        ((q::u16x2(ql + 4) >> lshift) & 0x0F0F0F0Fu) | (((q::u16x2(qh + 4) >> hshift) & 0x03030303u) << 4);
    return q::h2f(b + 208) * float(sc * (idot8(a, v0, v1) - 32 * a.qsum));
}

// Q8_0: w = d * n, n the int8.
template <>
__device__ __forceinline__ float dot8<Q8_0>(const uint8_t* row, int g, const Group& a) {
    const uint8_t* b = row + (g >> 2) * q::Quant<Q8_0>::BYTES;
    const uint8_t* qs = b + 2 + 8 * (g & 3);
    return q::h2f(b) * float(idot8(a, q::u16x2(qs), q::u16x2(qs + 4)));
}

// Q5_0: w = d * (n - 16), n = the nibble | the value's bit of qh << 4. Four bits b_0..b_3 spread to bit 4 of bytes
// 0..3 by one multiply: (b * 0x204081) & 0x01010101 puts b_i at bit 8i (the four shifted copies do not overlap).
template <>
__device__ __forceinline__ float dot8<Q5_0>(const uint8_t* row, int g, const Group& a) {
    const uint8_t* b = row + (g >> 2) * q::Quant<Q5_0>::BYTES;
    const int part = g & 3, shift = (part >> 1) * 4;
    const uint32_t qh = q::u16x2(b + 2) >> (8 * part);
    const uint8_t* qs = b + 6 + 8 * (part & 1);
    const uint32_t h0 = (((qh & 0xFu) * 0x204081u) & 0x01010101u) << 4;
    const uint32_t h1 = ((((qh >> 4) & 0xFu) * 0x204081u) & 0x01010101u) << 4;
    const uint32_t v0 = ((q::u16x2(qs) >> shift) & 0x0F0F0F0Fu) | h0;
    const uint32_t v1 = ((q::u16x2(qs + 4) >> shift) & 0x0F0F0F0Fu) | h1;
    return q::h2f(b) * float(idot8(a, v0, v1) - 16 * a.qsum);
}

// The sub-block form (matvec_block.cuh's 1-token kernels): one row's values [32 j, 32 j + 32) (its sub-block j, 8 to
// a K-quant block) against 4 groups of x at once, the row's scales decoded once for the 4 (dot8 decodes them for each
// group). SUB<T>: the types that have it. xs = sum_i a[i].s * a[i].qsum, an x-only term each thread forms once for
// all its rows. The result is in units of x (each group's step applied), unlike dot8's.
template <int T>
constexpr bool SUB = T == Q4_K;

__device__ __forceinline__ float sub_xs(const Group (&a)[4]) {
    float xs = a[0].s * float(a[0].qsum);
#pragma unroll
    for (int i = 1; i < 4; ++i) xs = fmaf(a[i].s, float(a[i].qsum), xs);
    return xs;
}

template <int T>
__device__ __forceinline__ float dot32(const uint8_t* row, int j, const Group (&a)[4], float xs);

// Q4_K: sub-block j of a block is the low (j even) or high nibbles of its 32 bytes qs[32 (j / 2), +32), 16-byte
// aligned (the row is; 144 = 9 * 16). sum = d * sc * sum_i s_i n_i - dmin * m * xs.
template <>
__device__ __forceinline__ float dot32<Q4_K>(const uint8_t* row, int j, const Group (&a)[4], float xs) {
    const uint8_t* b = row + (j >> 3) * q::Quant<Q4_K>::BYTES;
    const int jj = j & 7, shift = 4 * (jj & 1);
    float sc, m;
    q::scale_min_k4(b + 4, jj, sc, m);
    const uint4* w = reinterpret_cast<const uint4*>(b + 16 + 32 * (jj >> 1));
    const uint4 w0 = w[0], w1 = w[1];
    const uint32_t k = 0x0F0F0F0Fu;
    const int n0 = idot8(a[0], (w0.x >> shift) & k, (w0.y >> shift) & k);
    const int n1 = idot8(a[1], (w0.z >> shift) & k, (w0.w >> shift) & k);
    const int n2 = idot8(a[2], (w1.x >> shift) & k, (w1.y >> shift) & k);
    const int n3 = idot8(a[3], (w1.z >> shift) & k, (w1.w >> shift) & k);
    float t = a[0].s * float(n0);
    t = fmaf(a[1].s, float(n1), t);
    t = fmaf(a[2].s, float(n2), t);
    t = fmaf(a[3].s, float(n3), t);
    return fmaf(q::h2f(b) * sc, t, -q::h2f(b + 2) * m * xs);
}

}  // namespace q16

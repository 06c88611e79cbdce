// The 2- and 3-bit K-quants and the ternary types: Quant<T> for Q2_K, Q3_K, TQ1_0 and TQ2_0 (the contract:
// quant.cuh). engine/cpu/dequant.py decodes the same layouts; each diagram below names a block's fields in order.
// Every load8 is branch-free (selects, not branches), so the GEMM's stage loop keeps one straight-line body.
#pragma once
#include "quant_common.cuh"

namespace q {

// Q2_K, 84 bytes: | scales: u8[16] | qs: u8[64] | d: f16 | dmin: f16 |   (blocks 4-byte aligned)
// Sub-block j (16 values) has scale lo(scales[j]) and min hi(scales[j]). Half h (128 values) uses qs[32h..32h+31]:
// bits 2k..2k+1 of qs[32h + l] are value 128h + 32k + l. y = d*sc*q - dmin*m.
template <> struct Quant<Q2_K> {
    static constexpr int QK = 256, BYTES = 84;
    __device__ static void load8(const uint8_t* row, int g, float* out) {
        const uint8_t* b = row + (g >> 5) * BYTES;
        const int gi = g & 31, h = gi >> 4, shift = 2 * ((gi >> 2) & 3), l0 = (gi & 3) * 8;
        const uint32_t sm = b[gi >> 1];
        const float d = h2f(b + 80) * float(sm & 0xF), m = h2f(b + 82) * float(sm >> 4);
        const uint32_t q0 = u32(b + 16 + 32 * h + l0), q1 = u32(b + 20 + 32 * h + l0);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            out[i] = d * float((q0 >> (8 * i + shift)) & 3) - m;
            out[4 + i] = d * float((q1 >> (8 * i + shift)) & 3) - m;
        }
    }
};

// Q3_K, 110 bytes: | hmask: u8[32] | qs: u8[64] | scales: u8[12] | d: f16 |
// Value 128h + 32k + l: low 2 bits as Q2_K's (bits 2k..2k+1 of qs[32h + l]), minus 4 unless bit 4h + k of hmask[l]
// is set. Sub-block j (16 values) has a 6-bit scale offset by 32: its low 4 bits the low (j < 8) or high nibble of
// scales[j % 8], its top 2 bits bits 2(j / 4)..+1 of scales[8 + j % 4]. y = d * (sc - 32) * q.
template <> struct Quant<Q3_K> {
    static constexpr int QK = 256, BYTES = 110;
    __device__ static void load8(const uint8_t* row, int g, float* out) {
        const uint8_t* b = row + (g >> 5) * BYTES;
        const int gi = g & 31, h = gi >> 4, k = (gi >> 2) & 3, l0 = (gi & 3) * 8, j = gi >> 1;
        const uint32_t lo = (b[96 + (j & 7)] >> (4 * (j >> 3))) & 0xF, hi = (b[104 + (j & 3)] >> (2 * (j >> 2))) & 3;
        const float d = h2f(b + 108) * float(int(lo | (hi << 4)) - 32);
        const uint32_t q0 = u16x2(b + 32 + 32 * h + l0), q1 = u16x2(b + 36 + 32 * h + l0);
        const uint32_t m0 = u16x2(b + l0), m1 = u16x2(b + 4 + l0);
        const int shift = 2 * k, hbit = 4 * h + k;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            out[i] = d * float(int((q0 >> (8 * i + shift)) & 3) + 4 * int((m0 >> (8 * i + hbit)) & 1) - 4);
            out[4 + i] = d * float(int((q1 >> (8 * i + shift)) & 3) + 4 * int((m1 >> (8 * i + hbit)) & 1) - 4);
        }
    }
};

// Digit k of a TQ1_0 byte, given p = 3^k: the byte is a base-3 fraction of 256 (5 digits), so multiplying by 3^k mod
// 256 brings digit k to the top, and (top * 3) >> 8 reads it. 0, 1 or 2.
__device__ __forceinline__ int trit(uint32_t byte, uint32_t p) { return int((((byte * p) & 0xFF) * 3) >> 8); }

// TQ1_0, 54 bytes: | qs: u8[48] | qh: u8[4] | d: f16 |
// Five ternary digits per qs byte, four per qh byte: value 32k + l is digit k of qs[l] (l < 32, k < 5), value
// 160 + 16k + l digit k of qs[32 + l] (l < 16), value 240 + 4k + l digit k of qh[l] (l < 4). y = d * (digit - 1).
// Group gi (values 8gi..8gi+7) is thus 8 bytes with one digit (gi < 30), or qh's 4 bytes with two digits (gi >= 30).
template <> struct Quant<TQ1_0> {
    static constexpr int QK = 256, BYTES = 54;
    __device__ static void load8(const uint8_t* row, int g, float* out) {
        const uint8_t* b = row + (g >> 5) * BYTES;
        const int gi = g & 31;
        const bool first = gi < 20, tail = gi >= 30;
        const int off = first ? 8 * (gi & 3) : tail ? 48 : 32 + 8 * ((gi - 20) & 1);
        const int k0 = first ? gi >> 2 : tail ? 2 * (gi - 30) : (gi - 20) >> 1, k1 = tail ? k0 + 1 : k0;
        const uint32_t w0 = u16x2(b + off), w1 = u16x2(b + (tail ? off : off + 4));
        constexpr unsigned long long POW3 = 0x511B090301ull;  // 3^k in byte k
        const uint32_t p0 = uint32_t(POW3 >> (8 * k0)) & 0xFF, p1 = uint32_t(POW3 >> (8 * k1)) & 0xFF;
        const float d = h2f(b + 52);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            out[i] = d * float(trit((w0 >> (8 * i)) & 0xFF, p0) - 1);
            out[4 + i] = d * float(trit((w1 >> (8 * i)) & 0xFF, p1) - 1);
        }
    }
};

// TQ2_0, 66 bytes: | qs: u8[64] | d: f16 |
// 2-bit quants in Q2_K's order (bits 2k..2k+1 of qs[32h + l] are value 128h + 32k + l). y = d * (q - 1).
template <> struct Quant<TQ2_0> {
    static constexpr int QK = 256, BYTES = 66;
    __device__ static void load8(const uint8_t* row, int g, float* out) {
        const uint8_t* b = row + (g >> 5) * BYTES;
        const int gi = g & 31, h = gi >> 4, shift = 2 * ((gi >> 2) & 3), l0 = (gi & 3) * 8;
        const uint32_t q0 = u16x2(b + 32 * h + l0), q1 = u16x2(b + 4 + 32 * h + l0);
        const float d = h2f(b + 64);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            out[i] = d * float(int((q0 >> (8 * i + shift)) & 3) - 1);
            out[4 + i] = d * float(int((q1 >> (8 * i + shift)) & 3) - 1);
        }
    }
};

}  // namespace q

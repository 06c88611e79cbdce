// What every GGUF block decoder shares (quant.cuh, quant_lowbit.cuh, quant_iq.cuh): the type ids, the primary
// `Quant<T>` template, little-endian field loads at the alignment a block has within a row, and the register lookup
// of a 16-entry int8 table.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace q {

// ggml type ids (engine/quants.py GGMLType)
enum : int { F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12,
             Q5_K = 13, Q6_K = 14, IQ2_XXS = 16, IQ2_XS = 17, IQ3_XXS = 18, IQ1_S = 19, IQ4_NL = 20, IQ3_S = 21,
             IQ2_S = 22, IQ4_XS = 23, IQ1_M = 29, BF16 = 30, TQ1_0 = 34, TQ2_0 = 35, MXFP4 = 39 };

// QK values per block, BYTES bytes per block; load8(row, g, out): values [8g, 8g+8) of the row as float32.
template <int T> struct Quant;

__device__ __forceinline__ float h2f(const uint8_t* p) {  // little-endian f16 at a 2-byte aligned address
    return __half2float(*reinterpret_cast<const __half*>(p));
}
__device__ __forceinline__ uint16_t u16(const uint8_t* p) { return *reinterpret_cast<const uint16_t*>(p); }
__device__ __forceinline__ uint32_t u16x2(const uint8_t* p) {  // 4 bytes from a 2-byte aligned address
    return uint32_t(u16(p)) | (uint32_t(u16(p + 2)) << 16);
}
__device__ __forceinline__ uint32_t u32(const uint8_t* p) { return *reinterpret_cast<const uint32_t*>(p); }
__device__ __forceinline__ uint32_t u8x4(const uint8_t* p) {  // 4 bytes from any address
    return uint32_t(p[0]) | (uint32_t(p[1]) << 8) | (uint32_t(p[2]) << 16) | (uint32_t(p[3]) << 24);
}

// Four 4-bit indices, one in each byte of idx (each < 16), looked up in a 16-entry int8 table held as four words
// (entry i is byte i % 4 of word i / 4: w0 .. w3, immediates at every call): the four entries, one per byte. Two byte
// permutes pick each index's byte among entries 0-7 and among 8-15; bit 3 of the index chooses. No memory access.
__device__ __forceinline__ uint32_t lut16x4(uint32_t idx, uint32_t w0, uint32_t w1, uint32_t w2, uint32_t w3) {
    const uint32_t sel = (idx & 0x7u) | ((idx >> 4) & 0x70u) | ((idx >> 8) & 0x700u) | ((idx >> 12) & 0x7000u);
    const uint32_t lo = __byte_perm(w0, w1, sel), hi = __byte_perm(w2, w3, sel);
    const uint32_t high = ((idx >> 3) & 0x01010101u) * 0xFFu;  // 0xFF in the bytes whose index is >= 8
    return (lo & ~high) | (hi & high);
}

}  // namespace q

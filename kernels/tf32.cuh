// tf32 operand halves and the m16n8k8 tensor-core step, shared by tc_matvec.cu and attention_prefill_tc.cuh.
// Fragment layout of lane (g, q) = (lane / 4, lane % 4) in a step: A (16 x 8, row major) rows g and g + 8 at k slots
// q and q + 4 (a[0] = (g, q), a[1] = (g + 8, q), a[2] = (g, q + 4), a[3] = (g + 8, q + 4)); B (8 x 8, column major)
// column g at k slots q, q + 4 (b0, b1); the accumulators d[0..1] = row g, columns 2q, 2q + 1, d[2..3] = row g + 8.
#pragma once
#include <stdint.h>

namespace {

// hi = v rounded to tf32's 10 mantissa bits (to nearest, ties away from zero: an add and a mask, where cvt.rna is a
// longer sequence), lo = v - hi, exact in float (the mma reads its top 19 bits; |lo| <= 2^-11 |v|, so the pair holds
// about 21 bits of v).
__device__ __forceinline__ void split_tf32(float v, uint32_t& hi, uint32_t& lo) {
    hi = (__float_as_uint(v) + 0x1000u) & 0xffffe000u;
    lo = __float_as_uint(v - __uint_as_float(hi));
}

// d += A (16 x 8, row major) . B (8 x 8, column major), tf32 operands, f32 accumulators (sm_80 and later).
__device__ __forceinline__ void mma_tf32(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// d += A . B with both operands as split halves: three steps (lo.hi, hi.lo, then hi.hi; lo.lo is below float32
// rounding), about 21 bits of each operand, float32 sums.
__device__ __forceinline__ void mma_tf32x3(float (&d)[4], const uint32_t (&ah)[4], const uint32_t (&al)[4],
                                           uint32_t bh0, uint32_t bh1, uint32_t bl0, uint32_t bl1) {
    mma_tf32(d, al, bh0, bh1);
    mma_tf32(d, ah, bl0, bl1);
    mma_tf32(d, ah, bh0, bh1);
}

}  // namespace

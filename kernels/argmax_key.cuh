// A logit and its id as one 64-bit key whose unsigned order is argmax order, so that the blocks computing a row of
// logits can each fold their own into one slot with atomicMax, and the argmax is then one load (the LM head's
// greedy form: matvec_stream.cuh writes the keys, sample.cu's argmax_key reads and clears the slot).
//
// Argmax order is sample_block.cuh's: any NaN or infinite logit first (the row then has no answer: id -1), then the
// larger value, then the lower id. High word: the value's order-preserving bits (negative floats inverted, positive
// ones with the sign bit set, -0 as +0 so equal floats tie); low word: ~id, so the lower id is the larger key.
// Every finite key is above 0 (the cleared slot) and below NONFINITE.
#pragma once
#include <stdint.h>

namespace amk {

typedef unsigned long long u64;
constexpr u64 EMPTY = 0, NONFINITE = ~0ull;

__device__ __forceinline__ u64 key(float x, int id) {
    const unsigned u = __float_as_uint(x == 0.0f ? 0.0f : x);
    if ((u & 0x7f800000u) == 0x7f800000u) return NONFINITE;
    const unsigned k = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return (u64(k) << 32) | u64(~unsigned(id));
}

// The id a key names: -1 for NONFINITE (and for an empty slot, which no row of logits leaves).
__device__ __forceinline__ int id(u64 k) { return k == NONFINITE || k == EMPTY ? -1 : int(~unsigned(k)); }

}  // namespace amk

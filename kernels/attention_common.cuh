// Helpers shared by kernels/attention.cu (and its attention_decode.cuh, attention_prefill.cuh) and mla.cu: float4
// access, the K/V cache element (float, or __half when KV_CACHE_TYPE=f16), small vector math, warp sums.
#pragma once
#include <stdint.h>

#include "kv_cache.cuh"

namespace {

constexpr float LOG2E = 1.4426950408889634f, LN2 = 0.6931471805599453f;
__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }
__device__ __forceinline__ float4 zero4() { return make_float4(0.0f, 0.0f, 0.0f, 0.0f); }
__device__ __forceinline__ float4 ldg4(const float* p) { return __ldg(reinterpret_cast<const float4*>(p)); }
__device__ __forceinline__ float4 lds4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ void sts4(float* p, float4 v) { *reinterpret_cast<float4*>(p) = v; }
__device__ __forceinline__ float dot4(float4 a, float4 b, float c) {
    return fmaf(a.w, b.w, fmaf(a.z, b.z, fmaf(a.y, b.y, fmaf(a.x, b.x, c))));
}
__device__ __forceinline__ void axpy4(float4& y, float a, float4 x) {
    y.x = fmaf(a, x.x, y.x); y.y = fmaf(a, x.y, y.y); y.z = fmaf(a, x.z, y.z); y.w = fmaf(a, x.w, y.w);
}
__device__ __forceinline__ void scale4(float4& y, float a) { y.x *= a; y.y *= a; y.z *= a; y.w *= a; }
__device__ __forceinline__ float shfl_max(float v, int o) { return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o)); }
// By value: `c ? v[i] : v[j]` on array elements is an lvalue, i.e. a select of addresses, which sends the array
// to local memory.
__device__ __forceinline__ float pick(bool c, float a, float b) { return c ? a : b; }

// The work item (query tile qt, head h) of this block of a prefill grid (query tiles, H), ranked by cost, heaviest
// first: rank r is tile gridDim.x-1 - r/H of head r%H. Block L of the first half takes rank L and block L + N/2 the
// complementary rank N-1-L, so the blocks that land together on an SM (blocks are dealt to SMs in order, round after
// round) carry about the same total work.
__device__ __forceinline__ void heaviest_first(int H, int& qt, int& h) {
    const int N = gridDim.x * gridDim.y, L = blockIdx.x + gridDim.x * blockIdx.y, half = (N + 1) / 2;
    const int r = L < half ? L : N - 1 - (L - half);
    qt = gridDim.x - 1 - r / H;
    h = r % H;
}

// 32 partial sums per lane in, one full sum per lane out: lane L returns the warp-wide sum of v[L].
// Each xor step halves the values a lane holds (it keeps the half selected by its own lane bit and sends the other
// half to its partner): 31 shuffles instead of 32 * 5. Recursion keeps every index a compile-time constant.
template <int O>
__device__ __forceinline__ float transpose_sum(float (&v)[32], int lane) {
    const bool hi = lane & O;
#pragma unroll
    for (int i = 0; i < O; ++i) {
        const float send = pick(hi, v[i], v[i + O]), keep = pick(hi, v[i + O], v[i]);
        v[i] = keep + __shfl_xor_sync(0xffffffffu, send, O);
    }
    if constexpr (O > 1) return transpose_sum<O / 2>(v, lane);
    return v[0];
}

}  // namespace

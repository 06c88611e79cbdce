// The K/V cache's element: float (KV_CACHE_TYPE=f32, the default) or __half (f16), and the two ways kernels touch
// it. Every kernel that reads or writes a cache is built for both (attention.cu, norm_rope.cu, mla.cu: the f16 entry
// points end in _f16); arithmetic stays float32 either way.
#pragma once
#include <cuda_fp16.h>
#include <stdint.h>

namespace {

// Four cache values from p when c (16-byte aligned for float, 8-byte for __half), else zeros, widened to float.
// Only the load is conditional; the widening comes after the merge, so the compiler issues the loads of an unrolled
// loop together. With the conversion inside the branch each load's latency was waited out before the next one: the
// decode attention over an f16 cache took 2.7x the f32 one's time on an H200 (2026-12-03, 40,959 keys).
__device__ __forceinline__ float4 ldkv4_if(bool c, const float* p) {
    return c ? __ldg(reinterpret_cast<const float4*>(p)) : make_float4(0.f, 0.f, 0.f, 0.f);
}
__device__ __forceinline__ float4 ldkv4_if(bool c, const __half* p) {
    uint2 u = make_uint2(0u, 0u);  // two f16 zeros a word
    if (c) u = __ldg(reinterpret_cast<const uint2*>(p));
    const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&u.x));
    const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&u.y));
    return make_float4(a.x, a.y, b.x, b.y);
}

// One value into the cache, rounded to nearest even for __half (as numpy's astype(np.float16)).
__device__ __forceinline__ void stkv(float* p, float v) { *p = v; }
__device__ __forceinline__ void stkv(__half* p, float v) { *p = __float2half_rn(v); }

}  // namespace

// Small generic device helpers shared by the kernels: warp and block reductions, 16-byte float loads.
#pragma once
#include <stdint.h>

namespace cm {

constexpr unsigned FULL = 0xffffffffu;

__device__ __forceinline__ float warp_sum(float v) {  // every lane gets the total
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL, v, o));
    return v;
}

// Sum of v over a block of NW full warps; every thread gets the total. `scratch` holds NW floats and may be reused
// after the call returns (the trailing barrier orders the reads before any later write).
template <int NW>
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    v = warp_sum(v);
    if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
    __syncthreads();
    float t = 0.f;
#pragma unroll
    for (int w = 0; w < NW; ++w) t += scratch[w];
    __syncthreads();
    return t;
}

// Reduce-scatter of V values (V a power of two) across a warp, in 5 butterfly steps. A step at lane distance O
// halves the live values while C > 1: the lane with bit O set keeps (and receives) the upper half, its partner the
// lower; once one value is left the steps are plain sums. Lane L ends with the warp totals of values
// [L*V/32, L*V/32 + max(V/32, 1)) in v[0..]; when V < 32 the 32/V lanes sharing an index hold the same total.
// Shuffles: V - 1 + (5 - log2 V) instead of 5 V for independent sums.
template <int V, int C, int O>
__device__ __forceinline__ void reduce_scatter_step(float (&v)[V], int lane) {
    if constexpr (O > 0) {
        if constexpr (C > 1) {
            constexpr int H = C / 2;
            const bool upper = lane & O;
#pragma unroll
            for (int i = 0; i < H; ++i) {
                const float send = upper ? v[i] : v[i + H];
                const float keep = upper ? v[i + H] : v[i];
                v[i] = keep + __shfl_xor_sync(FULL, send, O);
            }
            reduce_scatter_step<V, H, O / 2>(v, lane);
        } else {
            v[0] += __shfl_xor_sync(FULL, v[0], O);
            reduce_scatter_step<V, 1, O / 2>(v, lane);
        }
    }
}

template <int V>
__device__ __forceinline__ void warp_reduce_scatter(float (&v)[V]) {
    static_assert(V > 0 && (V & (V - 1)) == 0, "V must be a power of two");
    reduce_scatter_step<V, V, 16>(v, threadIdx.x & 31);
}

// 8 consecutive floats from a 16-byte aligned address.
__device__ __forceinline__ void load8f(const float* __restrict__ p, float* out) {
    const float4 a = __ldg(reinterpret_cast<const float4*>(p)), b = __ldg(reinterpret_cast<const float4*>(p) + 1);
    out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w;
    out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
}


}  // namespace cm

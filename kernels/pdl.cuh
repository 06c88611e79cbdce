// Programmatic dependent launch (sm_90+). Every kernel starts with pdl::begin(), or with launch_dependents(), reads of
// its weights only, then wait():
//   launch_dependents  the next kernel on the stream may be launched once every block of this one has run it, so its
//                      launch overlaps this kernel's run instead of following its end;
//   wait               holds this kernel until the one before it has finished and its writes are visible: nothing
//                      but weights (written once, at load) may be read before it, and nothing written.
// So a matvec can pull its weight rows into L2 (prefetch_l2) while the kernel that computes its input still runs.
// An activation read after wait() should not come through a `const __restrict__` pointer: those become read-only
// loads (ld.global.nc), which assume the memory does not change while the kernel runs, and a block of them issued
// together may be scheduled above the wait. moe_route_decode's unrolled x loads read the previous kernel's stale
// residual that way (MoE and MLA greedy decode diverged on the H200, only under PDL); plain loads keep their place.
// Without the launch attribute (engine/cuda/driver.py: GPUs below sm_90, REFLEX_PDL=0) these are no-ops but the
// prefetch; below sm_90 all compile to nothing.
#pragma once

namespace pdl {

__device__ __forceinline__ void launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void begin() {
    launch_dependents();
    wait();
}

// The 128-byte lines of [p, p + n) into L2, spread over the block's threads (one prefetch each for a few KB).
__device__ __forceinline__ void prefetch_l2(const void* p, long long n) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const char* c = static_cast<const char*>(p);
    for (long long o = 128LL * threadIdx.x; o < n; o += 128LL * blockDim.x)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(c + o));
#endif
}

}  // namespace pdl

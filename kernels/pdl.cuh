// Programmatic dependent launch (sm_90+). Every kernel starts with pdl::begin(), or with launch_dependents(), reads of
// its weights only, then wait():
//   launch_dependents  the next kernel on the stream may be launched once every block of this one has run it, so its
//                      launch overlaps this kernel's run instead of following its end;
//   wait               holds this kernel until the one before it has finished and its writes are visible: nothing
//                      but weights (written once, at load) may be read before it, and nothing written.
// So a matvec can pull its weight rows into L2 (prefetch_l2) while the kernel that computes its input still runs.
// Under early launch a kernel may start while kernels two or more places before it still run: wait() orders it after
// the one before, which itself waited, so only reads after wait() see every earlier kernel's writes.
// ptxas (nvcc 13.0, sm_90) keeps plain loads on their side of the wait (griddepcontrol.wait, ACQBULK in SASS) but
// schedules read-only loads (ld.global.nc, what `const __restrict__` pointers become) freely across it:
//   - an activation read through one may be hoisted above it and read stale data. moe_route_decode's unrolled x loads
//     read the previous kernel's residual that way (MoE and MLA greedy decode diverged on the H200, only under
//     PDL), and attn_decode, attn_prefill, mla_attn and mla_kv_rope read the position (which the decode graph's
//     last kernel advances) above their wait;
//   - a weight loaded through one before the wait may be sunk below it, and then overlaps nothing.
// So a kernel with a prologue reads through plain pointers: activations and the position after the wait, weights
// before it, from lines that say `pre-wait:` in a comment. scripts/pdl_audit.py lists every load above a kernel's
// wait in the built SASS with its source line, and tests/test_pdl_audit.py fails on one from a line without the tag.
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

// The 128-byte line holding p into L2 (one thread's hint).
__device__ __forceinline__ void prefetch_line(const void* p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
#endif
}

}  // namespace pdl

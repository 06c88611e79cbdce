// Weight bytes staged through shared memory for the matvec kernels (matvec_block.cuh, matvec_stream.cuh).
//
// A quantized block decoder reads a row in small loads of 1-8 bytes at scattered offsets, and a warp's load of such
// pieces from global memory touches many sectors for a few useful bytes: measured on the H200, the LM head's Q6_K
// matvec reached 1.3 TB/s of its 4.8. Staged, every global access is a 16-byte granule of a contiguous span, a warp
// reads 512 consecutive bytes at once, and the decoders read shared memory instead (bank-parallel, no tags).
//
// A span [src, src + n) is copied in the 16-byte aligned granules that cover it, to a 16-byte aligned destination;
// the span's first byte lands at dst + src % 16. Every address keeps its value modulo 16, so a decoder's alignment
// assumptions hold in shared memory as they did in global memory. Only granules that hold a byte of the span are read,
// and an allocation is a whole number of granules (memory.malloc), so nothing outside a buffer is touched.
//
// On sm_80 and later the granules go through cp.async (no registers held while they are in flight); before, a plain
// 16-byte load and store.
#pragma once
#include <stdint.h>

namespace stage {

// Bytes of shared memory a span of at most n bytes needs (its head offset, up to 15, included).
__host__ __device__ constexpr int pitch(int n) { return (n + 15 + 15) / 16 * 16; }

__device__ __forceinline__ void copy16(uint8_t* dst, const uint8_t* src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(src));
#else
    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
#endif
}

// Waits for this thread's copies; a barrier (__syncthreads / __syncwarp) then makes everyone's visible.
__device__ __forceinline__ void wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_all;\n" ::: "memory");
#endif
}

// Pipelined copies: commit() closes this thread's group of copies issued since the last one; wait_pending<N>() waits
// until at most N of its groups are still in flight (the older ones have landed).
__device__ __forceinline__ void commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

template <int N>
__device__ __forceinline__ void wait_pending() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

// Granule j of the span [src, src + n) to dst + 16 j, if it holds a byte of the span; returns false past the end.
__device__ __forceinline__ bool granule(uint8_t* dst, const uint8_t* src, int n, int j) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(src);
    const int head = int(a & 15);
    if (16 * j >= head + n) return false;
    copy16(dst + 16 * j, reinterpret_cast<const uint8_t*>(a - head) + 16 * j);
    return true;
}

// Where the span's first byte lands in dst.
__device__ __forceinline__ const uint8_t* landed(const uint8_t* dst, const uint8_t* src) {
    return dst + (reinterpret_cast<uintptr_t>(src) & 15);
}

// The warp's lanes copy the span (granules lane, lane + 32, ...); wait() and __syncwarp() before reading it.
__device__ __forceinline__ void span_warp(uint8_t* dst, const uint8_t* src, int n, int lane) {
    for (int j = lane; granule(dst, src, n, j); j += 32) {
    }
}

}  // namespace stage

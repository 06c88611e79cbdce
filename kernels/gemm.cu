// Prefill matmuls (n > 64 tokens; fewer in tests and for some types) straight from GGUF blocks: gemm_{t} and gemm_swiglu_{t} for every weight type.
// Contract (names, arguments, grid/block): kernels/README.md, "gemm.cu". The tile code and its design: gemm_tile.cuh.
// Block 128 threads, grid (ceil(R / 64), ceil(n / 64)); W rows of K values (K a multiple of 32, of 256 for K-quants),
// row_bytes apart; A, resid and C 16-byte aligned; A must not overlap C.
#include "pdl.cuh"
#include "gemm_tile.cuh"

// (128, 2): at most 255 registers. Without a minimum, ptxas aims at ~128 registers and gets there by issuing the
// next stage's global loads late, right before their use (the latency the double buffer exists to hide).
// 3 blocks an SM (at most 168 registers, no spill on sm_90) measured the same on an H200 (2026-12-03, a Qwen3-0.6B
// layer at n = 512: 358.4 vs 360.6 us split, 369.1 vs 371.0 whole).
#define GEMM_BOUNDS __launch_bounds__(gemm::THREADS, 2)

// C[n, R] = A[n, K] . W^T (+ resid[n, R], which may be C itself); gridDim.z = S > 1 splits K (gemm_tile.cuh, Split)
#define GEMM_KERNELS(tag, T)                                                                                          \
    extern "C" __global__ void GEMM_BOUNDS                                                                            \
        gemm_##tag(const uint8_t* __restrict__ W, long long row_bytes, int R, int K, const float* __restrict__ A,     \
                   int n, const float* resid, float* C, float* part, int* tickets) {                                 \
        pdl::begin();                                                                                                 \
        const uint8_t* const w[1] = {W};                                                                              \
        gemm::tile<T, 1>(w, row_bytes, R, K, A, n, resid, C, {part, tickets});                                       \
    }                                                                                                                 \
    /* C[n, R] = silu(A . Wg^T) * (A . Wu^T), Wg and Wu both of type T and shape [R, K] */                            \
    extern "C" __global__ void GEMM_BOUNDS                                                                            \
        gemm_swiglu_##tag(const uint8_t* __restrict__ Wg, const uint8_t* __restrict__ Wu, long long row_bytes, int R, \
                          int K, const float* __restrict__ A, int n, float* __restrict__ C, float* part,              \
                          int* tickets) {                                                                             \
        pdl::begin();                                                                                                 \
        const uint8_t* const w[2] = {Wg, Wu};                                                                         \
        gemm::tile<T, 2>(w, row_bytes, R, K, A, n, nullptr, C, {part, tickets});                                     \
    }

Q_FOR_EACH_TYPE(GEMM_KERNELS)

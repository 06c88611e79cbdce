// Small element-wise kernels for the paths the fused kernels do not cover.
#include "pdl.cuh"

// y[i] = silu(g[i]) * u[i] for i < n: SwiGLU when ffn_gate and ffn_up have different weight types and so cannot
// share one fused matvec/GEMM launch. y may alias g.
extern "C" __global__ void swiglu_f32(const float* __restrict__ g, const float* __restrict__ u, float* y, long long n) {
    pdl::begin();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float a = g[i];
        y[i] = a / (1.0f + expf(-a)) * u[i];
    }
}

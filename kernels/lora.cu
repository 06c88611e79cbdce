// LoRA glue the existing kernels do not cover (engine/cuda/lora.py, engine/models/moe_cuda.py). Contract:
// kernels/README.md, "lora.cu".
#include "pdl.cuh"


// y[i] += d[i] for i < n. The grouped expert GEMM (moe_gemm_{t}) writes its product and cannot accumulate, so an
// expert stack's low-rank update B'_e · (A_e · x) lands in a scratch d and is added here. One thread an element, no
// atomics: the result does not depend on scheduling.
extern "C" __global__ void __launch_bounds__(256)
    lora_add_f32(float* __restrict__ y, const float* __restrict__ d, long long n) {
    pdl::begin();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] += d[i];
}

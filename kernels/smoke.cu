// The smallest AOT pipeline check (`python -m engine smoke`): y = a * x + y over n floats.
#include "pdl.cuh"

extern "C" __global__ void axpy_f32(float a, const float* __restrict__ x, float* __restrict__ y, int n) {
    pdl::begin();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}

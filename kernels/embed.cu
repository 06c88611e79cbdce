// Embedding lookup: out[i, :] = dequant(W[ids[i]]), out[n, K] float32. Contract: kernels/README.md, "embed.cu".
// Block 256, grid.x = n: block i decodes row ids[i]; thread j takes 8-value groups j, j + 256, ... and stores each
// as two float4 (rows of K floats, K a multiple of 32, stay 16-byte aligned from an aligned `out`).
#include "pdl.cuh"
#include "quant.cuh"

namespace {

template <int T>
__device__ __forceinline__ void embed_row(const uint8_t* __restrict__ W, long long row_bytes, int K,
                                          const int* __restrict__ ids, int n, float* __restrict__ out) {
    const int i = blockIdx.x;
    if (i >= n) return;
    const uint8_t* row = W + (long long)ids[i] * row_bytes;
    float4* dst = reinterpret_cast<float4*>(out + (long long)i * K);  // [K / 4]
    for (int g = threadIdx.x; g < (K >> 3); g += blockDim.x) {
        float v[8];
        q::Quant<T>::load8(row, g, v);
        dst[2 * g] = make_float4(v[0], v[1], v[2], v[3]);
        dst[2 * g + 1] = make_float4(v[4], v[5], v[6], v[7]);
    }
}

}  // namespace

#define EMBED_KERNEL(tag, T)                                                                                        \
    extern "C" __global__ void __launch_bounds__(256)                                                               \
        embed_##tag(const uint8_t* W, long long row_bytes, int K, const int* ids, int n, float* out) {              \
        pdl::begin();                                                                                               \
        embed_row<T>(W, row_bytes, K, ids, n, out);                                                                 \
    }

Q_FOR_EACH_TYPE(EMBED_KERNEL)

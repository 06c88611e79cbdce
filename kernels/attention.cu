// Causal grouped-query attention over the float32 KV cache (contract: kernels/README.md; math: engine/cpu/ops.py
// `attention`). Scores are kept in log2 units (q is pre-multiplied by scale * log2 e) so the softmax uses exp2f;
// part_ml stores the split maxima back in natural units. Layouts: q[n, H, hd], cache[pos, KVH, hd|vd].
#include "pdl.cuh"
#include "attention_common.cuh"
#include "attention_decode.cuh"
#include "attention_prefill.cuh"
#include "attention_prefill_tc.cuh"

// attn_decode over a float cache, attn_decode_f16 over a __half one (KV_CACHE_TYPE=f16): the same arguments; 4 warps
// a block, 3 blocks an SM (one wave holds dispatch.decode_splits). attn_decode_w8[_f16]: 8 warps, 2 blocks an SM, for
// at most 4 q heads a block with rows at most 128 wide (the paths that fit 128 registers; dispatch.decode_warps).
#define ATTN_DECODE(NAME, KV, WARPS, BLOCKS)                                                                       \
    extern "C" __global__ void __launch_bounds__(32 * WARPS, BLOCKS)                                               \
        NAME(const float* __restrict__ q, const KV* __restrict__ k_cache, const KV* __restrict__ v_cache,          \
             const int* pos, int H, int KVH, int hd, int vd, float scale, int n_splits, int min_chunk, int parts,  \
             float* __restrict__ part_o, float* __restrict__ part_ml, int* __restrict__ counters,                  \
             float* __restrict__ out, int prefetch) {                                                              \
        pdl::launch_dependents();                                                                                  \
        decode<WARPS, KV>(q, k_cache, v_cache, pos, H, KVH, hd, vd, scale, n_splits, min_chunk, parts, part_o,    \
                          part_ml, counters, out, prefetch);                                                       \
    }
ATTN_DECODE(attn_decode, float, 4, 3)
ATTN_DECODE(attn_decode_f16, __half, 4, 3)
ATTN_DECODE(attn_decode_w8, float, 8, 2)
ATTN_DECODE(attn_decode_w8_f16, __half, 8, 2)
#undef ATTN_DECODE


// out[h, :] = sum_s w_s * part_o[h, s, :] / sum_s w_s * l_s, with w_s = exp(m_s - max m), for n_splits <=
// MAX_COMBINE_SPLITS. grid (H, ceil(vd / 128)), block 128: element 128 * blockIdx.y + threadIdx.x of head blockIdx.x.
// Warp 0 turns the maxima into weights once for the block (shared memory), then each thread sums its element over
// the splits in split order with its loads independent (the splits' partials are in flight together). One block a
// head with a thread looping over the elements and the maxima took 16.8 us a launch for MLA's 16 heads of 512 on an
// H200 (65-key context, 32 splits), 6.0 us for 32 heads of 128. (MLA's split decode: kernels/mla.cu writes the
// partials of all n_splits splits.)
constexpr int MAX_COMBINE_SPLITS = 64;

extern "C" __global__ void __launch_bounds__(128)
attn_combine(const float* __restrict__ part_o, const float* __restrict__ part_ml, int H, int n_splits, int vd,
             float* __restrict__ out) {
    pdl::begin();
    __shared__ float ws[MAX_COMBINE_SPLITS];
    __shared__ float wl;
    const int h = blockIdx.x, lane = threadIdx.x & 31;
    const float* ml = part_ml + (long long)h * n_splits * 2;
    if (threadIdx.x < 32) {
        float M = neg_inf();
        for (int s = lane; s < n_splits; s += 32) M = fmaxf(M, ml[2 * s]);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) M = shfl_max(M, o);
        float L = 0.0f;  // this lane's splits, then the warp's in a fixed tree order
        for (int s = lane; s < n_splits; s += 32) {
            const float m = ml[2 * s], w = m == neg_inf() ? 0.0f : expf(m - M);
            ws[s] = w;
            L = fmaf(w, ml[2 * s + 1], L);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) L += __shfl_xor_sync(0xffffffffu, L, o);
        if (lane == 0) wl = L;
    }
    __syncthreads();
    const int e = blockIdx.y * 128 + threadIdx.x;
    if (e >= vd) return;
    const float* po = part_o + (long long)h * n_splits * vd + e;
    float o = 0.0f;
#pragma unroll 8
    for (int s = 0; s < n_splits; ++s) o = fmaf(ws[s], po[(long long)s * vd], o);
    out[(long long)h * vd + e] = o / wl;
}

// The prefill attention's forms, one signature: attn_prefill (float32 FMAs, any head dims), attn_prefill_tc{D}
// (tensor cores, hd = vd = D = 64 or 128 on sm_80 and later: engine/cuda/dispatch.py, prefill_tc; an entry point a
// head dim, so the 64 form is not held to the 128 form's registers; below sm_80 there is no tf32 mma, and at other
// dims they trap). Each has an entry point over a float cache and one over a __half cache (_f16), same arguments.
//   attn_prefill:      grid (ceil(n / 32), H), block 128, dynamic shared memory (2*32*(hd + 4) + 32*vd + 1056) * 4 B
//   attn_prefill_tc{D}: grid (ceil(n / 64), H), block 128, dynamic shared memory prefill_tc_smem_floats<D, D>() * 4 B
//   attn_prefill_tc{D}_k2: the same with block 256, two key groups (attention_prefill_tc.cuh, KS = 2)
struct SimtForm {
    template <typename KV>
    static __device__ __forceinline__ void run(const float* q, const KV* k_cache, const KV* v_cache, int p0, int n,
                                               int H, int KVH, int hd, int vd, float scale, float* out, float* sm) {
        if (vd <= 128) prefill_rows<1>(q, k_cache, v_cache, p0, n, H, KVH, hd, vd, scale, out, sm);
        else prefill_rows<2>(q, k_cache, v_cache, p0, n, H, KVH, hd, vd, scale, out, sm);
    }
};

template <int D, int KS = 1>
struct TcForm {
    template <typename KV>
    static __device__ __forceinline__ void run(const float* q, const KV* k_cache, const KV* v_cache, int p0, int n,
                                               int H, int KVH, int hd, int vd, float scale, float* out, float* sm) {
        if (TC_ATTENTION && hd == D && vd == D)
            prefill_tc<D, D, KS>(q, k_cache, v_cache, p0, n, H, KVH, scale, out, sm);
        else
            __trap();
    }
};

using TcForm128K2 = TcForm<128, 2>;  // one macro argument each
using TcForm64K2 = TcForm<64, 2>;

#define ATTN_PREFILL(NAME, KV, FORM) ATTN_PREFILL_BLOCK(NAME, KV, FORM, 128, 2)
#define ATTN_PREFILL_BLOCK(NAME, KV, FORM, THREADS, MIN_BLOCKS)                                                    \
    extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS)                                              \
        NAME(const float* __restrict__ q, const KV* __restrict__ k_cache, const KV* __restrict__ v_cache,          \
             const int* pos, int n, int H, int KVH, int hd, int vd, float scale, float* __restrict__ out) {        \
        pdl::begin();                                                                                              \
        extern __shared__ float4 dsm4[];                                                                           \
        FORM::template run<KV>(q, k_cache, v_cache, *pos, n, H, KVH, hd, vd, scale, out,                           \
                               reinterpret_cast<float*>(dsm4));                                                    \
    }
ATTN_PREFILL(attn_prefill, float, SimtForm)
ATTN_PREFILL(attn_prefill_f16, __half, SimtForm)
ATTN_PREFILL(attn_prefill_tc128, float, TcForm<128>)
ATTN_PREFILL(attn_prefill_tc128_f16, __half, TcForm<128>)
ATTN_PREFILL(attn_prefill_tc64, float, TcForm<64>)
ATTN_PREFILL(attn_prefill_tc64_f16, __half, TcForm<64>)
ATTN_PREFILL_BLOCK(attn_prefill_tc128_k2, float, TcForm128K2, 256, 1)
ATTN_PREFILL_BLOCK(attn_prefill_tc128_k2_f16, __half, TcForm128K2, 256, 1)
ATTN_PREFILL_BLOCK(attn_prefill_tc64_k2, float, TcForm64K2, 256, 1)
ATTN_PREFILL_BLOCK(attn_prefill_tc64_k2_f16, __half, TcForm64K2, 256, 1)
#undef ATTN_PREFILL
#undef ATTN_PREFILL_BLOCK

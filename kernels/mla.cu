// Multi-head latent attention (deepseek2) in the absorbed form, over the latent cache (float, or __half), and the per-head
// matvecs around it (q_nope -> latent with attn_k_b, latent -> value with attn_v_b). Math: engine/models/mla.py.
// Contract (names, arguments, grid/block): kernels/README.md, "mla.cu". The latent rows themselves are written by
// norm_rope.cu's mla_kv_rope.
//
// Layouts: a latent row is D = R + P floats, [normed latent c (R) | roped k_pe (P)]; the absorbed query of head h is
// qa[t, h, :] = [attn_k_b[h] . q_nope (R) | roped q_pe (P)], so every head scores qa . row over all D dims (K = the
// whole row, shared by all heads) and takes V = the row's first R dims.
#include "pdl.cuh"
#include "attention_common.cuh"
#include "common.cuh"
#include "quant.cuh"

namespace {

// ---- per-head matvec ---------------------------------------------------------------------------------------------
// y[t, h, r] = dot(W[h * R + r, :K], x[t, h, :K]): W stacks the heads' (R, K) matrices as H * R rows of K values in
// GGUF blocks (attn_k_b ne [nope, R, H]: rows are latent dims; attn_v_b ne [R, v, H]: rows are value dims).
// Block: 128 threads = rows [128 * blockIdx.x, +128) of head blockIdx.y, one row a thread, for tokens
// [N * blockIdx.z, +N). The tokens' x rows are staged in shared memory once; each thread walks its weight row in
// 8-value groups (dequantized in registers) and reuses every group for all N tokens, whose x it reads as broadcasts.
constexpr int HM_THREADS = 128;
constexpr int HM_WARP_THREADS = 256;  // head_matvec_warp
constexpr int HM_MAX_K = 512;

template <int T, int N>
__device__ __forceinline__ void head_matvec(const uint8_t* __restrict__ W, long long row_bytes, int R, int K,
                                            const float* __restrict__ x, long long x_tok, int x_head, int n,
                                            float* __restrict__ y, long long y_tok, int y_head) {
    __shared__ float4 xs4[N * HM_MAX_K / 4];  // [N tokens][K]
    float* xs = reinterpret_cast<float*>(xs4);
    const int h = blockIdx.y, t0 = blockIdx.z * N, nt = min(N, n - t0), K4 = K >> 2;
    for (int idx = threadIdx.x; idx < N * K4; idx += HM_THREADS) {
        const int t = idx / K4, c = idx - t * K4;  // tokens past n stage zeros (their outputs are not written)
        const float* src = x + (t0 + t) * x_tok + (long long)h * x_head + 4 * c;
        sts4(xs + t * K + 4 * c, t < nt ? ldg4(src) : zero4());
    }
    __syncthreads();
    const int r = blockIdx.x * HM_THREADS + threadIdx.x;
    if (r >= R) return;
    const uint8_t* row = W + ((long long)h * R + r) * row_bytes;
    float acc[N];
#pragma unroll
    for (int t = 0; t < N; ++t) acc[t] = 0.0f;
#pragma unroll 2
    for (int g = 0; g < (K >> 3); ++g) {
        float w[8];
        q::Quant<T>::load8(row, g, w);
#pragma unroll
        for (int t = 0; t < N; ++t) {
            const float4 a = lds4(xs + t * K + 8 * g), b = lds4(xs + t * K + 8 * g + 4);
            acc[t] = fmaf(w[0], a.x, fmaf(w[1], a.y, fmaf(w[2], a.z, fmaf(w[3], a.w, acc[t]))));
            acc[t] = fmaf(w[4], b.x, fmaf(w[5], b.y, fmaf(w[6], b.z, fmaf(w[7], b.w, acc[t]))));
        }
    }
#pragma unroll
    for (int t = 0; t < N; ++t)
        if (t < nt) y[(t0 + t) * y_tok + (long long)h * y_head + r] = acc[t];
}

// One token, a warp a row: block 256 = rows [8 * blockIdx.x, +8) of head blockIdx.y, lane L on the row's 8-value
// groups L, L + 32 (K <= 512: two at most), then a warp sum. The thread-a-row form above leaves one token's launch
// with too few threads: for DeepSeek-V2-Lite's attn_v_b (16 heads of 128 rows, K = 512) 16 blocks of 128 threads,
// each walking 64 groups in turn, 11.4 us a launch on an H200.
template <int T>
__device__ __forceinline__ void head_matvec_warp(const uint8_t* __restrict__ W, long long row_bytes, int R, int K,
                                                 const float* __restrict__ x, int x_head, float* __restrict__ y,
                                                 int y_head) {
    constexpr int RB = HM_WARP_THREADS / 32;  // rows a block
    const int h = blockIdx.y, lane = threadIdx.x & 31, r0 = blockIdx.x * RB, r = r0 + (threadIdx.x >> 5);
    pdl::prefetch_l2(W + ((long long)h * R + r0) * row_bytes, min(RB, R - r0) * row_bytes);  // before the wait
    pdl::wait();
    if (r >= R) return;  // a whole warp leaves: no block barrier below
    const uint8_t* row = W + ((long long)h * R + r) * row_bytes;
    const float* xh = x + (long long)h * x_head;
    float acc = 0.0f;
#pragma unroll
    for (int i = 0; i < HM_MAX_K / 256; ++i) {
        const int g = lane + 32 * i;
        if (8 * g < K) {
            float w[8];
            q::Quant<T>::load8(row, g, w);
            const float4 a = ldg4(xh + 8 * g), b = ldg4(xh + 8 * g + 4);
            acc = fmaf(w[0], a.x, fmaf(w[1], a.y, fmaf(w[2], a.z, fmaf(w[3], a.w, acc))));
            acc = fmaf(w[4], b.x, fmaf(w[5], b.y, fmaf(w[6], b.z, fmaf(w[7], b.w, acc))));
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (lane == 0) y[(long long)h * y_head + r] = acc;
}

// ---- absorbed attention ------------------------------------------------------------------------------------------
// Block (head group blockIdx.x, key split blockIdx.y, query blockIdx.z), 8 warps: heads h0 .. h0+7 of query t, at
// position p0 + t, over its split of keys 0 .. p0 + t (split s: [s*chunk, min((s+1)*chunk, L)), L = p0 + t + 1,
// chunk = ceil(L / n_splits)). Per tile of 8 latent rows, staged in shared memory once for all the block's heads:
//   scores: warp w takes key w of the tile with all 8 heads (lanes split the D dims, float4 each); one
//           reduce-scatter leaves head j's score on lanes 4j .. 4j+3, written to sc[j][w];
//   values: warp w is head h0 + w: its online softmax over the tile's 8 scores, then acc += p_k * row_k[:R] with the
//           lane owning dims 4*lane + 128*i (i < NI).
// Scores are kept in log2 units (q pre-multiplied by scale * log2 e), as in attention.cu. Padding heads (h >= H)
// score with zero queries and write nothing; tile rows past the split are zeros with score -inf.
constexpr int AT_HEADS = 8, AT_KEYS = 8, AT_THREADS = 256;
constexpr int AT_MAX_D = 640;  // R + P: 576 for DeepSeek V2/V3

template <int NI, typename KV>
__device__ __forceinline__ void attn_block(const float* __restrict__ q, const KV* __restrict__ cache, int p0,
                                           int H, int R, int D, float scale, int n_splits,
                                           float* __restrict__ part_o, float* __restrict__ part_ml,
                                           float* __restrict__ out, float* qs, float* ks, float* sc) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int h0 = blockIdx.x * AT_HEADS, s = blockIdx.y, t = blockIdx.z, h = h0 + warp;
    const int L = p0 + t + 1, chunk = (L + n_splits - 1) / n_splits;
    const int k0 = min(s * chunk, L), k1 = min(k0 + chunk, L);
    const int D4 = D >> 2;
    const float qscale = scale * LOG2E;
    for (int idx = threadIdx.x; idx < AT_HEADS * D4; idx += AT_THREADS) {
        const int j = idx / D4, d = 4 * (idx - j * D4);
        float4 v = h0 + j < H ? ldg4(q + ((long long)t * H + h0 + j) * D + d) : zero4();
        scale4(v, qscale);
        sts4(qs + j * D + d, v);
    }
    const bool live = h < H;  // warp-uniform
    float4 acc[NI];
#pragma unroll
    for (int i = 0; i < NI; ++i) acc[i] = zero4();
    float m = neg_inf(), l = 0.0f;  // head h: running max (log2 units) and sum of exp2

    for (int kt = k0; kt < k1; kt += AT_KEYS) {
        const int nk = min(AT_KEYS, k1 - kt);
        __syncthreads();  // q is staged (first tile); every warp is done with the previous tile
        for (int idx = threadIdx.x; idx < AT_KEYS * D4; idx += AT_THREADS) {
            const int r = idx / D4, d = 4 * (idx - r * D4);
            sts4(ks + r * D + d, ldkv4_if(r < nk, cache + (long long)(kt + r) * D + d));
        }
        __syncthreads();
        float part[AT_HEADS];
#pragma unroll
        for (int j = 0; j < AT_HEADS; ++j) part[j] = 0.0f;
        for (int d = 4 * lane; d < D; d += 128) {
            const float4 k4 = lds4(ks + warp * D + d);
#pragma unroll
            for (int j = 0; j < AT_HEADS; ++j) part[j] = dot4(lds4(qs + j * D + d), k4, part[j]);
        }
        cm::warp_reduce_scatter(part);  // lane L: the score of head L / 4 in part[0]
        if ((lane & 3) == 0) sc[(lane >> 2) * AT_KEYS + warp] = warp < nk ? part[0] : neg_inf();
        __syncthreads();
        if (!live) continue;
        float p[AT_KEYS], mt = neg_inf();
#pragma unroll
        for (int k = 0; k < AT_KEYS; ++k) {
            p[k] = sc[warp * AT_KEYS + k];
            mt = fmaxf(mt, p[k]);
        }
        const float mn = fmaxf(m, mt);  // finite: key kt is in the split
        const float corr = exp2f(m - mn);
        m = mn;
        float psum = 0.0f;
#pragma unroll
        for (int k = 0; k < AT_KEYS; ++k) {
            p[k] = exp2f(p[k] - mn);
            psum += p[k];
        }
        l = l * corr + psum;
#pragma unroll
        for (int i = 0; i < NI; ++i) scale4(acc[i], corr);
#pragma unroll
        for (int k = 0; k < AT_KEYS; ++k)
#pragma unroll
            for (int i = 0; i < NI; ++i) {
                const int d = 128 * i + 4 * lane;
                if (d < R) axpy4(acc[i], p[k], lds4(ks + k * D + d));
            }
    }
    if (!live) return;
    const long long row = (long long)t * H + h;  // (query, head)
    const float inv = n_splits == 1 ? 1.0f / l : 1.0f;  // one split: l > 0, the query's own key is in it
#pragma unroll
    for (int i = 0; i < NI; ++i) {
        const int d = 128 * i + 4 * lane;
        if (d >= R) break;
        float4 y = acc[i];
        scale4(y, inv);
        sts4((n_splits == 1 ? out + row * R : part_o + (row * n_splits + s) * R) + d, y);
    }
    if (n_splits > 1 && lane == 0) {
        part_ml[2 * (row * n_splits + s)] = m == neg_inf() ? m : m * LN2;  // natural units, for attn_combine
        part_ml[2 * (row * n_splits + s) + 1] = l;
    }
}

}  // namespace

// grid (ceil(R / 128), H, ceil(n / N)), block 128. At most 128 registers (4 blocks an SM): left to itself ptxas
// settled on 80 for the f16/bf16 N = 16 kernels on sm_100 and spilled.
#define HEAD_MATVEC_N(tag, T, N)                                                                                   \
    extern "C" __global__ void __launch_bounds__(HM_THREADS, 4)                                                    \
        mla_head_matvec_##tag##_n##N(const uint8_t* W, long long row_bytes, int R, int K, const float* x,          \
                                     long long x_tok, int x_head, int n, float* y, long long y_tok, int y_head) {  \
        pdl::begin();                                                                                              \
        head_matvec<T, N>(W, row_bytes, R, K, x, x_tok, x_head, n, y, y_tok, y_head);                               \
    }
// grid (ceil(R / 8), H), block 256: one token, a warp a row.
#define HEAD_MATVEC_WARP(tag, T)                                                                                   \
    extern "C" __global__ void __launch_bounds__(HM_WARP_THREADS)                                                  \
        mla_head_matvec_##tag##_w(const uint8_t* W, long long row_bytes, int R, int K, const float* x, int x_head,  \
                                  float* y, int y_head) {                                                          \
        pdl::launch_dependents(); /* head_matvec_warp waits after its weight prefetch */                           \
        head_matvec_warp<T>(W, row_bytes, R, K, x, x_head, y, y_head);                                             \
    }
#define HEAD_MATVEC(tag, T) HEAD_MATVEC_N(tag, T, 1) HEAD_MATVEC_N(tag, T, 16) HEAD_MATVEC_WARP(tag, T)
Q_FOR_EACH_TYPE(HEAD_MATVEC)

// grid (ceil(H / 8), n_splits, n), block 256. n_splits == 1 writes out[n, H, R] normalised; n_splits > 1 writes
// part_o[n, H, n_splits, R] and part_ml[n, H, n_splits, 2] for attention.cu's attn_combine (with n * H rows).
// mla_attn reads a float latent cache, mla_attn_f16 a __half one (KV_CACHE_TYPE=f16): the same arguments.
#define MLA_ATTN(NAME, KV)                                                                                         \
    extern "C" __global__ void __launch_bounds__(AT_THREADS, 2)                                                    \
        NAME(const float* __restrict__ q, const KV* __restrict__ cache, const int* pos, int H, int R, int D,       \
             float scale, int n_splits, float* __restrict__ part_o, float* __restrict__ part_ml,                   \
             float* __restrict__ out) {                                                                            \
        pdl::begin();                                                                                              \
        __shared__ float4 qs4[AT_HEADS * AT_MAX_D / 4]; /* [8 heads][D] */                                         \
        __shared__ float4 ks4[AT_KEYS * AT_MAX_D / 4];  /* [8 keys][D] */                                          \
        __shared__ float sc[AT_HEADS * AT_KEYS];        /* [head][key] of the tile */                              \
        float* qs = reinterpret_cast<float*>(qs4);                                                                 \
        float* ks = reinterpret_cast<float*>(ks4);                                                                 \
        if (R <= 128) attn_block<1>(q, cache, *pos, H, R, D, scale, n_splits, part_o, part_ml, out, qs, ks, sc);   \
        else attn_block<4>(q, cache, *pos, H, R, D, scale, n_splits, part_o, part_ml, out, qs, ks, sc);            \
    }
MLA_ATTN(mla_attn, float)
MLA_ATTN(mla_attn_f16, __half)
#undef MLA_ATTN

// Prefill GEMM, one 64 x 64 output tile per block: C[t, r] = sum_k A[t, k] * W[r, k] (+ resid), or the SwiGLU pair.
// Contract (names, arguments, grid/block): kernels/README.md, "gemm.cu". Kernels: gemm.cu.
//
// A block (128 threads = 4 warps) owns tokens [t0, t0 + 64) x weight rows [r0, r0 + 64) and walks K in stages of BK
// values. A stage travels global -> registers (A as float4, W dequantized by Quant<T>::load8) -> shared memory, two
// buffers deep: the loads of stage s + 1 are issued before the warps multiply stage s out of one buffer, and land in
// the other buffer after the multiply, one barrier per stage, where two stages fit in 48 KiB (the pair's); the one-matrix
// tile's stage takes one buffer and a second barrier. The loop body has no branches of its own (tokens past n
// and rows past R are clamped to the last valid one: they only feed outputs that are never written, and every read
// stays inside A and W), so ptxas can schedule the multiply between the loads and the dequantizing arithmetic that
// waits for them (seen in the sm_90 SASS; a branch inside load8, as scale_min_k4's for Q4_K/Q5_K, splits the body and
// puts one group's arithmetic, and its wait, before the multiply).
//
// Shared memory, one stage (floats; row stride LD = BK + 4):
//   sA[64][LD]         A[t0 + i, k0 + k]   (token-major: the row-major matrix_a)
//   sW[m][64][LD]      W_m[r0 + j, k0 + k] (weight-row-major: B = W^T read as column-major matrix_b)
// LD = 68, 36 or 20 (= 4, 4, 20 mod 32): the 8 rows x 4 columns that a tf32 fragment load touches per
// instruction, the float4 reads of the SIMT path, and the loaders' float4 stores all hit 32 distinct banks (at 68 the
// weight stores by alternating their two halves: Stage::store).
// After the loop the finished tile is staged through sC[64][68] (over the stage buffers), so the global stores are
// coalesced float4 and the n / R guards are per element.
//
// Two multiply paths over the same staging:
//   TF32 (sm_80+, quantized types): warp (wm, wn) = (warp / 2, warp % 2) computes tokens 32 wm + [0, 32) x rows
//     32 wn + [0, 32) as 2 x 2 wmma m16n16k8 fragments per matrix, float accumulators. Values are rounded to tf32
//     (round to nearest) when they enter shared memory, so fragments need no further conversion.
//   SIMT (float types everywhere, every type on sm_75): thread (tx, ty) = (tid % 8, tid / 8) computes tokens
//     ty + 16 i (i < 4) x rows tx + 8 j (j < 8) in exact float32 (fmaf in k order).
#pragma once
#include "quant.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#include <mma.h>

#include <type_traits>
#define GEMM_TF32 1
#else
#define GEMM_TF32 0
#endif

namespace gemm {

constexpr int BM = 64, BN = 64, THREADS = 128;
constexpr int CLD = BN + 4;  // row stride of the staged output tile sC[BM][CLD]

__host__ __device__ constexpr bool is_float_type(int t) { return t == q::F32 || t == q::F16 || t == q::BF16; }

// K values a stage of the one-matrix tile (the pair's takes half): 64. Every stage is a round trip to memory that costs
// ~0.85 us whatever n is (dispatch.py, split-K), so wider stages mean fewer of them; its stages no longer fit twice in
// 48 KiB, so they take one buffer and a second barrier a stage, and a split whose span is not a multiple of 64 ends
// in a partial one (zeros past the span). Chosen on an H200 (2026-12-05, Qwen3-0.6B shape, Q4_K_M, engine bench and
// engine profile, interleaved against 32, two rounds each): pp512 41.5k -> 43.7k tok/s, pp128 25.9k -> 26.8k, pp16
// and pp64 unchanged, although gemm_q4_k takes 250 registers (sm_90) and so 2 blocks an SM instead of 3.
// -DGEMM_STAGE_K=32 builds the former width (two buffers, one barrier) for comparisons through scripts/variant.sh.
#ifndef GEMM_STAGE_K
#define GEMM_STAGE_K 64
#endif

template <int NW>  // weight matrices per tile: 1 (gemm) or 2 (gate and up)
struct Cfg {
    static constexpr int BK = GEMM_STAGE_K / NW;  // K values per stage
    static constexpr int LD = BK + 4;
    static constexpr int TILE = 64 * LD;            // floats of one operand tile
    static constexpr int STAGE = (1 + NW) * TILE;   // sA, then sW[0..NW)
    static constexpr int BUFS = 2 * STAGE * 4 <= 48 * 1024 ? 2 : 1;  // stage buffers: two where they fit
    static constexpr int SMEM = BUFS * STAGE;       // floats
    static constexpr int A_VECS = BM * BK / 4 / THREADS;    // float4s of A per thread per stage
    static constexpr int W_GROUPS = BN * BK / 8 / THREADS;  // load8 groups per matrix per thread per stage
    static_assert(A_VECS >= 1 && W_GROUPS >= 1, "stage too small for the block");
    static_assert(SMEM >= BM * CLD, "the output tile is staged over the stage buffers");
    static_assert(BK % 8 == 0 && BK >= 16, "a stage is whole 8-value groups of every thread's share");
    static_assert(BM * BK / 4 % THREADS == 0 && BN * BK / 8 % THREADS == 0, "every thread loads whole items");
    static_assert(SMEM * 4 <= 48 * 1024, "static shared memory");
    static_assert((TILE * 4) % 32 == 0 && (16 * LD * 4) % 32 == 0, "wmma pointers must be 32-byte aligned");
};

__device__ __forceinline__ float silu(float x) { return x / (1.f + expf(-x)); }  // exp overflow gives -0: right

template <bool TF32>
__device__ __forceinline__ float operand(float x) {
#if GEMM_TF32
    if constexpr (TF32) return nvcuda::wmma::__float_to_tf32(x);
#endif
    return x;
}

// One stage of operands in registers, between global and shared memory.
template <int T, int NW, bool TF32>
struct Stage {
    using C = Cfg<NW>;
    float4 a[C::A_VECS];
    float w[NW][C::W_GROUPS][8];

    // Values [k0, k0 + BK) of the tile's 64 tokens and 64 rows, those from k0 + lim on as zeros (lim < BK only in
    // the partial last stage of a wider stage; K - 4 and the row's last group stand in for what lies past K, and the
    // select leaves no branch in the loop). Item i of A is token i / (BK/4), float4 i % (BK/4) (consecutive lanes
    // read consecutive 16 bytes of a row); item i of W is row i / (BK/8), group i % (BK/8).
    __device__ __forceinline__ void load(const float* __restrict__ A, int K, int t0, int n,
                                         const uint8_t* const (&W)[NW], long long row_bytes, int r0, int R, int k0,
                                         int lim) {
        constexpr bool PARTIAL = C::BK > 32;  // a stage of 32 always lies whole inside a split's span
#pragma unroll
        for (int p = 0; p < C::A_VECS; ++p) {
            const int i = threadIdx.x + THREADS * p, tok = i / (C::BK / 4), c = i % (C::BK / 4);
            const long long t = min(t0 + tok, n - 1);
            if constexpr (PARTIAL) {
                const float4 v = __ldg(reinterpret_cast<const float4*>(A + t * K + min(k0 + 4 * c, K - 4)));
                a[p] = 4 * c < lim ? v : make_float4(0.f, 0.f, 0.f, 0.f);
            } else {
                a[p] = __ldg(reinterpret_cast<const float4*>(A + t * K + k0) + c);
            }
        }
#pragma unroll
        for (int p = 0; p < C::W_GROUPS; ++p) {
            const int i = threadIdx.x + THREADS * p, row = i / (C::BK / 8), j = i % (C::BK / 8);
            const long long r = min(r0 + row, R - 1);
#pragma unroll
            for (int m = 0; m < NW; ++m) {
                if constexpr (PARTIAL) {
                    q::Quant<T>::load8(W[m] + r * row_bytes, min((k0 >> 3) + j, (K >> 3) - 1), w[m][p]);
#pragma unroll
                    for (int e = 0; e < 8; ++e) w[m][p][e] = 8 * j < lim ? w[m][p][e] : 0.f;
                } else {
                    q::Quant<T>::load8(W[m] + r * row_bytes, (k0 >> 3) + j, w[m][p]);
                }
            }
        }
    }

    __device__ __forceinline__ void store(float* s) const {
#pragma unroll
        for (int p = 0; p < C::A_VECS; ++p) {
            const int i = threadIdx.x + THREADS * p, tok = i / (C::BK / 4), c = i % (C::BK / 4);
            const float4 v = a[p];
            *reinterpret_cast<float4*>(s + tok * C::LD + 4 * c) =
                make_float4(operand<TF32>(v.x), operand<TF32>(v.y), operand<TF32>(v.z), operand<TF32>(v.w));
        }
#pragma unroll
        for (int p = 0; p < C::W_GROUPS; ++p) {
            const int i = threadIdx.x + THREADS * p, row = i / (C::BK / 8), j = i % (C::BK / 8);
#pragma unroll
            for (int m = 0; m < NW; ++m) {
                const float* v = w[m][p];
                float4* d = reinterpret_cast<float4*>(s + (1 + m) * C::TILE + row * C::LD + 8 * j);
                if constexpr (C::BK > 32) {  // 8 groups a row: groups j and j + 4 of a quarter-warp share banks
                    const float4 lo = make_float4(operand<TF32>(v[0]), operand<TF32>(v[1]), operand<TF32>(v[2]),
                                                  operand<TF32>(v[3]));
                    const float4 hi = make_float4(operand<TF32>(v[4]), operand<TF32>(v[5]), operand<TF32>(v[6]),
                                                  operand<TF32>(v[7]));
                    const bool h = (j >> 2) & 1;  // so half of it stores its upper half first
                    d[h] = h ? hi : lo;
                    d[!h] = h ? lo : hi;
                } else {
                    d[0] = make_float4(operand<TF32>(v[0]), operand<TF32>(v[1]), operand<TF32>(v[2]),
                                       operand<TF32>(v[3]));
                    d[1] = make_float4(operand<TF32>(v[4]), operand<TF32>(v[5]), operand<TF32>(v[6]),
                                       operand<TF32>(v[7]));
                }
            }
        }
    }
};

// Exact float32 register tile: c[m][i][j] is token ty + 16 i, row tx + 8 j of matrix m.
template <int NW>
struct SimtAcc {
    using C = Cfg<NW>;
    float c[NW][4][8];

    __device__ __forceinline__ void zero() {
#pragma unroll
        for (int m = 0; m < NW; ++m)
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 8; ++j) c[m][i][j] = 0.f;
    }

    __device__ __forceinline__ void mma(const float* s) {
        const int tx = threadIdx.x & 7, ty = threadIdx.x >> 3;
#pragma unroll
        for (int kk = 0; kk < C::BK; kk += 4) {
            float4 a[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) a[i] = *reinterpret_cast<const float4*>(s + (ty + 16 * i) * C::LD + kk);
#pragma unroll
            for (int m = 0; m < NW; ++m)
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    const float4 w = *reinterpret_cast<const float4*>(s + (1 + m) * C::TILE + (tx + 8 * j) * C::LD + kk);
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        float& d = c[m][i][j];
                        d = fmaf(a[i].x, w.x, d);
                        d = fmaf(a[i].y, w.y, d);
                        d = fmaf(a[i].z, w.z, d);
                        d = fmaf(a[i].w, w.w, d);
                    }
                }
        }
    }

    __device__ __forceinline__ void stage_out(float* sC) const {
        const int tx = threadIdx.x & 7, ty = threadIdx.x >> 3;
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int j = 0; j < 8; ++j)
                sC[(ty + 16 * i) * CLD + tx + 8 * j] = NW == 2 ? silu(c[0][i][j]) * c[NW - 1][i][j] : c[0][i][j];
    }

    // Matrix m's sums alone (a split-K partial).
    __device__ __forceinline__ void stage_one(float* sC, int m) const {
        const int tx = threadIdx.x & 7, ty = threadIdx.x >> 3;
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int j = 0; j < 8; ++j) sC[(ty + 16 * i) * CLD + tx + 8 * j] = m ? c[NW - 1][i][j] : c[0][i][j];
    }
};

#if GEMM_TF32
namespace wmma = nvcuda::wmma;
using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, wmma::row_major>;
using FragB = wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, wmma::col_major>;

// wmma::load_matrix_sync takes a generic pointer, and the compiler keeps it generic (LD, not LDS): state the
// shared-memory form of the same wmma.load. p is 32-byte aligned, ld a multiple of 4 floats.
template <class Frag>
__device__ __forceinline__ void load_shared(Frag& f, const float* p, int ld) {
    static_assert(Frag::num_elements == 4, "tf32 m16n16k8 a/b fragments hold 4 elements");
    const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(p));
    unsigned r[4];
    if constexpr (std::is_same<Frag, FragA>::value)
        asm volatile("wmma.load.a.sync.aligned.row.m16n16k8.shared.tf32 {%0, %1, %2, %3}, [%4], %5;"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr), "r"(ld));
    else
        asm volatile("wmma.load.b.sync.aligned.col.m16n16k8.shared.tf32 {%0, %1, %2, %3}, [%4], %5;"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr), "r"(ld));
#pragma unroll
    for (int e = 0; e < 4; ++e) f.x[e] = __uint_as_float(r[e]);
}

// Tensor-core tile: warp (wm, wn) holds c[m][i][j] = tokens 32 wm + 16 i, rows 32 wn + 16 j (16 x 16 each).
template <int NW>
struct TcAcc {
    using C = Cfg<NW>;
    wmma::fragment<wmma::accumulator, 16, 16, 8, float> c[NW][2][2];

    __device__ __forceinline__ void zero() {
#pragma unroll
        for (int m = 0; m < NW; ++m)
#pragma unroll
            for (int i = 0; i < 2; ++i)
#pragma unroll
                for (int j = 0; j < 2; ++j) wmma::fill_fragment(c[m][i][j], 0.f);
    }

    __device__ __forceinline__ void mma(const float* s) {
        const int warp = threadIdx.x >> 5, wm = warp >> 1, wn = warp & 1;
        const float* sA = s + 32 * wm * C::LD;
#pragma unroll
        for (int kk = 0; kk < C::BK; kk += 8) {
            FragA a[2];
#pragma unroll
            for (int i = 0; i < 2; ++i) load_shared(a[i], sA + 16 * i * C::LD + kk, C::LD);
#pragma unroll
            for (int m = 0; m < NW; ++m) {
                const float* sW = s + (1 + m) * C::TILE + 32 * wn * C::LD;
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    FragB b;
                    load_shared(b, sW + 16 * j * C::LD + kk, C::LD);
#pragma unroll
                    for (int i = 0; i < 2; ++i) wmma::mma_sync(c[m][i][j], a[i], b, c[m][i][j]);
                }
            }
        }
    }

    // Gate and up fragments share one element mapping, so SwiGLU is elementwise on the fragments.
    __device__ __forceinline__ void stage_out(float* sC) {
        const int warp = threadIdx.x >> 5, wm = warp >> 1, wn = warp & 1;
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                if constexpr (NW == 2) {
#pragma unroll
                    for (int e = 0; e < c[0][i][j].num_elements; ++e)
                        c[0][i][j].x[e] = silu(c[0][i][j].x[e]) * c[1][i][j].x[e];
                }
                wmma::store_matrix_sync(sC + (32 * wm + 16 * i) * CLD + 32 * wn + 16 * j, c[0][i][j], CLD,
                                        wmma::mem_row_major);
            }
    }

    // Matrix m's sums alone (a split-K partial).
    __device__ __forceinline__ void stage_one(float* sC, int m) {
        const int warp = threadIdx.x >> 5, wm = warp >> 1, wn = warp & 1;
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int j = 0; j < 2; ++j)
                wmma::store_matrix_sync(sC + (32 * wm + 16 * i) * CLD + 32 * wn + 16 * j, m ? c[NW - 1][i][j] : c[0][i][j],
                                        CLD, wmma::mem_row_major);
    }
};
#endif

template <bool B, class X, class Y> struct Pick { using type = X; };
template <class X, class Y> struct Pick<false, X, Y> { using type = Y; };

// C[t0 + i, r0 + j] for i, j < 64 inside [n, R), from the staged tile; C = tile + resid where resid is given (it may
// be C itself: each element is read and then written by the same thread). Item i: token i / 16, float4 i % 16.
__device__ __forceinline__ void write_out(const float* sC, int t0, int n, int r0, int R, const float* resid, float* C) {
#pragma unroll
    for (int p = 0; p < BM * BN / 4 / THREADS; ++p) {
        const int i = threadIdx.x + THREADS * p, tok = i >> 4, c4 = 4 * (i & 15);
        const int t = t0 + tok, r = r0 + c4;
        if (t >= n || r >= R) continue;
        float4 v = *reinterpret_cast<const float4*>(sC + tok * CLD + c4);
        const long long o = (long long)t * R + r;
        if ((R & 3) == 0) {  // r % 4 == 0 and r < R: the whole float4 is in the row, 16-byte aligned
            if (resid) {
                const float4 q = *reinterpret_cast<const float4*>(resid + o);
                v.x += q.x, v.y += q.y, v.z += q.z, v.w += q.w;
            }
            *reinterpret_cast<float4*>(C + o) = v;
        } else {
            const float e[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int u = 0; u < 4; ++u)
                if (r + u < R) C[o + u] = resid ? e[u] + resid[o + u] : e[u];
        }
    }
}

// Split-K (gemm.cu with gridDim.z = S > 1): block z of tile (x, y) sums K values [z K / S, +K / S) and writes its
// raw 64 x 64 tile of each matrix to part[(z * NW + m) * tiles + tile][token][row]; the block that then takes the
// tile's last ticket sums the S partials in z order (so the result does not depend on which block came last),
// applies SwiGLU / the residual, writes C and zeroes the ticket for the next launch. tiles = gridDim.x * gridDim.y.
struct Split {
    float* part;   // [S * NW * tiles][64][64] f32
    int* tickets;  // [tiles], zero between launches
};

// The staged tile sC (over the stage buffers) to or from part's 64 x 64 slot p, as float4s (item i: token i / 16,
// float4 i % 16); from part through L2 only (__ldcg): the slots were written by other blocks.
__device__ __forceinline__ void tile_to(const float* sC, float* p) {
#pragma unroll
    for (int q = 0; q < BM * BN / 4 / THREADS; ++q) {
        const int i = threadIdx.x + THREADS * q, tok = i >> 4, c4 = 4 * (i & 15);
        *reinterpret_cast<float4*>(p + tok * BN + c4) = *reinterpret_cast<const float4*>(sC + tok * CLD + c4);
    }
}

template <int NW>
__device__ __forceinline__ void sum_partials(const float* part, int S, int tiles, int tile, float* sC) {
#pragma unroll
    for (int q = 0; q < BM * BN / 4 / THREADS; ++q) {
        const int i = threadIdx.x + THREADS * q, tok = i >> 4, c4 = 4 * (i & 15);
        float4 v[NW];
#pragma unroll
        for (int m = 0; m < NW; ++m) v[m] = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int z = 0; z < S; ++z)
#pragma unroll
            for (int m = 0; m < NW; ++m) {
                const float4 a = __ldcg(reinterpret_cast<const float4*>(part + ((long long)(z * NW + m) * tiles + tile)
                                                                                   * (BM * BN) + tok * BN + c4));
                v[m].x += a.x, v[m].y += a.y, v[m].z += a.z, v[m].w += a.w;
            }
        if constexpr (NW == 2)
            v[0] = make_float4(silu(v[0].x) * v[1].x, silu(v[0].y) * v[1].y, silu(v[0].z) * v[1].z,
                               silu(v[0].w) * v[1].w);
        *reinterpret_cast<float4*>(sC + tok * CLD + c4) = v[0];
    }
}

template <int T, int NW>
__device__ __forceinline__ void tile(const uint8_t* const (&W)[NW], long long row_bytes, int R, int K,
                                     const float* __restrict__ A, int n, const float* resid, float* C,
                                     Split split = {nullptr, nullptr}) {
    using Cf = Cfg<NW>;
    constexpr bool TC = GEMM_TF32 && !is_float_type(T);
#if GEMM_TF32
    using Acc = typename Pick<TC, TcAcc<NW>, SimtAcc<NW>>::type;
#else
    using Acc = SimtAcc<NW>;
#endif
    __shared__ __align__(128) float smem[Cf::SMEM];
    __shared__ int last;
    const int r0 = blockIdx.x * BN, t0 = blockIdx.y * BM;
    // span: a multiple of 32 (k_gemm.SPLIT_STEP); of BK only where a stage takes 32
    const int S = split.part ? int(gridDim.z) : 1, span = K / S, k0 = span * int(blockIdx.z);
    const int nk = GEMM_STAGE_K > 32 ? (span + Cf::BK - 1) / Cf::BK : span / Cf::BK;

    Stage<T, NW, TC> st;
    Acc acc;
    acc.zero();
    st.load(A, K, t0, n, W, row_bytes, r0, R, k0, span);
    st.store(smem);
    __syncthreads();
    for (int kt = 0; kt < nk; ++kt) {
        // The next stage; on the last pass the last one again (in bounds; with two buffers it lands in one no one
        // reads, with one it is stored after the barrier and never read).
        const int next = min(kt + 1, nk - 1) * Cf::BK;
        st.load(A, K, t0, n, W, row_bytes, r0, R, k0 + next, span - next);
        acc.mma(smem + (Cf::BUFS == 2 ? kt & 1 : 0) * Cf::STAGE);
        if constexpr (Cf::BUFS == 1) __syncthreads();  // every warp is done with the buffer before it is refilled
        st.store(smem + (Cf::BUFS == 2 ? (kt + 1) & 1 : 0) * Cf::STAGE);
        __syncthreads();
    }
    if (S == 1) {
        acc.stage_out(smem);  // sC over the stage buffers: the loop's last barrier ended every read of them
        __syncthreads();
        write_out(smem, t0, n, r0, R, resid, C);
        return;
    }
    const int tiles = gridDim.x * gridDim.y, tile = blockIdx.y * gridDim.x + blockIdx.x;
#pragma unroll
    for (int m = 0; m < NW; ++m) {
        acc.stage_one(smem, m);
        __syncthreads();
        tile_to(smem, split.part + ((long long)(blockIdx.z * NW + m) * tiles + tile) * (BM * BN));
        __syncthreads();
    }
    __threadfence();  // this block's partials are visible to whichever block takes the last ticket
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(split.tickets + tile, 1) == S - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    sum_partials<NW>(split.part, S, tiles, tile, smem);
    __syncthreads();
    write_out(smem, t0, n, r0, R, resid, C);
    if (threadIdx.x == 0) split.tickets[tile] = 0;
}

}  // namespace gemm

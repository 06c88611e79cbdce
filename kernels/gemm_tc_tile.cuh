// The pipelined TF32 tile that gemm_tc.cu's prefill GEMMs share (128 tokens x 64 weight rows, A by cp.async,
// fragments by ldmatrix, mma.sync), its output and its split-K: included by kernels/gemm_tc.cu only.
#pragma once
#include "stage.cuh"
#include "tf32.cuh"

namespace {

// v's bits rounded to tf32 (to nearest, ties away from zero): cvt.rna, the conversion gemm.cu's operands go through
// (nvcuda::wmma::__float_to_tf32). Not tf32.cuh's add-and-mask, which turns the GPU's NaN (0x7fffffff) into -0 and
// would hide a non-finite activation from the logits' check.
__device__ __forceinline__ uint32_t tf32_rna(uint32_t bits) {
    uint32_t r = bits;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(__uint_as_float(bits)));
#endif
    return r;
}
__device__ __forceinline__ float tf32_round(float v) { return __uint_as_float(tf32_rna(__float_as_uint(v))); }

// The tile. Block: 128 threads (4 warps; gemm_pipe's PIPE_WARPS makes it 8: Acc), tile BM = 128 tokens x BN = 64
// weight (or slab) rows, K in stages of BK = 32 values, NSTAGE stages in flight (gemm_dense; gemm_pipe keeps
// PIPE_STAGES of A). With 4 warps, warp (wm, wn) = (warp / 2, warp % 2) computes tokens 64 wm + [0, 64) x rows
// 32 wn + [0, 32): 4 x 4 m16n8k8 tiles, 64 accumulators a thread.
// Shared memory, a stage (floats, row stride LD = BK + 4 = 36: the 8 rows of an ldmatrix phase, 144 bytes apart, fall
// in distinct 16-byte bank groups):
//   sA[128][LD]  A[t0 + i, k0 + k]      sW[64][LD]  Wd[r0 + j, k0 + k]
// ldmatrix.x4 on 32-bit values: an 8 x 8 b16 matrix is 8 rows of 4 floats, and lane l gets the float at (l / 4, l % 4),
// which is the tf32 fragment element (g, q). A's four matrices are rows +0 / +8 at k +0 / +4 (a0..a3), W's two n-tiles
// at k +0 / +4 (b0, b1 of each). Tokens past n read token n - 1 and rows past Rs row Rs - 1: never written.
constexpr int BM = 128, BN = 64, BK = 32, LD = BK + 4, THREADS = 128;
constexpr int NSTAGE = 4;  // engine/cuda/k_gemm_tc.py's SMEM follows (tests/test_layout.py holds them together)
constexpr int STAGE_FLOATS = (BM + BN) * LD;
constexpr int CLD = BN + 8;  // the staged output tile sC[BM][CLD], over the stage buffers (72: stage_out's float2
                             // stores of rows g, g + 1 fall in distinct banks)
static_assert(NSTAGE >= 2 && NSTAGE * STAGE_FLOATS >= BM * CLD, "the output tile is staged over the stage buffers");

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void ldmatrix4(uint32_t (&r)[4], unsigned addr) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
#endif
}

__device__ __forceinline__ float silu(float x) { return x / (1.f + expf(-x)); }

// A's copies for the stage at k: its 128 x 32 values (8 granules of 16 bytes a thread of NT) into sA[BM][LD].
template <int NT = THREADS>
__device__ __forceinline__ void load_a(float* sA, const float* A, int K, int t0, int n, int k) {
#pragma unroll
    for (int p = 0; p < BM * BK / 4 / NT; ++p) {
        const int i = threadIdx.x + NT * p, row = i >> 3, c = i & 7;
        const long long t = min(t0 + row, n - 1);
        stage::copy16(reinterpret_cast<uint8_t*>(sA + row * LD + 4 * c),
                      reinterpret_cast<const uint8_t*>(A + t * K + k + 4 * c));
    }
}

// The dense kernel's stage at k: A's copies, and Wd's 64 x 32 (4 granules a thread) into the tile after sA.
__device__ __forceinline__ void load_stage(float* s, const float* A, int K, int t0, int n, const float* Wd, int Rs,
                                           int r0, int k) {
    load_a(s, A, K, t0, n, k);
#pragma unroll
    for (int p = 0; p < BN * BK / 4 / THREADS; ++p) {
        const int i = threadIdx.x + THREADS * p, row = i >> 3, c = i & 7;
        const long long r = min(r0 + row, Rs - 1);
        stage::copy16(reinterpret_cast<uint8_t*>(s + (BM + row) * LD + 4 * c),
                      reinterpret_cast<const uint8_t*>(Wd + r * K + k + 4 * c));
    }
}

// A block of NW warps (4, or 8: gemm_tc.cu's PIPE_WARPS), NW / 2 along the tokens and 2 along the rows: warp
// (wm, wn) = (warp / 2, warp % 2) takes tokens TM wm + [0, TM), TM = BM / (NW / 2), x rows 32 wn + [0, 32), as MI =
// TM / 16 m-tiles x 4 n-tiles (4 x 4 with 4 warps, 2 x 4 with 8). Each output's sum over K is one thread's, in k
// order, however many warps share the tile.
template <int NW = 4>
struct Acc {
    static constexpr int TM = BM / (NW / 2), MI = TM / 16;
    static_assert(NW == 4 || NW == 8, "4 or 8 warps a block");
    float d[MI][4][4];  // [m-tile][n-tile][fragment element]

    __device__ __forceinline__ void zero() {
#pragma unroll
        for (int i = 0; i < MI; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) d[i][j][e] = 0.f;
    }

    // The 4 k8 steps of a stage: A's tile sA[BM][LD], W's (tf32 already) sW[BN][LD], in shared memory. A's 16
    // cvt.rna a warp's k8 step (beside its 16 mma) are not what bounds the tile: on an H200 (2026-12-05, the
    // Qwen3-0.6B shape, a measurement-only build without them, the tensor cores truncating A) the prefill step took
    // 10.08 -> 9.78 ms at 512 tokens and 7.11 -> 6.89 at 256. Nsight Compute (same day, 512 tokens): gemm_pipe_q4_k
    // 51 us, an instruction issued every ~3 cycles a scheduler, 10 % achieved occupancy (one 4-warp block an SM, a
    // warp a scheduler): latency, which more warps an SM would hide.
    __device__ __forceinline__ void mma_stage(const float* sA, const float* sW) {
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, wm = warp >> 1, wn = warp & 1, mi = lane >> 3;
        // this lane's row address for the ldmatrix of A's m-tile 0 and of W's n-tiles (0, 1), at k step 0
        const float* a0 = sA + (TM * wm + (lane & 7) + 8 * (mi & 1)) * LD + 4 * (mi >> 1);
        const float* w0 = sW + (32 * wn + 8 * (mi >> 1) + (lane & 7)) * LD + 4 * (mi & 1);
#pragma unroll
        for (int kk = 0; kk < BK; kk += 8) {
            uint32_t a[MI][4], b[4][2];
#pragma unroll
            for (int i = 0; i < MI; ++i) {
                ldmatrix4(a[i], smem_addr(a0 + 16 * i * LD + kk));
#pragma unroll
                for (int e = 0; e < 4; ++e) a[i][e] = tf32_rna(a[i][e]);
            }
#pragma unroll
            for (int j = 0; j < 4; j += 2) {
                uint32_t r[4];
                ldmatrix4(r, smem_addr(w0 + 8 * j * LD + kk));
                b[j][0] = r[0], b[j][1] = r[1], b[j + 1][0] = r[2], b[j + 1][1] = r[3];
            }
#pragma unroll
            for (int i = 0; i < MI; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) mma_tf32(d[i][j], a[i], b[j][0], b[j][1]);
        }
    }

    // The tile into sC[BM][CLD]: element e of (i, j) is token TM wm + 16 i + g (+ 8 for e >= 2), row 32 wn + 8 j + 2q
    // (+ 1 for odd e).
    __device__ __forceinline__ void stage_out(float* sC) const {
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, wm = warp >> 1, wn = warp & 1;
        const int g = lane >> 2, q = lane & 3;
#pragma unroll
        for (int i = 0; i < MI; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                float* p = sC + (TM * wm + 16 * i + g) * CLD + 32 * wn + 8 * j + 2 * q;
                *reinterpret_cast<float2*>(p) = make_float2(d[i][j][0], d[i][j][1]);
                *reinterpret_cast<float2*>(p + 8 * CLD) = make_float2(d[i][j][2], d[i][j][3]);
            }
    }
};

// Where output columns go: global column c (c0 + a slab row of one matrix, or an output of a pair) of segment m,
// [e(m-1), e(m)) with e(-1) = 0, is Cm[t, c - e(m-1)], rows e(m) - e(m-1) apart. One matrix: one segment (e0 = e1 =
// e2 = R); q/k/v in one slab: three.
struct Out {
    float *C0, *C1, *C2;
    int e0, e1, e2;

    // Column c's segment: its array, first column and end (selects, not indexing: no local memory).
    __device__ __forceinline__ void seg(int c, float*& C, int& s, int& e) const {
        const bool a = c < e0, b = c < e1;
        C = a ? C0 : b ? C1 : C2;
        s = a ? 0 : b ? e0 : e1;
        e = a ? e0 : b ? e1 : e2;
    }
    __device__ __forceinline__ float* at(int t, int c) const {
        float* C;
        int s, e;
        seg(c, C, s, e);
        return C + (long long)t * (e - s) + (c - s);
    }
    // Columns c .. c + 3 in one segment, at a 16-byte aligned place of it (C0..C2 are).
    __device__ __forceinline__ bool vec4(int c) const {
        float* C;
        int s, e;
        seg(c, C, s, e);
        return c + 4 <= e && (((e - s) | (c - s)) & 3) == 0;
    }
};

// The staged tile sC to the output: one matrix, column c0 + r0 + j (+ resid, laid out as segment 0) for j < 64 within
// `cols`; a pair, column c0 + r0 / 2 + j = silu(sC[.][j]) * sC[.][32 + j] for j < 32 within `cols`. NT threads.
template <int NT = THREADS>
__device__ __forceinline__ void write_out(const float* sC, int t0, int n, int r0, int cols, int pair,
                                          const float* resid, const Out& out, int c0) {
    const int per = pair ? BN / 2 : BN, o0 = pair ? r0 >> 1 : r0;  // outputs a tile row, the tile's first
#pragma unroll 4
    for (int p = 0; p < BM * (BN / 2) / 4 / NT * (pair ? 1 : 2); ++p) {
        const int i = threadIdx.x + NT * p, tok = i / (per / 4), c4 = 4 * (i % (per / 4));
        const int t = t0 + tok, r = o0 + c4;
        if (t >= n || r >= cols) continue;
        const float4 g = *reinterpret_cast<const float4*>(sC + tok * CLD + c4);
        float e[4] = {g.x, g.y, g.z, g.w};
        if (pair) {
            const float4 u = *reinterpret_cast<const float4*>(sC + tok * CLD + 32 + c4);
            e[0] = silu(g.x) * u.x, e[1] = silu(g.y) * u.y, e[2] = silu(g.z) * u.z, e[3] = silu(g.w) * u.w;
        }
        const int c = c0 + r;
        if (r + 4 <= cols && out.vec4(c)) {
            float4 v = make_float4(e[0], e[1], e[2], e[3]);
            if (resid) {
                const float4 q = *reinterpret_cast<const float4*>(resid + (long long)t * out.e0 + c);
                v.x += q.x, v.y += q.y, v.z += q.z, v.w += q.w;
            }
            *reinterpret_cast<float4*>(out.at(t, c)) = v;
        } else {
#pragma unroll
            for (int u = 0; u < 4; ++u)
                if (r + u < cols) *out.at(t, c + u) = resid ? e[u] + resid[(long long)t * out.e0 + c + u] : e[u];
        }
    }
}

// After the K loop (every stage buffer free): the tile to the output, or, split, to its partial slot, and the
// tile's last block (its ticket, `last` in shared memory) sums the partials in z order and writes the output.
template <int NW>
__device__ __forceinline__ void finish(const Acc<NW>& acc, float* smem, int* last, int t0, int n, int r0, int cols,
                                       int pair, const float* resid, const Out& out, int c0, float* part,
                                       int* tickets) {
    constexpr int NT = 32 * NW;
    acc.stage_out(smem);
    __syncthreads();
    const int S = gridDim.z;
    if (S == 1) {
        write_out<NT>(smem, t0, n, r0, cols, pair, resid, out, c0);
        return;
    }
    const int tiles = gridDim.x * gridDim.y, tile = blockIdx.y * gridDim.x + blockIdx.x;
    float* mine = part + ((long long)blockIdx.z * tiles + tile) * (BM * BN);
    for (int i = threadIdx.x; i < BM * BN / 4; i += NT) {
        const int tok = i >> 4, c4 = 4 * (i & 15);
        *reinterpret_cast<float4*>(mine + tok * BN + c4) = *reinterpret_cast<const float4*>(smem + tok * CLD + c4);
    }
    __threadfence();  // this block's partial is visible to whichever block takes the last ticket
    __syncthreads();
    if (threadIdx.x == 0) *last = atomicAdd(tickets + tile, 1) == S - 1;
    __syncthreads();
    if (!*last) return;
    __threadfence();
    for (int i = threadIdx.x; i < BM * BN / 4; i += NT) {
        const int tok = i >> 4, c4 = 4 * (i & 15);
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int z = 0; z < S; ++z) {  // z order: the sum does not depend on which block came last
            const float4 a = __ldcg(reinterpret_cast<const float4*>(part + ((long long)z * tiles + tile) * (BM * BN)
                                                                     + tok * BN + c4));
            v.x += a.x, v.y += a.y, v.z += a.z, v.w += a.w;
        }
        *reinterpret_cast<float4*>(smem + tok * CLD + c4) = v;
    }
    __syncthreads();
    write_out<NT>(smem, t0, n, r0, cols, pair, resid, out, c0);
    if (threadIdx.x == 0) tickets[tile] = 0;  // for the next launch
}

}  // namespace

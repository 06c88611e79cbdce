// Expert matvecs for decode and small batches (n <= 8 tokens), straight from the GGUF expert stacks: every block
// reads its expert id from device memory, so one launch covers all chosen experts of all tokens and a decode step
// stays one CUDA graph. Contract: kernels/README.md, "moe.cu". Kernels: moe.cu.
//
// A stack of E experts holds expert e's R x K matrix at W + e * expert_bytes (expert_bytes = R * row_bytes). Blocks
// of 256 threads = 8 warps. Every sum has a fixed order, so results do not depend on scheduling (no float atomics).
//
// gate_up: item p = blockIdx.y is slot p % k of token p / k; y[p] = silu(Wg_e . x) * (Wu_e . x), or Wg_e . x alone
//   when Wu is null (gate and up of different types: two launches and a SwiGLU). A block is matvec_block.cuh's, on
//   rows [8 * blockIdx.x, +8) of expert e's matrices (the threads split K; rows staged where that measured faster).
//   With a shared expert of the experts' type whose width is `parts` times theirs, items past n_items are its SwiGLU
//   in parts of R rows (hs[t] = silu(Sg . x[t]) * (Su . x[t])): one launch instead of a second for it.
//   A 16-bit form with 16 rows of gate and of up a block, all 32 staged at once (45.5 KiB, 3 blocks an SM: one wave
//   of 384 blocks on the 30B-A3B shape), measured on an H200 (2026-12-02, 4-layer profiles): 11.7 -> 11.4 us a
//   launch there, but the decode step 0.367 -> 0.370 ms (the expert down behind it could no longer start early beside
//   its shared memory), and 18.7 -> 19.5 us on DeepSeek-V2-Lite's shape. Not kept.
// down: block (row block, token t) sums the token's k slots in slot order, weighted, plus the optional shared
//   expert (times its gate), into the residual: x[t] += sum_j w_j * (W_{e_j} . h[t*k + j]) + g_t * shared[t].
//   A row's (slot, group) pairs are split over DOWN_WPR warps in contiguous quarters (each lane-strided), and the
//   quarters' sums are added in order: an output row has only K / 8 groups a slot, so one warp a row would leave an
//   SM with too few loads in flight (R / 8 blocks of 8 warps: 256 blocks for R = 2048 on 132 SMs). Its lanes stride
//   over groups (a warp reads one K-quant super-block, or 8 blocks of 32, a step), the loop unrolled by 2. Staging its
//   rows through shared memory, in passes a warp, measured slower on the H200 (12.2 -> 14.0 us, 30B-A3B shape).
//   Each routed item's gate_up blocks asking for an equal share of its expert's down matrix in L2 (one
//   cp.async.bulk.prefetch.L2 a block) measured slower on an H200 (2026-12-04): 4-layer steps 0.3529 -> 0.3551 ms
//   (30B-A3B shape) and 0.4230 -> 0.4278 (DeepSeek-V2-Lite), full 30B-A3B decode 354 -> 350 tok/s; gate_up took
//   the extra traffic (11.8 -> 12.2 us) and down did not get faster. Not kept.
// down_staged's grid pulling the next layer's q/k/v into L2 before its wait (its own rows wait on the experts' outputs;
// matvec3's 640 blocks cannot be resident beside it to prefetch their own) measured no faster on an H200 (2026-12-04,
// 4-layer 30B-A3B shape, two rounds): steps 0.3264 / 0.3257 ms without, 0.3250 / 0.3260 with; down took the extra
// reads (7.9-8.5 -> 9.0-9.2 us a launch) and matvec3 still cost ~11 us inside the step. Not kept.
// The 16-bit forms (gate_up<T, true>, down<T, true>; quant_i16.cuh's types): gate_up rounds x to 16 bits a group of 8
// and dots in integers; its SwiGLU outputs, 8 rows of a block being one group, go out rounded the same way (int16
// values and a Meta a group), which down reads in place of the float h.
#pragma once
#include <math.h>
#include <stdint.h>

#include "common.cuh"
#include "matvec_block.cuh"
#include "moe_route.cuh"  // MAX_K
#include "quant.cuh"
#include "quant_dot.cuh"
#include "quant_i16.cuh"
#include "stage.cuh"

namespace moe {

constexpr int MV_THREADS = mv::THREADS;  // gate_up runs matvec_block
constexpr int DOWN_WPR = 4, DOWN_ROWS = MV_THREADS / 32 / DOWN_WPR;  // down: 4 warps a row, 2 rows a block

template <int T, bool I16 = false>
__device__ __forceinline__ void gate_up(const uint8_t* __restrict__ Wg, const uint8_t* __restrict__ Wu,
                                        long long row_bytes, long long expert_bytes, int R, int K,
                                        const float* __restrict__ x, const int* __restrict__ ids, int k,
                                        float* __restrict__ y, int n_items, const uint8_t* __restrict__ Sg,
                                        const uint8_t* __restrict__ Su, int parts, float* __restrict__ hs,
                                        int16_t* __restrict__ yq = nullptr, q16::Meta* __restrict__ ym = nullptr) {
    const int p = blockIdx.y;
    __shared__ __align__(16) uint8_t buf[mv::STAGE_BYTES<T, 2>];  // either branch's staging
    // Item p's rows as byte offsets from Wg and Wu (the shared expert's too, so that one call site decodes every
    // item: a second one for it made ptxas spill moe_gate_up_q6_k on sm_100), its token and its output.
    long long og, ou;
    int t;
    float* yp;
    int16_t* qp = nullptr;  // I16: the experts' outputs go out as 16-bit groups (the shared expert's stay float)
    q16::Meta* mp = nullptr;
    if (p >= n_items) {  // the shared expert in parts of R rows (Wu is given): part q % parts of token q / parts
        const int q = p - n_items;
        t = q / parts;
        const long long part = (long long)(q - t * parts) * R * row_bytes;
        og = (long long)(reinterpret_cast<uintptr_t>(Sg) - reinterpret_cast<uintptr_t>(Wg)) + part;
        ou = (long long)(reinterpret_cast<uintptr_t>(Su) - reinterpret_cast<uintptr_t>(Wu)) + part;
        yp = hs + (long long)q * R;
    } else {
        og = ou = ids[p] * expert_bytes;
        t = p / k;
        yp = y + (long long)p * R;
        if (I16) qp = yq + (long long)p * R, mp = ym + (long long)p * (R >> 3);
    }
    const float* xt = x + (long long)t * K;
    if (Wu)
        mv::matvec_block_in<T, 1, 2, I16>(Wg + og, Wu + ou, row_bytes, R, K, xt, 1, nullptr, 0.f, nullptr, yp, buf,
                                          -1, qp, mp);
    else if constexpr (!I16)
        mv::matvec_block_in<T, 1, 1>(Wg + og, Wg + og, row_bytes, R, K, xt, 1, nullptr, 0.f, nullptr, yp, buf, -1);
}

// I16: h is given as hq and hm (gate_up<T, true>'s 16-bit groups), h itself unused.
template <int T, bool I16 = false>
__device__ __forceinline__ void down(const uint8_t* __restrict__ W, long long row_bytes, long long expert_bytes, int R,
                                     int K, const float* __restrict__ h, const int* __restrict__ ids,
                                     const float* __restrict__ w, int k, const float* __restrict__ shared,
                                     const float* __restrict__ sgate, float* x, const int16_t* __restrict__ hq = nullptr,
                                     const q16::Meta* __restrict__ hm = nullptr) {
    __shared__ long long eoff[MAX_K];         // byte offset of each slot's expert in the stack
    __shared__ float wt[MAX_K];               // each slot's weight
    __shared__ float part[MV_THREADS / 32];   // each warp's share of its row
    const int t = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int r = blockIdx.x * DOWN_ROWS + warp / DOWN_WPR, quarter = warp % DOWN_WPR;
    if (threadIdx.x < k) {
        eoff[threadIdx.x] = ids[(long long)t * k + threadIdx.x] * expert_bytes;
        wt[threadIdx.x] = w[(long long)t * k + threadIdx.x];
    }
    __syncthreads();
    // Lane steps run over the quarter's (slot, group) pairs, slot-major: one long loop keeps several loads in flight
    // even when a slot has only a few groups per lane.
    const int G = K >> 3, total = k * G, lo = quarter * total / DOWN_WPR, hi = (quarter + 1) * total / DOWN_WPR;
    const uint8_t* Wr = W + min(r, R - 1) * row_bytes;  // rows past R (last block) compute row R - 1, never written
    const long long item0 = (long long)t * k;  // the token's first item
    float acc = 0.f;
#pragma unroll 2
    for (int i = lo + lane; i < hi; i += 32) {
        const int j = i / G, q = i - j * G;
        float d = 0.f;
        if constexpr (I16) {
            const q16::Group a = q16::load(hq + (item0 + j) * K + 8 * q, hm + (item0 + j) * G + q);
            d = a.s * q16::dot8<T>(Wr + eoff[j], q, a);
        } else {
            float hv[1][8], hs[1];  // quant_dot.cuh: the split form where the type has one
            cm::load8f(h + (item0 + j) * K + 8 * q, hv[0]);
            q::xsums<T, 1>(hv, hs);
            q::dot8_acc<T, 1>(Wr + eoff[j], q, hv, hs, &d);
        }
        acc = fmaf(wt[j], d, acc);
    }
    acc = cm::warp_sum(acc);
    if (lane == 0) part[warp] = acc;
    __syncthreads();
    const int row = blockIdx.x * DOWN_ROWS + threadIdx.x;
    if (threadIdx.x < DOWN_ROWS && row < R) {
        float s = part[threadIdx.x * DOWN_WPR];
#pragma unroll
        for (int p = 1; p < DOWN_WPR; ++p) s += part[threadIdx.x * DOWN_WPR + p];
        const long long o = (long long)t * R + row;
        if (shared) s += (sgate ? sgate[t] : 1.f) * shared[o];
        x[o] += s;
    }
}

// down_staged: down's sum (I16 only) with the block's rows staged, for decode: block (row block, token t) computes
// rows [8 * blockIdx.x, +8). Its 8 rows of each of the token's k experts are copied into shared memory at once
// (stage.cuh: one DRAM round trip a block, 8 * k rows of at most STAGED_DOWN_BYTES / 64 bytes for k = 8), while each
// thread loads the 16-bit h groups of its (slot, group) pairs p = tid + 256 u (u < STAGED_DOWN_PAIRS); each pair then
// meets all 8 rows there. The 8 sums go through a warp reduce-scatter and then the 8 warps in order: a fixed order, as
// down's. Sized so that two blocks fit an SM. down reads its rows in small loads from global memory, a few in flight
// a lane: on an H200 (30B-A3B shape, 4-layer profile) down_staged took 7.6 us a launch for Q4_K rows and 8.2 for
// Q6_K, down 12.0 and 12.6; the decode step 0.3952 -> 0.3757 ms. Q4_K rows take the sub-block form (quant_i16.cuh,
// dot32): 7.65 -> 7.04 us on an H200 (2026-12-04).
constexpr int STAGED_DOWN_ROWS = 8, STAGED_DOWN_BYTES = 43008, STAGED_DOWN_PAIRS = 4;

template <int T>
__device__ __forceinline__ void down_staged(const uint8_t* W, long long row_bytes, long long expert_bytes, int R,
                                            int K, const int* ids, const float* w, int k, const float* shared,
                                            const float* sgate, float* x, const int16_t* hq,
                                            const q16::Meta* hm) {
    constexpr int ROWS = STAGED_DOWN_ROWS, NP = STAGED_DOWN_PAIRS;
    __shared__ __align__(16) uint8_t buf[STAGED_DOWN_BYTES];  // staged row (r, j) at (r * k + j) * pitch
    __shared__ long long eoff[MAX_K];                          // byte offset of each slot's expert in the stack
    __shared__ float wt[MAX_K];                                // each slot's weight
    __shared__ float red[MV_THREADS / 32][ROWS];               // each warp's sums
    const int t = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, r0 = blockIdx.x * ROWS;
    if (tid < k) {
        eoff[tid] = ids[(long long)t * k + tid] * expert_bytes;
        wt[tid] = w[(long long)t * k + tid];
    }
    __syncthreads();
    const int nb = int(row_bytes), P = stage::pitch(nb), NG = P / 16;  // a staged row's bytes, pitch, granules
    // Row r of slot j's expert, staged at buf + (r * k + j) * P (rows past R: row R - 1, never written).
    auto src = [&](int r, int j) { return W + eoff[j] + (long long)min(r0 + r, R - 1) * row_bytes; };
    for (int i = tid; i < ROWS * k * NG; i += MV_THREADS) {
        const int s = i / NG, r = s / k;
        stage::granule(buf + s * P, src(r, s - r * k), nb, i - s * NG);
    }
    const int G = K >> 3;
    const long long item0 = (long long)t * k;  // the token's first item
    float acc[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) acc[r] = 0.f;
    if constexpr (q16::SUB<T>) {
        // The sub-block form (quant_i16.cuh, dot32): thread u < k * K / 32 takes sub-block u % (K / 32) of slot
        // u / (K / 32) (k * K / 8 <= NP * 256 groups, k_moe.staged_down: a thread for each), its 4 groups of h
        // loaded beside the copies, against each of the 8 rows.
        const int SB = K >> 5, j = min(tid / SB, k - 1), sb = tid % SB;
        q16::Group a[4];
#pragma unroll
        for (int i = 0; i < 4; ++i)
            a[i] = q16::load(hq + (item0 + j) * K + 8 * (4 * sb + i), hm + (item0 + j) * G + 4 * sb + i);
        stage::wait();
        __syncthreads();
        if (tid < k * SB) {
            const float xs = q16::sub_xs(a), ws = wt[j];
#pragma unroll
            for (int r = 0; r < ROWS; ++r)
                acc[r] = ws * q16::dot32<T>(stage::landed(buf + (r * k + j) * P, src(r, j)), sb, a, xs);
        }
    } else {
        const int total = k * G;
        q16::Group a[NP];
#pragma unroll
        for (int u = 0; u < NP; ++u) {  // in flight beside the copies
            const int p = min(tid + MV_THREADS * u, total - 1), j = p / G, g = p - j * G;
            a[u] = q16::load(hq + (item0 + j) * K + 8 * g, hm + (item0 + j) * G + g);
        }
        stage::wait();
        __syncthreads();
#pragma unroll
        for (int u = 0; u < NP; ++u) {
            const int p = tid + MV_THREADS * u;
            if (p < total) {
                const int j = p / G, g = p - j * G;
                const float ws = wt[j] * a[u].s;
#pragma unroll
                for (int r = 0; r < ROWS; ++r) {
                    const uint8_t* rp = stage::landed(buf + (r * k + j) * P, src(r, j));
                    acc[r] = fmaf(ws, q16::dot8<T>(rp, g, a[u]), acc[r]);
                }
            }
        }
    }
    cm::warp_reduce_scatter(acc);  // lane L: the warp's total of row L / 4
    if (lane % (32 / ROWS) == 0) red[warp][lane / (32 / ROWS)] = acc[0];
    __syncthreads();
    const int row = r0 + tid;
    if (tid < ROWS && row < R) {
        float s = red[0][tid];
#pragma unroll
        for (int v = 1; v < MV_THREADS / 32; ++v) s += red[v][tid];
        const long long o = (long long)t * R + row;
        if (shared) s += (sgate ? sgate[t] : 1.f) * shared[o];
        x[o] += s;
    }
}

}  // namespace moe

// matvec_stream: one token through a tall matrix (the LM head: R in the hundred thousands, K <= 2048), for matvec.cu.
//
// The block matvec (matvec_block.cuh) reaches 1.0-1.5 TB/s on such a matrix on the H200: each block reads its 8 rows
// once, and then has nothing in flight while it decodes and reduces them. Here every warp streams ROWS consecutive
// rows through a ring of STAGES row buffers in shared memory (stage.cuh, one cp.async group a row): while it decodes
// row i there, rows i + 1 .. i + STAGES - 1 are on their way. x (times norm_w) stays in registers for all the rows:
// lane l holds groups l, l + 32, ... (at most MAXG: K <= 2048), with the split form's x sums (quant_dot.cuh).
// A row's sum: each lane's groups in order, then the warp sum. Rows past R are neither read nor written.
// Measured on the H200 (scripts/stream_bench.py): the time does not follow the bytes (Q8_0, Q4_K and Q6_K rows of
// 2048 took 136-137 us for 151936 rows) but the registers: with 4 groups a lane instead of 8 (63 registers, not ~100)
// 1024-wide rows went 92 -> 79 us. Neither more rows a warp, a deeper ring, nor 2 or 8 warps a block helped.
// I16 (q16::HAS types): x times norm_w rounded to 16 bits a group of 8 (quant_i16.cuh) once, before the rows, and
// each group's dot in integers: 4 __dp2a for 8 products instead of 8 conversions and 8 fma, and 6 registers a group
// of x instead of 9.
// best (greedy decoding, else null): each warp's best row as an argmax key (argmax_key.cuh), folded into *best with
// one atomicMax a warp, so that the argmax after the head reads one slot instead of the whole row of logits.
#pragma once
#include "argmax_key.cuh"
#include "common.cuh"
#include "pdl.cuh"
#include "quant.cuh"
#include "quant_dot.cuh"
#include "quant_i16.cuh"
#include "stage.cuh"

namespace mvs {

constexpr int WARPS = 4, ROWS = 16, STAGES = 4, MAXG = 8;  // a block: 4 warps, 16 rows each, 4 rows a warp in flight
constexpr int THREADS = 32 * WARPS, BLOCK_ROWS = WARPS * ROWS, MAX_K = 32 * MAXG * 8;

template <int T, int MG>
constexpr int PITCH = stage::pitch(32 * MG * 8 / q::Quant<T>::QK * q::Quant<T>::BYTES);  // a row buffer, K <= 256 MG

// y[r] = (resid[r] +) s * W[r] . (x * norm_w), s = rsqrt(mean(x^2) + eps) when norm_w, else 1.
// (NW warps a block, NR rows a warp, NS buffers a warp, MG groups a lane: the defaults above; I16: the integer dots.)
template <int T, int NW = WARPS, int NR = ROWS, int NS = STAGES, int MG = MAXG, bool I16 = false>
__device__ __forceinline__ void matvec_stream(const uint8_t* __restrict__ W, long long row_bytes, int R, int K,
                                              const float* __restrict__ x, const float* __restrict__ norm_w, float eps,
                                              const float* resid, float* y, unsigned long long* best) {
    constexpr int WARPS = NW, ROWS = NR, STAGES = NS, MAXG = MG;
    __shared__ __align__(16) uint8_t ring[WARPS][STAGES][PITCH<T, MAXG>];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, G = K >> 3;
    const int r0 = (blockIdx.x * WARPS + warp) * ROWS, nr = min(ROWS, R - r0);  // this warp's rows
    if (nr <= 0) return;  // warp-uniform; no block barrier below
    const int nb = int(row_bytes);
    uint8_t(*buf)[PITCH<T, MAXG>] = ring[warp];
#pragma unroll
    for (int i = 0; i < STAGES - 1; ++i) {
        if (i < nr) stage::span_warp(buf[i], W + (long long)(r0 + i) * row_bytes, nb, lane);
        stage::commit();
    }
    pdl::wait();  // the weight rows are on their way; x is the kernel before's output (pdl.cuh)

    float xv[MAXG][1][8], xs[MAXG][1], ss = 0.f;  // groups lane + 32 j of x (times norm_w); 0 past K
    q16::Group xq[I16 ? MAXG : 1];                 // I16: those groups rounded
#pragma unroll
    for (int j = 0; j < MAXG; ++j) {
        const int g = lane + 32 * j;
        if (g < G) {
            cm::load8f(x + 8 * g, xv[j][0]);
            if (norm_w) {
                float nw[8];
                cm::load8f(norm_w + 8 * g, nw);
#pragma unroll
                for (int k = 0; k < 8; ++k) ss = fmaf(xv[j][0][k], xv[j][0][k], ss), xv[j][0][k] *= nw[k];
            }
        } else {
#pragma unroll
            for (int k = 0; k < 8; ++k) xv[j][0][k] = 0.f;
        }
        if constexpr (I16) xq[j] = q16::quantize8(xv[j][0]);
        else q::xsums<T, 1>(xv[j], xs[j]);
    }
    const float s = norm_w ? rsqrtf(cm::warp_sum(ss) / float(K) + eps) : 1.f;

    amk::u64 bk = amk::EMPTY;  // lane 0: the best of this warp's rows so far, with best
    for (int i = 0; i < nr; ++i) {
        const int ahead = i + STAGES - 1;
        if (ahead < nr) stage::span_warp(buf[ahead % STAGES], W + (long long)(r0 + ahead) * row_bytes, nb, lane);
        stage::commit();
        stage::wait_pending<STAGES - 1>();  // row i's group has landed
        __syncwarp();
        const uint8_t* rp = stage::landed(buf[i % STAGES], W + (long long)(r0 + i) * row_bytes);
        float acc = 0.f;
#pragma unroll
        for (int j = 0; j < MAXG; ++j)
            if (lane + 32 * j < G) {
                if constexpr (I16) acc = fmaf(xq[j].s, q16::dot8<T>(rp, lane + 32 * j, xq[j]), acc);
                else q::dot8_acc<T, 1>(rp, lane + 32 * j, xv[j], xs[j], &acc);
            }
        acc = cm::warp_sum(acc);
        if (lane == 0) {
            const int r = r0 + i;
            const float v = resid ? resid[r] + s * acc : s * acc;
            y[r] = v;  // resid may be y: this lane alone reads and writes y[r]
            if (best) bk = max(bk, amk::key(v, r));
        }
        __syncwarp();  // every lane is done with buf[i % STAGES] before row i + STAGES is copied there
    }
    if (best && lane == 0) atomicMax(best, bk);
}

}  // namespace mvs

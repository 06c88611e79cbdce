// Shapes of matvec_stream (kernels/matvec_stream.cuh) side by side, for scripts/stream_bench.py: warps a block, rows a
// warp, ring depth, groups a lane. Built by that script with nvcc, never by the engine.
#include "pdl.cuh"
#include "matvec_stream.cuh"

#define VARIANT(name, T, NW, NR, NS, MG, I16)                                                                       \
    extern "C" __global__ void __launch_bounds__(32 * NW)                                                           \
        name(const uint8_t* W, long long row_bytes, int R, int K, const float* x, const float* norm_w, float eps,   \
             const float* resid, float* y) {                                                                        \
        pdl::begin();                                                                                               \
        mvs::matvec_stream<T, NW, NR, NS, MG, I16>(W, row_bytes, R, K, x, norm_w, eps, resid, y, nullptr);         \
    }

VARIANT(q6_w4_r16_s4_g8, q::Q6_K, 4, 16, 4, 8, false)
VARIANT(q6_w4_r32_s4_g8, q::Q6_K, 4, 32, 4, 8, false)
VARIANT(q6_w4_r16_s6_g8, q::Q6_K, 4, 16, 6, 8, false)
VARIANT(q6_w4_r16_s3_g8, q::Q6_K, 4, 16, 3, 8, false)
VARIANT(q6_w2_r32_s4_g8, q::Q6_K, 2, 32, 4, 8, false)
VARIANT(q6_w4_r8_s4_g8, q::Q6_K, 4, 8, 4, 8, false)
VARIANT(q6_w4_r16_s4_g4, q::Q6_K, 4, 16, 4, 4, false)
VARIANT(q6_w4_r32_s6_g4, q::Q6_K, 4, 32, 6, 4, false)
VARIANT(q6_w8_r16_s6_g4, q::Q6_K, 8, 16, 6, 4, false)
VARIANT(q8_w4_r16_s4_g8, q::Q8_0, 4, 16, 4, 8, false)
VARIANT(q4_w4_r16_s4_g8, q::Q4_K, 4, 16, 4, 8, false)
// I16 (the integer dots, quant_i16.cuh)
VARIANT(q6_w4_r16_s4_g8_i16, q::Q6_K, 4, 16, 4, 8, true)
VARIANT(q6_w4_r16_s4_g4_i16, q::Q6_K, 4, 16, 4, 4, true)
// One wave at 151,936 rows (9 blocks an SM at 55 registers, 132 SMs): H100, 2026-12-05, 30 repeats, 70.5 us
// against r16's 69.3 (two full waves). The wave count is not what bounds the head.
VARIANT(q6_w4_r32_s4_g4_i16, q::Q6_K, 4, 32, 4, 4, true)
VARIANT(q6_w8_r16_s3_g8_i16, q::Q6_K, 8, 16, 3, 8, true)
VARIANT(q6_w4_r16_s6_g8_i16, q::Q6_K, 4, 16, 6, 8, true)
VARIANT(q6_w4_r32_s4_g8_i16, q::Q6_K, 4, 32, 4, 8, true)
VARIANT(q6_w4_r8_s4_g8_i16, q::Q6_K, 4, 8, 4, 8, true)
VARIANT(q6_w8_r16_s6_g4_i16, q::Q6_K, 8, 16, 6, 4, true)
VARIANT(q8_w4_r16_s4_g8_i16, q::Q8_0, 4, 16, 4, 8, true)
VARIANT(q4_w4_r16_s4_g8_i16, q::Q4_K, 4, 16, 4, 8, true)

// What one dependency between two decode stages costs, three ways, for scripts/sync_cost.py (a benchmark: built by
// that script with nvcc, never loaded by the engine). Every stage is the same token of work: each block reads the
// previous stage's NB words (one a block, as a matvec reads the whole x the blocks before it wrote), sums them and
// writes its own word. So a stage costs what a dependency costs, plus one L2 round trip.
//   chain_step        one stage a launch (a graph of them, with or without programmatic dependent launch);
//   chain_persistent  every stage in one launch of one block an SM, a grid-wide barrier between stages: the
//                     dependency of a persistent ("megakernel") decode.
#include "pdl.cuh"

namespace {

// Block sum of one value a thread (256 threads), returned to thread 0.
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float red[8];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    v = threadIdx.x < 8 ? red[threadIdx.x] : 0.f;
#pragma unroll
    for (int o = 4; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// One stage: next[block] = mean(prev[0 .. nb)) + 1, so stage s holds s exactly in every word when each stage saw all
// of the one before (sums of equal small integers are exact in float, in any order). A stale word shows: the script
// poisons every row but the first with NaN before its check, and a NaN anywhere in a sum stays.
__device__ __forceinline__ void stage(const float* prev, float* next, int nb) {
    float v = 0.f;
    for (int i = threadIdx.x; i < nb; i += blockDim.x) v += __ldcg(prev + i);  // L2: other blocks wrote it
    v = block_sum(v);
    if (threadIdx.x == 0) next[blockIdx.x] = v / float(nb) + 1.f;
}

__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// Every block of the grid arrives before any leaves. gen only moves once all have arrived, this block included, so
// thread 0 knows its value from the launch's start (g, read there, then counted along: no load before arriving);
// the last to arrive resets count and moves gen on (release), the rest spin on gen (acquire). No reset is needed
// between launches. A block that waits past SPIN_LIMIT polls (the grid was not
// all resident) sets *failed and returns false, and a block that finds *failed set while it waits leaves too, so the
// benchmark reports it (it probes one launch before timing) instead of hanging the GPU.
constexpr long long SPIN_LIMIT = 1LL << 20;

__device__ __forceinline__ bool grid_sync(unsigned* count, unsigned* gen, unsigned* failed, unsigned& g) {
    __shared__ bool ok;
    __syncthreads();
    if (threadIdx.x == 0) {
        ok = true;
        __threadfence();  // this block's stage writes before its arrival
        if (atomicAdd(count, 1u) == gridDim.x - 1) {
            atomicExch(count, 0u);
            __threadfence();
            atomicAdd(gen, 1u);
        } else {
            // *failed is polled once in 65,536 spins, so that a healthy barrier's wait is one load a spin.
            for (long long spin = 1; ld_acquire(gen) == g; ++spin)
                if ((spin & 0xffff) == 0 && (spin >= SPIN_LIMIT || ld_acquire(failed) != 0u)) {
                    atomicExch(failed, 1u);
                    ok = false;
                    break;
                }
        }
        ++g;
    }
    __syncthreads();
    return ok;
}

}  // namespace

// buf[s * nb .. + nb) is stage s's output; stage s reads stage s - 1's.
extern "C" __global__ void __launch_bounds__(256) chain_step(float* buf, int s, int nb) {
    pdl::begin();
    stage(buf + (long long)(s - 1) * nb, buf + (long long)s * nb, nb);
}

// bar: [count, gen, failed] u32, zeroed before the first launch.
extern "C" __global__ void __launch_bounds__(256, 1) chain_persistent(float* buf, int stages, unsigned* bar) {
    const int nb = gridDim.x;
    unsigned g = threadIdx.x == 0 ? ld_acquire(bar + 1) : 0u;  // gen, as this launch starts
    for (int s = 1; s <= stages; ++s) {
        stage(buf + (long long)(s - 1) * nb, buf + (long long)s * nb, nb);
        if (!grid_sync(bar, bar + 1, bar + 2, g)) return;
    }
}

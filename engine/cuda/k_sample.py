"""Launch wrappers for kernels/sample.cu: device argmax, the seeded top-k/top-p sampler, and the position advance
(contract: kernels/README.md). Only the chosen token id crosses PCIe."""

from __future__ import annotations

from engine.cuda import driver
from engine.cuda.driver import Launch, f32, i32, ptr, u64
from engine.cuda.memory import DeviceArray, need
from engine.errors import CudaError

MAX_VOCAB = 1 << 18  # the sampler's fixed-point mass: p * 2^45 summed over V <= 2^18 tokens stays below 2^63


def _vocab(logits: DeviceArray, V: int, out: DeviceArray) -> None:
    if not 1 <= V <= MAX_VOCAB:
        raise CudaError(f"sampler: vocabulary of {V} outside 1..{MAX_VOCAB}")
    need(logits, "logits", "f4", V)
    need(out, "out", "i4", 1)


def argmax(logits: DeviceArray, V: int, out: DeviceArray) -> Launch:
    """out[0] = the lowest index among the maxima of logits[:V] (f32), or -1 when any is NaN or infinite (the
    runner's NonFiniteLogits); out (1,) i32. Kernel argmax_f32."""
    _vocab(logits, V, out)
    return Launch(driver.module("sample").fn("argmax_f32"), (1,), (1024,), [ptr(logits), i32(V), ptr(out)])


def sample(logits: DeviceArray, V: int, temperature: float, top_k: int, top_p: float, seed: int, step: DeviceArray,
           out: DeviceArray) -> Launch:  # fmt: skip
    """engine.sampling.sample(logits[:V], params, *step) into out (1,) i32, then *step += 1 (step (1,) i32);
    out -1 when any logit is NaN or infinite. Kernel sample_f32; temperature 0 or top_k 1 is greedy."""
    _vocab(logits, V, out)
    need(step, "step", "i4", 1)
    if not (temperature >= 0.0 and top_k >= 0 and 0.0 < top_p <= 1.0 and 0 <= seed < 1 << 64):
        raise CudaError(f"sampler: bad parameters T={temperature} top_k={top_k} top_p={top_p} seed={seed}")
    fn = driver.module("sample").fn("sample_f32")
    top_k = min(top_k, V)  # top_k >= V keeps everything, like 0
    args = [ptr(logits), i32(V), f32(temperature), i32(top_k), f32(top_p), u64(seed), ptr(step), ptr(out)]
    return Launch(fn, (1,), (1024,), args)


def advance(pos: DeviceArray, n: int) -> Launch:
    """*pos += n (pos (1,) i32): moves a captured decode graph to the next position."""
    need(pos, "pos", "i4", 1)
    return Launch(driver.module("sample").fn("advance"), (1,), (1,), [ptr(pos), i32(n)])

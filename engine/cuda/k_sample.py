"""Launch wrappers for kernels/sample.cu: device argmax, the seeded top-k/top-p sampler, and the position advance
(contract: kernels/README.md). Only the chosen token id crosses PCIe.

Either sampler can also end a step of a decode chain (`Chain`): the id it chooses becomes the next step's input and
the position moves on, on the device, so the host can queue steps ahead of the ids it reads.
"""

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


class Chain:
    """Where a sampler hands its id on (kernels/sample.cu, hand_off): ctrl is the model's control block (pos, step,
    out, n, ids...) i32, ring `length` i32 slots of page-locked host memory (an address the device can write: every
    page-locked allocation is mapped under unified addressing), slot n % length taking the id of chain step n."""

    def __init__(self, ctrl: DeviceArray, ring: int, length: int):
        need(ctrl, "ctrl", "i4", 5)
        if length < 1 or not ring:
            raise CudaError(f"decode chain: a ring of {length} slots at {ring:#x}")
        self.ctrl, self.ring, self.length = ctrl, ring, length

    def args(self) -> list:
        return [ptr(self.ctrl), ptr(self.ring), i32(self.length)]


_LONE = [ptr(None), ptr(None), i32(0)]  # no chain: a step whose id the host reads itself


def argmax(logits: DeviceArray, V: int, out: DeviceArray, chain: Chain | None = None) -> Launch:
    """out[0] = the lowest index among the maxima of logits[:V] (f32), or -1 when any is NaN or infinite (the
    runner's NonFiniteLogits); out (1,) i32; then the chain's hand-off, if any. Kernel argmax_f32."""
    _vocab(logits, V, out)
    args = [ptr(logits), i32(V), ptr(out)] + (_LONE if chain is None else chain.args())
    return Launch(driver.module("sample").fn("argmax_f32"), (1,), (1024,), args)


def argmax_key(best: DeviceArray, out: DeviceArray, chain: Chain | None = None) -> Launch:
    """argmax's answer for a row of logits whose LM head folded its argmax key into best (k_matvec.matvec's `best`:
    the same id, -1 likewise), then best = 0 for the next head, and the chain's hand-off, if any; best (1,) u8, out
    (1,) i32. Kernel argmax_key."""
    need(best, "best", "u8", 1)
    need(out, "out", "i4", 1)
    args = [ptr(best), ptr(out)] + (_LONE if chain is None else chain.args())
    return Launch(driver.module("sample").fn("argmax_key"), (1,), (32,), args)


def sample(logits: DeviceArray, V: int, temperature: float, top_k: int, top_p: float, seed: int, step: DeviceArray,
           out: DeviceArray, chain: Chain | None = None) -> Launch:  # fmt: skip
    """engine.sampling.sample(logits[:V], params, *step) into out (1,) i32, then *step += 1 (step (1,) i32) and
    the chain's hand-off, if any; out -1 when any logit is NaN or infinite. Kernel sample_f32; temperature 0 or
    top_k 1 is greedy."""
    _vocab(logits, V, out)
    need(step, "step", "i4", 1)
    if not (temperature >= 0.0 and top_k >= 0 and 0.0 < top_p <= 1.0 and 0 <= seed < 1 << 64):
        raise CudaError(f"sampler: bad parameters T={temperature} top_k={top_k} top_p={top_p} seed={seed}")
    fn = driver.module("sample").fn("sample_f32")
    top_k = min(top_k, V)  # top_k >= V keeps everything, like 0
    args = [ptr(logits), i32(V), f32(temperature), i32(top_k), f32(top_p), u64(seed), ptr(step), ptr(out)]
    args += _LONE if chain is None else chain.args()
    return Launch(fn, (1,), (1024,), args)


def advance(pos: DeviceArray, n: int) -> Launch:
    """*pos += n (pos (1,) i32): moves a captured decode graph to the next position."""
    need(pos, "pos", "i4", 1)
    return Launch(driver.module("sample").fn("advance"), (1,), (1,), [ptr(pos), i32(n)])

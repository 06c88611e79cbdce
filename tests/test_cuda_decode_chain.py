"""The chained decode on the CUDA backend: the samplers' hand-off (kernels/sample.cu), CudaRunner.decode_chain against
sample_next one step at a time on every family, an early stop, and generation with stop strings against the NumPy
backend."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from engine.cuda import driver, memory
from engine.cuda import k_sample as ks
from engine.cuda import runner as cuda_runner
from engine.cuda.memory import DeviceArray
from engine.engine import Engine
from engine.errors import CudaError, NonFiniteLogits
from engine.sampling import SamplingParams
from tests import conformance as C

pytestmark = pytest.mark.gpu
FAMILIES = ["qwen3-tiny-q4_k_m", "qwen3moe-tiny-q8_0", "qwen35-tiny-q8_0", "deepseek2-tiny-q8_0"]
POISON = -7


@pytest.fixture(scope="module", autouse=True)
def context() -> None:
    driver.start_context(0)


class Ring:
    """`n` page-locked i32 slots, poisoned."""

    def __init__(self, n: int):
        self.ptr = memory.host_alloc(4 * n)
        self.slots = (ctypes.c_int32 * n).from_address(self.ptr)
        for i in range(n):
            self.slots[i] = POISON

    def free(self) -> None:
        memory.host_free(self.ptr)


def run(launch: driver.Launch) -> None:
    launch(0)
    memory.synchronize(0)


@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("n_before", [0, 5, 13])
def test_hand_off(sampled: bool, n_before: int) -> None:
    rng = np.random.default_rng(n_before)
    V = 1000
    logits = DeviceArray.from_host((rng.standard_normal(V) * 3).astype(np.float32))
    ctrl = DeviceArray.from_host(np.array([41, 9, POISON, n_before, 123, 77], np.int32))
    ring = Ring(6)
    try:
        chain = ks.Chain(ctrl, ring.ptr, 6)
        out = ctrl.view(2, (1,))
        if sampled:
            run(ks.sample(logits, V, 0.9, 0, 1.0, 3, ctrl.view(1, (1,)), out, chain))
        else:
            run(ks.argmax(logits, V, out, chain))
        got = ctrl.to_host().tolist()
        token = got[2]
        assert 0 <= token < V
        if not sampled:
            assert token == int(np.argmax(logits.to_host()))
        assert got == [42, 10 if sampled else 9, token, n_before + 1, token, 77]
        assert [ring.slots[i] for i in range(6)] == [token if i == n_before % 6 else POISON for i in range(6)]
    finally:
        ring.free()


@pytest.mark.parametrize("sampled", [False, True])
def test_hand_off_of_the_non_finite_mark(sampled: bool) -> None:
    """NaN logits: the host gets -1 through the ring, the next step's input is the harmless id 0."""
    V = 300
    x = np.zeros(V, np.float32)
    x[17] = np.nan
    logits = DeviceArray.from_host(x)
    ctrl = DeviceArray.from_host(np.array([3, 0, POISON, 2, 55], np.int32))
    ring = Ring(4)
    try:
        chain = ks.Chain(ctrl, ring.ptr, 4)
        out = ctrl.view(2, (1,))
        run(ks.sample(logits, V, 1.0, 0, 1.0, 1, ctrl.view(1, (1,)), out, chain) if sampled
            else ks.argmax(logits, V, out, chain))  # fmt: skip
        assert ctrl.to_host().tolist() == [4, 1 if sampled else 0, -1, 3, 0]
        assert [ring.slots[i] for i in range(4)] == [POISON, POISON, -1, POISON]
    finally:
        ring.free()


def test_chain_checks_its_ring() -> None:
    ctrl = DeviceArray.empty((5,), "i4")
    with pytest.raises(CudaError):
        ks.Chain(ctrl, 0, 8)
    with pytest.raises(CudaError):
        ks.Chain(DeviceArray.empty((4,), "i4"), 4096, 8)


# -- the runner --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=FAMILIES)
def engines(request):
    path = C.fixture_path(request.param, ".gguf")
    return request.param, Engine.load(path, backend="cuda", max_seq_len=256), Engine.load(path, backend="cpu")


PARAMS = [SamplingParams.make(0.0), SamplingParams.make(1.0, seed=11), SamplingParams.make(0.8, 40, 0.9, seed=5)]


def one_at_a_time(runner, prompt: list[int], params: SamplingParams, n: int) -> list[int]:
    runner.reset()
    out = [runner.sample_next(prompt, params, 0)]
    for step in range(1, n):
        out.append(runner.sample_next([out[-1]], params, step))
    return out


@pytest.mark.parametrize("ahead", [0, 2, cuda_runner.RING - 1])
def test_chain_gives_the_ids_of_single_steps(engines, ahead, monkeypatch) -> None:
    name, cuda, _ = engines
    monkeypatch.setattr(cuda_runner, "DECODE_AHEAD", ahead)
    runner, prompt = cuda.runner, cuda.tokenizer.encode("The quick brown fox")
    for params in PARAMS:
        want = one_at_a_time(runner, prompt, params, 20)
        runner.reset()
        first = runner.sample_next(prompt, params, 0)
        got = [first, *runner.decode_chain(first, params, 1, 19)]
        assert got == want, (name, ahead, params)
        assert runner.position == len(prompt) + 19


def test_chain_stopped_early(engines) -> None:
    """Three ids taken of twenty: the position is theirs; K/V families go on from it as if no step had run past
    it, and a recurrent family refuses to until the sequence is reset."""
    name, cuda, _ = engines
    runner, prompt, params = cuda.runner, cuda.tokenizer.encode("Once upon a time"), SamplingParams.make(0.0)
    want = one_at_a_time(runner, prompt, params, 8)
    runner.reset()
    first = runner.sample_next(prompt, params, 0)
    steps = runner.decode_chain(first, params, 1, 20)
    taken = [next(steps) for _ in range(3)]
    steps.close()
    assert [first, *taken] == want[:4]
    assert runner.position == len(prompt) + 3
    if runner._recurrent:
        with pytest.raises(CudaError, match="recurrent state"):
            runner.sample_next([taken[-1]], params, 4)
        runner.reset()
        assert one_at_a_time(runner, prompt, params, 8) == want
    else:
        got = [runner.sample_next([taken[-1]], params, 4)]
        for step in range(5, 8):
            got.append(runner.sample_next([got[-1]], params, step))
        assert got == want[4:], name


def test_chain_limits(engines) -> None:
    _, cuda, _ = engines
    runner, params = cuda.runner, SamplingParams.make(0.0)
    runner.reset()
    first = runner.sample_next([1, 2, 3], params, 0)
    assert list(runner.decode_chain(first, params, 1, 0)) == []
    with pytest.raises(Exception, match="256"):
        next(runner.decode_chain(first, params, 1, 254))
    assert runner.position == 3


def test_chain_raises_on_non_finite_logits() -> None:
    cuda = Engine.load(C.fixture_path("qwen3-tiny-q8_0", ".gguf"), backend="cuda", max_seq_len=64)
    runner, params = cuda.runner, SamplingParams.make(0.0)
    runner.reset()
    first = runner.sample_next([1, 2, 3], params, 0)
    norm = runner.model.output_norm  # NaN weights: every logit after the final norm is NaN
    memory.rt_call("cudaMemset", memory.runtime().memset, norm.ptr, 0xFF, 4 * runner.cfg.dim)
    with pytest.raises(NonFiniteLogits):
        list(runner.decode_chain(first, params, 1, 5))
    assert runner.position == 4


def test_generate_with_stop_strings(engines) -> None:
    """A stop string that ends generation in the middle of the queued steps: the text up to it, the ids and the
    finish of a run without it (greedy: also the NumPy backend's), and the next request starts clean."""
    name, cuda, cpu = engines
    prompt = "def fibonacci(n):"
    for sampling in ({}, {"temperature": 0.9, "seed": 3}):
        free = cuda.generate(prompt, max_tokens=24, **sampling)
        pieces = [cuda.tokenizer.decode([t]) for t in free["token_ids"]]
        stop = next((p.strip() for p in pieces[6:] if p.strip()), None)
        if stop is None:
            continue
        cut = free["text"].find(stop)
        stopped = cuda.generate(prompt, max_tokens=24, stop=[stop], **sampling)
        assert stopped["text"] == free["text"][:cut] and stopped["finish_reason"] == "stop", (name, stop)
        assert free["token_ids"][: len(stopped["token_ids"])] == stopped["token_ids"]
        if not sampling:
            b = cpu.generate(prompt, max_tokens=24, stop=[stop])
            assert (stopped["text"], stopped["token_ids"]) == (b["text"], b["token_ids"]), name
        assert cuda.generate(prompt, max_tokens=24, **sampling)["token_ids"] == free["token_ids"]
    assert cuda.generate(prompt, max_tokens=5)["token_ids"] == cpu.generate(prompt, max_tokens=5)["token_ids"]

"""Non-finite logits on the CUDA backend (GPU only): the device argmax and sampler mark a row holding any NaN or
infinity with id -1, and the runner reports a `gguf` error (NonFiniteLogits) instead of a token: in the prefill
path, in a captured and replayed decode graph, and with graphs off."""

from __future__ import annotations

import math
import shutil

import numpy as np
import pytest

from engine import gguf
from engine.cuda import driver, memory
from engine.cuda import k_sample as ks
from engine.cuda.memory import DeviceArray
from engine.engine import Engine
from engine.errors import NonFiniteLogits
from engine.sampling import SamplingParams
from tests import conformance as C

pytestmark = pytest.mark.gpu
F32_MODEL = C.fixture_path("qwen3-tiny-f32", ".gguf")
PROMPT = "The capital of France is"
PARAMS = [  # greedy; top-k; a plain draw (every logit read); top-p alone; top-k and top-p
    SamplingParams(),
    SamplingParams(temperature=0.8, top_k=40, seed=7),
    SamplingParams(temperature=1.0, seed=7),
    SamplingParams(temperature=0.7, top_p=0.9, seed=7),
    SamplingParams(temperature=0.9, top_k=2000, top_p=0.95, seed=7),
]


@pytest.fixture(scope="module", autouse=True)
def cuda_context() -> None:
    driver.start_context(0)


def run(logits: DeviceArray, V: int, params: SamplingParams, kernel: str) -> tuple[int, int]:
    """(id, step after) of one launch on logits[:V], the output poisoned first and the step starting at 5."""
    out = DeviceArray.empty((1,), "i4")
    out.fill_byte(0x55)
    step = DeviceArray.from_host(np.array([5], dtype=np.int32))
    if kernel == "argmax":
        ks.argmax(logits, V, out)(0)
    else:
        ks.sample(logits, V, params.temperature, params.top_k, params.top_p, params.seed, step, out)(0)
    memory.synchronize(0)
    return int(out.to_host()[0]), int(step.to_host()[0])


@pytest.mark.parametrize("V", [1000, 151936])
@pytest.mark.parametrize("bad", [None, math.nan, math.inf, -math.inf], ids=["finite", "nan", "inf", "-inf"])
def test_planted_non_finite_logits_give_id_minus_one(V, bad):
    rng = np.random.default_rng()
    x = (rng.standard_normal(V) * 3).astype(np.float32)  # (V,) f32
    if bad is not None:
        x[rng.integers(V)] = bad
    logits = DeviceArray.from_host(x)
    for kernel in ("argmax", "sample"):
        for params in PARAMS if kernel == "sample" else PARAMS[:1]:
            got, step = run(logits, V, params, kernel)
            if bad is not None:
                assert got == -1, (kernel, params)
            elif params.greedy:
                assert got == int(np.argmax(x)), (kernel, params)
            else:  # tests/test_cuda_attention.py holds the draws to the host sampler's
                assert 0 <= got < V, (kernel, params)
            assert step == (5 if kernel == "argmax" else 6)


def planted(tmp_path, value: float) -> str:
    path = str(tmp_path / "nan-norm.gguf")
    shutil.copy(F32_MODEL, path)
    info = gguf.read(path).tensors["output_norm.weight"]
    with open(path, "r+b") as f:
        f.seek(info.offset + 4 * 3)
        f.write(np.float32(value).tobytes())
    return path


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "direct"])
def test_a_nan_weight_model_is_a_gguf_error(tmp_path, graphs):
    engine = Engine.load(planted(tmp_path, math.nan), backend="cuda", max_seq_len=64)
    engine.runner.use_graphs = graphs
    for params in PARAMS:
        with pytest.raises(NonFiniteLogits, match="not finite") as e:
            engine.generate(PROMPT, max_tokens=4, temperature=params.temperature, top_k=params.top_k,
                            top_p=params.top_p, seed=params.seed)  # fmt: skip
        assert e.value.kind == "gguf"
    with pytest.raises(NonFiniteLogits):
        engine.system1(PROMPT, [" Paris", " London"])


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "direct"])
def test_logits_turning_nan_at_a_decode_step_stop_generation(graphs):
    """Three good steps (the decode graph captured, then replayed), then the norm weight turns NaN on the device."""
    engine = Engine.load(F32_MODEL, backend="cuda", max_seq_len=64)
    engine.runner.use_graphs = graphs
    want = engine.generate(PROMPT, max_tokens=3)["token_ids"]
    chunks = iter(engine.generate_stream(PROMPT, max_tokens=16))
    got = [t for _ in range(3) for t in next(chunks)["token_ids"]]
    assert got == want
    engine.runner.model.output_norm.fill_byte(0xFF)  # 0xFFFFFFFF is a NaN
    memory.synchronize(0)
    with pytest.raises(NonFiniteLogits):
        for _ in chunks:
            pass


def test_the_check_costs_little():
    """Timings of the marked kernels on a 151,936-token row (printed for the notes; the bound is loose)."""
    V = 151936
    logits = DeviceArray.from_host(np.random.default_rng(0).standard_normal(V).astype(np.float32))
    out, step = DeviceArray.empty((1,), "i4"), DeviceArray.from_host(np.zeros(1, dtype=np.int32))
    stream = memory.stream_create()
    timer = memory.Timer(stream)
    times = {}
    launches = {
        "argmax": ks.argmax(logits, V, out),
        "sample T=0.8 top_k=40": ks.sample(logits, V, 0.8, 40, 1.0, 1, step, out),
        "sample T=1": ks.sample(logits, V, 1.0, 0, 1.0, 1, step, out),
    }
    for name, launch in launches.items():
        for _ in range(10):
            launch(stream)
        timer.start()
        for _ in range(100):
            launch(stream)
        times[name] = timer.stop() * 10.0  # us per launch
    print({k: round(v, 2) for k, v in times.items()})
    assert all(t < 200.0 for t in times.values()), times

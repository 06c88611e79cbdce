"""Non-finite numbers from the model are the model file's fault: NaN or infinite logits end generate and system1 in a
`gguf` error saying so (never a token chosen from NaNs, never `invalid_input`); and system1 at an extreme temperature
still names the highest score best."""

from __future__ import annotations

import math
import shutil

import numpy as np
import pytest

from engine import gguf, system1
from engine.engine import Engine
from engine.errors import NonFiniteLogits
from engine.sampling import SamplingParams, sample
from engine.worker.limits import Limits
from engine.worker.service import Worker
from tests import conformance as C

F32_MODEL = C.fixture_path("qwen3-tiny-f32", ".gguf")
PROMPT = "The capital of France is"


def planted(tmp_path, tensor: str, index: int, value: float) -> str:
    """A copy of the F32 fixture with one weight of `tensor` (flat index) set to `value`."""
    path = str(tmp_path / f"planted-{tensor}-{value}.gguf")
    shutil.copy(F32_MODEL, path)
    info = gguf.read(path).tensors[tensor]
    with open(path, "r+b") as f:
        f.seek(info.offset + 4 * index)
        f.write(np.float32(value).tobytes())
    return path


# output_norm: every logit NaN. One token_embd row (the tied LM head): that one logit NaN or infinite.
CASES = [("output_norm.weight", 3, math.nan), ("token_embd.weight", 700 * 256 + 5, math.nan),
         ("token_embd.weight", 700 * 256 + 5, math.inf), ("output_norm.weight", 0, -math.inf)]  # fmt: skip


@pytest.mark.parametrize(("tensor", "index", "value"), CASES)
def test_generate_and_system1_report_the_model_not_the_request(tmp_path, tensor, index, value):
    engine = Engine.load(planted(tmp_path, tensor, index, value), backend="cpu", max_seq_len=64)
    for sampling in ({"temperature": 0.0}, {"temperature": 0.8, "top_k": 40, "seed": 1}, {"temperature": 1.0}):
        with pytest.raises(NonFiniteLogits, match="not finite") as e:
            engine.generate(PROMPT, max_tokens=4, **sampling)
        assert e.value.kind == "gguf"
    if tensor == "output_norm.weight":  # every candidate's score is then NaN too
        with pytest.raises(NonFiniteLogits, match="not finite"):
            engine.system1(PROMPT, [" Paris", " London"])
    worker = Worker(engine, Limits())
    for job in ({"prompt": PROMPT, "max_tokens": 3}, {"prompt": PROMPT, "max_tokens": 3, "stream": True}):
        out = [o for o in worker.run(job) if o is not None][-1]
        assert out["error_kind"] == "gguf" and "not finite" in out["error"], out


def test_the_host_sampler_refuses_non_finite_rows():
    for bad in (math.nan, math.inf, -math.inf):
        row = np.zeros(1000, dtype=np.float32)
        row[617] = bad
        for params in (SamplingParams(), SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=3)):
            with pytest.raises(NonFiniteLogits):
                sample(row, params, 0)
    with pytest.raises(NonFiniteLogits):
        system1.probabilities([1.0, math.nan], 1.0)


def test_system1_at_an_extreme_temperature_names_the_highest_score_best():
    engine = Engine.load(C.fixture_path("qwen3-tiny-q8_0", ".gguf"), backend="cpu", max_seq_len=64)
    candidates = [" Paris", " London", " Rome", " Berlin"]
    scores = [c["score"] for c in engine.system1(PROMPT, candidates)["candidates"]]
    want = max(range(len(scores)), key=lambda i: (scores[i], i))
    for temperature in (1e300, 1e-300, 1e-5, 1e5):
        r = engine.system1(PROMPT, candidates, temperature=temperature)
        assert r["best_idx"] == want and r["best_text"] == candidates[want], (temperature, scores, r["best_idx"])
        assert math.isclose(sum(c["probability"] for c in r["candidates"]), 1.0)
    assert system1.best_index([1.0, 3.0, 3.0, 2.0]) == 2  # ties: the last maximum

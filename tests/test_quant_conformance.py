"""Low-bit and i-quant GGUFs made by llama.cpp's own quantizer (scripts/make_quant_fixture.py): the NumPy backend
within 1e-3 of exact f32 math on the dequantized weights (docs/design.md §7), at every prompt position and greedy
step; and the CUDA backend refusing them at load, before any upload, so that backend "auto" runs them on the CPU.

The references (tests/fixtures/<case>.quant.json / .npz) are llama.cpp's logits on an all-F32 copy whose weights
gguf-py dequantized, kept at every 4th vocabulary id, with each full row's argmax and logsumexp.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os

import numpy as np
import pytest

from engine import engine as engine_module
from engine.config import ModelConfig
from engine.cuda import load_runner
from engine.engine import Engine
from engine.errors import UnsupportedArchitecture
from engine.gguf import read
from engine.quants import KERNEL_TAGS, SUPPORTED_TYPES, GGMLType
from tests import conformance as C

CASES = sorted(os.path.basename(p).removesuffix(".quant.json") for p in glob.glob(C.fixture_path("*", ".quant.json")))
TOLERANCE = 1e-3  # docs/design.md §7: quantized files, f32 math on dequantized weights, vs exact math


def load_case(name: str) -> tuple[dict, dict]:
    with open(C.fixture_path(name, ".quant.json")) as f:
        ref = json.load(f)
    return ref, dict(np.load(C.fixture_path(name, ".quant.npz")))


@pytest.fixture(scope="module", params=CASES)
def case(request):
    ref, npz = load_case(request.param)
    return request.param, ref, npz, Engine.load(C.fixture_path(request.param, ".gguf"), backend="cpu", max_seq_len=128)


def test_cases_hold_every_type_a_model_file_can():
    """Between them the files hold every new type but Q8_K (no llama.cpp matmul takes Q8_K weights)."""
    held = {GGMLType[t] for name in CASES for t in load_case(name)[0]["tensor_type_counts"]}
    assert SUPPORTED_TYPES - set(KERNEL_TAGS) - {GGMLType.Q8_K} <= held, sorted(t.name for t in held)


def test_file_is_the_one_llama_cpp_wrote(case):
    name, ref, _, engine = case
    with open(C.fixture_path(name, ".gguf"), "rb") as f:
        assert hashlib.sha256(f.read()).hexdigest() == ref["model_sha256"]
    assert {t: info.ggml_type.name for t, info in read(C.fixture_path(name, ".gguf")).tensors.items()} == ref[
        "tensor_types"
    ]
    assert engine.backend == "cpu"


def check_rows(ours: np.ndarray, npz: dict, key: str, context: str) -> float:
    """Max abs error of `ours` (rows, n_vocab) at the stored columns; logsumexp within the tolerance; an argmax may
    differ only where our own top two are within twice the tolerance."""
    err = float(np.abs(ours[:, npz["columns"]] - npz[key]).max())
    peak = ours.max(-1, keepdims=True).astype(np.float64)
    lse = peak[:, 0] + np.log(np.exp(ours - peak).sum(-1))
    assert float(np.abs(lse - npz[f"{key}_lse"]).max()) <= TOLERANCE, context
    rows = np.arange(len(ours))
    gap = ours[rows, ours.argmax(-1)] - ours[rows, npz[f"{key}_argmax"]]
    assert (gap <= 2 * TOLERANCE).all(), f"{context}: argmax differs beyond a near tie, gaps {gap}"
    return err


def test_cpu_backend_matches_exact_math(case):
    name, ref, npz, engine = case
    worst_prompt = worst_steps = 0.0
    for i, p in enumerate(ref["prompts"]):
        ids = p["token_ids"]
        assert engine.tokenizer.encode(p["text"]) == ids
        worst_prompt = max(worst_prompt, check_rows(engine.logits(ids), npz, f"prompt{i}_logits", f"{name} {i}"))
        # the greedy steps through the decode path: the prompt as one batch, then the greedy ids one at a time
        forced = ids + p["greedy_ids"][:-1]
        steps = engine.logits(forced, prefill=len(ids))[len(ids) - 1 :]
        worst_steps = max(worst_steps, check_rows(steps, npz, f"prompt{i}_greedy_step_logits", f"{name} {i} steps"))
        out = engine.generate(p["text"], max_tokens=len(p["greedy_ids"]), temperature=0.0)
        err = max(worst_prompt, worst_steps)
        assert C.greedy_agrees(out["token_ids"], p["greedy_ids"], p["greedy_top1_minus_top2"], err), (name, i)
    assert worst_prompt <= TOLERANCE, (name, worst_prompt)
    assert worst_steps <= TOLERANCE, (name, worst_steps)


class _NoContext:
    """A CUDA context that must not be needed: the refusal comes before the wait for it and any upload."""

    device = 0

    def wait(self) -> float:
        raise AssertionError("load_runner waited for the CUDA context of a file it must refuse")


def test_cuda_load_refuses_types_without_kernels():
    gf = read(C.fixture_path("qwen3-tiny-lowbit-mix", ".gguf"))
    config = ModelConfig.from_gguf(gf.metadata, gf.tensors)
    first = next(info for info in gf.tensors.values() if info.ggml_type not in KERNEL_TAGS)
    match = rf"tensor '{first.name}' has type {first.ggml_type.name}, which the CUDA kernels do not compute"
    with pytest.raises(UnsupportedArchitecture, match=match):
        load_runner(config, gf, 64, _NoContext())


@pytest.mark.parametrize("backend", ["auto", "cuda"])
def test_auto_falls_back_to_cpu_and_cuda_fails(monkeypatch, caplog, backend):
    """As on a GPU machine: the backend choice yields a context, the CUDA load refuses the file."""
    monkeypatch.setattr(engine_module, "_start_backend", lambda requested: (backend, _NoContext()))
    path = C.fixture_path("qwen3-tiny-q2_k", ".gguf")
    if backend == "cuda":
        with pytest.raises(UnsupportedArchitecture, match="type Q2_K, which the CUDA kernels do not compute"):
            Engine.load(path, backend="cuda", max_seq_len=64)
        return
    with caplog.at_level(logging.WARNING):
        engine = Engine.load(path, backend="auto", max_seq_len=64)
    assert engine.backend == "cpu"
    assert "CUDA kernels do not compute" in caplog.text

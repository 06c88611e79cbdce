"""Low-bit and i-quant GGUFs made by llama.cpp's own quantizer (scripts/make_quant_fixture.py): both backends within
1e-3 of exact f32 math on the dequantized weights (docs/design.md §7), at every prompt position and greedy step (the
CUDA backend's float32 matvec paths; its TF32 GEMM chunks are held to the CPU backend as in tests/test_cuda_model.py);
and the CUDA backend refusing a type it has no kernels for (Q8_K) at load, before any upload, so that backend "auto"
runs such a file on the CPU.

The references (tests/fixtures/<case>.quant.json / .npz) are llama.cpp's logits on an all-F32 copy whose weights
gguf-py dequantized, kept at every 4th vocabulary id, with each full row's argmax and logsumexp.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import struct

import numpy as np
import pytest

from engine import engine as engine_module
from engine.config import ModelConfig
from engine.cpu.dequant import dequantize
from engine.cuda import load_runner
from engine.cuda.dispatch import MATVEC_MAX
from engine.engine import Engine
from engine.errors import UnsupportedArchitecture
from engine.gguf import read
from engine.quants import LOWBIT_TYPES, GGMLType
from tests import conformance as C
from tests.gguf_builder import gstr

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
    """Between them the files hold every low-bit and codebook type (Q8_K is no weight type: llama.cpp writes none)."""
    held = {GGMLType[t] for name in CASES for t in load_case(name)[0]["tensor_type_counts"]}
    assert held >= LOWBIT_TYPES, sorted(t.name for t in held)


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


def check_case(engine, name: str, ref: dict, npz: dict, max_prompt: int | None = None) -> None:
    """Every prompt's logits and greedy steps within TOLERANCE of exact math, and the greedy ids where no near tie
    (only the prompts of at most `max_prompt` tokens, when given)."""
    worst_prompt = worst_steps = 0.0
    for i, p in enumerate(ref["prompts"]):
        ids = p["token_ids"]
        if max_prompt is not None and len(ids) > max_prompt:
            continue
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


def test_cpu_backend_matches_exact_math(case):
    name, ref, npz, engine = case
    check_case(engine, name, ref, npz)


@pytest.mark.gpu
def test_cuda_backend_matches_exact_math(case):
    """The prompts that go through small batches (float32 math: matvec passes or tc_matvec, at most
    dispatch.MATVEC_MAX tokens) and their greedy steps on the kernels of every type in the files, against exact math;
    the longer prompts and a 100-token chunk, which go through the GEMM (TF32 tensor cores), against the CPU backend,
    as tests/test_cuda_model.py does."""
    name, ref, npz, cpu = case
    cuda = Engine.load(C.fixture_path(name, ".gguf"), backend="cuda", max_seq_len=128)
    assert cuda.backend == "cuda"
    check_case(cuda, name, ref, npz, max_prompt=MATVEC_MAX)
    chunk = cpu.tokenizer.encode("def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n")
    long = [p["token_ids"] for p in ref["prompts"] if len(p["token_ids"]) > MATVEC_MAX]
    chunk = (chunk * 4)[:100]
    assert len(chunk) > MATVEC_MAX, "the chunk must exercise the GEMM path"
    for ids in [*long, chunk]:
        a, b = cuda.logits(ids), cpu.logits(ids)
        assert np.abs(a - b).max() <= 2e-3 * max(1.0, np.abs(b).max()), (name, len(ids), np.abs(a - b).max())


class _NoContext:
    """A CUDA context that must not be needed: the refusal comes before the wait for it and any upload; a load that
    gives CUDA up lets it go (abandon: its thread ends, an early weight upload it holds is freed)."""

    device = 0

    def __init__(self):
        self.abandoned = 0

    def wait(self) -> float:
        raise AssertionError("load_runner waited for the CUDA context of a file it must refuse")

    def abandon(self) -> None:
        self.abandoned += 1


def q8_k_file(tmp_path) -> str:
    """qwen3-tiny-f32 with token_embd.weight stored as Q8_K, patched in place: its tensor info's type, and its data
    quantized (d = max |x| / 127 per 256 values, bsums zero: the decoders ignore them) at the start of its old slot."""
    src = C.fixture_path("qwen3-tiny-f32", ".gguf")
    info = read(src).tensors["token_embd.weight"]
    with open(src, "rb") as f:
        data = bytearray(f.read())
    header = gstr(info.name) + struct.pack("<I", len(info.ne)) + struct.pack(f"<{len(info.ne)}Q", *info.ne)
    at = data.index(header) + len(header)
    data[at : at + 4] = struct.pack("<I", GGMLType.Q8_K)
    x = np.frombuffer(data, np.float32, count=info.n_bytes // 4, offset=info.offset).reshape(-1, 256).copy()
    d = np.maximum(np.abs(x).max(axis=1, keepdims=True), 1e-30).astype(np.float32) / 127
    blocks = np.zeros((len(x), 292), np.uint8)
    blocks[:, 0:4] = d.view(np.uint8)
    blocks[:, 4:260] = np.round(x / d).astype(np.int8).view(np.uint8)
    data[info.offset : info.offset + blocks.size] = blocks.tobytes()
    path = tmp_path / "qwen3-tiny-q8_k-embd.gguf"
    path.write_bytes(bytes(data))
    assert np.array_equal(dequantize(blocks.reshape(-1), GGMLType.Q8_K, (len(x), 256)), d * np.round(x / d))
    return str(path)


def test_cuda_load_refuses_types_without_kernels(tmp_path):
    gf = read(q8_k_file(tmp_path))
    config = ModelConfig.from_gguf(gf.metadata, gf.tensors)
    match = "tensor 'token_embd.weight' has type Q8_K, which the CUDA kernels do not compute"
    context = _NoContext()
    with pytest.raises(UnsupportedArchitecture, match=match):
        load_runner(config, gf, 64, context)
    assert context.abandoned == 1  # an early upload of this file would be freed, not leaked


@pytest.mark.parametrize("backend", ["auto", "cuda"])
def test_auto_falls_back_to_cpu_and_cuda_fails(monkeypatch, caplog, tmp_path, backend):
    """As on a GPU machine: the backend choice yields a context, the CUDA load refuses the file."""
    context = _NoContext()
    monkeypatch.setattr(engine_module, "_start_backend", lambda requested: (backend, context))
    path = q8_k_file(tmp_path)
    if backend == "cuda":
        with pytest.raises(UnsupportedArchitecture, match="type Q8_K, which the CUDA kernels do not compute"):
            Engine.load(path, backend="cuda", max_seq_len=64)
        assert context.abandoned >= 1
        return
    with caplog.at_level(logging.WARNING):
        engine = Engine.load(path, backend="auto", max_seq_len=64)
    assert engine.backend == "cpu" and context.abandoned >= 1
    assert "CUDA kernels do not compute" in caplog.text
    assert np.isfinite(engine.logits(engine.tokenizer.encode("The capital of France is"))).all()

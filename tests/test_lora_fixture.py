"""LoRA conformance against llama.cpp: the NumPy backend with the same adapters (rebuilt from the seeds in
tests/fixtures/*.lora.json, proven identical by their sha256) within 1e-4 of llama.cpp's logits on F32 bases
(docs/design.md §7). Made by scripts/make_lora_fixture.py."""

from __future__ import annotations

import glob
import json
import os

import numpy as np
import pytest

from engine.engine import Engine
from engine.gguf import read
from tests import conformance as C
from tests import lora_util

FIXTURES = sorted(os.path.basename(p).removesuffix(".lora.json") for p in glob.glob(C.fixture_path("*", ".lora.json")))


def load_fixture(name: str) -> tuple[dict, dict, list[dict]]:
    with open(C.fixture_path(name, ".lora.json")) as f:
        ref = json.load(f)
    return ref, dict(np.load(C.fixture_path(name, ".lora.npz"))), ref["adapters"]


def make_adapters(name: str, directory) -> list[tuple[str, float]]:
    """The fixture's adapters, rebuilt into `directory`: [(path, scale), ...]."""
    ref, _, adapters = load_fixture(name)
    gf = read(C.fixture_path(ref["base"], ".gguf"))
    out = []
    for i, a in enumerate(adapters):
        pairs = lora_util.random_pairs(gf, a["targets"], a["rank"], a["seed"])
        assert lora_util.pairs_sha256(pairs) == a["tensors_sha256"], (
            f"{name}: the rebuilt adapter {i} differs from llama.cpp's"
        )
        path = lora_util.write_adapter(os.path.join(directory, f"{name}.{i}.gguf"), gf.architecture, pairs, a["alpha"])
        out.append((path, a["scale"]))
    return out


def test_fixtures_exist():
    assert len(FIXTURES) >= 6


@pytest.mark.parametrize("name", FIXTURES)
def test_cpu_backend_matches_llama_cpp_with_the_adapters(tmp_path, name):
    ref, npz, _ = load_fixture(name)
    engine = Engine.load(C.fixture_path(ref["base"], ".gguf"), backend="cpu", max_seq_len=128,
                         lora=make_adapters(name, tmp_path))  # fmt: skip
    _, base_npz, _ = C.load_reference(ref["base"])
    cols = npz["columns"]
    worst = 0.0
    for i, p in enumerate(ref["prompts"]):
        logits = engine.logits(p["token_ids"])
        want = npz[f"prompt{i}_logits"]
        worst = max(worst, float(np.abs(logits[:, cols] - want).max()))
        m = logits.max(-1, keepdims=True).astype(np.float64)
        lse = m[:, 0] + np.log(np.exp(logits - m).sum(-1))
        assert float(np.abs(lse - npz[f"prompt{i}_lse"]).max()) <= 1e-4
        assert np.array_equal(logits.argmax(-1), npz[f"prompt{i}_argmax"])
        # llama.cpp did apply the adapters: its logits moved away from the base model's
        assert float(np.abs(base_npz[f"prompt{i}_logits"][:, cols] - want).max()) > 1e-2
        steps = engine.generate(p["text"], max_tokens=len(p["greedy_ids"]))["token_ids"]
        assert steps == p["greedy_ids"]
    assert worst <= 1e-4, (name, worst)

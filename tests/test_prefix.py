"""The build-time prefix cache and the command-line and worker settings of this feature, as a user drives them:
`prepare MODEL --prefix TEXT` bakes the state beside the model, later processes resume from it; `--export-state` /
`--import-state`; `--lora PATH[:SCALE]`; the worker's LORA_ADAPTERS."""

from __future__ import annotations

import os
import shutil

from engine import state
from engine.engine import Engine
from engine.gguf import read
from tests import conformance as C
from tests import lora_util
from tests.test_cli_prepare import run

SYSTEM = "<|im_start|>system\nYou are a terse assistant. Answer with one word.<|im_end|>\n"
PROMPT = SYSTEM + "<|im_start|>user\nCapital of France?<|im_end|>\n<|im_start|>assistant\n"
CANDS = ["--candidate", " Paris", "--candidate", " London"]


def _scores(result: dict) -> list[float]:
    return [c["score"] for c in result["candidates"]]


def test_prepare_bakes_a_prefix_that_later_processes_resume(tmp_path):
    model = str(tmp_path / "model.gguf")
    shutil.copy(C.fixture_path("qwen3-tiny-q8_0", ".gguf"), model)
    code, out, err = run("prepare", model, "--prefix", SYSTEM)
    assert code == 0, err
    assert out["prefix"]["state"] == state.prefix_path(model) and os.path.exists(state.prefix_path(model))
    assert out["prefix"]["n_positions"] == len(Engine.load(model, backend="cpu").tokenizer.encode(SYSTEM))
    code, got, err = run("system1", model, PROMPT, *CANDS, "--backend", "cpu")
    assert code == 0, err
    assert got["timings"]["prefix_tokens_reused"] == out["prefix"]["n_positions"]
    want = Engine.load(C.fixture_path("qwen3-tiny-q8_0", ".gguf"), backend="cpu").system1(PROMPT, [" Paris", " London"])
    assert max(abs(a - b) for a, b in zip(_scores(got), _scores(want), strict=True)) <= 1e-4
    code, other, _ = run("system1", model, "Capital of France?", *CANDS, "--backend", "cpu")
    assert code == 0 and other["timings"]["prefix_tokens_reused"] == 0


def test_export_and_import_state_on_the_command_line(tmp_path):
    model = C.fixture_path("qwen3-tiny-f32", ".gguf")
    path = str(tmp_path / "p.state")
    code, out, err = run("generate", model, SYSTEM, "--max-tokens", "2", "--backend", "cpu", "--export-state", path)
    assert code == 0, err
    assert out["state_exported"]["state"] == path and out["state_exported"]["bytes"] > 0
    code, resumed, err = run("generate", model, PROMPT, "--max-tokens", "5", "--backend", "cpu", "--import-state", path)
    assert code == 0, err
    code, full, _ = run("generate", model, PROMPT, "--max-tokens", "5", "--backend", "cpu")
    assert resumed["token_ids"] == full["token_ids"] and resumed["timings"]["prefix_tokens_reused"] > 0
    code, bad, _ = run("generate", C.fixture_path("qwen3-tiny-q8_0", ".gguf"), PROMPT, "--import-state", path)
    assert code == 2 and bad["error_kind"] == "invalid_input" and "another model" in bad["error"]


def test_lora_on_the_command_line_and_in_the_worker(tmp_path):
    model = C.fixture_path("qwen3-tiny-f32", ".gguf")
    pairs = lora_util.random_pairs(read(model), lora_util.TARGETS["qwen3"], 8, seed=9)
    adapter = lora_util.write_adapter(tmp_path / "a.gguf", "qwen3", pairs, 16.0)
    want = Engine.load(model, backend="cpu", lora=[(adapter, 0.5)]).system1(PROMPT, [" Paris", " London"])
    code, got, err = run("system1", model, PROMPT, *CANDS, "--backend", "cpu", "--lora", f"{adapter}:0.5")
    assert code == 0, err
    assert max(abs(a - b) for a, b in zip(_scores(got), _scores(want), strict=True)) <= 1e-4
    assert got["model"]["lora"][0]["scale"] == 0.5
    code, bad, _ = run("system1", model, PROMPT, *CANDS, "--lora", str(tmp_path / "none.gguf"))
    assert code == 2 and bad["error_kind"] == "invalid_input"

    from engine.worker.service import Worker

    env = {"MODEL_PATH": model, "LORA_ADAPTERS": f"{adapter}:0.5", "REFLEX_BACKEND": "cpu"}
    worker = Worker.load(env=env)
    assert worker.engine is not None, worker.load_error
    result = next(iter(worker.run({"prompt": PROMPT, "candidates": [" Paris", " London"]})))
    assert max(abs(a - b) for a, b in zip(_scores(result), _scores(want), strict=True)) <= 1e-4
    broken = Worker.load(env={**env, "LORA_ADAPTERS": f"{adapter}:x:nan"})
    assert broken.engine is None and "LORA_ADAPTERS" in str(broken.load_error)

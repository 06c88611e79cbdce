"""The command line (as a user runs it, in fresh processes) and the prepare cache."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from engine import prepare
from tests import conformance as C

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = C.fixture_path("qwen3-tiny-q8_0", ".gguf")


def run(*args: str) -> tuple[int, dict, str]:
    p = subprocess.run([sys.executable, "-m", "engine", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    lines = [ln for ln in p.stdout.splitlines() if ln.strip()]
    return p.returncode, json.loads(lines[-1]) if lines else {}, p.stderr


def test_system1_and_generate(tmp_path):
    code, out, _ = run("system1", MODEL, "The capital of France is", "--candidate", " Paris", "--candidate", " Rome")
    assert code == 0 and len(out["candidates"]) == 2
    assert out["cold_start"]["process_start_to_result_ms"] > out["cold_start"]["process_start_to_ready_ms"] > 0
    code, out, _ = run("generate", MODEL, "Hello", "--max-tokens", "3", "--temperature", "0.7", "--seed", "5")
    assert code == 0 and out["usage"]["completion_tokens"] <= 3
    assert out["cold_start"]["process_start_to_first_token_ms"] > 0


def test_errors_are_typed_with_exit_code_2(tmp_path):
    code, out, _ = run("system1", MODEL, "The capital of Fra", "--candidate", "nce")
    assert code == 2 and out["error_kind"] == "invalid_input"
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x07\x00\x00\x00" + b"\x00" * 64)
    code, out, _ = run("generate", str(bad), "x")
    assert code == 2 and out["error_kind"] == "gguf" and "version 7" in out["error"]
    code, out, _ = run("generate", MODEL, "x", "--max-tokens", "100000")
    assert code == 2 and out["error_kind"] == "context_overflow"
    assert subprocess.run([sys.executable, "-m", "engine", "generate", "--help"], cwd=ROOT).returncode == 0


def test_check_passes_and_fails(tmp_path):
    ref = tmp_path / "ref.json"
    code, out, _ = run("check", MODEL, "The capital of France is", "--write-reference", str(ref))
    assert code == 0 and len(out["token_ids"]) == 8
    code, out, _ = run("check", MODEL, "The capital of France is", "--reference", str(ref))
    assert code == 0 and out["status"] == "pass"
    good = json.loads(ref.read_text())
    wrong_id = dict(good, token_ids=[*good["token_ids"][:3], (good["token_ids"][3] + 1) % 1024, *good["token_ids"][4:]])
    ref.write_text(json.dumps(wrong_id))
    code, out, _ = run("check", MODEL, "The capital of France is", "--reference", str(ref))
    assert code == 1 and out["reason"] == "token_id_mismatch"
    ref.write_text(json.dumps(dict(good, logit_checksum=good["logit_checksum"] + 1e3)))
    code, out, _ = run("check", MODEL, "The capital of France is", "--reference", str(ref))
    assert code == 1 and out["reason"] == "logit_checksum_mismatch"
    code, out, _ = run("check", MODEL, "x", "--reference", str(tmp_path / "missing.json"))
    assert code == 2


@pytest.fixture
def model_copy(tmp_path):
    path = str(tmp_path / "m.gguf")
    shutil.copy(MODEL, path)
    return path


def test_prepare_cache_is_used_and_equivalent(model_copy):
    code, out, _ = run("prepare", model_copy)
    assert code == 0 and out["cache_used"] is True and os.path.exists(prepare.cache_path(model_copy))
    cached = prepare.open_model(model_copy)
    parsed = prepare.OpenedModel(prepare.gguf.read(model_copy), None, None, False)
    assert cached.cache_used and cached.sha256 == prepare.file_sha256(model_copy)
    assert {k: v.ne for k, v in cached.file.tensors.items()} == {k: v.ne for k, v in parsed.file.tensors.items()}
    assert all(cached.file.tensors[k].offset == v.offset for k, v in parsed.file.tensors.items())
    assert cached.file.metadata["qwen3.block_count"] == parsed.file.metadata["qwen3.block_count"]
    from engine.text.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(parsed.file)
    text = "<|im_start|>user\nWhat is 1234 + 5?<|im_end|>"
    assert cached.tokenizer.encode(text) == tok.encode(text)


def test_stale_or_broken_cache_is_ignored(model_copy, caplog):
    prepare.write_cache(model_copy)
    with open(model_copy, "r+b") as f:  # change one byte of a metadata string: same size, different header
        data = f.read()
        at = data.index(b"Qwen3")
        f.seek(at)
        f.write(b"Qwen4")
    with caplog.at_level("INFO"):
        assert prepare.open_model(model_copy).cache_used is False
    assert "header bytes" in caplog.text
    with open(prepare.cache_path(model_copy), "wb") as f:
        f.write(b"RFLXCACHE1\n\xff\xff")
    assert prepare.open_model(model_copy).cache_used is False

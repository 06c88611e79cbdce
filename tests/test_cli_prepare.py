"""The command line (as a user runs it, in fresh processes) and the prepare cache."""

from __future__ import annotations

import json
import os
import re
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


def test_a_cache_of_an_older_format_is_written_again(model_copy):
    """The worker's ensure_prepared replaces a cache whose format is not the current one (a model folder prepared by
    an older image) instead of leaving every cold start to parse the GGUF."""
    from engine.worker import models

    with open(prepare.cache_path(model_copy), "wb") as f:
        f.write(b"RFLXCACHE2\n" + b"\0" * 64)
    assert not prepare.cache_is_current(model_copy)
    assert models.ensure_prepared(model_copy)
    assert prepare.cache_is_current(model_copy) and prepare.open_model(model_copy).cache_used


def in_process(*args: str) -> tuple[int, dict]:
    """(exit code, last JSON line) of cli.main in this process: argument errors never reach the engine."""
    import contextlib
    import io

    from engine.tools import cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        try:
            code = cli.main(list(args), fast_exit=False)
        except SystemExit as e:
            code = e.code
    lines = [ln for ln in out.getvalue().splitlines() if ln.strip()]
    return code, json.loads(lines[-1]) if lines else {}


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("generate", MODEL, "x", "--max-seq-len", "0"), "--max-seq-len: 0 is not in"),
        (("generate", MODEL, "x", "--max-seq-len", "-5"), "--max-seq-len: -5 is not in"),
        (("generate", MODEL, "x", "--temperature", "nan"), "--temperature: 'nan' is not a finite number"),
        (("generate", MODEL, "x", "--top-p", "0"), "--top-p"),
        (("generate", MODEL, "x", "--seed", "-1"), "--seed"),
        (("generate", MODEL, "x", "--max-tokens", "many"), "'many' is not an integer"),
        (("system1", MODEL, "x", "--candidate", "a", "--temperature", "inf"), "--temperature"),
        (("check", MODEL, "x", "--reference", "r.json", "--tolerance", "nan"), "--tolerance"),
        (("generate", MODEL), "the following arguments are required: prompt"),
        (("bogus",), "invalid choice"),
        (("generate", MODEL, "x", "--bogus"), "unrecognized arguments: --bogus"),
        (("generate", MODEL, "caf\udce9"), "argument 3 .* is not valid UTF-8"),
        (("--log-level", "loud", "smoke"), "'loud' is not one of"),
    ],
)
def test_bad_arguments_are_json_invalid_input_errors(args, match):
    code, out = in_process(*args)
    assert code == 2 and out["error_kind"] == "invalid_input", out
    assert re.search(match, out["error"]), out["error"]


def test_invalid_utf8_from_a_real_command_line_and_a_bad_log_level_setting():
    p = subprocess.run([os.fsencode(sys.executable), b"-m", b"engine", b"generate", os.fsencode(MODEL), b"caf\xe9"],
                       cwd=ROOT, capture_output=True, timeout=300)  # fmt: skip
    out = json.loads(p.stdout.decode().splitlines()[-1])
    assert p.returncode == 2 and out["error_kind"] == "invalid_input" and "UTF-8" in out["error"]
    p = subprocess.run([sys.executable, "-m", "engine", "smoke"], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "REFLEX_LOG_LEVEL": "loud"}, timeout=300)  # fmt: skip
    out = json.loads(p.stdout.splitlines()[-1])
    assert p.returncode == 2 and out["error_kind"] == "invalid_input" and "REFLEX_LOG_LEVEL" in out["error"]


def test_candidates_and_text_are_capped_as_in_the_worker(monkeypatch):
    many = [a for i in range(65) for a in ("--candidate", f" c{i}")]
    code, out = in_process("system1", MODEL, "x", *many)
    assert code == 2 and out["error_kind"] == "invalid_input" and "MAX_CANDIDATES" in out["error"]
    monkeypatch.setenv("MAX_PROMPT_CHARS", "10")
    code, out = in_process("generate", MODEL, "x" * 11)
    assert code == 2 and "MAX_PROMPT_CHARS" in out["error"]
    monkeypatch.setenv("MAX_CANDIDATES", "abc")
    code, out = in_process("system1", MODEL, "x", "--candidate", "a")
    assert code == 2 and out["error_kind"] == "invalid_input" and "MAX_CANDIDATES" in out["error"]


@pytest.mark.parametrize(
    "reference",
    [
        {"token_ids": [], "logit_checksum": 1.0},
        {"token_ids": "12", "logit_checksum": 1.0},
        {"token_ids": [1, True], "logit_checksum": 1.0},
        {"token_ids": [1], "logit_checksum": "nan"},
        {"token_ids": [1], "logit_checksum": float("nan")},
        {"logit_checksum": 1.0},
        [1, 2],
    ],
)
def test_a_malformed_reference_is_an_unreadable_reference(tmp_path, reference):
    ref = tmp_path / "ref.json"
    ref.write_text(json.dumps(reference))
    code, out = in_process("check", MODEL, "x", "--max-tokens", "1", "--reference", str(ref))
    assert code == 2 and out["error_kind"] == "invalid_input" and "cannot read reference" in out["error"], out

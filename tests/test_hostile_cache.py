"""Hostile prepare caches (engine/prepare.py): edited, copied beside another file, huge, unwritable. Each is ignored
with a log line (or refused, when writing) and the answer is the one a fresh parse gives."""

from __future__ import annotations

import json
import os
import shutil
import struct
import time
import tracemalloc

import pytest

from engine import gguf, prepare
from engine.engine import Engine
from engine.errors import InvalidInput
from engine.tools import cli
from tests import conformance as C

MODEL = C.fixture_path("qwen3-tiny-q8_0", ".gguf")
PROMPT = "The capital of France is"


@pytest.fixture
def model(tmp_path):
    path = str(tmp_path / "m.gguf")
    shutil.copy(MODEL, path)
    return path


def greedy(path: str) -> tuple[list[int], bool]:
    engine = Engine.load(path, backend="cpu", max_seq_len=64)
    result = engine.generate(PROMPT, max_tokens=8)
    return result["token_ids"], result["cold_start"]["prepare_cache_used"]


def ignored(path: str, caplog, why: str) -> None:
    caplog.clear()
    with caplog.at_level("INFO", logger="engine.prepare"):
        assert prepare.open_model(path).cache_used is False
    assert why in caplog.text, caplog.text


def test_one_changed_digit_of_a_tensor_offset_is_noticed(model, caplog):
    fresh, used = greedy(model)
    assert not used
    prepare.write_cache(model)
    assert greedy(model) == (fresh, True)
    cache = prepare.cache_path(model)
    with open(cache, "rb") as f:
        data = bytearray(f.read())
    info = gguf.read(model).tensors["blk.1.ffn_down.weight"]
    at = data.index(b'"blk.1.ffn_down.weight",')
    digits = str(info.offset).encode()
    at = data.index(b"," + digits + b",", at) + 1
    data[at] = ord("1") if data[at] != ord("1") else ord("2")  # the offset, one digit off
    with open(cache, "wb") as f:
        f.write(data)
    ignored(model, caplog, "do not match their digest")
    assert greedy(model) == (fresh, False)


@pytest.mark.parametrize("field", ["size", "format", "data_offset"])
def test_an_edited_value_is_reported_as_an_edit_not_as_another_file(model, caplog, field):
    """The JSON is read tentatively before its digest is checked (its data offset and file size start the model's
    hashing early): a value edited there must still end in the digest's message, and nothing from it used."""
    prepare.write_cache(model)
    cache = prepare.cache_path(model)
    with open(cache, "rb") as f:
        data = f.read()
    value = {"size": os.path.getsize(model), "format": prepare.FORMAT, "data_offset": gguf.read(model).data_offset}
    old = f'"{field}":{value[field]}'.encode()
    new = old[:-1] + (b"1" if old[-1:] != b"1" else b"2")  # its last digit off
    assert data.count(old) >= 1
    with open(cache, "wb") as f:
        f.write(data.replace(old, new, 1))
    ignored(model, caplog, "do not match their digest")


def test_a_cache_copied_beside_another_file_of_the_same_size_and_header_is_noticed(tmp_path, caplog):
    a, b = str(tmp_path / "a.gguf"), str(tmp_path / "b.gguf")
    shutil.copy(MODEL, a)
    shutil.copy(MODEL, b)
    f = gguf.read(b)
    span = f.size - f.data_offset
    with open(b, "r+b") as fh:  # other tensor data: a byte inside the 33rd sampled block
        fh.seek(f.data_offset + span * 32 // 64 + 100)
        byte = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([byte[0] ^ 0x55]))
    prepare.write_cache(a)
    shutil.copy(prepare.cache_path(a), prepare.cache_path(b))
    ignored(b, caplog, "tensor data (sampled)")
    engine = Engine.load(b, backend="cpu", max_seq_len=64)
    assert engine.sha256 == prepare.file_sha256(b) != prepare.file_sha256(a)


@pytest.mark.parametrize("kind", ["no magic", "a section over the limit", "sections that do not add up"])
def test_a_huge_garbage_cache_costs_one_small_read(model, caplog, kind):
    cache = prepare.cache_path(model)
    size = 1_500_000_000  # sparse: nothing is written but the preamble
    with open(cache, "wb") as f:
        if kind != "no magic":
            n_json = size - len(prepare.MAGIC) - 48 if kind == "a section over the limit" else 1000
            f.write(prepare.MAGIC + struct.pack("<QQ32s", n_json, 0, b"\0" * 32))
        f.truncate(size)
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        opened = prepare.open_model(model)
        elapsed, peak = time.perf_counter() - t0, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert opened.cache_used is False and elapsed < 1.0 and peak < 32 << 20, (elapsed, peak)
    ignored(model, caplog, "bad magic" if kind == "no magic" else "do not match its size")


def test_a_truncated_cache_is_ignored(model, caplog):
    prepare.write_cache(model)
    cache = prepare.cache_path(model)
    os.truncate(cache, os.path.getsize(cache) // 2)
    ignored(model, caplog, "do not match its size")


def test_an_unwritable_cache_is_a_typed_error_and_leaves_nothing_behind(model, tmp_path):
    os.mkdir(prepare.cache_path(model))  # a directory where the cache goes
    with pytest.raises(InvalidInput, match="cannot write the cache"):
        prepare.write_cache(model)
    assert sorted(os.listdir(tmp_path)) == ["m.gguf", "m.gguf.reflex-cache"]
    assert os.listdir(prepare.cache_path(model)) == []


def test_prepare_writes_only_where_the_loader_reads(model, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["prepare", model, "--output", model + ".elsewhere"], fast_exit=False)
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert e.value.code == 2 and out["error_kind"] == "invalid_input" and "--output" in out["error"]
    assert cli.main(["prepare", model], fast_exit=False) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["cache"] == prepare.cache_path(model) and out["cache_used"] is True

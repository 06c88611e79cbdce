"""engine.cpu.dequant against gguf-py's dequantizer, bit for bit, on fresh random blocks every run.

Each run draws a new seed and names it in every failure message; set DEQUANT_SEED=<seed> to replay one. gguf-py has
no Q8_K decoder: its reference here is its definition (f32 d times the int8 quants), and tests/test_quant_ggml.py
checks it, like every other type, against llama.cpp's own dequantizer.
"""

from __future__ import annotations

import math
import os
import tracemalloc

import gguf
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import engine.cpu.dequant as dq
from engine.cpu.dequant import dequantize, dequantize_rows
from engine.errors import GGUFError, InvalidInput, UnsupportedArchitecture
from engine.quants import BLOCK_SIZES, SUPPORTED_TYPES, GGMLType, row_bytes, type_name
from tests.quant_blocks import random_blocks, random_bytes

TYPES = sorted(SUPPORTED_TYPES)
QUANTIZED = [t for t in TYPES if BLOCK_SIZES[t][0] > 1]


@pytest.fixture
def seed() -> int:
    return int(os.environ.get("DEQUANT_SEED") or np.random.default_rng().integers(2**63))


def reference(raw: np.ndarray, ggml_type: GGMLType, shape: tuple[int, ...]) -> np.ndarray:
    if ggml_type == GGMLType.Q8_K:  # | d: f32 (4) | qs: int8[256] (256) | bsums: int16[16] (32) |
        blocks = raw.reshape(-1, 292)
        return (blocks[:, 0:4].view(np.float32) * blocks[:, 4:260].view(np.int8).astype(np.float32)).reshape(shape)
    byte_shape = (*shape[:-1], row_bytes(ggml_type, shape[-1]))
    return gguf.quants.dequantize(raw.reshape(byte_shape), gguf.GGMLQuantizationType(int(ggml_type)))


def assert_bit_identical(actual: np.ndarray, expected: np.ndarray, context: str) -> None:
    assert actual.dtype == np.float32 and actual.flags.c_contiguous, context
    assert actual.shape == expected.shape, f"{context}: shape {actual.shape} != {expected.shape}"
    assert np.array_equal(actual, expected), f"{context}: values differ"
    # array_equal calls -0.0 == 0.0; the bit patterns must match too.
    assert np.array_equal(actual.view(np.uint32), expected.view(np.uint32)), f"{context}: bit patterns differ"


def check_against_gguf(ggml_type: GGMLType, shape: tuple[int, ...], seed: int) -> None:
    raw = random_blocks(np.random.default_rng(seed), ggml_type, shape)
    context = f"{ggml_type.name} shape {shape} seed {seed}"
    assert_bit_identical(dequantize(raw, ggml_type, shape), reference(raw, ggml_type, shape), context)


# Shapes in blocks: the last entry is the number of blocks per row.
SHAPES_IN_BLOCKS = [(1,), (1, 1), (3, 4), (7, 1), (2, 3, 2), (5, 9)]


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("blocks_shape", SHAPES_IN_BLOCKS, ids=str)
def test_matches_gguf(ggml_type: GGMLType, blocks_shape: tuple[int, ...], seed: int) -> None:
    block = BLOCK_SIZES[ggml_type][0]
    check_against_gguf(ggml_type, (*blocks_shape[:-1], blocks_shape[-1] * block), seed)


@settings(max_examples=400, deadline=None)
@given(
    ggml_type=st.sampled_from(TYPES),
    n_rows=st.integers(1, 8),
    n_blocks=st.integers(1, 6),
    seed=st.integers(0, 2**63 - 1),
)
def test_matches_gguf_any_size(ggml_type: GGMLType, n_rows: int, n_blocks: int, seed: int) -> None:
    check_against_gguf(ggml_type, (n_rows, n_blocks * BLOCK_SIZES[ggml_type][0]), seed)


def test_chunked_matches_gguf(seed: int) -> None:
    """Tensors several chunks long, ending in a partial chunk."""
    rng = np.random.default_rng(seed)
    for ggml_type in TYPES:
        n_cols = 4 * BLOCK_SIZES[ggml_type][0] if ggml_type in QUANTIZED else 1000
        shape = (int(2.5 * dq._CHUNK_VALUES) // n_cols + 1, n_cols)
        assert math.prod(shape) > 2 * dq._CHUNK_VALUES
        raw = random_blocks(rng, ggml_type, shape)
        context = f"{ggml_type.name} shape {shape} seed {seed}"
        assert_bit_identical(dequantize(raw, ggml_type, shape), reference(raw, ggml_type, shape), context)


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_tiny_chunks_match_gguf(ggml_type: GGMLType, seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk of a few blocks, not dividing the tensor, splits rows and blocks at awkward places."""
    block = BLOCK_SIZES[ggml_type][0]
    monkeypatch.setattr(dq, "_CHUNK_VALUES", 3 * block)
    shape = (5, 7 * block)
    raw = random_blocks(np.random.default_rng(seed), ggml_type, shape)
    context = f"{ggml_type.name} shape {shape} seed {seed}"
    expected = reference(raw, ggml_type, shape)
    assert_bit_identical(dequantize(raw, ggml_type, shape), expected, context)
    rows = [4, 0, 4, 2, 1, 3, 3]
    assert_bit_identical(dequantize_rows(raw, ggml_type, shape[1], rows), expected[rows], context)


@pytest.mark.parametrize("ggml_type", QUANTIZED, ids=lambda t: t.name)
def test_temporaries_stay_bounded(ggml_type: GGMLType, seed: int) -> None:
    """A 4M-value matrix, whose unchunked temporaries would be 40-60 MB (10-14 bytes per value), stays within 16 MB
    beyond its output."""
    shape = (4096, 1024)
    raw = random_blocks(np.random.default_rng(seed), ggml_type, shape)
    tracemalloc.start()
    try:
        out = dequantize(raw, ggml_type, shape)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak - out.nbytes < 16 * 2**20, f"peak {peak / 2**20:.1f} MiB for a {out.nbytes / 2**20:.0f} MiB output"


@pytest.mark.parametrize("ggml_type", [t for t in QUANTIZED if t != GGMLType.Q8_K], ids=lambda t: t.name)
def test_random_bytes_match_gguf(ggml_type: GGMLType, seed: int) -> None:
    """Every byte random, scales included: NaN comes out exactly where gguf-py's does (its payload bits are the
    hardware's business), every other value (inf included) bit for bit."""
    shape = (3, 40 * BLOCK_SIZES[ggml_type][0])
    raw = random_bytes(np.random.default_rng(seed), ggml_type, shape)
    with np.errstate(all="ignore"):
        expected = reference(raw, ggml_type, shape)
        actual = dequantize(raw, ggml_type, shape)
    context = f"{ggml_type.name} seed {seed}"
    nan = np.isnan(expected)
    assert np.array_equal(np.isnan(actual), nan), f"{context}: NaN elsewhere"
    assert np.array_equal(actual.view(np.uint32)[~nan], expected.view(np.uint32)[~nan]), f"{context}: bits differ"


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_rows_match_full_tensor(ggml_type: GGMLType, seed: int) -> None:
    rng = np.random.default_rng(seed)
    shape = (37, 3 * BLOCK_SIZES[ggml_type][0])
    raw = random_blocks(rng, ggml_type, shape)
    full = dequantize(raw, ggml_type, shape)
    context = f"{ggml_type.name} seed {seed}"
    rows = rng.integers(0, shape[0], size=int(rng.integers(1, 60)))  # repeats likely
    assert_bit_identical(dequantize_rows(raw, ggml_type, shape[1], rows), full[rows], context)
    as_list = [int(r) for r in rows[:5]]
    assert_bit_identical(dequantize_rows(raw, int(ggml_type), shape[1], as_list), full[as_list], context)
    assert dequantize_rows(raw, ggml_type, shape[1], []).shape == (0, shape[1])


def test_rows_across_chunks(seed: int) -> None:
    rng = np.random.default_rng(seed)
    shape = (2000, 1024)
    raw = random_blocks(rng, GGMLType.Q4_K, shape)
    rows = rng.integers(0, shape[0], size=3 * dq._CHUNK_VALUES // shape[1] + 7)
    expected = reference(raw, GGMLType.Q4_K, shape)[rows]
    assert_bit_identical(dequantize_rows(raw, GGMLType.Q4_K, shape[1], rows), expected, f"seed {seed}")


def test_read_only_unaligned_view(seed: int) -> None:
    """Bytes straight from a file: read-only and at an odd address."""
    shape = (3, 64)
    raw = random_blocks(np.random.default_rng(seed), GGMLType.Q5_1, shape)
    view = np.frombuffer(b"\0" + raw.tobytes(), dtype=np.uint8)[1:]
    assert not view.flags.writeable
    assert_bit_identical(dequantize(view, GGMLType.Q5_1, shape), reference(raw, GGMLType.Q5_1, shape), f"seed {seed}")
    out = dequantize(view, GGMLType.Q5_1, shape)
    assert_bit_identical(dequantize_rows(view, GGMLType.Q5_1, 64, [2, 0]), out[[2, 0]], f"seed {seed}")


def test_float_tensors_are_copied() -> None:
    raw = np.arange(8, dtype=np.float32).view(np.uint8)
    out = dequantize(raw, GGMLType.F32, (2, 4))
    assert not np.shares_memory(out, raw)
    assert out.flags.writeable and out.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_empty_tensor() -> None:
    assert dequantize(np.zeros(0, dtype=np.uint8), GGMLType.Q8_0, (0, 32)).shape == (0, 32)


@pytest.mark.parametrize("extra", [-1, 1, -34])
def test_wrong_byte_length(extra: int) -> None:
    raw = np.zeros(2 * 34 + extra, dtype=np.uint8)
    with pytest.raises(GGUFError, match="needs 68 bytes"):
        dequantize(raw, GGMLType.Q8_0, (2, 32))


def test_last_dim_not_a_whole_number_of_blocks() -> None:
    with pytest.raises(GGUFError, match="not a multiple of the block size 256"):
        dequantize(np.zeros(144, dtype=np.uint8), GGMLType.Q4_K, (1, 100))
    with pytest.raises(GGUFError, match="block size 32"):
        dequantize_rows(np.zeros(34, dtype=np.uint8), GGMLType.Q8_0, 48, [0])


@pytest.mark.parametrize("shape", [(), (2, -32)])
def test_invalid_shape(shape: tuple[int, ...]) -> None:
    with pytest.raises(GGUFError, match="invalid shape"):
        dequantize(np.zeros(0, dtype=np.uint8), GGMLType.Q8_0, shape)


@pytest.mark.parametrize("ggml_type", [GGMLType.Q8_1, 40, 99], ids=str)
def test_unsupported_type(ggml_type: int) -> None:
    name = type_name(ggml_type)
    raw = np.zeros(84, dtype=np.uint8)
    with pytest.raises(UnsupportedArchitecture, match=f"tensor type {name} is not supported"):
        dequantize(raw, ggml_type, (1, 256))
    with pytest.raises(UnsupportedArchitecture, match=name):
        dequantize_rows(raw, ggml_type, 256, [0])


def test_rows_byte_length_not_whole_rows() -> None:
    with pytest.raises(GGUFError, match="not a whole number of 68-byte rows"):
        dequantize_rows(np.zeros(3 * 34, dtype=np.uint8), GGMLType.Q8_0, 64, [0])


@pytest.mark.parametrize("rows", [[4], [0, -1], [1.0], [[0, 1]], [True]], ids=str)
def test_bad_rows(rows: list) -> None:
    raw = np.zeros(4 * 34, dtype=np.uint8)
    with pytest.raises(InvalidInput):
        dequantize_rows(raw, GGMLType.Q8_0, 32, rows)

"""engine.cpu.dequant against llama.cpp's own C dequantizer (`dequantize_row_<type>`), on the random blocks stored
in tests/fixtures/ggml-dequant.npz by scripts/make_ggml_dequant_fixture.py.

This is the reference for Q8_K, which gguf-py cannot decode, and a second one for every other quantized type; the
blocks of random bytes (scales that are inf or NaN) are compared NaN-aware, as in tests/test_dequant.py.
"""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest

from engine.cpu.dequant import dequantize, dequantize_rows
from engine.quants import BLOCK_SIZES, SUPPORTED_TYPES, GGMLType
from tests import conformance as C

FIXTURE = np.load(C.fixture_path("ggml-dequant", ".npz"))
TYPES = [GGMLType[name] for name in json.loads(str(FIXTURE["producer"]))["types"]]


def assert_same(actual: np.ndarray, expected: np.ndarray, context: str) -> None:
    nan = np.isnan(expected)
    assert np.array_equal(np.isnan(actual), nan), f"{context}: NaN elsewhere"
    assert np.array_equal(actual.view(np.uint32)[~nan], expected.view(np.uint32)[~nan]), f"{context}: bits differ"


def test_fixture_covers_every_quantized_type():
    assert set(TYPES) == {t for t in SUPPORTED_TYPES if BLOCK_SIZES[t][0] > 1}


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("kind", ["", "_raw"], ids=["well-formed", "random-bytes"])
def test_matches_llama_cpp(ggml_type: GGMLType, kind: str):
    blocks = FIXTURE[f"{ggml_type.name}{kind}_blocks"]  # (n, type_size) u8
    expected = FIXTURE[f"{ggml_type.name}{kind}_values"]  # (n * block_size,) f32
    block = BLOCK_SIZES[ggml_type][0]
    with np.errstate(all="ignore"):  # random bytes: inf and NaN scales
        assert_same(dequantize(blocks.reshape(-1), ggml_type, expected.shape), expected, ggml_type.name)
        rows = dequantize_rows(blocks.reshape(-1), ggml_type, block, np.arange(len(blocks))[::-1])
    assert_same(rows, expected.reshape(-1, block)[::-1], f"{ggml_type.name} rows")
    if not kind:
        assert np.isfinite(expected).all(), "well-formed blocks decode to finite values"


@pytest.mark.parametrize("ggml_type", [t for t in TYPES if t != GGMLType.Q8_K], ids=lambda t: t.name)
def test_the_two_oracles_agree(ggml_type: GGMLType):
    """gguf-py (the oracle of tests/test_dequant.py) and llama.cpp decode the same blocks to the same bits."""
    blocks = FIXTURE[f"{ggml_type.name}_blocks"]
    decoded = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType(int(ggml_type))).reshape(-1)
    assert_same(decoded, FIXTURE[f"{ggml_type.name}_values"], ggml_type.name)

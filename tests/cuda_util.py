"""Shared pieces of the kernel tests (GPU only): the context, random GGUF weights on the device."""

from __future__ import annotations

import numpy as np
import pytest

from engine.cpu.dequant import dequantize
from engine.cuda import driver
from engine.cuda.memory import DeviceArray, DeviceWeight
from engine.quants import BLOCK_SIZES, GGMLType, row_bytes
from tests.quant_data import random_weights


@pytest.fixture(scope="module", autouse=True)
def cuda_context() -> None:
    driver.start_context(0)


def needs_blocks(ggml_type: GGMLType, cols: int) -> None:
    if cols % BLOCK_SIZES[ggml_type][0]:
        pytest.skip(f"{ggml_type.name} rows are whole {BLOCK_SIZES[ggml_type][0]}-value blocks")


class Weight:
    """A random (rows, cols) matrix on the device in its GGUF layout, allocated to the byte, and its f64 values."""

    def __init__(self, rng: np.random.Generator, ggml_type: GGMLType, rows: int, cols: int):
        raw = random_weights(rng, ggml_type, (rows, cols))  # (rows * row_bytes,) u1
        self.dense = dequantize(raw, ggml_type, (rows, cols)).astype(np.float64)  # (rows, cols)
        self.array = DeviceArray.from_host(raw)
        self.dev = DeviceWeight(self.array.ptr, ggml_type, rows, cols, row_bytes(ggml_type, cols), ggml_type.name)

"""Shared pieces of the kernel tests (GPU only): the context, random GGUF weights on the device, greedy ids from
fresh processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from engine.cpu.dequant import dequantize
from engine.cuda import driver
from engine.cuda.memory import DeviceArray, DeviceWeight
from engine.quants import BLOCK_SIZES, GGMLType, row_bytes
from tests import conformance as C
from tests.quant_data import random_weights

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LONG_PROMPT = "Hello there, this prompt is longer than eight tokens"  # past the 8-token matvec batch: a prefill GEMM


@pytest.fixture(scope="module", autouse=True)
def cuda_context() -> None:
    driver.start_context(0)


def needs_blocks(ggml_type: GGMLType, cols: int) -> None:
    if cols % BLOCK_SIZES[ggml_type][0]:
        pytest.skip(f"{ggml_type.name} rows are whole {BLOCK_SIZES[ggml_type][0]}-value blocks")


class Weight:
    """A random (rows, cols) matrix on the device in its GGUF layout, allocated to the byte, and its f64 values
    (`raw`: those bytes instead of random ones)."""

    def __init__(self, rng: np.random.Generator, ggml_type: GGMLType, rows: int, cols: int,
                 raw: np.ndarray | None = None):  # fmt: skip
        if raw is None:
            raw = random_weights(rng, ggml_type, (rows, cols))  # (rows * row_bytes,) u1
        self.dense = dequantize(raw, ggml_type, (rows, cols)).astype(np.float64)  # (rows, cols)
        self.array = DeviceArray.from_host(raw)
        self.dev = DeviceWeight(self.array.ptr, ggml_type, rows, cols, row_bytes(ggml_type, cols), ggml_type.name)


def greedy_ids_per_setting(fixture: str, var: str, values: tuple[str, ...], prompts: tuple[str, ...],
                           max_tokens: int) -> list[list[list[int]]]:  # fmt: skip
    """For each value of the environment variable `var`, a fresh process loads `fixture` on the CUDA backend and
    generates greedily from each prompt in turn: [value][prompt] -> token ids."""
    code = (
        "import json\nfrom engine.engine import Engine\n"
        f"e = Engine.load({C.fixture_path(fixture, '.gguf')!r}, backend='cuda')\n"
        f"print(json.dumps([e.generate(p, max_tokens={max_tokens})['token_ids'] for p in {list(prompts)!r}]))\n"
    )
    out = []
    for value in values:
        p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, var: value},
                           capture_output=True, text=True, timeout=300)  # fmt: skip
        assert p.returncode == 0, p.stderr
        out.append(json.loads(p.stdout))
    return out

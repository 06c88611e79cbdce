"""Caches mapped by need on the GPU (engine/cuda/vmm.py): rows written and read back across growth, the typed
out-of-memory error, the up-front fallback, and a model whose logits do not depend on how its cache was allocated."""

from __future__ import annotations

import numpy as np
import pytest

from engine.cuda import driver, memory, vmm
from engine.engine import Engine
from engine.errors import CudaError, OutOfMemory
from tests import conformance as C

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def context() -> None:
    driver.start_context(0)


def row_address(a: vmm.ByNeedArray, layer: int, row: int) -> int:
    return a.ptr + layer * a.layer_bytes + row * a.row_bytes


def write_row(a: vmm.ByNeedArray, layer: int, row: int, values) -> np.ndarray:
    v = np.ascontiguousarray(values, np.float32)
    memory.memcpy(row_address(a, layer, row), v.ctypes.data, a.row_bytes, memory.H2D)
    return v


def read_row(a: vmm.ByNeedArray, layer: int, row: int) -> np.ndarray:
    out = np.empty(a.row_bytes // 4, np.float32)
    memory.memcpy(out.ctypes.data, row_address(a, layer, row), a.row_bytes, memory.D2H)
    return out


def test_rows_survive_growth() -> None:
    a = vmm.cache((3, 5000, 8, 128))
    assert isinstance(a, vmm.ByNeedArray) and a.mapped_rows == vmm.MIN_ROWS
    first = a.mapped_bytes
    assert first < a.nbytes
    rng = np.random.default_rng(0)
    written = {}
    for rows in (vmm.MIN_ROWS, 700, 3000, 5000):
        a.ensure(rows)
        assert a.mapped_rows >= rows
        for layer in range(3):
            row = int(rng.integers(0, rows))
            written[layer, row] = write_row(a, layer, row, rng.standard_normal(1024))
        for (layer, row), v in written.items():  # rows written before a growth keep their values
            assert np.array_equal(read_row(a, layer, row), v), (layer, row, rows)
    assert a.mapped_bytes >= a.nbytes > first
    with pytest.raises(CudaError):
        a.fill_byte(0)
    with pytest.raises(CudaError):
        a.to_host()
    a.free()
    assert a.ptr == 0


def test_out_of_memory_is_typed_and_keeps_what_was_mapped() -> None:
    free, _ = memory.runtime().memGetInfo()
    rows = int(free // (1 << 20)) + 4096  # 1 MiB rows: more than the device has
    a = vmm.cache((1, rows, 1 << 18))
    kept = write_row(a, 0, 3, np.arange(1 << 18))
    with pytest.raises(OutOfMemory):
        a.ensure(rows)
    assert a.mapped_rows == vmm.MIN_ROWS and np.array_equal(read_row(a, 0, 3), kept)
    a.free()


def test_up_front_when_asked(monkeypatch) -> None:
    monkeypatch.setenv("REFLEX_KV_BY_NEED", "0")
    a = vmm.cache((2, 300, 64))
    assert isinstance(a, vmm.UpFrontArray) and a.mapped_rows == 300 and a.mapped_bytes == a.nbytes
    a.ensure(300)
    a.fill_byte(0)
    assert not a.to_host().any()


def test_model_logits_do_not_depend_on_the_allocation(monkeypatch) -> None:
    """The tiny dense model over every position its context allows (growing past the first rows mapped): the same
    bits whether its cache was mapped by need or allocated up front; the load reports both sizes."""
    path = C.fixture_path("qwen3-tiny-q8_0", ".gguf")
    by_need = Engine.load(path, backend="cuda", max_seq_len=32768)
    cold = by_need.cold_start.take()
    assert 0 < cold["kv_cache_mapped_mib"] <= cold["kv_cache_mib"], cold
    assert isinstance(by_need.runner.model.k_cache, vmm.ByNeedArray)
    monkeypatch.setenv("REFLEX_KV_BY_NEED", "0")
    up_front = Engine.load(path, backend="cuda", max_seq_len=32768)
    assert isinstance(up_front.runner.model.k_cache, vmm.UpFrontArray)
    n = min(700, by_need.max_seq)
    ids = (by_need.tokenizer.encode("def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1)\n") * 60)[:n]
    for prefill in (n, n // 2):
        a, b = by_need.logits(ids, prefill=prefill), up_front.logits(ids, prefill=prefill)
        assert np.array_equal(a, b), prefill
    assert by_need.runner.model.k_cache.mapped_rows >= n

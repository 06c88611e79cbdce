"""Programmatic dependent launch (engine/cuda/driver.py, kernels/pdl.cuh): on the H200 the decode step's launches
carry the attribute, so the model tests' decode runs that way; here a chain of programmatic launches that each read
what the one before wrote, issued directly and replayed as a graph, must lose no update, and every family's greedy
decode must give the same ids with the attribute as without it (a kernel that reads an activation before its wait,
or through loads that may be scheduled above it, reads the one before's stale output only when launched early)."""

from __future__ import annotations

import numpy as np
import pytest

from engine.cuda import driver, k_smoke, memory
from engine.cuda.memory import DeviceArray
from tests import cuda_util as cu
from tests.cuda_util import cuda_context  # noqa: F401 - autouse fixture

pytestmark = pytest.mark.gpu

N, STEPS = 1 << 20, 200  # a million floats a launch, so each launch runs long enough to overlap a neighbour


def _arch_major() -> int:
    return int(driver.device_info(0)["arch"][3:-1])


def test_pdl_is_on_from_sm_90() -> None:
    assert driver.pdl_enabled() == (_arch_major() >= 9)


@pytest.mark.parametrize("graph", [False, True], ids=["direct", "graph"])
def test_a_chain_of_dependent_launches_loses_no_update(graph: bool) -> None:
    rng = np.random.default_rng()
    x = rng.integers(-8, 8, N).astype(np.float32)
    y0 = rng.integers(-1000, 1000, N).astype(np.float32)
    dx, dy = DeviceArray.from_host(x), DeviceArray.from_host(y0)
    (launch,) = driver.programmatic([k_smoke.axpy(1.0, dx, dy, N)])  # y += x: each reads the y the one before wrote
    stream = memory.stream_create()
    if graph:
        g = memory.Graph(stream)
        with g:
            for _ in range(STEPS):
                launch(stream)
        g.launch()
        memory.synchronize(stream)
        g.destroy()
    else:
        for _ in range(STEPS):
            launch(stream)
        memory.synchronize(stream)
    np.testing.assert_array_equal(dy.to_host(), y0 + STEPS * x)  # small integers: exact in float32


@pytest.mark.parametrize("name", ["qwen3-tiny-q8_0", "qwen3moe-tiny-q8_0", "deepseek2-tiny-q8_0", "qwen35-tiny-q8_0"])
def test_decode_is_the_same_with_and_without_early_launch(name: str) -> None:
    if _arch_major() < 9:
        pytest.skip("programmatic dependent launch needs sm_90")
    prompts = (cu.LONG_PROMPT, "The capital of France is")
    early, plain = cu.greedy_ids_per_setting(name, "REFLEX_PDL", ("1", "0"), prompts, 24)
    assert early == plain, name

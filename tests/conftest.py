"""GPU tests (marker `gpu`) run only where the CUDA backend can: a device, CuPy's bindings and built kernels."""

from __future__ import annotations

import functools

import pytest


@functools.cache
def _cuda() -> tuple[bool, str]:
    try:
        from engine.cuda.driver import probe

        return probe()
    except Exception as e:  # any failure to probe means: no GPU here
        return False, str(e)


def pytest_collection_modifyitems(config, items):
    ok, why = _cuda()
    if ok:
        return
    skip = pytest.mark.skip(reason=f"no CUDA backend here: {why}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

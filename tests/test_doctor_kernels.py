"""doctor's kernel check against the build's manifest: native code for the GPU passes, a newer GPU with PTX of an
older arch warns (a JIT at first load), without PTX fails, and so does a GPU older than the PTX."""

from __future__ import annotations

import json

import pytest

from engine.cuda import driver
from engine.tools import doctor


@pytest.mark.parametrize(("archs", "ptx", "gpu", "status"), [
    ("75;80;86;89;90", "compute_90", "sm_90", "pass"),
    ("75;80;86;89;90", "compute_90", "sm_120", "warn"),
    ("90", None, "sm_120", "fail"),
    ("90", "compute_90", "sm_86", "fail"),
])  # fmt: skip
def test_kernel_check_reads_the_manifest(tmp_path, monkeypatch, archs, ptx, gpu, status) -> None:
    manifest = {"archs": archs, "ptx": ptx, "nvcc": "Build cuda_13.0", "lineinfo": False, "modules": {"a": {}}}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    monkeypatch.setattr(driver, "KERNEL_DIR", str(tmp_path))
    monkeypatch.setattr(driver, "device_info", lambda device: {"arch": gpu})
    got, detail = doctor._kernels()
    assert got == status, detail

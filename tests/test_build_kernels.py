"""build_kernels.sh's incremental build, with a stand-in nvcc (no CUDA toolkit needed): a module is rebuilt when
its source, a header it includes, the flags or the nvcc version change, and only then; FORCE=1 rebuilds all; a fresh
build directory takes what an earlier build compiled from the cache; errors and spills still fail the build."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Prints what the real nvcc prints for the script's three uses; a compile writes its output and a ptxas log with
# one kernel (spilling when the source says SPILL), fails when the source says FAIL, and logs the source compiled.
FAKE_NVCC = r"""#!/usr/bin/env bash
case "$1" in
  --list-gpu-code) printf 'sm_75\nsm_80\nsm_86\nsm_89\nsm_90\n'; exit 0 ;;
  --version) echo "Cuda compilation tools, release ${FAKE_NVCC_RELEASE:-12.8}, V12.8.93"; exit 0 ;;
esac
out= src=
while (($#)); do case "$1" in -o) out=$2; shift 2 ;; *) src=$1; shift ;; esac; done
echo "$src" >> "$FAKE_NVCC_LOG"
grep -q FAIL "$src" && { echo "$src(1): error: FAIL" >&2; exit 1; }
spill=0; grep -q SPILL "$src" && spill=8
echo "fatbin of $src" > "$out"
echo "ptxas info    : Compiling entry function 'k_$(basename "$src" .cu)' for 'sm_90'" >&2
echo "ptxas info    : Function properties for k" >&2
echo "    0 bytes stack frame, $spill bytes spill stores, 0 bytes spill loads" >&2
echo "ptxas info    : Used 32 registers, used 0 barriers, 0 bytes smem, 368 bytes cmem[0]" >&2
"""


@pytest.fixture
def tree(tmp_path):
    """A copy of build_kernels.sh beside a kernels/ of three modules: a.cu and b.cu include common.cuh (which
    includes deep.cuh), c.cu includes nothing."""
    shutil.copy(os.path.join(ROOT, "build_kernels.sh"), tmp_path)
    k = tmp_path / "kernels"
    k.mkdir()
    (k / "deep.cuh").write_text("// deep v1\n")
    (k / "common.cuh").write_text('#pragma once\n#include "deep.cuh"\n#include <stdint.h>\n')
    (k / "a.cu").write_text('#include "common.cuh"\n// a\n')
    (k / "b.cu").write_text('  #  include "common.cuh"\n// b\n')
    (k / "c.cu").write_text("// c\n")
    nvcc = tmp_path / "nvcc"
    nvcc.write_text(FAKE_NVCC)
    nvcc.chmod(0o755)
    return tmp_path


def build(tree, **env) -> tuple[int, set[str], str]:
    """(exit code, stems compiled by this run, all output)."""
    log = tree / "nvcc.log"
    log.write_text("")
    full_env = {**os.environ, "NVCC": str(tree / "nvcc"), "FAKE_NVCC_LOG": str(log), "JOBS": "2",
                "CUDA_ARCHS": "90", "KERNEL_CACHE_DIR": "", **env}  # fmt: skip
    if "KERNEL_BUILD_DIR" not in env:
        full_env.pop("KERNEL_BUILD_DIR", None)
    p = subprocess.run(["bash", str(tree / "build_kernels.sh")], env=full_env, capture_output=True, text=True)
    compiled = {os.path.basename(line).removesuffix(".cu") for line in log.read_text().split()}
    return p.returncode, compiled, p.stdout + p.stderr


def test_only_changed_modules_are_rebuilt(tree):
    code, compiled, out = build(tree)
    assert code == 0 and compiled == {"a", "b", "c"}, out
    manifest = json.loads((tree / "kernels/build/manifest.json").read_text())
    assert set(manifest["modules"]) == {"a", "b", "c"}
    assert build(tree)[:2] == (0, set())  # nothing changed: nothing compiled, manifest and resources rewritten
    assert json.loads((tree / "kernels/build/manifest.json").read_text()) == manifest
    (tree / "kernels/c.cu").write_text("// c v2\n")
    assert build(tree)[:2] == (0, {"c"})
    (tree / "kernels/deep.cuh").write_text("// deep v2\n")  # included through common.cuh
    assert build(tree)[:2] == (0, {"a", "b"})
    assert build(tree, CUDA_ARCHS="80;90")[:2] == (0, {"a", "b", "c"})  # other flags
    assert build(tree, CUDA_ARCHS="80;90", FAKE_NVCC_RELEASE="13.0")[:2] == (0, {"a", "b", "c"})  # other nvcc
    assert build(tree, CUDA_ARCHS="80;90", FAKE_NVCC_RELEASE="13.0", FORCE="1")[:2] == (0, {"a", "b", "c"})
    (tree / "kernels/b.cu").unlink()
    assert build(tree, CUDA_ARCHS="80;90", FAKE_NVCC_RELEASE="13.0")[:2] == (0, set())
    assert sorted(os.listdir(tree / "kernels/build")) == sorted(
        [f"{s}.{e}" for s in "ac" for e in ("fatbin", "ptxas.log", "stamp")] + ["manifest.json", "resources.txt"]
    )


def test_errors_and_spills_still_fail_loudly_and_are_retried(tree):
    assert build(tree)[0] == 0
    (tree / "kernels/a.cu").write_text('#include "common.cuh"\n// FAIL\n')
    code, compiled, out = build(tree)
    assert code != 0 and "FAILED kernels/a.cu" in out and compiled == {"a"}
    code, compiled, out = build(tree)  # a failed module is never stamped: tried again
    assert code != 0 and compiled == {"a"}
    (tree / "kernels/a.cu").write_text('#include "common.cuh"\n// SPILL\n')
    code, compiled, out = build(tree)
    assert code != 0 and "register spills" in out and compiled == {"a"}
    code, compiled, out = build(tree)  # skipped now, but its spill is still in resources.txt: still a failure
    assert code != 0 and "register spills" in out and compiled == set()


def test_a_fresh_build_directory_reuses_the_cache(tree):
    cache = {"KERNEL_CACHE_DIR": str(tree / "cache")}
    assert build(tree, **cache)[:2] == (0, {"a", "b", "c"})
    first = json.loads((tree / "kernels/build/manifest.json").read_text())
    code, compiled, out = build(tree, KERNEL_BUILD_DIR=str(tree / "scratch"), **cache)
    assert (code, compiled) == (0, set()) and out.count("from the cache") == 3, out
    assert json.loads((tree / "scratch/manifest.json").read_text())["modules"] == first["modules"]
    assert build(tree, KERNEL_BUILD_DIR=str(tree / "scratch2"), FORCE="1", **cache)[:2] == (0, {"a", "b", "c"})
    (tree / "kernels/c.cu").write_text("// c SPILL\n")
    assert build(tree, **cache)[0] != 0  # compiled, cached, and failing on its spill
    code, compiled, out = build(tree, KERNEL_BUILD_DIR=str(tree / "scratch3"), **cache)
    assert code != 0 and compiled == set() and "register spills" in out  # the cached log still reports it


def test_ptx_0_builds_only_the_listed_archs(tree):
    """PTX=0 drops the PTX of the highest arch (a different build: every module compiles again), and the manifest
    says so (doctor then fails on a GPU outside the list instead of expecting a JIT)."""
    assert build(tree)[0] == 0
    assert json.loads((tree / "kernels/build/manifest.json").read_text())["ptx"] == "compute_90"
    assert build(tree, PTX="0")[:2] == (0, {"a", "b", "c"})
    assert json.loads((tree / "kernels/build/manifest.json").read_text())["ptx"] is None
    code, _, out = build(tree, PTX="2")
    assert code != 0 and "PTX must be 0 or 1" in out

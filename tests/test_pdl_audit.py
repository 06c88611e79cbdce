"""kernels/pdl.cuh's rule in the built SASS: every global load a kernel issues above its programmatic-launch wait
comes from a source line tagged as a weight read (scripts/pdl_audit.py), and the audit itself finds hoisted and
untagged loads in a planted disassembly."""

from __future__ import annotations

import json
import os

import pytest

from scripts import pdl_audit

BUILD = os.path.join(pdl_audit.ROOT, "kernels", "build")


def built_archs() -> list[str]:
    """The archs of a build with line tables (a LINEINFO=0 build has none to audit by)."""
    try:
        with open(os.path.join(BUILD, "manifest.json")) as f:
            manifest = json.load(f)
        return manifest["archs"].split(";") if manifest.get("lineinfo", True) else []  # e.g. "75;80;86;89;90"
    except (OSError, KeyError, ValueError):
        return []


@pytest.mark.skipif("90" not in built_archs(), reason="no sm_90 kernel build with -lineinfo (./build_kernels.sh)")
def test_built_kernels_load_only_tagged_lines_before_the_wait():
    loads = pdl_audit.audit(BUILD, 90)
    bad = [f"{a.module}.{a.kernel}: {a.instruction} from {a.file}:{a.line}" for a in loads if not a.tagged()]
    assert not bad, "loads above griddepcontrol.wait from untagged lines (kernels/pdl.cuh):\n" + "\n".join(bad)
    # The kernels with a prologue keep it: their weights still load before the wait.
    kernels = {a.kernel for a in loads}
    assert {"moe_route_decode", "qk_rope_kv"} <= kernels, kernels


def planted(tmp_path, source_lines: list[str], sass: str) -> list[pdl_audit.EarlyLoad]:
    src = tmp_path / "k.cu"
    src.write_text("\n".join(source_lines) + "\n")
    return pdl_audit.early_loads_in("k", sass.replace("SRC", str(src)).splitlines(), "kern")


def test_audit_takes_the_innermost_line_and_stops_at_the_wait(tmp_path):
    lines = ["w = W[i];  // pre-wait: a weight", "x = X[i];", "y = X[i + 1];"]
    sass = """
	//## File "SRC", line 1 inlined at "other.cu", line 9
	//## File "other.cu", line 9
        /*0010*/                   LDG.E.128 R4, desc[UR8][R2.64] ;
	//## File "SRC", line 2
        /*0020*/                   LDG.E.CONSTANT R7, desc[UR8][R6.64] ;
        /*0030*/                   LDS R9, [R1] ;
        /*0040*/                   ACQBULK ;
	//## File "SRC", line 3
        /*0050*/                   LDG.E R8, desc[UR8][R6.64+0x4] ;
"""
    found = planted(tmp_path, lines, sass)
    assert [(a.line, a.instruction, a.tagged()) for a in found] == [
        (1, "LDG.E.128 R4, desc[UR8][R2.64]", True),
        (2, "LDG.E.CONSTANT R7, desc[UR8][R6.64]", False),
    ]


def test_a_kernel_without_a_wait_has_no_early_loads(tmp_path):
    sass = """
	//## File "SRC", line 1
        /*0010*/                   LDG.E R4, desc[UR8][R2.64] ;
"""
    assert planted(tmp_path, ["x = X[i];"], sass) == []


def test_disassembly_splits_by_kernel():
    text = "\t.text.a:\n  /*0000*/ ACQBULK ;\n\t.text.b:\n  /*0000*/ LDG.E R1, desc[UR4][R2.64] ;\n"
    assert {k: len(v) for k, v in pdl_audit.kernels_of(text).items()} == {"a": 1, "b": 1}

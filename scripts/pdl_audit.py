"""Global loads that a kernel issues before its programmatic-dependent-launch wait, from the built SASS.

kernels/pdl.cuh's rule: before `pdl::wait()` a kernel may read weights only. Under early launch a kernel can start
while the kernels two or more places before it on the stream still run, so an activation read there may be stale.
The source alone does not show every such read: ptxas may schedule a read-only (ld.global.nc) load above the wait
(griddepcontrol.wait, ACQBULK in SASS). This lists every global load above a kernel's first ACQBULK with the source
line it came from (the innermost one, through `-lineinfo`), and the sources mark each line that may load before the
wait with the tag PRE_WAIT_TAG in a comment; tests/test_pdl_audit.py holds the built kernels to it.

    python scripts/pdl_audit.py [BUILD_DIR] [--arch 90]

Needs cuobjdump and nvdisasm (the dev extras' nvidia-cuda-cuobjdump / nvidia-cuda-nvdisasm, or a CUDA toolkit).
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRE_WAIT_TAG = "pre-wait:"  # the comment on a source line whose loads may come before the wait: what they read
WAIT = "ACQBULK"  # griddepcontrol.wait
LOAD = re.compile(r"\b(LDG|LD)\.[A-Z0-9.]*")  # global (LDG) and generic (LD) loads; LDS / LDC are not memory reads
FUNC = re.compile(r"^\s*\.text\.(\S+):")
LINE = re.compile(r'//## File "([^"]+)", line (\d+)')


@dataclass(frozen=True)
class EarlyLoad:
    module: str  # kernels/<module>.cu
    kernel: str
    instruction: str  # the SASS, e.g. "LDG.E.CONSTANT R7, desc[UR10][R2.64]"
    file: str  # the innermost source location of the load
    line: int

    def source(self) -> str:
        """The line in this checkout's kernels/ (a module from the kernel cache may name another checkout's path)."""
        path = os.path.join(ROOT, "kernels", os.path.basename(self.file))
        try:
            with open(path if os.path.exists(path) else self.file) as f:
                return f.read().splitlines()[self.line - 1]
        except (OSError, IndexError):
            return ""

    def tagged(self) -> bool:
        return PRE_WAIT_TAG in self.source()


def tool(name: str) -> str | None:
    """A CUDA binary tool: the nvidia-cuda-* wheels' copy (site-packages/nvidia/cu*/bin), else the PATH's."""
    for base in {sysconfig.get_paths()["purelib"], *sys.path}:
        for path in sorted(glob.glob(os.path.join(base, "nvidia", "cu*", "bin", name))):
            if os.access(path, os.X_OK):
                return path
    return shutil.which(name)


def kernels_of(disassembly: str) -> dict[str, list[str]]:
    """nvdisasm -gi output split by kernel: name -> its lines."""
    out: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in disassembly.splitlines():
        m = FUNC.match(line)
        if m:
            current = out.setdefault(m.group(1), [])
        elif current is not None:
            current.append(line)
    return out


def early_loads_in(module: str, lines: list[str], kernel: str) -> list[EarlyLoad]:
    """The loads above the kernel's first wait (none when it has no wait: it runs without early launch)."""
    waits = [i for i, line in enumerate(lines) if WAIT in line]
    if not waits:
        return []
    found, file, lineno, in_run = [], "", 0, False
    for line in lines[: waits[0]]:
        m = LINE.search(line)
        if m:  # a run of these: the innermost location first, then the ones it is inlined into
            if not in_run:
                file, lineno = m.group(1), int(m.group(2))
            in_run = True
            continue
        in_run = False
        if LOAD.search(line):
            ins = line.split("*/", 1)[-1].split(";", 1)[0].strip()
            found.append(EarlyLoad(module, kernel, ins, file, lineno))
    return found


def audit(build_dir: str, arch: int = 90) -> list[EarlyLoad]:
    """Every early load of every module in build_dir, for sm_<arch>."""
    cuobjdump, nvdisasm = tool("cuobjdump"), tool("nvdisasm")
    if not cuobjdump or not nvdisasm:
        raise RuntimeError("cuobjdump and nvdisasm are needed (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    found: list[EarlyLoad] = []
    for fatbin in sorted(glob.glob(os.path.join(build_dir, "*.fatbin"))):
        module = os.path.basename(fatbin)[: -len(".fatbin")]
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run([cuobjdump, "-xelf", f"sm_{arch}", os.path.abspath(fatbin)], cwd=tmp, check=True,
                           capture_output=True)  # fmt: skip
            for cubin in sorted(glob.glob(os.path.join(tmp, "*.cubin"))):
                dis = subprocess.run([nvdisasm, "-gi", "-c", cubin], check=True, capture_output=True, text=True)
                for kernel, lines in kernels_of(dis.stdout).items():
                    found += early_loads_in(module, lines, kernel)
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("build_dir", nargs="?", default=os.path.join(ROOT, "kernels", "build"))
    ap.add_argument("--arch", type=int, default=90)
    args = ap.parse_args()
    loads = audit(args.build_dir, args.arch)
    untagged = [a for a in loads if not a.tagged()]
    for a in loads:
        mark = "ok " if a.tagged() else "BAD"
        print(f"{mark} {a.module}.{a.kernel}  {a.instruction}  {os.path.relpath(a.file, ROOT)}:{a.line}")
    print(f"{len(loads)} loads before a wait, {len(untagged)} from a line without '{PRE_WAIT_TAG}'")
    return 1 if untagged else 0


if __name__ == "__main__":
    sys.exit(main())

"""The CUDA cold path imports neither NumPy nor CuPy proper (docs/design.md §2: together worth ~0.6 s on a cold GPU
machine), and the prepare cache gives the same tokenizer as the GGUF."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from tests import conformance as C

CODE = """
import sys
from engine.cuda import prestart
prestart("cuda")                      # a no-op here (no driver), but its imports count
import engine.engine, engine.cuda.runner, engine.cuda.upload, engine.models.dense_cuda
from engine.prepare import open_model
m = open_model(sys.argv[1])
assert m.cache_used
ids = m.tokenizer.encode("<|im_start|>user\\nThe capital of France is<|im_end|>")
heavy = sorted(k for k in sys.modules if k.split(".")[0] in ("numpy", "cupy"))
print(heavy)
"""


def test_cuda_cold_path_needs_no_numpy(tmp_path):
    model = str(tmp_path / "m.gguf")
    shutil.copy(C.fixture_path("qwen3-tiny-q8_0", ".gguf"), model)
    from engine.prepare import write_cache

    write_cache(model)
    p = subprocess.run([sys.executable, "-c", CODE, model], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]", p.stdout


PRESTART = """
import sys
from engine.cuda import prestart
prestart("cuda")
print(sorted(m for m in ("dataclasses", "inspect", "typing", "re", "engine.archs") if m in sys.modules))
"""


def test_prestart_comes_before_the_slower_imports():
    """The context thread starts after the standard library's lighter modules only: dataclasses, inspect, typing and
    re (~8 ms on a 2-core CI machine) load while the context is created, not before. -S: no site hooks."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, "-S", "-c", PRESTART], capture_output=True, text=True, timeout=60, cwd=root)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]", p.stdout

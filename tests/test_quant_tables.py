"""The generated codebooks (engine/cpu/iq_tables.py, kernels/iq_tables.cuh) against gguf-py's, and when the engine
loads them: only for a tensor of a codebook type, and never gguf-py itself."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import numpy as np

from engine.cpu import iq_tables
from scripts.make_iq_tables import TARGET_CUH, gguf_tables, render_cuh


def test_tables_equal_gguf_py():
    tables = gguf_tables()
    assert set(tables) == {"IQ2_XXS_GRID", "IQ2_XS_GRID", "IQ2_S_GRID", "IQ3_XXS_GRID", "IQ3_S_GRID", "IQ1_S_GRID",
                           "KSIGNS", "IQ4_NL_VALUES", "MXFP4_VALUES"}  # fmt: skip
    for name, values in tables.items():
        ours = getattr(iq_tables, name)
        assert ours.shape == values.shape, name
        assert np.array_equal(ours, values), name


def test_cuda_tables_are_the_generated_ones():
    """kernels/iq_tables.cuh is exactly what scripts/make_iq_tables.py writes from gguf-py's tables today."""
    assert TARGET_CUH.read_text() == render_cuh(gguf_tables()), "run scripts/make_iq_tables.py"


def test_sign_multipliers_follow_ksigns():
    bits = (iq_tables.KSIGNS[:, None] >> np.arange(8)) & 1  # (128, 8)
    assert np.array_equal(iq_tables.SIGNS, np.where(bits == 1, -1.0, 1.0))
    assert iq_tables.SIGNS.dtype == np.float32
    assert (bits.sum(axis=1) % 2 == 0).all(), "the 8th sign bit is the parity of the 7 stored ones"


def test_tables_load_only_for_codebook_types_and_gguf_py_never():
    script = """
import sys
import numpy as np
from engine.cpu.dequant import dequantize
from engine.quants import GGMLType
dequantize(np.zeros(144, np.uint8), GGMLType.Q4_K, (256,))
dequantize(np.zeros(84, np.uint8), GGMLType.Q2_K, (256,))
assert "engine.cpu.iq_tables" not in sys.modules and "engine.cpu.dequant_iq" not in sys.modules
dequantize(np.zeros(66, np.uint8), GGMLType.IQ2_XXS, (256,))
assert "engine.cpu.iq_tables" in sys.modules
assert "gguf" not in sys.modules
"""
    root = pathlib.Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=root)
    assert done.returncode == 0, done.stderr

"""Make tests/fixtures/ggml-dequant.npz: random blocks of every quantized type the NumPy backend decodes and what
llama.cpp's own C dequantizer (`dequantize_row_<type>` in libggml-base) makes of them.

gguf-py is the oracle of tests/test_dequant.py, but it has no Q8_K decoder; this fixture is the reference for Q8_K
and a second one, from llama.cpp itself, for every other type. Per type it keeps two sets of blocks: well-formed
ones (finite scales, tests/quant_blocks.py `random_blocks`) and blocks of random bytes, whose scales may be inf or
NaN (`random_bytes`); about 1,000 and 500 values of each.

Keys: `<TYPE>_blocks` u8 (n, type_size) and `<TYPE>_values` f32 (n * block_size,), the same for `<TYPE>_raw_*`;
`producer`, a JSON string (library, versions, seed).

Run in an environment with a CPU build of llama-cpp-python 0.3.36 and numpy, from the repository root:

    PYTHONPATH=. python scripts/make_ggml_dequant_fixture.py

It is a development tool; the engine does not import it.
"""

from __future__ import annotations

import ctypes
import json
from pathlib import Path

import llama_cpp
import numpy as np

from engine.quants import BLOCK_SIZES, SUPPORTED_TYPES, GGMLType
from scripts.make_llamacpp_reference import VENDORED_LLAMA_CPP_COMMIT
from tests.quant_blocks import random_blocks, random_bytes

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "ggml-dequant.npz"
SEED = 20261202
VALUES_WELL_FORMED = 1024
VALUES_RAW = 512


def ggml_base() -> ctypes.CDLL:
    lib_dir = Path(llama_cpp.__file__).parent / "lib"
    return ctypes.CDLL(str(next(lib_dir.glob("libggml-base.so*"))))


def c_name(ggml_type: GGMLType) -> str:
    """llama.cpp's spelling: dequantize_row_q4_K, dequantize_row_iq2_xxs, dequantize_row_mxfp4."""
    name = ggml_type.name.lower()
    return name[:-2] + "_K" if name.endswith("_k") else name


def dequantize_c(lib: ctypes.CDLL, ggml_type: GGMLType, blocks: np.ndarray) -> np.ndarray:
    fn = getattr(lib, f"dequantize_row_{c_name(ggml_type)}")
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    fn.restype = None
    blocks = np.ascontiguousarray(blocks)
    out = np.full(len(blocks) * BLOCK_SIZES[ggml_type][0], np.nan, dtype=np.float32)
    fn(blocks.ctypes.data, out.ctypes.data, out.size)
    return out


def main() -> None:
    lib = ggml_base()
    rng = np.random.default_rng(SEED)
    arrays: dict[str, np.ndarray] = {}
    types = [t for t in sorted(SUPPORTED_TYPES) if BLOCK_SIZES[t][0] > 1]
    for t in types:
        block, type_size = BLOCK_SIZES[t]
        for suffix, make, n_values in (("", random_blocks, VALUES_WELL_FORMED), ("_raw", random_bytes, VALUES_RAW)):
            n_values = max(n_values, block)
            blocks = make(rng, t, (n_values,)).reshape(-1, type_size)
            arrays[f"{t.name}{suffix}_blocks"] = blocks
            arrays[f"{t.name}{suffix}_values"] = dequantize_c(lib, t, blocks)
    producer = {
        "function": "dequantize_row_<type> of libggml-base (ctypes)",
        "llama_cpp_python": llama_cpp.__version__,
        "llama_cpp_commit": VENDORED_LLAMA_CPP_COMMIT.get(llama_cpp.__version__),
        "seed": SEED,
        "types": [t.name for t in types],
    }
    arrays["producer"] = np.array(json.dumps(producer))
    np.savez_compressed(OUT, **arrays)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes, {len(types)} types)")


if __name__ == "__main__":
    main()

"""Random, well-formed tensor bytes of every type the NumPy backend decodes (engine.quants.SUPPORTED_TYPES).

The types with CUDA kernels come from tests/quant_data.py; this adds the others: random quant bytes, finite scales,
so that every decoded value is finite (`random_bytes` drops that promise, for NaN-aware checks).
"""

from __future__ import annotations

import math

import numpy as np

from engine.quants import BLOCK_SIZES, GGMLType
from tests.quant_data import SCALE_OFFSETS, random_normals, random_tensor

# Scale fields of the other types: (byte offset in the block, dtype). IQ1_M's f16 is split (see `_iq1_m_scale`);
# MXFP4's e8m0 byte is drawn from a range that keeps its values finite.
SCALE_FIELDS: dict[GGMLType, tuple[tuple[int, type], ...]] = {
    GGMLType.Q2_K: ((80, np.float16), (82, np.float16)),
    GGMLType.Q3_K: ((108, np.float16),),
    GGMLType.Q8_K: ((0, np.float32),),
    GGMLType.IQ2_XXS: ((0, np.float16),),
    GGMLType.IQ2_XS: ((0, np.float16),),
    GGMLType.IQ2_S: ((0, np.float16),),
    GGMLType.IQ3_XXS: ((0, np.float16),),
    GGMLType.IQ3_S: ((0, np.float16),),
    GGMLType.IQ1_S: ((0, np.float16),),
    GGMLType.IQ1_M: (),
    GGMLType.IQ4_NL: ((0, np.float16),),
    GGMLType.IQ4_XS: ((0, np.float16),),
    GGMLType.TQ1_0: ((52, np.float16),),
    GGMLType.TQ2_0: ((64, np.float16),),
    GGMLType.MXFP4: (),
}
MXFP4_MAX_EXPONENT = 250  # 2^(250 - 128) * 12 is finite; e = 255 would overflow float32 to inf


def _iq1_m_scale(rng: np.random.Generator, blocks: np.ndarray) -> None:
    """IQ1_M keeps its f16 d in the top nibbles of its 4 u16 scales (bytes 49, 51, 53, 55: nibble i = bits 4i..)."""
    d = random_normals(rng, len(blocks), np.float16).view(np.uint16)
    for i in range(4):
        top = ((d >> (4 * i)) & 0x0F).astype(np.uint8)
        blocks[:, 49 + 2 * i] = (blocks[:, 49 + 2 * i] & 0x0F) | (top << 4)


def random_blocks(rng: np.random.Generator, ggml_type: GGMLType, shape: tuple[int, ...]) -> np.ndarray:
    """(n_bytes,) u8: a well-formed tensor of `shape`; random quants, finite scales and values."""
    if ggml_type in SCALE_OFFSETS or BLOCK_SIZES[ggml_type][0] == 1:
        return random_tensor(rng, ggml_type, shape)
    block, type_size = BLOCK_SIZES[ggml_type]
    blocks = rng.integers(0, 256, size=(math.prod(shape) // block, type_size), dtype=np.uint8)
    for offset, dtype in SCALE_FIELDS[ggml_type]:
        size = np.dtype(dtype).itemsize
        blocks[:, offset : offset + size] = random_normals(rng, len(blocks), dtype).view(np.uint8).reshape(-1, size)
    if ggml_type == GGMLType.IQ1_M:
        _iq1_m_scale(rng, blocks)
    if ggml_type == GGMLType.MXFP4:
        blocks[:, 0] = rng.integers(0, MXFP4_MAX_EXPONENT + 1, size=len(blocks))
    return blocks.reshape(-1)


def random_bytes(rng: np.random.Generator, ggml_type: GGMLType, shape: tuple[int, ...]) -> np.ndarray:
    """(n_bytes,) u8 of `shape`, every byte random: scales may be inf or NaN (bytes straight from a damaged file)."""
    block, type_size = BLOCK_SIZES[ggml_type]
    return rng.integers(0, 256, size=math.prod(shape) // block * type_size, dtype=np.uint8)

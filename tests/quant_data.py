"""Random, well-formed GGUF tensor bytes for tests: random quants, finite f16 scales."""

from __future__ import annotations

import math

import numpy as np

from engine.quants import BLOCK_SIZES, GGMLType

# Byte offsets of the f16 scale fields inside one block; random bytes there could be inf/NaN.
SCALE_OFFSETS = {
    GGMLType.Q8_0: (0,),
    GGMLType.Q4_0: (0,),
    GGMLType.Q4_1: (0, 2),
    GGMLType.Q5_0: (0,),
    GGMLType.Q5_1: (0, 2),
    GGMLType.Q4_K: (0, 2),
    GGMLType.Q5_K: (0, 2),
    GGMLType.Q6_K: (208,),
}


def random_normals(rng: np.random.Generator, n: int, dtype: type) -> np.ndarray:
    """(n,) finite values of dtype, normal with magnitudes from 2**-20 to 2**5 (f16 subnormals included)."""
    return (rng.normal(size=n) * 2.0 ** rng.integers(-20, 6, size=n)).astype(dtype)


def random_tensor(rng: np.random.Generator, ggml_type: GGMLType, shape: tuple[int, ...]) -> np.ndarray:
    """(n_bytes,) u8: a well-formed tensor of `shape`; random quants, finite scales and values."""
    n_values = math.prod(shape)
    if ggml_type == GGMLType.F32:
        return random_normals(rng, n_values, np.float32).view(np.uint8)
    if ggml_type == GGMLType.F16:
        return random_normals(rng, n_values, np.float16).view(np.uint8)
    if ggml_type == GGMLType.BF16:
        return (random_normals(rng, n_values, np.float32).view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    block, type_size = BLOCK_SIZES[ggml_type]
    blocks = rng.integers(0, 256, size=(n_values // block, type_size), dtype=np.uint8)
    for offset in SCALE_OFFSETS[ggml_type]:
        blocks[:, offset : offset + 2] = random_normals(rng, len(blocks), np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(-1)


# The kernel types beyond SCALE_OFFSETS: (byte offsets of their f16 scales, roughly |value| / d for random quants).
# IQ1_M's d is split over four nibbles and MXFP4's scale is an exponent byte; `random_weights` sets those itself.
WEIGHT_SCALES: dict[GGMLType, tuple[tuple[int, ...], float]] = {
    GGMLType.Q2_K: ((80, 82), 16.0),
    GGMLType.Q3_K: ((108,), 32.0),
    GGMLType.TQ1_0: ((52,), 1.0),
    GGMLType.TQ2_0: ((64,), 1.0),
    GGMLType.IQ1_S: ((0,), 8.0),
    GGMLType.IQ1_M: ((), 8.0),
    GGMLType.IQ2_XXS: ((0,), 64.0),
    GGMLType.IQ2_XS: ((0,), 64.0),
    GGMLType.IQ2_S: ((0,), 64.0),
    GGMLType.IQ3_XXS: ((0,), 128.0),
    GGMLType.IQ3_S: ((0,), 128.0),
    GGMLType.IQ4_NL: ((0,), 64.0),
    GGMLType.IQ4_XS: ((0,), 1024.0),
    GGMLType.MXFP4: ((), 6.0),
}


def random_weights(
    rng: np.random.Generator, ggml_type: GGMLType, shape: tuple[int, ...], scale: float = 0.02
) -> np.ndarray:
    """(n_bytes,) u8 like `random_tensor`, but with scales near `scale` / (typical quant), so dequantized values are
    O(scale) as in real models: the right data for tolerance checks of kernels (not for bit-exactness)."""
    n_values = math.prod(shape)
    if ggml_type in (GGMLType.F32, GGMLType.F16, GGMLType.BF16):
        values = (rng.normal(size=n_values) * scale).astype(np.float32)
        if ggml_type == GGMLType.F32:
            return values.view(np.uint8)
        if ggml_type == GGMLType.F16:
            return values.astype(np.float16).view(np.uint8)
        return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    block, type_size = BLOCK_SIZES[ggml_type]
    blocks = rng.integers(0, 256, size=(n_values // block, type_size), dtype=np.uint8)
    if ggml_type in SCALE_OFFSETS:
        # A quant spans roughly +-16 levels (K-quants multiply by a 6-bit sub-scale, up to 63): O(scale) values.
        offsets = SCALE_OFFSETS[ggml_type]
        per_level = scale / (16.0 * (32.0 if ggml_type in (GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K) else 1.0))
    else:
        offsets, typical = WEIGHT_SCALES[ggml_type]
        per_level = scale / typical
    for offset in offsets:
        d = (np.abs(rng.normal(size=len(blocks))) * per_level + per_level / 4).astype(np.float16)
        blocks[:, offset : offset + 2] = d.view(np.uint8).reshape(-1, 2)
    if ggml_type == GGMLType.IQ1_M:  # d's nibble i is the top nibble of the u16 scales[i] (block bytes 49, 51, 53, 55)
        d = (np.abs(rng.normal(size=len(blocks))) * per_level + per_level / 4).astype(np.float16).view(np.uint16)
        for i in range(4):
            blocks[:, 49 + 2 * i] = (blocks[:, 49 + 2 * i] & 0x0F) | (((d >> (4 * i)) & 0x0F).astype(np.uint8) << 4)
    if ggml_type == GGMLType.MXFP4:  # d = 2^(e - 128)
        e = round(128 + math.log2(per_level))
        blocks[:, 0] = rng.integers(e - 2, e + 3, size=len(blocks))
    return blocks.reshape(-1)

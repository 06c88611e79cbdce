"""Pieces both block decoders share (engine/cpu/dequant.py, and engine/cpu/dequant_iq.py for the codebook types):
the decoder signature, bit and half-float unpacking, and which types the codebook module decodes."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from engine.quants import GGMLType

# decoder(blocks (n, type_size) u8, out (n, block_size) f32) writes the n blocks' values into out.
Decoder = Callable[[np.ndarray, np.ndarray], None]

PAIR_SHIFTS = np.arange(0, 8, 2, dtype=np.uint8)[:, None]  # (4, 1): bits 2k..2k+1 of a byte land in row k


def half(field: np.ndarray) -> np.ndarray:
    """(n, 2) u8 holding a little-endian half -> (n, 1) f32."""
    return field.view(np.float16).astype(np.float32)


def nibbles(qs: np.ndarray) -> np.ndarray:
    """(..., k) u8 -> (..., 2k) u8: the k low nibbles, then the k high nibbles."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


# Decoded by engine/cpu/dequant_iq.py, imported on first use (it loads the codebook tables).
CODEBOOK_TYPES = frozenset(
    {
        GGMLType.IQ2_XXS,
        GGMLType.IQ2_XS,
        GGMLType.IQ2_S,
        GGMLType.IQ3_XXS,
        GGMLType.IQ3_S,
        GGMLType.IQ1_S,
        GGMLType.IQ1_M,
        GGMLType.IQ4_NL,
        GGMLType.IQ4_XS,
        GGMLType.MXFP4,
    }
)

"""NumPy decoders of the codebook GGUF types: the i-quants (IQ1_S ... IQ4_XS) and MXFP4.

Their values come from fixed tables (engine/cpu/iq_tables.py) rather than from the quant bits alone. engine.cpu.dequant
imports this module, and with it the tables, the first time it decodes a tensor of one of these types; it owns the
calling convention (`Decoder`: blocks (n, type_size) u8 into out (n, block_size) f32) and the exactness argument.
"""

from __future__ import annotations

import numpy as np

from engine.cpu import iq_tables
from engine.cpu.blockbits import CODEBOOK_TYPES, Decoder
from engine.cpu.blockbits import PAIR_SHIFTS as _PAIR_SHIFTS
from engine.cpu.blockbits import half as _half
from engine.cpu.blockbits import nibbles as _nibbles
from engine.quants import GGMLType

_SEVEN_BIT_SHIFTS = np.array([0, 7, 14, 21], dtype=np.uint32)  # four 7-bit sign indices in a u32
_THREE_BIT_SHIFTS = np.array([0, 3, 6, 9], dtype=np.uint16)  # four 3-bit fields in a u16
_NIBBLE_SHIFTS = np.array([0, 4], dtype=np.uint8)
_IQ1_DELTA = np.float32(0.125)  # IQ1_S / IQ1_M shift every grid value by +-1/8


def _signs(bits: np.ndarray) -> np.ndarray:
    """(..., k) u8 of sign bits -> (..., 8k) f32 multipliers: bit j of byte t set makes value 8t + j negative."""
    return 1 - 2 * np.unpackbits(bits, axis=-1, bitorder="little").astype(np.float32)


def _sign_index_7(packed: np.ndarray) -> np.ndarray:
    """(...) u32 holding four 7-bit sign indices in bits 0-27 -> (..., 4, 8) f32 multipliers (iq_tables.SIGNS)."""
    return iq_tables.SIGNS[(packed[..., None] >> _SEVEN_BIT_SHIFTS) & 0x7F]


def _interleaved_nibbles(packed: np.ndarray) -> np.ndarray:
    """(n, k) u8 -> (n, 2k) u8: low nibble of byte i is entry 2i, its high nibble entry 2i + 1."""
    return ((packed[:, :, None] >> _NIBBLE_SHIFTS) & 0x0F).reshape(len(packed), -1)


# IQ2_XXS block, 66 bytes: | d: f16 (2) | qs: u16[32] (64) |
# 8 groups of 32 values, each from 8 qs bytes read as two u32: the first is 4 grid indices (one byte each, 8 values
# of IQ2_XXS_GRID apiece), the second 4 seven-bit sign indices (bits 0-27, 8 values each) and a 4-bit scale s
# (bits 28-31).
# y = (d * (0.5 + s) * 0.25) * grid * sign.
def _iq2_xxs(blocks: np.ndarray, out: np.ndarray) -> None:
    d = _half(blocks[:, 0:2])
    aux = blocks[:, 2:66].view(np.uint32).reshape(-1, 8, 2)  # (n, 8, 2)
    scale = d * (np.float32(0.5) + (aux[:, :, 1] >> 28).astype(np.float32)) * np.float32(0.25)  # (n, 8)
    grid = iq_tables.IQ2_XXS_GRID[blocks[:, 2:66].reshape(-1, 8, 8)[:, :, 0:4]]  # (n, 8, 4, 8)
    grid *= _sign_index_7(aux[:, :, 1])
    np.multiply(scale[:, :, None, None], grid, out=out.reshape(-1, 8, 4, 8))


# IQ2_XS block, 74 bytes: | d: f16 (2) | qs: u16[32] (64) | scales: u8[8] (8) |
# qs[t]: bits 0-8 index IQ2_XS_GRID (8 values), bits 9-15 a sign index. 16 sub-blocks of 16 values (qs[2j], qs[2j+1]),
# scale s[j] the low (j even) or high (j odd) nibble of scales[j // 2]. y = (d * (0.5 + s) * 0.25) * grid * sign.
def _iq2_xs(blocks: np.ndarray, out: np.ndarray) -> None:
    d = _half(blocks[:, 0:2])
    qs = blocks[:, 2:66].view(np.uint16)  # (n, 32)
    scale = d * (np.float32(0.5) + _interleaved_nibbles(blocks[:, 66:74]).astype(np.float32)) * np.float32(0.25)
    grid = iq_tables.IQ2_XS_GRID[qs & 0x1FF]  # (n, 32, 8)
    grid *= iq_tables.SIGNS[qs >> 9]
    np.multiply(scale[:, :, None], grid.reshape(-1, 16, 16), out=out.reshape(-1, 16, 16))


# IQ2_S block, 82 bytes: | d: f16 (2) | qs: u8[32] (32) | signs: u8[32] (32) | qh: u8[8] (8) | scales: u8[8] (8) |
# Entry t (8 values) indexes IQ2_S_GRID with qs[t] plus bits 2(t % 4)..+1 of qh[t // 4] as bits 8-9; byte t of signs
# holds its 8 sign bits. Scales as IQ2_XS. y = (d * (0.5 + s) * 0.25) * grid * sign.
def _iq2_s(blocks: np.ndarray, out: np.ndarray) -> None:
    d = _half(blocks[:, 0:2])
    high = ((blocks[:, 66:74, None] >> _PAIR_SHIFTS[:, 0]) & 3).reshape(-1, 32).astype(np.uint16)
    index = blocks[:, 2:34].astype(np.uint16) | (high << 8)  # (n, 32)
    scale = d * (np.float32(0.5) + _interleaved_nibbles(blocks[:, 74:82]).astype(np.float32)) * np.float32(0.25)
    grid = iq_tables.IQ2_S_GRID[index].reshape(-1, 16, 16)
    grid *= _signs(blocks[:, 34:66]).reshape(-1, 16, 16)
    np.multiply(scale[:, :, None], grid, out=out.reshape(-1, 16, 16))


# IQ3_XXS block, 98 bytes: | d: f16 (2) | qs: u8[64] (64) | scales_and_signs: u32[8] (32) |
# qs[t] indexes IQ3_XXS_GRID (4 values). 8 groups of 32 values (8 entries); the group's u32 holds 4 seven-bit sign
# indices (bits 0-27, 8 values each) and a 4-bit scale s (bits 28-31). y = (d * (0.5 + s) * 0.5) * grid * sign.
def _iq3_xxs(blocks: np.ndarray, out: np.ndarray) -> None:
    d = _half(blocks[:, 0:2])
    aux = blocks[:, 66:98].view(np.uint32)  # (n, 8)
    scale = d * (np.float32(0.5) + (aux >> 28).astype(np.float32)) * np.float32(0.5)  # (n, 8)
    grid = iq_tables.IQ3_XXS_GRID[blocks[:, 2:66]].reshape(-1, 8, 4, 8)
    grid *= _sign_index_7(aux)
    np.multiply(scale[:, :, None, None], grid, out=out.reshape(-1, 8, 4, 8))


# IQ3_S block, 110 bytes: | d: f16 (2) | qs: u8[64] (64) | qh: u8[8] (8) | signs: u8[32] (32) | scales: u8[4] (4) |
# Entry t (4 values) indexes IQ3_S_GRID with qs[t] plus bit t % 8 of qh[t // 8] as bit 8; the signs are explicit bits
# (bit j of byte t: value 8t + j). 8 sub-blocks of 32 values, scale s[j] a nibble as in IQ2_XS. y = d * (1 + 2s) *
# grid * sign.
def _iq3_s(blocks: np.ndarray, out: np.ndarray) -> None:
    d = _half(blocks[:, 0:2])
    high = np.unpackbits(blocks[:, 66:74], axis=-1, bitorder="little").astype(np.uint16)  # (n, 64)
    index = blocks[:, 2:66].astype(np.uint16) | (high << 8)
    scale = d * (1 + 2 * _interleaved_nibbles(blocks[:, 106:110]).astype(np.float32))  # (n, 8)
    grid = iq_tables.IQ3_S_GRID[index].reshape(-1, 8, 32)
    grid *= _signs(blocks[:, 74:106]).reshape(-1, 8, 32)
    np.multiply(scale[:, :, None], grid, out=out.reshape(-1, 8, 32))


# IQ1_S block, 50 bytes: | d: f16 (2) | qs: u8[32] (32) | qh: u16[8] (16) |
# 8 sub-blocks of 32 values (4 entries of 8). Entry 4j + k indexes IQ1_S_GRID (values -1, 0, 1) with qs[4j + k] plus
# bits 3k..3k+2 of qh[j] as bits 8-10; qh[j] bits 12-14 are the scale s, bit 15 the sign of the shift delta.
# y = (d * (2s + 1)) * (grid + delta), delta = +-0.125.
def _iq1_s(blocks: np.ndarray, out: np.ndarray) -> None:
    d = _half(blocks[:, 0:2])
    qh = blocks[:, 34:50].view(np.uint16)  # (n, 8)
    scale = d * (2 * ((qh >> 12) & 7) + 1).astype(np.float32)  # (n, 8)
    delta = np.where(qh & 0x8000, -_IQ1_DELTA, _IQ1_DELTA)  # (n, 8)
    high = ((qh[:, :, None] >> _THREE_BIT_SHIFTS) & 7).reshape(-1, 32)
    grid = iq_tables.IQ1_S_GRID[blocks[:, 2:34].astype(np.uint16) | (high << 8)].reshape(-1, 8, 32)
    grid += delta[:, :, None]
    np.multiply(scale[:, :, None], grid, out=out.reshape(-1, 8, 32))


# IQ1_M block, 56 bytes: | qs: u8[32] (32) | qh: u8[16] (16) | scales: u16[4] (8) |
# The f16 d is split over the top nibbles of the 4 scales (scales[i] >> 12 is bits 4i..4i+3); their low 12 bits hold
# 16 three-bit scales s (bits 3k..3k+2: sub-block 4i + k of 16 values, 2 entries). Entry t indexes IQ1_S_GRID with qs[t]
# plus the low 3 bits of nibble t % 2 of qh[t // 2] as bits 8-10; that nibble's bit 3 is the sign of delta.
# y = (d * (2s + 1)) * (grid + delta), delta = +-0.125.
def _iq1_m(blocks: np.ndarray, out: np.ndarray) -> None:
    packed = blocks[:, 48:56].view(np.uint16)  # (n, 4)
    d_bits = np.bitwise_or.reduce((packed >> 12) << np.array([0, 4, 8, 12], dtype=np.uint16), axis=-1)  # (n,)
    d = d_bits.view(np.float16).astype(np.float32)[:, None]
    sc = ((packed[:, :, None] >> _THREE_BIT_SHIFTS) & 7).reshape(-1, 16)
    scale = d * (2 * sc + 1).astype(np.float32)  # (n, 16)
    nibble = _interleaved_nibbles(blocks[:, 32:48])  # (n, 32)
    delta = np.where(nibble & 0x08, -_IQ1_DELTA, _IQ1_DELTA)
    grid = iq_tables.IQ1_S_GRID[blocks[:, 0:32].astype(np.uint16) | ((nibble & 7).astype(np.uint16) << 8)]
    grid += delta[:, :, None]
    np.multiply(scale[:, :, None], grid.reshape(-1, 16, 16), out=out.reshape(-1, 16, 16))


# IQ4_NL block, 18 bytes: | d: f16 (2) | qs: u8[16] (16) |
# Nibble order as Q4_0; each nibble indexes the 16 non-linear levels IQ4_NL_VALUES. y = d * level.
def _iq4_nl(blocks: np.ndarray, out: np.ndarray) -> None:
    np.multiply(_half(blocks[:, 0:2]), iq_tables.IQ4_NL_VALUES[_nibbles(blocks[:, 2:18])], out=out)


# IQ4_XS block, 136 bytes: | d: f16 (2) | scales_h: u16 (2) | scales_l: u8[4] (4) | qs: u8[128] (128) |
# 8 sub-blocks of 32 values, each from 16 qs bytes in Q4_0's nibble order, levels as IQ4_NL. Six-bit scale j: low
# 4 bits a nibble of scales_l as in IQ2_XS, top 2 bits bits 2j..2j+1 of scales_h. y = (d * (s - 32)) * level.
def _iq4_xs(blocks: np.ndarray, out: np.ndarray) -> None:
    d = _half(blocks[:, 0:2])
    high = (blocks[:, 2:4].view(np.uint16) >> np.arange(0, 16, 2, dtype=np.uint16)) & 3  # (n, 8)
    sc = _interleaved_nibbles(blocks[:, 4:8]) | (high.astype(np.uint8) << 4)
    scale = d * (sc.astype(np.float32) - 32)  # (n, 8)
    level = iq_tables.IQ4_NL_VALUES[_nibbles(blocks[:, 8:136].reshape(-1, 8, 16))]  # (n, 8, 32)
    np.multiply(scale[:, :, None], level, out=out.reshape(-1, 8, 32))


# MXFP4 block, 17 bytes: | e: u8 (1) | qs: u8[16] (16) |
# Nibble order as Q4_0; each nibble an E2M1 value from MXFP4_VALUES (doubled), the shared scale 2^(e - 127) halved
# to match: d = 2^(e - 128), built as float32 bits (a subnormal for e < 2), as llama.cpp does. y = d * value.
def _mxfp4(blocks: np.ndarray, out: np.ndarray) -> None:
    e = blocks[:, 0:1].astype(np.uint32)
    d = np.where(e < 2, np.uint32(0x00200000) << e, (np.maximum(e, 1) - 1) << 23).view(np.float32)  # (n, 1)
    np.multiply(d, iq_tables.MXFP4_VALUES[_nibbles(blocks[:, 1:17])], out=out)


DECODERS: dict[GGMLType, Decoder] = {
    GGMLType.IQ2_XXS: _iq2_xxs,
    GGMLType.IQ2_XS: _iq2_xs,
    GGMLType.IQ2_S: _iq2_s,
    GGMLType.IQ3_XXS: _iq3_xxs,
    GGMLType.IQ3_S: _iq3_s,
    GGMLType.IQ1_S: _iq1_s,
    GGMLType.IQ1_M: _iq1_m,
    GGMLType.IQ4_NL: _iq4_nl,
    GGMLType.IQ4_XS: _iq4_xs,
    GGMLType.MXFP4: _mxfp4,
}
assert DECODERS.keys() == CODEBOOK_TYPES

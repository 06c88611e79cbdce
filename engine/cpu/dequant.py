"""NumPy dequantization of GGUF tensor data to float32: the reference the CUDA kernels are tested against.

Every block type has a decoder that turns whole blocks `(n, type_size) u8` into their values `(n, block_size) f32`.
Results are bit-identical to gguf-py's `gguf.quants.dequantize`; the float32 operations follow its order (scales
first, `d * sc` and `dmin * m`, then `scale * q - offset` or `d * q + m`). That order is not what makes them match,
though: an f16 scale has 11 significant bits and sub-scale times quant at most 12 more (Q6_K: 127 * 31), so every
product fits float32's 24-bit significand exactly and only the final add/subtract rounds. Kernels may therefore fuse
(FMA) or reorder the products freely and still match, as long as they compute in float32.

Tensors are decoded `_CHUNK_VALUES` values at a time, so temporaries stay bounded whatever the tensor's size.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from engine.errors import GGUFError, InvalidInput, UnsupportedArchitecture
from engine.quants import BLOCK_SIZES, SUPPORTED_TYPES, GGMLType, type_name

# Q6_K, the hungriest decoder, keeps about 10 bytes of temporaries per value: ~2.5 MB per chunk. Chunks this small
# stay in cache and decode faster than large ones.
_CHUNK_VALUES = 1 << 18

# decoder(blocks (n, type_size) u8, out (n, block_size) f32) writes the n blocks' values into out.
Decoder = Callable[[np.ndarray, np.ndarray], None]

_BIT_SHIFTS = np.arange(8, dtype=np.uint8)[:, None]  # (8, 1): bit k of a byte lands in row k
_PAIR_SHIFTS = np.arange(0, 8, 2, dtype=np.uint8)[:, None]  # (4, 1): bits 2k..2k+1 of a byte land in row k


def _half(field: np.ndarray) -> np.ndarray:
    """(n, 2) u8 holding a little-endian half -> (n, 1) f32."""
    return field.view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(..., k) u8 -> (..., 2k) u8: the k low nibbles, then the k high nibbles."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


# F32 value, 4 bytes: | f32 (4) |
def _f32(blocks: np.ndarray, out: np.ndarray) -> None:
    out[:] = blocks.view(np.float32)


# F16 value, 2 bytes: | f16 (2) |
def _f16(blocks: np.ndarray, out: np.ndarray) -> None:
    out[:] = blocks.view(np.float16)


# BF16 value, 2 bytes: | upper half of an f32 (2) |
def _bf16(blocks: np.ndarray, out: np.ndarray) -> None:
    out[:] = (blocks.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


# Q8_0 block, 34 bytes: | d: f16 (2) | qs: int8[32] (32) |
def _q8_0(blocks: np.ndarray, out: np.ndarray) -> None:
    d = _half(blocks[:, 0:2])
    np.multiply(d, blocks[:, 2:34].view(np.int8).astype(np.float32), out=out)


# Q4_0 block, 18 bytes: | d: f16 (2) | qs: u8[16] (16) |
# Value j < 16 is lo(qs[j]), value 16 + j is hi(qs[j]); y = d * (q - 8).
def _q4_0(blocks: np.ndarray, out: np.ndarray) -> None:
    d = _half(blocks[:, 0:2])
    q = _nibbles(blocks[:, 2:18]).astype(np.float32) - 8
    np.multiply(d, q, out=out)


# Q4_1 block, 20 bytes: | d: f16 (2) | m: f16 (2) | qs: u8[16] (16) |
# Nibble order as Q4_0; y = d * q + m.
def _q4_1(blocks: np.ndarray, out: np.ndarray) -> None:
    d, m = _half(blocks[:, 0:2]), _half(blocks[:, 2:4])
    q = _nibbles(blocks[:, 4:20]).astype(np.float32)
    np.add(d * q, m, out=out)


def _five_bit(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1 quants (n, 32) u8: nibble j of qs, plus bit j of the little-endian u32 qh as bit 4."""
    return _nibbles(qs) | (np.unpackbits(qh, axis=-1, bitorder="little") << 4)


# Q5_0 block, 22 bytes: | d: f16 (2) | qh: u8[4] (4) | qs: u8[16] (16) |
# y = d * (q - 16).
def _q5_0(blocks: np.ndarray, out: np.ndarray) -> None:
    d = _half(blocks[:, 0:2])
    q = _five_bit(blocks[:, 2:6], blocks[:, 6:22]).astype(np.float32) - 16
    np.multiply(d, q, out=out)


# Q5_1 block, 24 bytes: | d: f16 (2) | m: f16 (2) | qh: u8[4] (4) | qs: u8[16] (16) |
# y = d * q + m.
def _q5_1(blocks: np.ndarray, out: np.ndarray) -> None:
    d, m = _half(blocks[:, 0:2]), _half(blocks[:, 2:4])
    q = _five_bit(blocks[:, 4:8], blocks[:, 8:24]).astype(np.float32)
    np.add(d * q, m, out=out)


def _k_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 scale bytes of Q4_K/Q5_K -> 8 six-bit scales and 8 six-bit mins, each (n, 8) f32.

    Bytes 0-3 hold scales 0-3 in their low 6 bits, bytes 4-7 mins 0-3; scales/mins 4-7 take their low 4 bits from
    the low/high nibble of bytes 8-11 and their top 2 bits from the top 2 bits of bytes 0-3/4-7.
    """
    lo_sc, lo_m, hi = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = np.concatenate([lo_sc & 0x3F, (hi & 0x0F) | ((lo_sc >> 6) << 4)], axis=-1)
    m = np.concatenate([lo_m & 0x3F, (hi >> 4) | ((lo_m >> 6) << 4)], axis=-1)
    return sc.astype(np.float32), m.astype(np.float32)


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """(n, 128) u8 -> (n, 8, 32) u8: each 32-byte run gives 32 values of its low nibbles, then 32 of its high."""
    return _nibbles(qs.reshape(-1, 4, 32)).reshape(-1, 8, 32)


# Q4_K block, 144 bytes: | d: f16 (2) | dmin: f16 (2) | scales: u8[12] (12) | qs: u8[128] (128) |
# 8 sub-blocks of 32 values; y = (d * sc[j]) * q - (dmin * m[j]).
def _q4_k(blocks: np.ndarray, out: np.ndarray) -> None:
    d, dmin = _half(blocks[:, 0:2]), _half(blocks[:, 2:4])
    sc, m = _k_scales_mins(blocks[:, 4:16])
    q = _k_nibbles(blocks[:, 16:144]).astype(np.float32)  # (n, 8, 32)
    np.subtract((d * sc)[:, :, None] * q, (dmin * m)[:, :, None], out=out.reshape(-1, 8, 32))


# Q5_K block, 176 bytes: | d: f16 (2) | dmin: f16 (2) | scales: u8[12] (12) | qh: u8[32] (32) | qs: u8[128] (128) |
# As Q4_K, with bit j of qh[l] as bit 4 of value 32j + l.
def _q5_k(blocks: np.ndarray, out: np.ndarray) -> None:
    d, dmin = _half(blocks[:, 0:2]), _half(blocks[:, 2:4])
    sc, m = _k_scales_mins(blocks[:, 4:16])
    high = (blocks[:, None, 16:48] >> _BIT_SHIFTS) & 1  # (n, 8, 32)
    q = (_k_nibbles(blocks[:, 48:176]) | (high << 4)).astype(np.float32)
    np.subtract((d * sc)[:, :, None] * q, (dmin * m)[:, :, None], out=out.reshape(-1, 8, 32))


# Q6_K block, 210 bytes: | ql: u8[128] (128) | qh: u8[64] (64) | scales: int8[16] (16) | d: f16 (2) |
# Two halves of 128 values, each from 64 ql bytes (low nibbles then high nibbles) and 32 qh bytes (bits 2k..2k+1 of
# qh[l] are the top bits of value 32k + l); 16 sub-blocks of 16 values; y = (d * sc[j]) * (q - 32).
def _q6_k(blocks: np.ndarray, out: np.ndarray) -> None:
    d = _half(blocks[:, 208:210])
    low = _nibbles(blocks[:, 0:128].reshape(-1, 2, 64))  # (n, 2, 128)
    high = (blocks[:, 128:192].reshape(-1, 2, 1, 32) >> _PAIR_SHIFTS) & 3  # (n, 2, 4, 32)
    q = (low | (high.reshape(-1, 2, 128) << 4)).astype(np.float32) - 32
    scale = d * blocks[:, 192:208].view(np.int8).astype(np.float32)  # (n, 16)
    np.multiply(scale[:, :, None], q.reshape(-1, 16, 16), out=out.reshape(-1, 16, 16))


_DECODERS: dict[GGMLType, Decoder] = {
    GGMLType.F32: _f32,
    GGMLType.F16: _f16,
    GGMLType.BF16: _bf16,
    GGMLType.Q8_0: _q8_0,
    GGMLType.Q4_0: _q4_0,
    GGMLType.Q4_1: _q4_1,
    GGMLType.Q5_0: _q5_0,
    GGMLType.Q5_1: _q5_1,
    GGMLType.Q4_K: _q4_k,
    GGMLType.Q5_K: _q5_k,
    GGMLType.Q6_K: _q6_k,
}
assert _DECODERS.keys() == SUPPORTED_TYPES


def _supported_type(ggml_type: GGMLType | int) -> GGMLType:
    if ggml_type not in SUPPORTED_TYPES:
        supported = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        raise UnsupportedArchitecture(f"tensor type {type_name(ggml_type)} is not supported (supported: {supported})")
    return GGMLType(ggml_type)


def _decode_into(blocks: np.ndarray, ggml_type: GGMLType, out: np.ndarray) -> None:
    """Decode blocks (n, type_size) u8 into out (n, block_size) f32, a bounded number of blocks at a time."""
    assert out.flags.c_contiguous, "decoders write through reshaped views of out"
    decode = _DECODERS[ggml_type]
    step = max(1, _CHUNK_VALUES // out.shape[1])
    for start in range(0, len(blocks), step):
        decode(blocks[start : start + step], out[start : start + step])


def dequantize(raw: np.ndarray, ggml_type: GGMLType | int, shape: Sequence[int]) -> np.ndarray:
    """Decode a whole tensor.

    raw: (n_bytes,) u8, the tensor's bytes (a read-only view into the file is fine).
    shape: NumPy shape, the reversed GGUF `ne`; the last axis is the contiguous one.
    Returns a new C-contiguous f32 array of `shape`.
    """
    assert raw.dtype == np.uint8 and raw.ndim == 1, f"raw must be 1-D uint8, got {raw.dtype} {raw.shape}"
    ggml_type = _supported_type(ggml_type)
    shape = tuple(int(n) for n in shape)
    block, type_size = BLOCK_SIZES[ggml_type]
    if not shape or min(shape) < 0:
        raise GGUFError(f"{ggml_type.name} tensor has an invalid shape {shape}")
    if shape[-1] % block != 0:
        raise GGUFError(
            f"{ggml_type.name} tensor of shape {shape}: last dimension {shape[-1]} is not a multiple of "
            f"the block size {block}"
        )
    n_blocks = math.prod(shape) // block
    if raw.size != n_blocks * type_size:
        raise GGUFError(f"{ggml_type.name} tensor of shape {shape} needs {n_blocks * type_size} bytes, got {raw.size}")
    out = np.empty(shape, dtype=np.float32)
    _decode_into(raw.reshape(n_blocks, type_size), ggml_type, out.reshape(n_blocks, block))
    return out


def _row_index(rows: Sequence[int] | np.ndarray, n_rows: int) -> np.ndarray:
    """Requested rows -> (k,) int64, each in [0, n_rows)."""
    index = np.asarray(rows)
    if index.size == 0:
        return np.zeros(0, dtype=np.int64)
    if index.ndim != 1 or index.dtype.kind not in "iu":
        raise InvalidInput(f"rows must be a 1-D sequence of integers, got {index.dtype} of shape {index.shape}")
    bad = (index < 0) | (index >= n_rows)
    if bad.any():
        raise InvalidInput(f"row {index[bad][0]} is out of range for a tensor of {n_rows} rows")
    return index.astype(np.int64)


def dequantize_rows(
    raw: np.ndarray, ggml_type: GGMLType | int, n_cols: int, rows: Sequence[int] | np.ndarray
) -> np.ndarray:
    """Decode only the requested rows of a tensor seen as a matrix of `n_cols`-value rows (embedding lookup).

    raw: (n_bytes,) u8, the tensor's bytes; it holds len(raw) // row_bytes rows.
    rows: (k,) integers in [0, n_rows); repeats allowed.
    Returns a new f32 array (k, n_cols).
    """
    assert raw.dtype == np.uint8 and raw.ndim == 1, f"raw must be 1-D uint8, got {raw.dtype} {raw.shape}"
    ggml_type = _supported_type(ggml_type)
    block, type_size = BLOCK_SIZES[ggml_type]
    if n_cols <= 0 or n_cols % block != 0:
        raise GGUFError(
            f"{ggml_type.name} rows of {n_cols} values are not a positive multiple of the block size {block}"
        )
    row_bytes = n_cols // block * type_size
    if raw.size % row_bytes != 0:
        raise GGUFError(f"{ggml_type.name} tensor of {raw.size} bytes is not a whole number of {row_bytes}-byte rows")
    matrix = raw.reshape(-1, row_bytes)  # (n_rows, row_bytes) u8
    index = _row_index(rows, len(matrix))
    out = np.empty((len(index), n_cols), dtype=np.float32)
    step = max(1, _CHUNK_VALUES // n_cols)
    for start in range(0, len(index), step):
        picked = matrix[index[start : start + step]]  # (k', row_bytes) u8, a copy of just these rows
        _decode_into(picked.reshape(-1, type_size), ggml_type, out[start : start + step].reshape(-1, block))
    return out

"""NumPy dequantization of GGUF tensor data to float32: the reference the CUDA kernels are tested against.

Every block type has a decoder that turns whole blocks `(n, type_size) u8` into their values `(n, block_size) f32`.
Results are bit-identical to gguf-py's `gguf.quants.dequantize` and to llama.cpp's `dequantize_row_*` (gguf-py has
no Q8_K; there llama.cpp's is the reference). The float32 operations follow gguf-py's order (scales first, `d * sc`
and `dmin * m`, then `scale * q - offset` or `d * q + m`). That order is not what makes them match, though: an f16
scale has 11 significant bits and sub-scale times quant (or grid value) at most 12 more (Q6_K: 127 * 31; IQ4_XS:
31 * 127; IQ2_*: 15.5 * 43), so every product fits float32's 24-bit significand exactly and only the final
add/subtract of the types with a min (Q4_1, Q5_1, Q2_K, Q4_K, Q5_K) rounds; Q8_K's f32 scale times its int8 is one
rounding either way. Kernels may therefore fuse (FMA) or reorder the products freely and still match, as long as
they compute in float32.

The i-quants and MXFP4 look their values up in fixed codebooks (engine/cpu/iq_tables.py, generated from gguf-py);
their decoders live in engine/cpu/dequant_iq.py, imported on first use so that files without these types never
load the tables.

Tensors are decoded `_CHUNK_VALUES` values at a time, so temporaries stay bounded whatever the tensor's size.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from engine.cpu.blockbits import CODEBOOK_TYPES, Decoder
from engine.cpu.blockbits import PAIR_SHIFTS as _PAIR_SHIFTS
from engine.cpu.blockbits import half as _half
from engine.cpu.blockbits import nibbles as _nibbles
from engine.errors import GGUFError, InvalidInput, UnsupportedArchitecture
from engine.quants import BLOCK_SIZES, SUPPORTED_TYPES, GGMLType, type_name

# The hungriest decoders (Q3_K, IQ3_S, IQ2_S) keep about 14 bytes of temporaries per value: ~3.5 MB per chunk.
# Chunks this small stay in cache and decode faster than large ones.
_CHUNK_VALUES = 1 << 18

_BIT_SHIFTS = np.arange(8, dtype=np.uint8)[:, None]  # (8, 1): bit k of a byte lands in row k
_POW3 = np.array([1, 3, 9, 27, 81], dtype=np.uint8)[:, None]  # (5, 1): TQ1_0's digit k sits at byte * 3^k (mod 256)


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


# Q2_K block, 84 bytes: | scales: u8[16] (16) | qs: u8[64] (64) | d: f16 (2) | dmin: f16 (2) |
# 16 sub-blocks of 16 values; scales[j] holds sub-block j's scale (low nibble) and min (high nibble). Two halves of
# 128 values, each from 32 qs bytes: bits 2k..2k+1 of qs[32h + l] are value 128h + 32k + l.
# y = (d * sc[j]) * q - (dmin * m[j]).
def _q2_k(blocks: np.ndarray, out: np.ndarray) -> None:
    d, dmin = _half(blocks[:, 80:82]), _half(blocks[:, 82:84])
    packed = blocks[:, 0:16]
    q = (blocks[:, 16:80].reshape(-1, 2, 1, 32) >> _PAIR_SHIFTS) & 3  # (n, 2, 4, 32)
    scale = d * (packed & 0x0F).astype(np.float32)  # (n, 16)
    offset = dmin * (packed >> 4).astype(np.float32)  # (n, 16)
    product = scale[:, :, None] * q.reshape(-1, 16, 16).astype(np.float32)
    np.subtract(product, offset[:, :, None], out=out.reshape(-1, 16, 16))


# Q3_K block, 110 bytes: | hmask: u8[32] (32) | qs: u8[64] (64) | scales: u8[12] (12) | d: f16 (2) |
# Value v = 32k + l of each 128-value half h: low 2 bits from bits 2k..2k+1 of qs[32h + l] (as Q2_K), and 4 is
# subtracted unless bit (4h + k) of hmask[l] is set. 16 six-bit scales, offset by 32: the low nibble of byte j (j < 8)
# or the high nibble of byte j - 8 (j >= 8), the top 2 bits from bits 2(j // 4), 2(j // 4) + 1 of byte 8 + j % 4.
# y = (d * (sc[j] - 32)) * q.
def _q3_k(blocks: np.ndarray, out: np.ndarray) -> None:
    d = _half(blocks[:, 108:110])
    low, high = blocks[:, 96:104], blocks[:, 104:108]
    sc = np.concatenate([low & 0x0F, low >> 4], axis=-1)  # (n, 16)
    sc |= ((high[:, None, :] >> _PAIR_SHIFTS) & 3).reshape(-1, 16) << 4
    scale = d * (sc.astype(np.float32) - 32)  # (n, 16)
    ql = (blocks[:, 32:96].reshape(-1, 2, 1, 32) >> _PAIR_SHIFTS) & 3  # (n, 2, 4, 32)
    hm = (blocks[:, None, 0:32] >> _BIT_SHIFTS) & 1  # (n, 8, 32): row 4h + k
    q = ql.reshape(-1, 8, 32).astype(np.float32) - 4 * (1 - hm.astype(np.float32))
    np.multiply(scale[:, :, None], q.reshape(-1, 16, 16), out=out.reshape(-1, 16, 16))


# Q8_K block, 292 bytes: | d: f32 (4) | qs: int8[256] (256) | bsums: int16[16] (32) |
# The activation type of llama.cpp's K-quant dot products (bsums: sums of 16 quants each, unused here); y = d * q.
def _q8_k(blocks: np.ndarray, out: np.ndarray) -> None:
    np.multiply(blocks[:, 0:4].view(np.float32), blocks[:, 4:260].view(np.int8).astype(np.float32), out=out)


# TQ1_0 block, 54 bytes: | qs: u8[48] (48) | qh: u8[4] (4) | d: f16 (2) |
# Ternary digits, 5 per byte (4 in qh) as a fraction of 243: digit k of byte b is ((b * 3^k mod 256) * 3) >> 8.
# Values 32k + l from qs[l] (l < 32), 160 + 16k + l from qs[32 + l], 240 + 4k + l from qh[l]. y = d * (digit - 1).
def _tq1_0(blocks: np.ndarray, out: np.ndarray) -> None:
    d = _half(blocks[:, 52:54])
    parts = [blocks[:, None, 0:32] * _POW3, blocks[:, None, 32:48] * _POW3, blocks[:, None, 48:52] * _POW3[:4]]
    shifted = np.concatenate([p.reshape(len(blocks), -1) for p in parts], axis=-1)  # (n, 256) u8, wrapped mod 256
    digit = (shifted.astype(np.uint16) * 3) >> 8
    np.multiply(d, digit.astype(np.float32) - 1, out=out)


# TQ2_0 block, 66 bytes: | qs: u8[64] (64) | d: f16 (2) |
# 2-bit quants in Q2_K's order (bits 2k..2k+1 of qs[32h + l] are value 128h + 32k + l). y = d * (q - 1).
def _tq2_0(blocks: np.ndarray, out: np.ndarray) -> None:
    d = _half(blocks[:, 64:66])
    q = (blocks[:, 0:64].reshape(-1, 2, 1, 32) >> _PAIR_SHIFTS) & 3  # (n, 2, 4, 32)
    np.multiply(d, q.reshape(-1, 256).astype(np.float32) - 1, out=out)


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
    GGMLType.Q2_K: _q2_k,
    GGMLType.Q3_K: _q3_k,
    GGMLType.Q8_K: _q8_k,
    GGMLType.TQ1_0: _tq1_0,
    GGMLType.TQ2_0: _tq2_0,
}
assert _DECODERS.keys() | CODEBOOK_TYPES == SUPPORTED_TYPES and not _DECODERS.keys() & CODEBOOK_TYPES


def _decoder(ggml_type: GGMLType) -> Decoder:
    if ggml_type in CODEBOOK_TYPES:
        from engine.cpu import dequant_iq

        return dequant_iq.DECODERS[ggml_type]
    return _DECODERS[ggml_type]


def _supported_type(ggml_type: GGMLType | int) -> GGMLType:
    if ggml_type not in SUPPORTED_TYPES:
        supported = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        raise UnsupportedArchitecture(f"tensor type {type_name(ggml_type)} is not supported (supported: {supported})")
    return GGMLType(ggml_type)


def _decode_into(blocks: np.ndarray, ggml_type: GGMLType, out: np.ndarray) -> None:
    """Decode blocks (n, type_size) u8 into out (n, block_size) f32, a bounded number of blocks at a time."""
    assert out.flags.c_contiguous, "decoders write through reshaped views of out"
    decode = _decoder(ggml_type)
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

"""Writes GGUF bytes field by field, so tests can make well-formed files and precisely malformed ones."""

from __future__ import annotations

import struct

U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
_FMT = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<?", U64: "<Q",
        I64: "<q", F64: "<d"}  # fmt: skip


def gstr(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def value(vtype: int, v) -> bytes:
    if vtype == STRING:
        return gstr(v)
    if vtype == ARRAY:
        etype, items = v
        return struct.pack("<IQ", etype, len(items)) + b"".join(value(etype, x) for x in items)
    return struct.pack(_FMT[vtype], v)


def kv(key: str, vtype: int, v) -> bytes:
    return gstr(key) + struct.pack("<I", vtype) + value(vtype, v)


def tensor_info(name: str, ne: list[int], ggml_type: int, offset: int) -> bytes:
    return gstr(name) + struct.pack("<I", len(ne)) + struct.pack(f"<{len(ne)}Q", *ne) + struct.pack("<IQ", ggml_type,
                                                                                                  offset)  # fmt: skip


def build(kvs: list[bytes], infos: list[bytes], data: bytes = b"", *, magic: bytes = b"GGUF", version: int = 3,
          n_tensors: int | None = None, n_kv: int | None = None, alignment: int = 32) -> bytes:  # fmt: skip
    head = magic + struct.pack("<IQQ", version, len(infos) if n_tensors is None else n_tensors,
                               len(kvs) if n_kv is None else n_kv)  # fmt: skip
    body = head + b"".join(kvs) + b"".join(infos)
    pad = (-len(body)) % alignment
    return body + b"\0" * pad + data


def sample_file(n_tokens: int = 300) -> bytes:
    """A small valid file: scalars of every type, a vocabulary-like string array (with an empty and a 300-byte
    string, so both string-array paths run), a numeric array and two F32 tensors."""
    tokens = [f"tok{i}" for i in range(n_tokens)]
    tokens[7] = ""
    tokens[100] = "x" * 300
    kvs = [
        kv("general.architecture", STRING, "llama"),
        kv("general.alignment", U32, 32),
        kv("llama.block_count", U32, 1),
        kv("a.u8", U8, 7),
        kv("a.i8", I8, -7),
        kv("a.u16", U16, 700),
        kv("a.i16", I16, -700),
        kv("a.i32", I32, -70000),
        kv("a.f32", F32, 0.5),
        kv("a.bool", BOOL, True),
        kv("a.u64", U64, 1 << 40),
        kv("a.i64", I64, -(1 << 40)),
        kv("a.f64", F64, 0.25),
        kv("tokenizer.ggml.tokens", ARRAY, (STRING, tokens)),
        kv("tokenizer.ggml.token_type", ARRAY, (I32, [1] * n_tokens)),
        kv("a.nested", ARRAY, (ARRAY, [(U8, [1, 2]), (U8, [3])])),
    ]
    infos = [tensor_info("a.weight", [8, 2], 0, 0), tensor_info("b.weight", [4], 0, 64)]
    data = struct.pack("<16f", *range(16)) + struct.pack("<4f", 1, 2, 3, 4)
    return build(kvs, infos, data)

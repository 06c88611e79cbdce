"""Write a GGUF shaped exactly like Qwen3-0.6B Q4_K_M (or Q8_0), with random weights and the real Qwen3 vocabulary.

    python scripts/make_bench_model.py --quant q4_k_m|q8_0 [--seed 0] [--out PATH] [--layers N]

For measuring cold start and decode speed without downloading the real model: performance does not depend on the
weight values, only on the tensor names, shapes, types and order, which follow what llama-quantize writes for the
tied-embedding Qwen3-0.6B (`../shared/reference/gguf-kernels-architectures.md` §1.4):

- q4_k_m (file_type 15): token_embd Q6_K (it is also the LM head); attn_v and ffn_down Q6_K on the layers where
  `use_more_bits(i, n_layers)` holds, else Q4_K; every other matrix Q4_K; norms F32.
  28 layers: 310 tensors, f32 113, q4_K 168, q6_K 29.
- q8_0 (file_type 7): every matrix and token_embd Q8_0; norms F32. 28 layers: f32 113, q8_0 197.

Tensor order is llama-quantize's (its loader keeps tensors in a map ordered by layer, then by name): output_norm,
token_embd, then blk.0 .. blk.{n-1}, each layer's tensors sorted by name. Metadata: general.*, the qwen3.*
hyper-parameters of Qwen3-0.6B, the tokenizer.* keys copied from tests/fixtures/tokenizer/qwen3-vocab.gguf, then
general.quantization_version and general.file_type last (where llama-quantize puts them); default alignment.

Blocks are random bytes with their scale fields overwritten so that every dequantized matrix has mean ~0 and standard
deviation ~0.02 (norm weights ~U(0.95, 1.05)): a forward pass stays finite and a greedy continuation is noise.
Each tensor's bytes depend only on (--seed, tensor name, type), so a given seed always writes the same file.
Tensors are generated and written one at a time (gguf-py's GGUFWriter, streaming), so the peak RSS stays around 0.4 GB.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import zlib
from collections import Counter
from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, GGUFWriter

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, REPO)

from engine import gguf as engine_gguf  # noqa: E402  (the repo's reader: parses the 152k-token vocab in ~0.1 s)
from engine.prepare import file_sha256  # noqa: E402

VOCAB_GGUF = os.path.join(REPO, "tests", "fixtures", "tokenizer", "qwen3-vocab.gguf")
Q = GGMLQuantizationType

# Qwen3-0.6B hyper-parameters (the HF config.json of Qwen/Qwen3-0.6B).
DIM, HIDDEN_DIM, N_HEADS, N_KV_HEADS, HEAD_DIM, N_LAYERS = 1024, 3072, 16, 8, 128, 28
N_CTX, ROPE_THETA, NORM_EPS = 40960, 1e6, 1e-6

QUANTS = {"q4_k_m": 15, "q8_0": 7}  # --quant -> general.file_type (llama_ftype)
WEIGHT_STD = 0.02
NORM_SPREAD = 0.05

# Copied verbatim (in this order) from the vocab GGUF; the value types are the ones convert_hf_to_gguf writes.
_S, _U32, _BOOL, _ARR = GGUFValueType.STRING, GGUFValueType.UINT32, GGUFValueType.BOOL, GGUFValueType.ARRAY
TOKENIZER_KEYS: list[tuple[str, GGUFValueType, GGUFValueType | None]] = [
    ("tokenizer.ggml.model", _S, None),
    ("tokenizer.ggml.pre", _S, None),
    ("tokenizer.ggml.tokens", _ARR, _S),
    ("tokenizer.ggml.token_type", _ARR, GGUFValueType.INT32),
    ("tokenizer.ggml.merges", _ARR, _S),
    ("tokenizer.ggml.eos_token_id", _U32, None),
    ("tokenizer.ggml.padding_token_id", _U32, None),
    ("tokenizer.ggml.bos_token_id", _U32, None),
    ("tokenizer.ggml.add_bos_token", _BOOL, None),
    ("tokenizer.ggml.add_eos_token", _BOOL, None),
    ("tokenizer.chat_template", _S, None),
]


@dataclass(frozen=True)
class TensorSpec:
    name: str
    ne: tuple[int, ...]  # GGUF order: ne[0] is contiguous
    ggml_type: GGMLQuantizationType

    @property
    def n_bytes(self) -> int:
        block, type_size = GGML_QUANT_SIZES[self.ggml_type]
        n = int(np.prod(self.ne))
        assert n % block == 0, self
        return n // block * type_size


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama-quantize's choice of the layers whose attn_v / ffn_down get more bits (integer division)."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def _layer_shapes() -> dict[str, tuple[int, ...]]:
    """One layer's tensors (name suffix -> ne). q projects 1024 -> 16 x 128 = 2048: head_dim is not dim/n_heads."""
    q_dim, kv_dim = N_HEADS * HEAD_DIM, N_KV_HEADS * HEAD_DIM
    return {
        "attn_norm": (DIM,),
        "attn_q": (DIM, q_dim),
        "attn_k": (DIM, kv_dim),
        "attn_v": (DIM, kv_dim),
        "attn_q_norm": (HEAD_DIM,),
        "attn_k_norm": (HEAD_DIM,),
        "attn_output": (q_dim, DIM),
        "ffn_norm": (DIM,),
        "ffn_gate": (DIM, HIDDEN_DIM),
        "ffn_up": (DIM, HIDDEN_DIM),
        "ffn_down": (HIDDEN_DIM, DIM),
    }


def _matrix_type(quant: str, kind: str, i_layer: int, n_layers: int) -> GGMLQuantizationType:
    if quant == "q8_0":
        return Q.Q8_0
    if kind == "token_embd":  # tied embeddings: the embedding is the output matrix and gets the output's Q6_K
        return Q.Q6_K
    if kind in ("attn_v", "ffn_down") and use_more_bits(i_layer, n_layers):
        return Q.Q6_K
    return Q.Q4_K


def tensor_plan(quant: str, n_layers: int = N_LAYERS, n_vocab: int = 151936) -> list[TensorSpec]:
    """Every tensor of the file in llama-quantize's order: non-layer tensors by name, then layer by layer."""
    if quant not in QUANTS:
        raise ValueError(f"unknown quant {quant!r} (choose from {', '.join(QUANTS)})")

    def spec(name: str, ne: tuple[int, ...], kind: str, i_layer: int) -> TensorSpec:
        if len(ne) == 1:  # norm vectors are never quantized
            return TensorSpec(name, ne, Q.F32)
        # llama-quantize falls back to Q5_0/Q8_0 when a row is not a multiple of 256; no Qwen3-0.6B row is.
        assert ne[0] % 256 == 0, name
        return TensorSpec(name, ne, _matrix_type(quant, kind, i_layer, n_layers))

    plan = [spec("output_norm.weight", (DIM,), "output_norm", -1),
            spec("token_embd.weight", (DIM, n_vocab), "token_embd", -1)]  # fmt: skip
    shapes = _layer_shapes()
    for i in range(n_layers):
        for kind in sorted(shapes, key=lambda k: f"{k}.weight"):
            plan.append(spec(f"blk.{i}.{kind}.weight", shapes[kind], kind, i))
    return plan


# -- random, well-formed blocks ---------------------------------------------------------------------------------

_JITTER = (0.8, 1.2)  # per-block factor on the f16 super-scale, so blocks differ like real ones
_JITTER_MS = 1.0 + (_JITTER[1] - _JITTER[0]) ** 2 / 12  # E[j^2] of U(0.8, 1.2)
# Q8_0: int8 quants uniform on -127..127 with -128 folded onto -127 (llama-quantize never writes -128).
_Q8_0_MS = (2 * sum(k * k for k in range(128)) + 127 * 127) / 256
# Q4_K: 6-bit sub-block scales sc in 32..63 and mins m = sc with dmin = 7.5 d, so y = d*sc*(q - 7.5), q in 0..15.
_Q4_K_SC = np.arange(32, 64)
_Q4_K_MS = float(np.mean(_Q4_K_SC.astype(np.float64) ** 2)) * (16 * 16 - 1) / 12
# Q6_K: int8 sub-block scales with |sc| in 64..127 and a random sign; q uniform on -32..31.
_Q6_K_SC = np.arange(64, 128)
_Q6_K_MS = float(np.mean(_Q6_K_SC.astype(np.float64) ** 2)) * float(np.mean(np.arange(-32, 32) ** 2.0))


def _random_blocks(rng: np.random.Generator, n_blocks: int, type_size: int) -> np.ndarray:
    """(n_blocks, type_size) u8 of uniform random bytes (full-range uint64 draws are the fastest NumPy source)."""
    n = n_blocks * type_size
    words = rng.integers(0, 2**64 - 1, size=(n + 7) // 8, dtype=np.uint64, endpoint=True)
    return words.view(np.uint8)[:n].reshape(n_blocks, type_size)


def _put_f16(blocks: np.ndarray, at: int, values: np.ndarray) -> None:
    blocks[:, at : at + 2] = values.astype("<f2").view(np.uint8).reshape(-1, 2)


def _super_scale(rng: np.random.Generator, n_blocks: int, mean_square: float) -> np.ndarray:
    """Per-block d such that E[(d * scale * q)^2] = WEIGHT_STD^2 given E[(scale * q)^2] = mean_square."""
    return WEIGHT_STD / np.sqrt(mean_square * _JITTER_MS) * rng.uniform(*_JITTER, size=n_blocks)


def _q8_0(rng: np.random.Generator, n_blocks: int) -> np.ndarray:
    """Q8_0, 34 B: | d f16 (0-1) | qs int8[32] (2-33) |  y = d * qs."""
    b = _random_blocks(rng, n_blocks, 34)
    qs = b[:, 2:].view(np.int8)
    np.maximum(qs, -127, out=qs)
    _put_f16(b, 0, _super_scale(rng, n_blocks, _Q8_0_MS))
    return b


def _q4_k(rng: np.random.Generator, n_blocks: int) -> np.ndarray:
    """Q4_K, 144 B: | d f16 (0-1) | dmin f16 (2-3) | scales u8[12] (4-15) | qs u8[128] (16-143) |.

    scales packs 8 six-bit scales sc[j] and mins m[j]: bytes 0-3 = sc[0..3] | (sc[4..7] >> 4) << 6,
    bytes 4-7 = m[0..3] | (m[4..7] >> 4) << 6, bytes 8-11 = (sc[4..7] & 15) | (m[4..7] & 15) << 4.
    y = d*sc[j]*q - dmin*m[j]; with m = sc and dmin = 7.5 d every sub-block is centred on 0.
    """
    b = _random_blocks(rng, n_blocks, 144)
    sc = rng.choice(_Q4_K_SC, size=(n_blocks, 8)).astype(np.uint8)
    m = sc
    b[:, 4:8] = sc[:, :4] | (sc[:, 4:] >> 4) << 6
    b[:, 8:12] = m[:, :4] | (m[:, 4:] >> 4) << 6
    b[:, 12:16] = (sc[:, 4:] & 15) | (m[:, 4:] & 15) << 4
    d = _super_scale(rng, n_blocks, _Q4_K_MS).astype(np.float16)
    _put_f16(b, 0, d)
    _put_f16(b, 2, d.astype(np.float32) * 7.5)
    return b


def _q6_k(rng: np.random.Generator, n_blocks: int) -> np.ndarray:
    """Q6_K, 210 B: | ql u8[128] (0-127) | qh u8[64] (128-191) | scales int8[16] (192-207) | d f16 (208-209) |.

    q = (4 low bits from ql | 2 high bits from qh) - 32, y = d * scales[sub-block of 16] * q.
    """
    b = _random_blocks(rng, n_blocks, 210)
    sign = rng.choice(np.array([-1, 1], dtype=np.int8), size=(n_blocks, 16))
    b[:, 192:208] = (rng.choice(_Q6_K_SC, size=(n_blocks, 16)).astype(np.int8) * sign).view(np.uint8)
    _put_f16(b, 208, _super_scale(rng, n_blocks, _Q6_K_MS))
    return b


_BLOCK_MAKERS = {Q.Q8_0: _q8_0, Q.Q4_K: _q4_k, Q.Q6_K: _q6_k}


def tensor_data(t: TensorSpec, seed: int) -> np.ndarray:
    """The tensor's bytes as written: F32 values, or (n_blocks, type_size) u8 blocks. Depends on (seed, name, type)."""
    rng = np.random.default_rng([seed, zlib.crc32(t.name.encode()), int(t.ggml_type)])
    if t.ggml_type == Q.F32:
        return rng.uniform(1 - NORM_SPREAD, 1 + NORM_SPREAD, size=t.ne[::-1]).astype(np.float32)
    block, _ = GGML_QUANT_SIZES[t.ggml_type]
    return _BLOCK_MAKERS[t.ggml_type](rng, int(np.prod(t.ne)) // block)


# -- the file ---------------------------------------------------------------------------------------------------


def _vocab_metadata(path: str) -> list[tuple[str, object, GGUFValueType, GGUFValueType | None]]:
    md = engine_gguf.read(path).metadata
    missing = [k for k, _, _ in TOKENIZER_KEYS if k not in md]
    if missing:
        raise SystemExit(f"{path}: vocab GGUF lacks {', '.join(missing)}")
    out = []
    for key, vtype, sub in TOKENIZER_KEYS:
        value = md[key]
        if isinstance(value, np.ndarray):
            value = value.tolist()
        out.append((key, value, vtype, sub))
    return out


def _add_metadata(w: GGUFWriter, quant: str, n_layers: int, vocab: list) -> None:
    w.add_type("model")  # general.architecture = qwen3 was added by the writer
    w.add_name("Qwen3 0.6B shaped (random weights)")
    w.add_size_label("0.6B")
    w.add_block_count(n_layers)
    w.add_context_length(N_CTX)
    w.add_embedding_length(DIM)
    w.add_feed_forward_length(HIDDEN_DIM)
    w.add_head_count(N_HEADS)
    w.add_head_count_kv(N_KV_HEADS)
    w.add_rope_freq_base(ROPE_THETA)
    w.add_layer_norm_rms_eps(NORM_EPS)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    for key, value, vtype, sub in vocab:
        w.add_key_value(key, value, vtype, sub)
    w.add_quantization_version(2)
    w.add_file_type(QUANTS[quant])


def write_model(
    out: str, quant: str, seed: int = 0, n_layers: int = N_LAYERS, vocab_path: str = VOCAB_GGUF
) -> list[TensorSpec]:
    """Write the file; returns its tensor plan."""
    if n_layers < 1 or seed < 0:
        raise ValueError(f"need n_layers >= 1 and seed >= 0, got {n_layers}, {seed}")
    vocab = _vocab_metadata(vocab_path)
    n_vocab = len(next(v for k, v, _, _ in vocab if k == "tokenizer.ggml.tokens"))
    plan = tensor_plan(quant, n_layers, n_vocab)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    w = GGUFWriter(out, "qwen3")
    _add_metadata(w, quant, n_layers, vocab)
    write_tensors(w, plan, lambda t: tensor_data(t, seed))
    return plan


def write_tensors(w: GGUFWriter, plan: list[TensorSpec], data) -> None:
    """The tensor infos, then (after the header and metadata) each tensor's `data(t)`, one at a time; closes w."""
    for t in plan:
        if t.ggml_type == Q.F32:
            w.add_tensor_info(t.name, t.ne[::-1], np.dtype(np.float32), t.n_bytes)
        else:  # byte shape (rows, row bytes); gguf-py turns it back into element counts for the raw type
            row_bytes = t.n_bytes // int(np.prod(t.ne[1:]))
            w.add_tensor_info(t.name, (*t.ne[:0:-1], row_bytes), np.dtype(np.uint8), t.n_bytes, raw_dtype=t.ggml_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in plan:
        w.write_tensor_data(data(t))
    w.close()


def type_counts(plan: list[TensorSpec]) -> dict[str, int]:
    """llama.cpp's spelling (f32, q4_K, q6_K, q8_0), as in its load log."""
    counts = Counter(t.ggml_type.name.lower().replace("_k", "_K") for t in plan)
    return dict(sorted(counts.items()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quant", choices=sorted(QUANTS), required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=N_LAYERS, help=f"number of layers (default {N_LAYERS})")
    p.add_argument("--out", default=None, help="output path (default bench/models/qwen3-0.6b-shaped-QUANT.gguf)")
    args = p.parse_args(argv)
    if args.layers < 1:
        p.error("--layers must be >= 1")
    if args.seed < 0:
        p.error("--seed must be >= 0")
    suffix = "" if args.layers == N_LAYERS else f"-{args.layers}layers"
    out = args.out or os.path.join(REPO, "bench", "models", f"qwen3-0.6b-shaped-{args.quant}{suffix}.gguf")
    start = time.perf_counter()
    plan = write_model(out, args.quant, args.seed, args.layers)
    seconds = time.perf_counter() - start
    size = os.path.getsize(out)
    counts = ", ".join(f"{k}: {v}" for k, v in type_counts(plan).items())
    print(out)
    print(f"size    {size:,} bytes ({size / 2**20:.1f} MiB), written in {seconds:.2f} s")
    print(f"sha256  {file_sha256(out)}")
    print(f"tensors {len(plan)} ({counts})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Write a GGUF shaped like a published MoE, MLA or hybrid model, with random weights and the real Qwen3 vocabulary.

    python scripts/make_family_bench_model.py --shape qwen3-30b-a3b|deepseek-v2-lite|qwen3.5-0.8b [--layers N]
                                              [--seed 0] [--out PATH]

The sibling of make_bench_model.py (Qwen3-0.6B) for the other seed families; it reuses that script's random,
well-formed blocks (mean ~0, standard deviation ~0.02). The tensor list comes from the engine's own per-family specs
(engine/models/specs.py) for the shape's hyper-parameters, so the file is what the engine expects; the types follow
llama-quantize's Q4_K_M rules for these tensors (see `q4_k_m_type`), so llama.cpp loads the same file.

Shapes (hyper-parameters as published in each model's Hugging Face config.json):
- qwen3-30b-a3b: Qwen/Qwen3-30B-A3B. 48 layers, hidden 2048, 32 heads / 4 KV heads of 128, 128 experts of 768,
  top-8 (softmax, renormalised), untied output. ~17.5 GB.
- deepseek-v2-lite: deepseek-ai/DeepSeek-V2-Lite. 27 layers, hidden 2048, 16 heads, MLA with kv_lora_rank 512,
  qk_nope 128 / qk_rope 64 / v_head 128, no q-LoRA; layer 0 dense (10944), then 64 experts of 1408, top-6, 2 shared
  experts; YaRN factor 40 over 4096 positions, mscale_all_dim 0.707. ~10 GB.
- qwen3.5-0.8b: Qwen/Qwen3.5-0.8B's text model. 24 layers, every 4th full attention (8 heads / 2 KV heads of 256,
  output-gated, 64 rotary dims), the others Gated DeltaNet (16 key / 16 value heads of 128, conv 4); hidden 1024,
  FFN 3584; tied embeddings. ~0.55 GB.

Vocabulary: the Qwen3 tokenizer of tests/fixtures/tokenizer (151,936 tokens). Qwen3-30B-A3B uses it as published.
qwen3.5-0.8b pads it to Qwen3.5's 248,320 rows with unused tokens (type 5, never produced by tokenization), so the
embedding / LM head has the real size. deepseek-v2-lite keeps 151,936 rows (the real model has 102,400): its LM head
is 1.48x the real one's, ~2 % more bytes per decoded token.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import zlib
from types import SimpleNamespace

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_bench_model as mb  # (it also puts the repository on sys.path)

from engine.config import ModelConfig
from engine.models import specs
from engine.prepare import file_sha256

Q = GGMLQuantizationType
UNUSED_TOKEN = 5  # llama_token_type LLAMA_TOKEN_TYPE_UNUSED

# Per shape: architecture, the engine's spec family, vocabulary size, display name, the tensors (name -> ne) whose
# presence decides the config (untied head, q/k norms, shared-expert width), and the metadata under "{arch}." (ints
# as uint32, floats as float32, lists as arrays).
SHAPES: dict[str, dict] = {
    "qwen3-30b-a3b": {
        "arch": "qwen3moe", "family": specs.dense, "n_vocab": 151936, "name": "Qwen3 30B-A3B shaped", "size": "30B-A3B",
        "present": {"output.weight": (2048, 151936), "blk.0.attn_q_norm.weight": (128,)},
        "kv": {"block_count": 48, "context_length": 40960, "embedding_length": 2048, "feed_forward_length": 6144,
               "attention.head_count": 32, "attention.head_count_kv": 4, "rope.freq_base": 1e6,
               "attention.layer_norm_rms_epsilon": 1e-6, "expert_used_count": 8, "attention.key_length": 128,
               "attention.value_length": 128, "expert_count": 128, "expert_feed_forward_length": 768},
    },
    "deepseek-v2-lite": {
        "arch": "deepseek2", "family": specs.mla, "n_vocab": 151936, "name": "DeepSeek V2 Lite shaped",
        "size": "64x1.5B",
        "present": {"output.weight": (2048, 151936), "blk.1.ffn_up_shexp.weight": (2048, 2 * 1408)},
        "kv": {"block_count": 27, "context_length": 163840, "embedding_length": 2048, "feed_forward_length": 10944,
               "attention.head_count": 16, "attention.head_count_kv": 1, "rope.freq_base": 10000.0,
               "attention.layer_norm_rms_epsilon": 1e-6, "expert_used_count": 6, "expert_count": 64,
               "expert_group_count": 1, "expert_group_used_count": 1, "attention.key_length": 576,
               "attention.value_length": 512, "leading_dense_block_count": 1, "vocab_size": 151936,
               "attention.q_lora_rank": 0, "attention.kv_lora_rank": 512, "attention.key_length_mla": 192,
               "attention.value_length_mla": 128, "expert_feed_forward_length": 1408, "expert_shared_count": 2,
               "expert_weights_scale": 1.0, "expert_weights_norm": False, "expert_gating_func": 1,
               "rope.dimension_count": 64, "rope.scaling.type": "yarn", "rope.scaling.factor": 40.0,
               "rope.scaling.original_context_length": 4096, "rope.scaling.yarn_log_multiplier": 0.0707},
    },
    "qwen3.5-0.8b": {
        "arch": "qwen35", "family": specs.hybrid, "n_vocab": 248320, "name": "Qwen3.5 0.8B shaped", "size": "0.8B",
        "present": {},
        "kv": {"block_count": 24, "context_length": 262144, "embedding_length": 1024, "feed_forward_length": 3584,
               "attention.head_count": 8, "attention.head_count_kv": 2, "rope.dimension_sections": [11, 11, 10, 0],
               "rope.freq_base": 1e7, "attention.layer_norm_rms_epsilon": 1e-6, "attention.key_length": 256,
               "attention.value_length": 256, "ssm.conv_kernel": 4, "ssm.state_size": 128, "ssm.group_count": 16,
               "ssm.time_step_rank": 16, "ssm.inner_size": 2048,
               "attention.recurrent_layers": [(i + 1) % 4 != 0 for i in range(24)], "full_attention_interval": 4,
               "rope.dimension_count": 64},
    },
}  # fmt: skip
F32_KINDS = ("ffn_gate_inp", "ssm_conv1d", "ssm_a", "ssm_dt", "exp_probs_b")  # llama-quantize leaves these F32
# llama-quantize's fallback when a row is not a whole number of 256-value blocks (tensor_type_fallback).
FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}


def q4_k_m_type(name: str, ne: tuple[int, ...], n_layers: int, tied: bool) -> GGMLQuantizationType:
    """llama-quantize's Q4_K_M choice for the tensors these shapes have: output (and a tied token_embd) Q6_K;
    attn_v and every ffn_down* on the `use_more_bits` layers Q6_K; attn_qkv Q5_K; the rest Q4_K; vectors, routers and
    the DeltaNet conv/decay tensors F32; 256-block types fall back when ne[0] is not a multiple of 256."""
    kind = name.split(".")[2] if name.startswith("blk.") else name.split(".")[0]
    if len(ne) == 1 or kind in F32_KINDS:
        return Q.F32
    layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
    if kind == "output" or (kind == "token_embd" and tied):
        t = Q.Q6_K if ne[0] % 256 == 0 else Q.Q8_0
    elif kind == "attn_qkv":
        t = Q.Q5_K
    elif (kind == "attn_v" or kind.startswith("ffn_down")) and mb.use_more_bits(layer, n_layers):
        t = Q.Q6_K
    else:
        t = Q.Q4_K
    return FALLBACK.get(t, t) if ne[0] % 256 else t


def config_for(shape: str, n_layers: int | None) -> tuple[dict, ModelConfig]:
    s = SHAPES[shape]
    kv = dict(s["kv"])
    if n_layers is not None:
        kv["block_count"] = n_layers
        if "attention.recurrent_layers" in kv:
            kv["attention.recurrent_layers"] = [(i + 1) % 4 != 0 for i in range(n_layers)]
    md = {"general.architecture": s["arch"]} | {f"{s['arch']}.{k}": v for k, v in kv.items()}
    # ModelConfig decides the vocabulary, a tied head and q/k norms from which tensors a file has.
    present = {"token_embd.weight": (kv["embedding_length"], s["n_vocab"])} | s["present"]
    present = {name: SimpleNamespace(ne=ne) for name, ne in present.items()}
    return kv, ModelConfig.from_gguf(md, present)


def tensor_plan(shape: str, n_layers: int | None = None) -> list[mb.TensorSpec]:
    """The file's tensors in llama-quantize's order: non-layer tensors by name, then layer by layer, each by name."""
    _, cfg = config_for(shape, n_layers)
    wanted = [t for t in SHAPES[shape]["family"](cfg) if t.required]

    def key(t):
        if not t.name.startswith("blk."):
            return (-1, t.name)
        return (int(t.name.split(".")[1]), t.name)

    return [mb.TensorSpec(t.name, t.ne, q4_k_m_type(t.name, t.ne, cfg.n_layers, cfg.tied_output))
            for t in sorted(wanted, key=key)]  # fmt: skip


# -- blocks of the types make_bench_model.py does not write ------------------------------------------------------

_Q5_0_MS = float(np.mean((np.arange(32) - 16.0) ** 2))
_Q5_K_MS = float(np.mean(mb._Q4_K_SC.astype(np.float64) ** 2)) * (32 * 32 - 1) / 12


def _q5_0(rng: np.random.Generator, n_blocks: int) -> np.ndarray:
    """Q5_0, 22 B: | d f16 (0-1) | qh u32 (2-5) | qs u8[16] (6-21) |  y = d * (q - 16), q = 5 bits in 0..31.
    q - 16 averages -1/2, so d takes a random sign per block to centre the matrix on 0."""
    b = mb._random_blocks(rng, n_blocks, 22)
    sign = rng.choice(np.array([-1.0, 1.0]), size=n_blocks)
    mb._put_f16(b, 0, mb._super_scale(rng, n_blocks, _Q5_0_MS) * sign)
    return b


def _q5_k(rng: np.random.Generator, n_blocks: int) -> np.ndarray:
    """Q5_K, 176 B: | d | dmin | scales u8[12] | qh u8[32] | qs u8[128] |, scales packed as Q4_K's; with m = sc and
    dmin = 15.5 d every sub-block y = d*sc*(q - 15.5) is centred on 0."""
    b = mb._random_blocks(rng, n_blocks, 176)
    sc = rng.choice(mb._Q4_K_SC, size=(n_blocks, 8)).astype(np.uint8)
    b[:, 4:8] = sc[:, :4] | (sc[:, 4:] >> 4) << 6
    b[:, 8:12] = sc[:, :4] | (sc[:, 4:] >> 4) << 6
    b[:, 12:16] = (sc[:, 4:] & 15) | (sc[:, 4:] & 15) << 4
    d = mb._super_scale(rng, n_blocks, _Q5_K_MS).astype(np.float16)
    mb._put_f16(b, 0, d)
    mb._put_f16(b, 2, d.astype(np.float32) * 15.5)
    return b


BLOCK_MAKERS = {**mb._BLOCK_MAKERS, Q.Q5_0: _q5_0, Q.Q5_K: _q5_k}


def tensor_data(t: mb.TensorSpec, seed: int) -> np.ndarray:
    rng = np.random.default_rng([seed, zlib.crc32(t.name.encode()), int(t.ggml_type)])
    kind = t.name.split(".")[2] if t.name.startswith("blk.") else ""
    if t.ggml_type == Q.F32:
        if kind == "ssm_a":  # A = -exp(A_log): negative, so the state decays
            return -rng.uniform(0.5, 1.5, size=t.ne[::-1]).astype(np.float32)
        if kind in ("ffn_gate_inp", "ssm_conv1d", "ssm_dt", "exp_probs_b"):
            return rng.normal(0.0, mb.WEIGHT_STD, size=t.ne[::-1]).astype(np.float32)
        return rng.uniform(1 - mb.NORM_SPREAD, 1 + mb.NORM_SPREAD, size=t.ne[::-1]).astype(np.float32)
    block, _ = GGML_QUANT_SIZES[t.ggml_type]
    return BLOCK_MAKERS[t.ggml_type](rng, int(np.prod(t.ne)) // block)


# -- the file ---------------------------------------------------------------------------------------------------


def _add_kv(w: GGUFWriter, key: str, value) -> None:
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    else:  # gguf-py types an array by its first element: bool or int32
        w.add_array(key, list(value))


def _padded_vocab(vocab: list, n_vocab: int) -> list:
    """The Qwen3 tokenizer keys, its token list padded to n_vocab with unused tokens."""
    out = []
    for key, value, vtype, sub in vocab:
        if key == "tokenizer.ggml.tokens" and len(value) < n_vocab:
            value = value + [f"<|unused_{i}|>" for i in range(n_vocab - len(value))]
        elif key == "tokenizer.ggml.token_type" and len(value) < n_vocab:
            value = value + [UNUSED_TOKEN] * (n_vocab - len(value))
        out.append((key, value, vtype, sub))
    return out


def write_model(out: str, shape: str, seed: int = 0, n_layers: int | None = None) -> list[mb.TensorSpec]:
    s = SHAPES[shape]
    kv, _ = config_for(shape, n_layers)
    plan = tensor_plan(shape, n_layers)
    vocab = _padded_vocab(mb._vocab_metadata(mb.VOCAB_GGUF), s["n_vocab"])
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    w = GGUFWriter(out, s["arch"])
    w.add_type("model")
    w.add_name(f"{s['name']} (random weights)")
    w.add_size_label(s["size"])
    for key, value in kv.items():
        _add_kv(w, f"{s['arch']}.{key}", value)
    for key, value, vtype, sub in vocab:
        w.add_key_value(key, value, vtype, sub)
    w.add_quantization_version(2)
    w.add_file_type(15)  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    mb.write_tensors(w, plan, lambda t: tensor_data(t, seed))
    return plan


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=None, help="number of layers (default: the published count)")
    p.add_argument("--out", default=None, help="output path (default bench/models/SHAPE-shaped-q4_k_m.gguf)")
    args = p.parse_args(argv)
    if args.layers is not None and args.layers < 1:
        p.error("--layers must be >= 1")
    if args.seed < 0:
        p.error("--seed must be >= 0")
    suffix = "" if args.layers is None else f"-{args.layers}layers"
    out = args.out or os.path.join(mb.REPO, "bench", "models", f"{args.shape}-shaped-q4_k_m{suffix}.gguf")
    start = time.perf_counter()
    plan = write_model(out, args.shape, args.seed, args.layers)
    seconds = time.perf_counter() - start
    size = os.path.getsize(out)
    counts = ", ".join(f"{k}: {v}" for k, v in mb.type_counts(plan).items())
    print(out)
    print(f"size    {size:,} bytes ({size / 2**30:.2f} GiB), written in {seconds:.1f} s")
    if size < 2**31:
        print(f"sha256  {file_sha256(out)}")
    print(f"tensors {len(plan)} ({counts})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

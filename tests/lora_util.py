"""LoRA adapter files in llama.cpp's GGUF adapter format, written with gguf-py, and the naive reference they are
held to (W + scale · B·A on the dequantized base). Shared by the tests and scripts/make_lora_fixture.py."""

from __future__ import annotations

import hashlib
import os

import gguf
import numpy as np

from engine.gguf import GGUFFile
from tests import synthetic

# Per family, the base tensors an adapter adapts in the tests: the ones llama.cpp runs through its LoRA matmul
# (build_lora_mm / build_lora_mm_id) in that architecture's graph, so its logits are a fair reference.
TARGETS = {
    "qwen3": ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"],
    "qwen3moe": ["attn_q", "attn_v", "attn_output", "ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"],
    "qwen35": ["attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha", "ssm_out", "attn_output", "ffn_gate", "ffn_down"],
    "deepseek2": ["attn_output", "ffn_gate", "ffn_up", "ffn_down"],
    "llama": ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "output"],
}


def random_pairs(base: GGUFFile, shorts: list[str], rank: int, seed: int, std: float = 0.05) -> dict:
    """target name -> (a, b) f32 in NumPy order: a (rank, in) / (E, rank, in), b (out, rank) / (E, out, rank),
    for every base tensor whose short name is in `shorts`."""
    rng = np.random.default_rng(seed)
    out = {}
    for name in sorted(base.tensors):
        info = base.tensors[name]
        parts = name.split(".")
        short = parts[2] if parts[0] == "blk" else parts[0]
        if short not in shorts or not name.endswith(".weight") or len(info.ne) < 2:
            continue
        ne = info.ne
        experts = ne[2:]  # () or (E,)
        a = rng.standard_normal((*experts, rank, ne[0])).astype(np.float32) * std
        b = rng.standard_normal((*experts, ne[1], rank)).astype(np.float32) * std
        out[name] = (a, b)
    return out


def pairs_sha256(pairs: dict) -> str:
    """sha256 over an adapter's tensors (name, then a's and b's float32 bytes), in name order."""
    h = hashlib.sha256()
    for name in sorted(pairs):
        a, b = pairs[name]
        h.update(name.encode())
        h.update(np.ascontiguousarray(a, np.float32).tobytes())
        h.update(np.ascontiguousarray(b, np.float32).tobytes())
    return h.hexdigest()


def write_adapter(path: str | os.PathLike, arch: str, pairs: dict, alpha: float, dtype=np.float32,
                  general_type: str = "adapter", adapter_type: str = "lora") -> str:  # fmt: skip
    """An adapter GGUF as llama.cpp's convert_lora_to_gguf.py writes it."""
    w = gguf.GGUFWriter(os.fspath(path), arch)
    w.add_string("general.type", general_type)
    w.add_string("adapter.type", adapter_type)
    w.add_float32("adapter.lora.alpha", float(alpha))
    for name, (a, b) in pairs.items():
        w.add_tensor(name + ".lora_a", np.ascontiguousarray(a, dtype=dtype))
        w.add_tensor(name + ".lora_b", np.ascontiguousarray(b, dtype=dtype))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return os.fspath(path)


def merged_runner(base_path: str, adapters: list[tuple[dict, float]], max_seq: int = 256):
    """A NumPy-backend runner over the base whose adapted weights are replaced by W + scale · B·A (computed in
    float64, stored as f32): the naive reference. adapters: [(pairs, scale), ...]."""
    from engine.cpu.runner import CpuRunner

    r = synthetic.runner(base_path, max_seq)
    model = r.model
    for pairs, scale in adapters:
        for name, (a, b) in pairs.items():
            parts = name.split(".")
            delta = scale * np.matmul(b.astype(np.float64), a.astype(np.float64))
            if parts[0] == "blk":
                layer = model.layers[int(parts[1])]
                layer[parts[2]] = (layer[parts[2]] + delta).astype(np.float32)
            else:
                model.output = (model.output + delta).astype(np.float32)
    return CpuRunner(model, max_seq)

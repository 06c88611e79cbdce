"""The `llama` path on the CUDA backend (normal RoPE pairs, no QK-norm, `rope_freqs`, GQA) over weight types the
llama.cpp fixtures do not cover, against the NumPy backend on the same file: batched (GEMM), 8-token matvec passes
and single-token decode rows."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from engine import models
from engine.config import ModelConfig
from engine.cpu.runner import CpuRunner
from engine.cuda.context import ContextStarter
from engine.cuda.dispatch import use_matvec
from engine.gguf import read
from tests import synthetic

pytestmark = pytest.mark.gpu

DIM, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, VOCAB, LAYERS = 256, 512, 4, 2, 64, 512, 2
TYPES = ["F32", "F16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]


def write_llama(path: str, type_name: str, seed: int) -> str:
    rng = np.random.default_rng(seed)
    qtype = gguf.GGMLQuantizationType[type_name]
    w = gguf.GGUFWriter(path, "llama")
    for key, v in {"block_count": LAYERS, "context_length": 512, "embedding_length": DIM,
                   "feed_forward_length": HIDDEN, "attention.head_count": HEADS,
                   "attention.head_count_kv": KV_HEADS, "rope.dimension_count": HEAD_DIM}.items():  # fmt: skip
        w.add_uint32(f"llama.{key}", v)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)

    def matrix(name: str, rows: int, cols: int) -> None:
        a = (rng.normal(size=(rows, cols)) * 0.05).astype(np.float32)
        if type_name == "F32":
            w.add_tensor(name, a)
        elif type_name == "F16":
            w.add_tensor(name, a.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)

    def vector(name: str, n: int, around: float = 1.0) -> None:
        w.add_tensor(name, (around + rng.normal(size=n) * 0.1).astype(np.float32))

    matrix("token_embd.weight", VOCAB, DIM)
    vector("output_norm.weight", DIM)
    matrix("output.weight", VOCAB, DIM)
    vector("rope_freqs.weight", HEAD_DIM // 2)
    for i in range(LAYERS):
        b = f"blk.{i}."
        vector(b + "attn_norm.weight", DIM)
        vector(b + "ffn_norm.weight", DIM)
        matrix(b + "attn_q.weight", HEADS * HEAD_DIM, DIM)
        matrix(b + "attn_k.weight", KV_HEADS * HEAD_DIM, DIM)
        matrix(b + "attn_v.weight", KV_HEADS * HEAD_DIM, DIM)
        matrix(b + "attn_output.weight", DIM, HEADS * HEAD_DIM)
        matrix(b + "ffn_gate.weight", HIDDEN, DIM)
        matrix(b + "ffn_up.weight", HIDDEN, DIM)
        matrix(b + "ffn_down.weight", DIM, HIDDEN)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("type_name", TYPES)
def test_llama_cuda_matches_cpu(tmp_path, type_name):
    from engine.cuda import load_runner

    seed = int(np.random.default_rng().integers(2**31))
    path = write_llama(str(tmp_path / f"llama-{type_name}.gguf"), type_name, seed)
    gf = read(path)
    cfg = ModelConfig.from_gguf(gf.metadata, gf.tensors)
    cpu = CpuRunner(models.family("llama").CpuModel(cfg, gf), 256)
    cuda, _ = load_runner(cfg, gf, 256, ContextStarter(0))
    ids = np.random.default_rng(seed).integers(0, VOCAB, size=80).tolist()
    for prefill in (80, 20, 7, 1):  # GEMM chunk, tc_matvec (quantized types), matvec passes, decode steps
        want = synthetic.logits(cpu, ids, prefill)
        got = synthetic.logits(cuda, ids, prefill)
        # Float weights and the float32 small-batch paths: float32 rounding only. Quantized weights in the GEMM go
        # through TF32 tensor cores (10-bit mantissa).
        tol = 1e-4 if type_name in ("F32", "F16") or use_matvec(prefill) else 5e-3
        err = float(np.abs(got - want).max())
        assert err <= tol * max(1.0, float(np.abs(want).max())), (type_name, prefill, err, seed)

"""Tiny random-weight GGUFs written with gguf-py's GGUFWriter, for architecture options the llama.cpp fixtures do
not exercise, and a runner over them that needs no tokenizer."""

from __future__ import annotations

import os
from typing import Any

import gguf
import numpy as np

from engine import models
from engine.config import ModelConfig
from engine.cpu.runner import CpuRunner
from engine.gguf import read


def write(path: str | os.PathLike, arch: str, kv: dict[str, Any], tensors: dict[str, np.ndarray]) -> str:
    """kv keys without a "general."/"tokenizer." prefix get "{arch}."; tensors are NumPy arrays in NumPy order
    (the reversed GGUF ne), written as F32."""
    w = gguf.GGUFWriter(os.fspath(path), arch)
    for key, v in kv.items():
        full = key if key.startswith(("general.", "tokenizer.")) else f"{arch}.{key}"
        if isinstance(v, bool):
            w.add_bool(full, v)
        elif isinstance(v, int):
            w.add_uint32(full, v)
        elif isinstance(v, float):
            w.add_float32(full, v)
        elif isinstance(v, str):
            w.add_string(full, v)
        else:
            w.add_array(full, list(v))
    for name, a in tensors.items():
        w.add_tensor(name, np.ascontiguousarray(a, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return os.fspath(path)


def runner(path: str, max_seq: int = 128) -> CpuRunner:
    gf = read(path)
    cfg = ModelConfig.from_gguf(gf.metadata, gf.tensors)
    return CpuRunner(models.family(cfg.arch).CpuModel(cfg, gf), max_seq)


def logits(r: CpuRunner, ids: list[int], prefill: int) -> np.ndarray:
    """(len(ids), n_vocab): the first `prefill` ids as one chunk, the rest one at a time (the decode path)."""
    r.reset()
    rows = [r.forward(ids[:prefill], "all")]
    rows += [r.forward([t], "last")[None, :] for t in ids[prefill:]]
    return np.concatenate(rows)


class Weights:
    """Random tensors: matrices N(0, std^2), norm vectors 1 + N(0, 0.1^2)."""

    def __init__(self, seed: int, std: float = 0.2):
        self.rng = np.random.default_rng(seed)
        self.std = std

    def mat(self, *shape: int, std: float | None = None) -> np.ndarray:
        return (self.rng.standard_normal(shape) * (self.std if std is None else std)).astype(np.float32)

    def norm(self, n: int) -> np.ndarray:
        return (1.0 + 0.1 * self.rng.standard_normal(n)).astype(np.float32)

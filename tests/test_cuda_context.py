"""The CUDA context thread (engine/cuda/context.ContextStarter): it creates the context, then loads the kernel modules
the model runs (engine/cuda.kernel_modules) while the main thread uploads the weights."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from engine import archs, cuda, prepare
from engine.config import ModelConfig, MoE
from engine.cuda import BASE_MODULES, context, driver, kernel_modules
from engine.engine import Engine
from tests import conformance as C

KERNELS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels")


def _config(moe: MoE | None) -> ModelConfig:
    return ModelConfig(arch="qwen3", n_layers=1, dim=64, hidden_dim=128, n_heads=2, n_kv_heads=1, head_dim=32,
                       value_dim=32, n_vocab=32, n_ctx=64, norm_eps=1e-6, rope_type="neox", rope_theta=1e6,
                       rope_dim=32, moe=moe)  # fmt: skip


def test_every_architecture_names_kernel_modules_that_exist() -> None:
    moe = MoE(n_experts=4, n_experts_used=2, expert_hidden_dim=32, shared_hidden_dim=0)
    for row in archs.ARCHS.values():
        if row.cuda_module is None:
            continue
        for cfg in (_config(None), _config(moe)):
            names = kernel_modules(cfg, row)
            assert set(BASE_MODULES) <= set(names) and ("moe" in names) == (cfg.moe is not None), row.name
            for name in names:
                assert os.path.exists(os.path.join(KERNELS, name + ".cu")), f"{row.name}: no kernels/{name}.cu"
    assert "mla" in kernel_modules(_config(None), archs.get("deepseek2"))
    assert "deltanet" in kernel_modules(_config(None), archs.get("qwen35"))


@pytest.mark.gpu
def test_the_context_thread_loads_the_preloaded_modules() -> None:
    starter = context.ContextStarter(0)
    starter.preload(("smoke", "elementwise"))
    starter.wait()
    starter._thread.join(10)
    assert not starter._thread.is_alive()
    assert {"smoke", "elementwise"} <= set(driver._modules)
    assert driver.module("smoke") is driver._modules["smoke"]  # the same module, not loaded twice


@pytest.mark.gpu
def test_the_model_runs_on_the_weights_uploaded_early(tmp_path, monkeypatch) -> None:
    """prestart with the model: the weights go up on the context's thread, the loader takes them, and the logits are
    bit for bit those of a load that uploads itself; a model other than the one uploaded early is uploaded as usual
    (and the other's upload freed)."""
    model = str(tmp_path / "m.gguf")
    shutil.copy(C.fixture_path("qwen3-tiny-q8_0", ".gguf"), model)
    prepare.write_cache(model)
    other = str(tmp_path / "other.gguf")
    shutil.copy(model, other)
    prepare.write_cache(other)
    runs = {}
    for name, early in (("early", model), ("plain", None), ("another", other)):
        monkeypatch.setattr(cuda, "_prestarted", None)
        cuda.prestart("cuda", early)
        engine = Engine.load(model, backend="cuda", max_seq_len=64)
        ids = engine.tokenizer.encode("The capital of France is")
        runs[name] = (engine.cold_start["early_upload"], engine.logits(ids))
    assert runs["early"][0] is True and runs["plain"][0] is False and runs["another"][0] is False
    assert np.array_equal(runs["early"][1], runs["plain"][1]) and np.array_equal(runs["another"][1], runs["plain"][1])

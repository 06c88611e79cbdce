"""The CUDA context thread (engine/cuda/driver.ContextStarter): it creates the context, then loads the kernel modules
the model runs (engine/cuda.kernel_modules) while the main thread uploads the weights."""

from __future__ import annotations

import os

import pytest

from engine import archs
from engine.config import ModelConfig, MoE
from engine.cuda import BASE_MODULES, driver, kernel_modules

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
    starter = driver.ContextStarter(0)
    starter.preload(("smoke", "elementwise"))
    starter.wait()
    starter._thread.join(10)
    assert not starter._thread.is_alive()
    assert {"smoke", "elementwise"} <= set(driver._modules)
    assert driver.module("smoke") is driver._modules["smoke"]  # the same module, not loaded twice

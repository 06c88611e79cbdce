"""The architecture registry: one row per GGUF `general.architecture` this engine runs, written as data.

Everything that differs between architectures at the level of "which code applies" is here, and nowhere else:
`config.py` reads the row to decide which sub-config sections to fill (it alone reads the `{arch}.*` keys),
`models/` picks the NumPy family module from `numpy_module`, and `cuda/` the CUDA one from `cuda_module`.
Adding an architecture is one row here plus its model modules (tests/test_layout.py holds every named module to
an existing file). This module imports nothing of the engine but its errors, so the CUDA cold path stays light.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import UnsupportedArchitecture


@dataclass(frozen=True)
class Arch:
    name: str  # general.architecture
    rope: str  # "neox" rotates (x[i], x[i + n/2]); "norm" rotates (x[2i], x[2i+1])
    numpy_module: str  # engine.models.<numpy_module>: the CpuModel (the oracle)
    cuda_module: str | None  # engine.models.<cuda_module>: the CudaModel, or None (the CPU backend serves it)
    moe: str | None = None  # which MoE keys the config reads: "qwen" (expert_* keys), "deepseek" (+ groups, gating)
    moe_optional: bool = False  # MoE only when the file has experts (Mixtral-style llama files)
    deltanet: bool = False  # Gated DeltaNet recurrent layers (the qwen35 hybrids)
    mla: bool = False  # multi-head latent attention (deepseek2)


# qwen35's IMROPE gives every MRoPE section the same position for text, which is exactly NEOX on rope_dim dims.
ARCHS: dict[str, Arch] = {
    a.name: a
    for a in (
        Arch("qwen3", rope="neox", numpy_module="dense", cuda_module="dense_cuda"),
        Arch("llama", rope="norm", numpy_module="dense", cuda_module="dense_cuda", moe="qwen", moe_optional=True),
        Arch("qwen3moe", rope="neox", numpy_module="dense", cuda_module="dense_cuda", moe="qwen"),
        Arch("qwen35", rope="neox", numpy_module="hybrid", cuda_module="hybrid_cuda", deltanet=True),
        Arch("qwen35moe", rope="neox", numpy_module="hybrid", cuda_module="hybrid_cuda", moe="qwen", deltanet=True),
        Arch("qwen3next", rope="neox", numpy_module="hybrid", cuda_module="hybrid_cuda", moe="qwen", deltanet=True),
        Arch("deepseek2", rope="norm", numpy_module="mla", cuda_module="mla_cuda", moe="deepseek", mla=True),
    )
}


def get(name: str) -> Arch:
    """The registry row of `name`; an `unsupported_architecture` error listing the supported ones otherwise."""
    arch = ARCHS.get(name)
    if arch is None:
        raise UnsupportedArchitecture(f"architecture '{name}' is not supported (supported: {', '.join(ARCHS)})")
    return arch

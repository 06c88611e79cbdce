"""The CUDA backend: prebuilt kernels (kernels/build), weights uploaded in GGUF layout, graph-captured steps."""

from __future__ import annotations

import importlib
import os

from engine.errors import EngineError, InvalidInput, UnsupportedArchitecture, env_int
from engine.timing import Stopwatch

DEFAULT_MAX_BATCH = 512  # tokens per prefill launch; longer prompts run in chunks

_prestarted = None  # a driver.ContextStarter started before the heavy imports


def backend_choice(requested: str | None = None) -> str:
    """ "auto" | "cpu" | "cuda": the argument, else REFLEX_BACKEND, else auto. The one parser of the choice."""
    choice = (requested or os.environ.get("REFLEX_BACKEND") or "auto").lower()
    if choice not in ("auto", "cpu", "cuda"):
        raise InvalidInput(f"backend must be auto, cpu or cuda, got {choice!r} (REFLEX_BACKEND or --backend)")
    return choice


def kernels_built() -> bool:
    from engine.cuda.driver import kernels_built

    return kernels_built()


def prestart(backend: str | None = None) -> None:
    """Start creating the CUDA context on a thread now, first thing in the process, so that it is ready by the time
    the imports, the model open and the tokenizer are done (docs/design.md §2). A no-op when the CPU
    backend is asked for, when no kernels are built or when there is no driver; `Engine.load` picks the started
    context up."""
    global _prestarted
    try:
        choice = backend_choice(backend)
    except InvalidInput:  # reported properly by Engine.load
        return
    if _prestarted is not None or choice == "cpu" or not kernels_built():
        return
    from engine.cuda import driver

    try:
        driver.libcuda()
        device = env_int("REFLEX_DEVICE", 0)
    except EngineError:  # no driver, or a malformed setting that Engine.load then reports properly
        return
    _prestarted = driver.ContextStarter(device)


def take_prestarted():
    """The context started by `prestart`, once (None if there is none)."""
    global _prestarted
    started, _prestarted = _prestarted, None
    return started


def _check_kernel_types(gf) -> None:
    """Refuse a file with a tensor type the kernels do not compute (engine/quants.py: SUPPORTED_TYPES is wider than
    KERNEL_TAGS), before anything is uploaded, so that backend "auto" can still run it on the CPU backend."""
    from engine.quants import KERNEL_TAGS, SUPPORTED_TYPES

    for info in gf.tensors.values():
        if info.ggml_type not in KERNEL_TAGS:
            cpu = " (the CPU backend does)" if info.ggml_type in SUPPORTED_TYPES else ""
            raise UnsupportedArchitecture(
                f"tensor '{info.name}' has type {info.ggml_type.name}, which the CUDA kernels do not compute{cpu}"
            )


# The kernel modules (kernels/<name>.cu) every model runs; its architecture's layers and an MoE FFN add theirs.
BASE_MODULES = ("matvec", "tc_matvec", "norm_rope", "attention", "embed", "sample", "gemm", "elementwise")


def kernel_modules(config, row) -> tuple[str, ...]:
    """The kernel modules a model of this config runs (loaded while its weights upload: ContextStarter.preload); row:
    its engine.archs.Arch."""
    extra = (("deltanet",) if row.deltanet else ()) + (("mla",) if row.mla else ())
    return BASE_MODULES + extra + (("moe",) if config.moe is not None else ())


def load_runner(config, gf, max_seq: int, context, kv_dtype: str = "f4") -> tuple[object, dict]:
    """Wait for the context (a driver.ContextStarter), upload the weights, build the architecture's CudaModel with
    its K/V cache of kv_dtype ("f4" or "f2": engine/cache_type.py).

    Returns the runner and the phases measured here (cuda_init_ms, upload statistics, kv cache size)."""
    from engine import archs  # here, not at the top: prestart runs before it is needed (dataclasses, inspect)

    row = archs.get(config.arch)
    if row.cuda_module is None:
        raise UnsupportedArchitecture(f"{config.arch}: this architecture has no CUDA path yet")
    _check_kernel_types(gf)
    from engine.cuda import k_gemm, memory
    from engine.cuda.runner import CudaRunner
    from engine.cuda.upload import DeviceWeights

    context.preload(kernel_modules(config, row))
    with Stopwatch() as wait_sw:
        context_ms = context.wait()
    stream = memory.stream_create()
    k_gemm.reserve()  # the split-K workspace every model's prefill GEMMs share (before the upload's copies start)
    weights = DeviceWeights(gf, stream, context.device)
    family = importlib.import_module(f"engine.models.{row.cuda_module}")
    max_batch = env_int("REFLEX_MAX_BATCH", DEFAULT_MAX_BATCH, minimum=1)
    with Stopwatch() as build_sw:
        model = family.CudaModel(config, weights, max_seq, max_batch, kv_dtype)
        runner = CudaRunner(model, stream, context.device)
    phases = {
        "cuda_init_ms": context_ms,
        "cuda_init_wait_ms": wait_sw.ms,
        **weights.stats,
        "buffers_ms": build_sw.ms,
        "weights_mib": weights.n_bytes / 2**20,
        "kv_cache_mib": model.kv_cache_bytes / 2**20,
        "kv_cache_mapped_mib": sum(c.mapped_bytes for c in model.caches) / 2**20,  # engine/cuda/vmm.py
    }
    return runner, phases

"""The CUDA backend: prebuilt kernels (kernels/build), weights uploaded in GGUF layout, graph-captured steps."""

from __future__ import annotations

import importlib
import importlib.util
import os

from engine.errors import EngineError, UnsupportedArchitecture, env_int
from engine.timing import Stopwatch

DEFAULT_MAX_BATCH = 512  # tokens per prefill launch; longer prompts run in chunks

_prestarted = None  # a driver.ContextStarter started before the heavy imports


def kernels_built() -> bool:
    from engine.cuda.driver import KERNEL_DIR

    return os.path.exists(os.path.join(KERNEL_DIR, "manifest.json"))


def prestart(backend: str | None = None) -> None:
    """Start creating the CUDA context on a thread now, first thing in the process, so that it is ready by the time
    the imports, the model open and the tokenizer are done (DESIGN.md §2). A no-op when the CPU backend is asked
    for, when no kernels are built or when there is no driver; `Engine.load` picks the started context up."""
    global _prestarted
    choice = (backend or os.environ.get("REFLEX_BACKEND") or "auto").lower()
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


def load_runner(config, gf, family_name: str, max_seq: int, context) -> tuple[object, dict]:
    """Wait for the context (a driver.ContextStarter), upload the weights, build the family's CudaModel.

    Returns the runner and the phases measured here (cuda_init_ms, upload statistics, kv cache size)."""
    from engine.cuda import driver
    from engine.cuda.runner import CudaRunner
    from engine.cuda.upload import DeviceWeights

    if importlib.util.find_spec(f"engine.models.{family_name}_cuda") is None:
        raise UnsupportedArchitecture(f"{config.arch}: this architecture has no CUDA path yet")
    with Stopwatch() as wait_sw:
        context_ms = context.wait()
    stream = driver.stream_create()
    weights = DeviceWeights(gf, stream)
    family = importlib.import_module(f"engine.models.{family_name}_cuda")
    max_batch = env_int("REFLEX_MAX_BATCH", DEFAULT_MAX_BATCH, minimum=1)
    with Stopwatch() as build_sw:
        model = family.CudaModel(config, weights, max_seq, max_batch)
        runner = CudaRunner(model, stream, context.device)
    phases = {
        "cuda_init_ms": context_ms,
        "cuda_init_wait_ms": wait_sw.ms,
        **weights.stats,
        "buffers_ms": build_sw.ms,
        "weights_mib": weights.n_bytes / 2**20,
        "kv_cache_mib": model.kv_cache_bytes / 2**20,
    }
    return runner, phases

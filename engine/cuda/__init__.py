"""The CUDA backend: prebuilt kernels (kernels/build), weights uploaded in GGUF layout, graph-captured steps."""

from __future__ import annotations

import importlib
import os

from engine.errors import EngineError, InvalidInput, UnsupportedArchitecture, env_int
from engine.timing import Stopwatch

DEFAULT_MAX_BATCH = 512  # tokens per prefill launch; longer prompts run in chunks

_prestarted = None  # a context.ContextStarter started before the heavy imports


def backend_choice(requested: str | None = None) -> str:
    """ "auto" | "cpu" | "cuda": the argument, else REFLEX_BACKEND, else auto. The one parser of the choice."""
    choice = (requested or os.environ.get("REFLEX_BACKEND") or "auto").lower()
    if choice not in ("auto", "cpu", "cuda"):
        raise InvalidInput(f"backend must be auto, cpu or cuda, got {choice!r} (REFLEX_BACKEND or --backend)")
    return choice


def kernels_built() -> bool:
    from engine.cuda.driver import kernels_built

    return kernels_built()


def prestart(backend: str | None = None, model: str | None = None) -> None:
    """Start creating the CUDA context on a thread now, first thing in the process, so that it is ready by the time
    the imports, the model open and the tokenizer are done (docs/design.md §2); with `model` (a GGUF path known
    this early), its weights upload on that thread next (upload_early). A no-op when the CPU backend is asked for,
    when no kernels are built or when there is no driver; `Engine.load` picks the started context up."""
    global _prestarted
    try:
        choice = backend_choice(backend)
    except InvalidInput:  # reported properly by Engine.load
        return
    if _prestarted is not None or choice == "cpu" or not kernels_built():
        return
    from engine.cuda import context, driver

    try:
        driver.libcuda()
        device = env_int("REFLEX_DEVICE", 0)
    except EngineError:  # no driver, or a malformed setting that Engine.load then reports properly
        return
    _prestarted = context.ContextStarter(device)
    if model is not None:
        upload_early(model)


MODEL_COMMANDS = ("system1", "generate", "check", "bench", "profile")  # the CLI's commands that load a model


def prestart_cli(argv: list[str]) -> None:
    """prestart for `python -m engine COMMAND MODEL ...`: the commands that load a model, with their --backend, and
    the model when it comes first after the command (the usual order; otherwise the weights upload as usual). Not
    for bench, which reads the idle power and free memory before it loads anything."""
    if len(argv) < 2 or argv[1] not in MODEL_COMMANDS:
        return
    backend = None
    for i, arg in enumerate(argv):
        if arg.startswith("--backend="):
            backend = arg.split("=", 1)[1]
        elif arg == "--backend" and i + 1 < len(argv):
            backend = argv[i + 1]
    early = len(argv) > 2 and not argv[2].startswith("-") and argv[1] != "bench"
    prestart(backend, argv[2] if early else None)


def upload_early(model) -> None:
    """Upload the weights of the GGUF at `model` (a path, or a function that returns one, or None for nothing, called
    on the upload's thread) as soon as the prestarted context exists, from the data offset its prepare cache records,
    while this thread imports and opens the model and the context's thread loads the kernel modules every model runs;
    until the context exists, the file may be read ahead into the page cache (files.prefetch, REFLEX_PREFETCH=1).
    load_runner takes the upload when it is of the file it opened (else it is freed and the weights upload as usual).
    A no-op without a prestarted context, without a model, or with REFLEX_EARLY_UPLOAD=0."""
    if _prestarted is None or not model or os.environ.get("REFLEX_EARLY_UPLOAD", "1") == "0":
        return
    started = _prestarted

    def upload(cancel):
        from engine import files, gil

        path = model() if callable(model) else model
        span = files.cached_data_span(path) if path else None
        if span is None:
            return None
        read = files.prefetch(path, span[0], lambda: started.ready() or cancel.is_set())
        started.wait()  # the context, current on this thread (or its error)
        if cancel.is_set():
            return None
        from engine.cuda import upload as up

        held = gil.hold()  # the main thread runs Python meanwhile: each CUDA call takes the GIL back sooner
        try:
            upload = up.early(path, span[0], started.device, cancel)
        finally:
            if held:
                gil.release()
        upload.stats["prefetch_mib"] = read / 2**20
        return upload

    started.upload_early(upload, then=BASE_MODULES)


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
    """Wait for the context (a context.ContextStarter), take its early weight upload or upload the weights, build the
    architecture's CudaModel with its K/V cache of kv_dtype ("f4" or "f2": engine/cache_type.py).

    Returns the runner and the phases measured here (cuda_init_ms, upload statistics, kv cache size)."""
    from engine import archs  # here, not at the top: prestart runs before it is needed (dataclasses, inspect)

    try:
        row = archs.get(config.arch)
        if row.cuda_module is None:
            raise UnsupportedArchitecture(f"{config.arch}: this architecture has no CUDA path yet")
        _check_kernel_types(gf)
    except BaseException:
        context.abandon()  # an early upload of this file is freed
        raise
    from engine.cuda import k_gemm, memory
    from engine.cuda.runner import CudaRunner
    from engine.cuda.upload import DeviceWeights

    context.preload(kernel_modules(config, row))
    with Stopwatch() as wait_sw:
        context_ms = context.wait()
    with Stopwatch() as early_sw:
        early = context.take_upload(lambda upload: upload.matches(gf))
    try:
        with Stopwatch() as stream_sw:
            stream = memory.stream_create()
            k_gemm.reserve()  # the split-K workspace every model's prefill GEMMs share (before the upload's copies)
        weights = DeviceWeights(gf, stream, context.device, upload=early)
    except BaseException:
        if early is not None:
            early.free()
        raise
    try:
        family = importlib.import_module(f"engine.models.{row.cuda_module}")
        max_batch = env_int("REFLEX_MAX_BATCH", DEFAULT_MAX_BATCH, minimum=1)
        with Stopwatch() as build_sw:
            model = family.CudaModel(config, weights, max_seq, max_batch, kv_dtype)
            runner = CudaRunner(model, stream, context.device)
        # The buffers' fills (ticket counters, zeroed states) ran on the legacy stream, which the runner's
        # non-blocking stream does not wait for.
        memory.synchronize(0)
    except BaseException:
        weights.free()  # not left to a traceback that a failed worker keeps
        raise
    phases = {
        "cuda_init_ms": context_ms,
        "cuda_init_wait_ms": wait_sw.ms,
        "early_upload": early is not None,  # the weights went up on the context's thread, during the imports
        "early_upload_wait_ms": early_sw.ms,
        "stream_ms": stream_sw.ms,  # the runtime's first calls: a stream and the split-K workspace
        **weights.stats,
        "buffers_ms": build_sw.ms,
        "weights_mib": weights.n_bytes / 2**20,
        "kv_cache_mib": model.kv_cache_bytes / 2**20,
        "kv_cache_mapped_mib": sum(c.mapped_bytes for c in model.caches) / 2**20,  # engine/cuda/vmm.py
    }
    return runner, phases

"""CUDA through libcuda (ctypes), without NVRTC and without `import cupy`: the primary context (created on a thread
when the caller wants it overlapped with other start-up work), prebuilt kernel modules (cuModuleLoad of
kernels/build/*.fatbin) and launches (cuLaunchKernel, or cuLaunchKernelEx with programmatic dependent launch on
sm_90+, with typed scalar arguments packed once). Memory, copies and graphs are engine/cuda/memory.py's. Every
failure becomes a `CudaError` (or `OutOfMemory`) naming the call.
"""

from __future__ import annotations

import ctypes
import os
import threading

from engine.cuda import memory
from engine.errors import CudaError, OutOfMemory

KERNEL_DIR = os.environ.get(
    "REFLEX_KERNEL_DIR", os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "kernels", "build")
)

_lib: ctypes.CDLL | None = None


def libcuda() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        try:
            _lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise CudaError(f"the CUDA driver (libcuda.so.1) cannot be loaded: {e}") from e
    return _lib


def check(result: int, what: str) -> None:
    """Raise for a non-zero CUresult."""
    if result == 0:
        return
    name = ctypes.c_char_p()
    libcuda().cuGetErrorName(result, ctypes.byref(name))
    text = (name.value or b"?").decode()
    cls = OutOfMemory if result == memory.OUT_OF_MEMORY else CudaError
    raise cls(f"{what} failed: {text} ({result})")


# -- context ------------------------------------------------------------------------------------------------


class Job:
    """A function to run on the context's thread, and its outcome (`result()` waits for it and raises its error). No
    concurrent.futures here: this module is imported before the heavy imports (prestart), and that one brings
    logging and re with it."""

    def __init__(self, fn):
        self.fn = fn
        self.value = None
        self.error: BaseException | None = None
        self._done = threading.Event()

    def run(self) -> None:
        try:
            self.value = self.fn()
        except BaseException as e:  # the job's owner decides what it means
            self.error = e
        self._done.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self._done.set()

    def result(self):
        self._done.wait()
        if self.error is not None:
            raise self.error
        return self.value


class ContextStarter:
    """Creates the primary context of `device` on a background thread; `wait()` returns its start-up time. Once the
    context exists the thread runs the jobs handed to it, in order: the weight upload when the model is known early
    (`upload_early`, engine/cuda.upload_early), then the kernel modules named by `preload()` (the model's, known after
    the GGUF is open), so that both overlap the main thread's imports, model open and buffer set-up."""

    def __init__(self, device: int = 0):
        self.device = device
        self.error: BaseException | None = None
        self.ms = 0.0
        self._started = threading.Event()
        self._jobs: list[Job] = []  # run in order on the thread once the context exists
        self._more = threading.Condition()
        self._closed = False  # preload() was the last job: later submits run nothing
        self._upload: Job | None = None  # the early weight upload, until load_runner takes it
        self._thread = threading.Thread(target=self._run, name="cuda-context", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from engine.timing import Stopwatch

        try:
            with Stopwatch() as sw:
                start_context(self.device)
            self.ms = sw.ms
        except BaseException as e:  # handed to the waiting thread, and to every job
            self.error = e
            self._close(fail=e)
            return
        finally:
            self._started.set()
        while True:
            with self._more:
                while not self._jobs and not self._closed:
                    self._more.wait()
                if not self._jobs:
                    return
                job = self._jobs.pop(0)
            job.run()

    def _close(self, fail: BaseException | None = None) -> None:
        with self._more:
            self._closed = True
            pending = self._jobs if fail is not None else []
            if fail is not None:
                self._jobs = []
            self._more.notify()
        for job in pending:
            job.fail(fail)

    def submit(self, fn) -> Job:
        """Run fn() on the context's thread once the context exists (after the jobs before it). After preload() (or
        a failed context) nothing more runs: the job fails at once."""
        job = Job(fn)
        with self._more:
            if not self._closed:
                self._jobs.append(job)
                self._more.notify()
                return job
        job.fail(self.error or CudaError("the CUDA context's thread takes no more work"))
        return job

    def upload_early(self, fn) -> None:
        """Start the weight upload fn() (engine/cuda/upload.early) on the thread; load_runner takes it (take_upload)."""
        if self._upload is None:
            self._upload = self.submit(fn)

    def take_upload(self, accept) -> object | None:
        """The early upload if there was one, it succeeded and accept(upload) holds, else None (a refused upload is
        freed here). Waits for it to finish."""
        job, self._upload = self._upload, None
        if job is None:
            return None
        try:
            upload = job.result()
        except Exception as e:  # the loader uploads in the usual way, and meets the same error there if it persists
            _log().info("the early weight upload failed (%s): uploading now", e)
            return None
        if upload is not None and not accept(upload):
            _log().info("the early weight upload was of another file or offset: uploading now")
            upload.free()
            return None
        return upload

    def discard_upload(self) -> None:
        """Free an early upload nobody took (the model's checks refused the CUDA path)."""
        self.take_upload(lambda upload: False)

    def abandon(self) -> None:
        """The model will not load on this context (an error, or the CPU backend instead): the thread takes no more
        work and ends, and an early upload nobody took is freed."""
        self._close()
        self.discard_upload()

    def preload(self, names: tuple[str, ...]) -> None:
        """Load these kernel modules on the context's thread after its other jobs (REFLEX_MODULE_PRELOAD=0: on first
        use instead); the thread takes nothing more."""
        if os.environ.get("REFLEX_MODULE_PRELOAD", "1") != "0":
            self.submit(lambda: _load_modules(names))
        self._close()

    def wait(self) -> float:
        self._started.wait()
        if self.error is not None:
            raise self.error
        # The runtime binds to the primary context the thread created; this thread must make it current too.
        start_context(self.device)
        return self.ms


def _log():
    import logging  # here: this module is imported before the heavy imports

    return logging.getLogger(__name__)


def _load_modules(names: tuple[str, ...]) -> None:
    for name in names:
        try:
            module(name)
        except CudaError:  # raised again where the module is first used
            return


_ctx_lock = threading.Lock()
_primary: dict[int, ctypes.c_void_p] = {}


def start_context(device: int = 0) -> None:
    """Retain the primary context of `device` and make it current on the calling thread."""
    lib = libcuda()
    with _ctx_lock:
        ctx = _primary.get(device)
        if ctx is None:
            check(lib.cuInit(0), "cuInit")
            dev = ctypes.c_int()
            check(lib.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet")
            ctx = ctypes.c_void_p()
            check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
            _primary[device] = ctx
            _use_pdl(lib, device)
    check(lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


# -- programmatic dependent launch ---------------------------------------------------------------------------------
# On sm_90+ the launches of a decode step carry CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
# (kernels/pdl.cuh): a kernel's launch overlaps the run of the one before, and its blocks wait on the device until
# that one is done. Every kernel of kernels/ starts with pdl::begin() (or prefetches weights, then waits), so none
# touches memory before its predecessor has finished. Measured on one H200 (2026-12-01, `engine bench` / `engine
# profile`, PDL on vs REFLEX_PDL=0): decode steps 2-6 % shorter (DeepSeek-V2-Lite shaped 359.6 -> 381.1 tok/s), but
# pp512 of the 0.6B shape 40.2k -> 27.7k tok/s with every launch programmatic, so prefill and system1 launch
# plainly. REFLEX_PDL=0 turns it off.
_PDL_ATTRIBUTE = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
_pdl = False


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: id, padding to 8, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int), ("rest", ctypes.c_char * 60)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("smem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)),
                ("n_attrs", ctypes.c_uint)]  # fmt: skip


_PDL_ATTRS = (_LaunchAttribute * 1)(_LaunchAttribute(id=_PDL_ATTRIBUTE, value=1))


def _use_pdl(lib: ctypes.CDLL, device: int) -> None:
    """Set once, when the device's primary context is created."""
    global _pdl
    major = _attribute(lib, _CC_MAJOR, device)
    _pdl = major >= 9 and os.environ.get("REFLEX_PDL", "1") != "0" and hasattr(lib, "cuLaunchKernelEx")


def programmatic(launches: list[Launch]) -> list[Launch]:
    """Mark launches (one decode step's) to go out as programmatic dependent launches where the GPU has them: each
    gets its CUlaunchConfig, packed once like its arguments."""
    for launch in launches:
        g, b = launch.grid, launch.block
        launch._config = _LaunchConfig((ctypes.c_uint * 3)(*g), (ctypes.c_uint * 3)(*b), launch.smem, None,
                                       _PDL_ATTRS, 1)  # fmt: skip
    return launches


def pdl_enabled() -> bool:
    """Whether launches carry the programmatic-dependent-launch attribute (set when a context starts)."""
    return _pdl


_CC_MAJOR, _CC_MINOR = 75, 76  # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR / _MINOR


def _attribute(lib: ctypes.CDLL, attribute: int, device: int) -> int:
    value = ctypes.c_int()
    check(lib.cuDeviceGetAttribute(ctypes.byref(value), attribute, device), "cuDeviceGetAttribute")
    return value.value


def attribute(attribute: int, device: int = 0) -> int:
    """cuDeviceGetAttribute(attribute) of `device`."""
    return _attribute(libcuda(), attribute, device)


def device_info(device: int = 0) -> dict:
    lib = libcuda()
    name = ctypes.create_string_buffer(256)
    check(lib.cuDeviceGetName(name, 256, device), "cuDeviceGetName")
    major, minor = _attribute(lib, _CC_MAJOR, device), _attribute(lib, _CC_MINOR, device)
    free, total = memory.rt_call("cudaMemGetInfo", memory.runtime().memGetInfo)
    return {"name": name.value.decode(), "arch": f"sm_{major}{minor}", "free_mib": free >> 20,
            "total_mib": total >> 20}  # fmt: skip


# -- modules and launches ----------------------------------------------------------------------------------


def i32(v: int) -> ctypes.c_int32:
    return ctypes.c_int32(int(v))


def i64(v: int) -> ctypes.c_int64:
    return ctypes.c_int64(int(v))


def u64(v: int) -> ctypes.c_uint64:
    return ctypes.c_uint64(int(v))


def f32(v: float) -> ctypes.c_float:
    return ctypes.c_float(float(v))


class _DevicePtr(ctypes.c_void_p):
    """A pointer argument that keeps its DeviceArray alive as long as the Launch holding it."""


def ptr(p: int | memory.DeviceArray | memory.DeviceWeight | None) -> ctypes.c_void_p:
    """A device pointer argument; None is the null pointer (an absent optional input)."""
    if p is None:
        return ctypes.c_void_p(0)
    if isinstance(p, int):
        return ctypes.c_void_p(p)
    arg = _DevicePtr(p.ptr)
    arg.owner = p
    return arg


class Launch:
    """One kernel launch with its arguments packed once, so it can be issued (or captured) cheaply and often."""

    def __init__(self, fn: ctypes.c_void_p, grid: tuple[int, ...], block: tuple[int, ...], args: list, smem: int = 0):
        self.fn = fn
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.block = tuple(block) + (1,) * (3 - len(block))
        if min(self.grid) < 1 or min(self.block) < 1:
            raise CudaError(f"empty launch grid {self.grid} / block {self.block}")
        self.smem = smem
        self.name = _kernel_names.get(fn.value, "?")  # "module.kernel", for profiles and error messages
        self._args = args  # the ctypes values the parameter array points into: kept alive with it
        self._params = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.byref(a), ctypes.c_void_p) for a in args])
        self._config: _LaunchConfig | None = None  # set by programmatic(): a programmatic dependent launch

    def __call__(self, stream: int = 0) -> None:
        if _pdl and self._config is not None:
            self._config.stream = stream
            config = ctypes.byref(self._config)
            check(libcuda().cuLaunchKernelEx(config, self.fn, self._params, None), "cuLaunchKernelEx")
            return
        g, b = self.grid, self.block
        check(libcuda().cuLaunchKernel(self.fn, g[0], g[1], g[2], b[0], b[1], b[2], self.smem, ctypes.c_void_p(stream),
                                       self._params, None), "cuLaunchKernel")  # fmt: skip


class Module:
    """A prebuilt kernel module kernels/build/<name>.fatbin (never compiled at run time)."""

    def __init__(self, name: str, directory: str | None = None):
        path = os.path.join(directory or KERNEL_DIR, name + ".fatbin")
        if not os.path.exists(path):
            raise CudaError(
                f"kernel module {path} is missing: run ./build_kernels.sh (needs nvcc) to build the kernels"
            )
        self.name = name
        self.handle = ctypes.c_void_p()
        check(libcuda().cuModuleLoad(ctypes.byref(self.handle), path.encode()), f"cuModuleLoad({path})")
        self._functions: dict[str, ctypes.c_void_p] = {}

    def fn(self, name: str) -> ctypes.c_void_p:
        f = self._functions.get(name)
        if f is None:
            f = ctypes.c_void_p()
            check(libcuda().cuModuleGetFunction(ctypes.byref(f), self.handle, name.encode()),
                  f"cuModuleGetFunction({self.name}.{name})")  # fmt: skip
            self._functions[name] = f
            _kernel_names[f.value] = f"{self.name}.{name}"
        return f


_modules: dict[str, Module] = {}
_module_lock = threading.Lock()
_kernel_names: dict[int, str] = {}  # function handle -> "module.kernel"


def module(name: str) -> Module:
    """The loaded module `name` (loaded on first use; ContextStarter.preload may load it on another thread)."""
    m = _modules.get(name)
    if m is None:
        with _module_lock:
            m = _modules.get(name)
            if m is None:
                m = _modules[name] = Module(name)
    return m


def probe() -> tuple[bool, str]:
    """Whether the CUDA backend can run here: a driver, a device, CuPy's bindings and the built kernels."""
    try:
        lib = libcuda()
        if lib.cuInit(0) != 0:
            return False, "cuInit failed (no usable GPU)"
        count = ctypes.c_int()
        if lib.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value == 0:
            return False, "no CUDA device"
        memory.runtime()
    except CudaError as e:
        return False, str(e)
    if not kernels_built():
        return False, f"no built kernels in {KERNEL_DIR} (run ./build_kernels.sh)"
    return True, "ok"


def kernels_built() -> bool:
    """Whether ./build_kernels.sh has run: the one check every caller uses."""
    return os.path.exists(os.path.join(KERNEL_DIR, "manifest.json"))

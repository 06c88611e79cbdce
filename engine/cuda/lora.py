"""LoRA on the CUDA backend: the base weights stay in their GGUF blocks and each adapted matmul gains two small
launches of the existing kernels, t = A·x (reusing the base launch's fused RMSNorm) and y += B'·t, with
B' = scale·B (docs/design.md §4; the adapter format is engine/lora.py's).

A and B go to the device as F32 zero-padded to a rank multiple of 32 (the matvec and GEMM kernels step K by 32):
A (rank_pad, in) with zero rows past the rank, B' (out, rank_pad) with zero columns, so the padding adds exact
zeros. An expert stack's update is E such pairs back to back, A (E, rank_pad, in) and B' (E, out, rank_pad): the
layout of a GGUF expert stack, so the MoE kernels run them with the expert ids in device memory
(engine/models/moe_cuda.py). The kernels take no scale argument, so the scale is folded into B once at load, on the
device, by the F32 GEMM with scale·I (exact: every output is one product plus zeros) — scaling on the host would
need NumPy here. No NumPy on this path (the worker loads adapters on its cold path).
"""

from __future__ import annotations

import array
import ctypes
import importlib
import struct

from engine import archs
from engine.config import ModelConfig
from engine.cuda import k_gemm as kg
from engine.cuda import memory
from engine.cuda.memory import DeviceArray, DeviceWeight
from engine.errors import UnsupportedArchitecture
from engine.gguf import TensorInfo
from engine.lora import Adapter, LoraTensor, updates
from engine.quants import GGMLType
from engine.timing import Stopwatch

RANK_STEP = 32
GEMM_ROWS = 65535 * kg.TILE  # the rows one GEMM launch takes (grid.y <= 65535)


def check_supported(config: ModelConfig, adapters: list[Adapter]) -> None:
    """Refuse, before the weights are uploaded, an adapter tensor the architecture's CudaModel cannot adapt
    (its `LORA_TARGETS`): the CPU backend runs every adaptable tensor."""
    row = archs.get(config.arch)
    model_cls = importlib.import_module(f"engine.models.{row.cuda_module}").CudaModel if row.cuda_module else None
    targets = getattr(model_cls, "LORA_TARGETS", frozenset())
    for target, ts in updates(adapters).items():
        if ts[0].short not in targets or ts[0].layer is None:
            where = ", ".join(sorted(targets)) or "none"
            raise UnsupportedArchitecture(f"{config.arch}: a LoRA update of '{target}' has no CUDA path yet (the "
                                          f"CUDA model adapts: {where}); the CPU backend runs it")  # fmt: skip


class Pair:
    """One update on the device, scale folded in: a (rank_pad, in) and b (out, rank_pad) F32 weights, or for an
    expert stack (E, rank_pad, in) and (E, out, rank_pad), whose handles are expert 0's matrix (k_moe's convention:
    expert e starts rows x row_bytes further)."""

    def __init__(self, a: DeviceArray, b: DeviceArray, name: str):
        self._owners = (a, b)
        rp, k = a.shape[-2:]
        r = b.shape[-2]
        self.rank_pad = rp
        self.n_experts = a.shape[0] if len(a.shape) == 3 else 0  # 0: a plain matrix
        self.a = DeviceWeight(a.ptr, GGMLType.F32, rp, k, 4 * k, name + ".lora_a")
        self.b = DeviceWeight(b.ptr, GGMLType.F32, r, rp, 4 * rp, name + ".lora_b")


class DeviceLora:
    """Every update of a model, by base tensor name, and `t`, the (max_batch, rank_pad) scratch of A·x for the
    plain matrices (the MoE FFN keeps its own, one row per routed item: engine/models/moe_cuda.py)."""

    def __init__(self, pairs: dict[str, list[Pair]], max_batch: int):
        self.pairs = pairs
        self.max_batch = max_batch
        widest = max((p.rank_pad for ps in pairs.values() for p in ps if not p.n_experts), default=0)
        # (b, rank_pad) f32: A·x of the update being applied (launches run in order on one stream, so one suffices)
        self.t = DeviceArray.empty((max_batch, widest)) if widest else None

    def of(self, name: str) -> list[Pair]:
        return self.pairs.get(name, [])

    def scratch(self, pair: Pair) -> DeviceArray:
        """t viewed as (max_batch, pair.rank_pad)."""
        return self.t.view(0, (self.max_batch, pair.rank_pad))

    @property
    def nbytes(self) -> int:
        owned = sum(o.nbytes for ps in self.pairs.values() for p in ps for o in p._owners)
        return owned + (self.t.nbytes if self.t is not None else 0)


NO_LORA = DeviceLora({}, 0)  # what a model holds without adapters: adapts nothing, allocates nothing


def _host_f32(info: TensorInfo) -> bytearray:
    """The tensor's values as float32 bytes, whatever of F32 / F16 / BF16 it is stored in."""
    raw = memoryview(info._file.mm)[info.offset : info.offset + info.n_bytes]
    if info.ggml_type == GGMLType.F32:
        return bytearray(raw)
    if info.ggml_type == GGMLType.F16:
        return bytearray(array.array("f", struct.unpack(f"<{info.n_elements}e", raw)).tobytes())
    src = bytes(raw)
    out = bytearray(4 * info.n_elements)  # BF16 is the high half of a float32: widen by placing its two bytes
    out[2::4] = src[0::2]
    out[3::4] = src[1::2]
    return out


def _upload_padded(host: bytearray, rows: int, cols: int, pitch: int, shape: tuple[int, ...]) -> DeviceArray:
    """host (rows, cols) f32 bytes -> a zeroed device array of `shape`, seen as rows `pitch` values apart (rows and
    pitch at least the host's), holding it top-left."""
    d = DeviceArray.empty(shape)
    d.fill_byte(0)
    src = ctypes.addressof((ctypes.c_char * len(host)).from_buffer(host))
    memory.rt_call("cudaMemcpy2D", memory.runtime().memcpy2D, d.ptr, 4 * pitch, src, 4 * cols, 4 * cols, rows,
                   memory.H2D)  # fmt: skip
    return d


def _scaled(b: DeviceArray, scale: float, stream: int) -> DeviceArray:
    """scale · b for b (..., rank_pad) f32, through the F32 GEMM with scale·I (rank_pad, rank_pad), in chunks of the
    rows one GEMM grid takes."""
    rp = b.shape[-1]
    rows = b.size // rp
    eye = array.array("f", bytes(4 * rp * rp))
    for j in range(rp):
        eye[j * rp + j] = scale
    w = DeviceArray.empty((rp, rp))
    memory.memcpy(w.ptr, eye.buffer_info()[0], 4 * rp * rp, memory.H2D)
    eye_w = DeviceWeight(w.ptr, GGMLType.F32, rp, rp, 4 * rp, "lora scale")
    out = DeviceArray.empty(b.shape)
    for at in range(0, rows, GEMM_ROWS):
        m = min(GEMM_ROWS, rows - at)
        kg.gemm(eye_w, b.view(at * rp, (m, rp)), m, out.view(at * rp, (m, rp)))(stream)
    memory.synchronize(stream)
    w.free()
    return out


def _pair(t: LoraTensor, stream: int) -> Pair:
    rank = t.rank
    rp = (rank + RANK_STEP - 1) // RANK_STEP * RANK_STEP
    k, r = t.a.ne[0], t.b.ne[1]
    if len(t.a.ne) == 3:  # an expert stack: A (E, rank, in), B (E, out, rank)
        e = t.a.ne[2]
        a = _upload_padded(_host_f32(t.a), e, rank * k, rp * k, (e, rp, k))  # each expert's rows past the rank: 0
        b_raw = _upload_padded(_host_f32(t.b), e * r, rank, rp, (e, r, rp))  # columns past the rank: 0
    else:
        a = _upload_padded(_host_f32(t.a), rank, k, k, (rp, k))  # A (rank, in): rows past the rank are zero
        b_raw = _upload_padded(_host_f32(t.b), r, rank, rp, (r, rp))  # B (out, rank): columns past the rank are zero
    b = _scaled(b_raw, t.scale, stream)
    b_raw.free()
    return Pair(a, b, t.target)


def attach(model, adapters: list[Adapter], stream: int) -> float:
    """Upload every update (checked by `check_supported`) and hand them to `model.lora`. Returns the ms taken."""
    with Stopwatch() as sw:
        pairs = {target: [_pair(t, stream) for t in ts] for target, ts in updates(adapters).items()}
        model.lora = DeviceLora(pairs, model.max_batch)
        for ffn in getattr(model, "moe", None) or ():  # the MoE FFNs (engine/models/moe_cuda.py), one per MoE layer
            if ffn is not None:
                ffn.use_lora(model.lora)
    return sw.ms

"""Launch wrapper for kernels/embed.cu: embedding rows dequantized from token_embd (contract: kernels/README.md)."""

from __future__ import annotations

from engine.cuda import driver
from engine.cuda.driver import Launch, i32, i64, ptr
from engine.cuda.memory import DeviceArray, DeviceWeight, need, need_aligned_weight
from engine.errors import CudaError

THREADS = 256


def embed(
    w: DeviceWeight,  # (n_vocab, K) GGUF blocks: token_embd
    ids: DeviceArray,  # (n,) i4 token ids, each in [0, n_vocab) (not checked: device memory)
    n: int,  # tokens
    out: DeviceArray,  # (n, K) f4
) -> Launch:
    if n < 1:
        raise CudaError(f"embed: n={n} must be >= 1")
    need_aligned_weight(w)
    need(ids, "ids", "i4", n)
    need(out, "out", "f4", n * w.cols, aligned=True)
    fn = driver.module("embed").fn(f"embed_{w.tag}")
    args = [ptr(w.ptr), i64(w.row_bytes), i32(w.cols), ptr(ids), i32(n), ptr(out)]
    return Launch(fn, (n,), (THREADS,), args)

"""Launch wrappers for kernels/deltanet.cu: the Gated DeltaNet layer's conv, L2-norm and gates, delta-rule recurrence
and gated RMSNorm, and the gated attention's glue (splitting per-head groups, the sigmoid output gate).

Each function checks its buffers and returns a `driver.Launch` (it does not launch). Names, argument order, grid and
block follow kernels/README.md. Buffers may be larger than needed; all are float32 and need no particular alignment.
The conv and recurrent states are device arrays the launches read and rewrite, so a captured graph carries them
from step to step.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.cuda import driver
from engine.cuda.driver import Launch, f32, i32, i64, ptr
from engine.cuda.memory import DeviceArray, need
from engine.errors import CudaError

HEAD_K_DIMS = (32, 64, 128)  # gdn_recurrence_dk{N} instantiations
CONV_TOKENS = 64  # tokens per gdn_conv_silu block row; also the longest conv kernel + 1
COLS_PER_BLOCK = 16  # recurrent state columns per gdn_recurrence block (4 warps x 4 columns)
MAX_PARTS = 4  # split_groups


def _blocks(count: int, per_block: int) -> int:
    return (count + per_block - 1) // per_block


def _fn(name: str):
    return driver.module("deltanet").fn(name)


def conv_silu(
    x: DeviceArray,  # (n, C) f32: the new conv inputs (the attn_qkv projection)
    n: int,
    C: int,  # channels (conv_dim)
    w: DeviceArray,  # (C, K) f32: ssm_conv1d, w[c, K-1] weighing the current input
    K: int,
    state: DeviceArray,  # (K-1, C) f32: the previous K-1 inputs, oldest first; advanced by n tokens
    y: DeviceArray,  # (n, C) f32 out: silu(causal conv); must not overlap x
) -> Launch:
    if not (1 <= K <= CONV_TOKENS + 1 and n >= 1):
        raise CudaError(f"gdn_conv_silu: conv kernel {K} must be in 1..{CONV_TOKENS + 1} and n={n} >= 1")
    need(w, "w", "f4", C * K)
    need(x, "x", "f4", n * C)
    need(state, "state", "f4", (K - 1) * C)
    need(y, "y", "f4", n * C)
    args = [ptr(x), i32(n), i32(C), i32(K), ptr(w), ptr(state), ptr(y)]
    return Launch(_fn("gdn_conv_silu"), (_blocks(C, 256), _blocks(n, CONV_TOKENS)), (256,), args)


def l2norm_gates(
    mixed: DeviceArray,  # (n, C) f32: [q heads | k heads | v heads]; q and k heads normalised in place
    n: int, C: int, H_k: int, Dk: int, eps: float,
    q_scale: float,  # q heads are also multiplied by this (1 / sqrt(Dk))
    b: DeviceArray,  # (n, H_v) f32: ssm_beta projection in, beta = sigmoid(b) out
    a: DeviceArray,  # (n, H_v) f32: ssm_alpha projection in, decay out
    ssm_a: DeviceArray,  # (H_v,) f32: -exp(A_log)
    dt: DeviceArray,  # (H_v,) f32: ssm_dt.bias
    H_v: int,
) -> Launch:  # fmt: skip
    if 2 * H_k * Dk > C or n < 1:
        raise CudaError(f"gdn_l2norm_gates: {2 * H_k} heads of {Dk} do not fit rows of {C} (n={n})")
    need(mixed, "mixed", "f4", n * C)
    for arr, name, size in ((b, "b", n * H_v), (a, "a", n * H_v), (ssm_a, "ssm_a", H_v), (dt, "dt", H_v)):
        need(arr, name, "f4", size)
    args = [ptr(mixed), i32(C), i32(H_k), i32(Dk), f32(eps), f32(q_scale), ptr(b), ptr(a), ptr(ssm_a), ptr(dt),
            i32(H_v)]  # fmt: skip
    return Launch(_fn("gdn_l2norm_gates"), (n,), (256,), args)


def recurrence(
    mixed: DeviceArray,  # (n, 2*H_k*Dk + H_v*Dv) f32: normalised q, k heads, then v heads
    decay: DeviceArray,  # (n, H_v) f32 in (0, 1)
    beta: DeviceArray,  # (n, H_v) f32 in (0, 1)
    n: int, H_k: int, H_v: int, Dk: int, Dv: int,
    tiled: bool,  # v head h reads k head h % H_k (qwen35); else h // (H_v / H_k) (qwen3next)
    state: DeviceArray,  # (H_v, Dv, Dk) f32: this layer's S transposed (state[h, j, i] = S_h[i, j]); advanced
    o: DeviceArray,  # (n, H_v*Dv) f32 out
) -> Launch:  # fmt: skip
    if Dk not in HEAD_K_DIMS or Dv < 4 or Dv % 4 or H_k < 1 or H_v % H_k or n < 1:
        raise CudaError(f"gdn_recurrence: head_k_dim {Dk} (one of {HEAD_K_DIMS}), head_v_dim {Dv} (a multiple "
                        f"of 4), {H_v} v heads over {H_k} k heads, n={n}")  # fmt: skip
    need(mixed, "mixed", "f4", n * (2 * H_k * Dk + H_v * Dv))
    need(decay, "decay", "f4", n * H_v)
    need(beta, "beta", "f4", n * H_v)
    need(state, "state", "f4", H_v * Dv * Dk)
    need(o, "o", "f4", n * H_v * Dv)
    args = [ptr(mixed), ptr(decay), ptr(beta), i32(n), i32(H_k), i32(H_v), i32(Dv), i32(1 if tiled else 0),
            ptr(state), ptr(o)]  # fmt: skip
    return Launch(_fn(f"gdn_recurrence_dk{Dk}"), (H_v, _blocks(Dv, COLS_PER_BLOCK)), (128,), args)


def gated_norm(
    o: DeviceArray,  # (rows, Dv) f32, normalised in place
    z: DeviceArray,  # (rows, Dv) f32: the attn_gate projection
    w: DeviceArray,  # (Dv,) f32: ssm_norm
    eps: float,
    rows: int,  # tokens x v heads
    Dv: int,
) -> Launch:
    need(o, "o", "f4", rows * Dv)
    need(z, "z", "f4", rows * Dv)
    need(w, "w", "f4", Dv)
    args = [ptr(o), ptr(z), ptr(w), f32(eps), i32(rows), i32(Dv)]
    return Launch(_fn("gdn_gated_norm"), (_blocks(rows, 8),), (256,), args)


def split_groups(
    src: DeviceArray,  # (n, groups * sum(widths)) f32: per group [part 0 | part 1 | ...]
    n: int,
    groups: int,
    widths: Sequence[int],  # up to 4 part widths
    dsts: Sequence[tuple[DeviceArray, int]],  # per part (output, row stride): out[t*stride + g*width + i]
) -> Launch:
    if not (1 <= len(widths) == len(dsts) <= MAX_PARTS) or min(widths) < 1 or groups < 1 or not 1 <= n <= 65535:
        raise CudaError(f"split_groups: {len(widths)} parts of widths {list(widths)} for {len(dsts)} outputs")
    W = sum(widths)
    need(src, "src", "f4", n * groups * W)
    args: list = [ptr(src), i32(groups)]
    args += [i32(widths[p]) if p < len(widths) else i32(0) for p in range(MAX_PARTS)]
    for p in range(MAX_PARTS):
        if p < len(dsts):
            dst, stride = dsts[p]
            if stride < groups * widths[p]:
                raise CudaError(f"split_groups: part {p} rows of {groups * widths[p]} exceed the stride {stride}")
            need(dst, f"dst{p}", "f4", (n - 1) * stride + groups * widths[p])
            args += [ptr(dst), i32(stride)]
        else:
            args += [ptr(None), i32(0)]
    return Launch(_fn("split_groups"), (_blocks(groups * W, 256), n), (256,), args)


def sigmoid_mul(x: DeviceArray, g: DeviceArray, count: int) -> Launch:
    """x[:count] *= sigmoid(g[:count]); x, g f32 (the gated attention's output gate)."""
    need(x, "x", "f4", count)
    need(g, "g", "f4", count)
    return Launch(_fn("sigmoid_mul"), (_blocks(count, 256),), (256,), [ptr(x), ptr(g), i64(count)])

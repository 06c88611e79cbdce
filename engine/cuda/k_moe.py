"""Launch wrappers for kernels/moe.cu: expert routing, decode expert matvecs, the grouping of routed rows by expert
and the grouped prefill GEMM (contract: kernels/README.md, "moe.cu").

Each function checks its buffers and returns a `driver.Launch` (it does not launch). Buffers may be larger than
needed. Expert ids live in device memory and are not checked here: `route` writes them in [0, n_experts), and every
later kernel trusts them. An expert stack is passed as the `DeviceWeight` of its expert 0 (rows x cols of one
expert, as `DeviceWeights.matrix` gives for a GGUF ne [cols, rows, n_experts]); expert e starts
`e * rows * row_bytes` bytes further. A routed "item" is one (token, slot) pair, item p = token p // k, slot p % k.

The 16-bit forms (kernels/quant_i16.cuh): for the types in I16_TYPES, gate_up rounds each group of 8 activations to
16 bits and dots in integers, and hands its SwiGLU outputs to down as `Groups16` instead of float rows.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from engine.cuda import driver
from engine.cuda.driver import Launch, f32, i32, i64, ptr
from engine.cuda.k_gemm import _need_weight
from engine.cuda.k_matvec import I16_TYPES  # quant_i16.cuh's dot8 types, the 16-bit expert forms' too
from engine.cuda.memory import DeviceArray, DeviceWeight, need, need_aligned_weight
from engine.errors import CudaError
from engine.quants import GGMLType

MAX_EXPERTS = 1024  # kernels/moe_route.cuh: shared-memory tables per expert
MAX_K = 32  # experts used per token
MAX_GROUPS = 64
ROUTE_THREADS, GROUP_THREADS, MV_THREADS, MV_ROWS = 256, 1024, 256, 8
ROUTE_MAX_DIM = 8192  # route_decode: a row's 4-float granules in 8 registers a thread
DOWN_ROWS = 2  # moe_down: 4 warps a row (kernels/moe_expert.cuh)
# moe_down16s (moe_expert.cuh, down_staged): 8 rows a block, each of the k experts' 8 rows staged in 42 KiB of shared
# memory, and at most 4 (slot, group) pairs a thread.
STAGED_DOWN_ROWS, STAGED_DOWN_BYTES, STAGED_DOWN_PAIRS = 8, 43008, 4
TILE = 64  # rows (and weight rows) of a grouped-GEMM tile: gemm_tile.cuh's BM and BN
GEMM_THREADS = 128
MAX_GRID_Y = 65535


@dataclass(frozen=True)
class Groups16:
    """Rows rounded to 16 bits a group of 8 values (kernels/quant_i16.cuh), as moe_gate_up16 writes them: q (rows,
    width) i2, meta (rows, width / 8, 2) i4: each group's step (float32 bits) and the sum of its 8 q."""

    q: DeviceArray
    meta: DeviceArray

    @classmethod
    def empty(cls, rows: int, width: int) -> Groups16:
        if width % 8:
            raise CudaError(f"16-bit groups: width {width} is not a multiple of 8")
        return cls(DeviceArray.empty((rows, width), "i2"), DeviceArray.empty((rows, width // 8, 2), "i4"))

    def need(self, rows: int, width: int, what: str) -> None:
        need(self.q, f"{what} q", "i2", rows * width, aligned=True)
        need(self.meta, f"{what} meta", "i4", rows * width // 4)


def takes_i16(gate: DeviceWeight, up: DeviceWeight | None, down: DeviceWeight) -> bool:
    """Whether gate_up and down can run their 16-bit forms on these stacks: gate and up fused (one layout), all of
    I16_TYPES, the expert width a multiple of 8 (a gate_up block's 8 outputs are one group)."""
    return (up is not None and _layout(gate) == _layout(up) and gate.ggml_type in I16_TYPES
            and down.ggml_type in I16_TYPES and gate.rows % 8 == 0 and down.cols == gate.rows)  # fmt: skip


def max_tiles(n_items: int, n_experts: int) -> int:
    """The most 64-row tiles n_items routed rows can need: sum over the m used experts of ceil(count / 64) <=
    (n_items + 63 m) / 64. The grouped GEMM's grid.y and the tile list's length, fixed by n alone."""
    return (n_items + (TILE - 1) * min(n_experts, n_items)) // TILE


def _stack(w: DeviceWeight) -> int:
    """Bytes from one expert of a stack to the next."""
    need_aligned_weight(w)
    return w.rows * w.row_bytes


def _items(n_items: int, what: str) -> None:
    if not 1 <= n_items <= MAX_GRID_Y:
        raise CudaError(f"{what}: {n_items} routed rows must be in 1..{MAX_GRID_Y}")


def _route_shape(n_experts: int, k: int, n_groups: int, n_groups_used: int, n: int) -> None:
    if not (1 <= k <= min(n_experts, MAX_K) and n_experts <= MAX_EXPERTS and n >= 1):
        raise CudaError(f"moe route: k={k} of {n_experts} experts (at most {MAX_K} of {MAX_EXPERTS}), n={n}")
    if n_groups > 1 and (n_groups > MAX_GROUPS or n_experts % n_groups or not 1 <= n_groups_used <= n_groups):
        raise CudaError(f"moe route: {n_experts} experts in {n_groups} groups, {n_groups_used} used")


def route(
    logits: DeviceArray,  # (n, n_experts) f4: ffn_gate_inp . xn
    n: int,
    n_experts: int,
    k: int,  # experts used per token
    ids: DeviceArray,  # (n, k) i4 out: chosen experts, best first
    w: DeviceArray,  # (n, k) f4 out: their weights
    *,
    sigmoid: bool = False,  # gating: softmax (False) or sigmoid over the experts
    bias: DeviceArray | None = None,  # (n_experts,) f4 exp_probs_b: added for the choice only
    n_groups: int = 1,
    n_groups_used: int = 1,
    norm: bool = True,  # divide the chosen weights by their sum
    scale: float = 1.0,
    xn: DeviceArray | None = None,  # (n, dim) f4: with gate_shexp, the rows its gate reads
    gate_shexp: DeviceArray | None = None,  # (dim,) f4 ffn_gate_inp_shexp
    sgate: DeviceArray | None = None,  # (n,) f4 out: sigmoid(gate_shexp . xn[t])
) -> Launch:
    _route_shape(n_experts, k, n_groups, n_groups_used, n)
    need(logits, "logits", "f4", n * n_experts)
    need(ids, "ids", "i4", n * k)
    need(w, "w", "f4", n * k)
    if bias is not None:
        need(bias, "bias", "f4", n_experts)
    dim = 0
    if gate_shexp is not None:
        dim = gate_shexp.size
        need(xn, "xn", "f4", n * dim)
        need(sgate, "sgate", "f4", n)
    fn = driver.module("moe").fn("moe_route")
    args = [ptr(logits), i32(n_experts), i32(k), i32(1 if sigmoid else 0), ptr(bias), i32(n_groups),
            i32(n_groups_used), i32(1 if norm else 0), f32(scale), ptr(xn), i32(dim), ptr(gate_shexp), ptr(ids),
            ptr(w), ptr(sgate)]  # fmt: skip
    return Launch(fn, (n,), (ROUTE_THREADS,), args)


def route_decode(
    x: DeviceArray,  # (dim,) f4: one token's residual
    norm_w: DeviceArray,  # (dim,) f4 ffn_norm
    eps: float,
    router: DeviceWeight,  # (n_experts, dim) F32 ffn_gate_inp
    k: int,
    xn: DeviceArray,  # (dim,) f4 out: RMSNorm(x) * norm_w, for the expert launches
    logits: DeviceArray,  # (n_experts,) f4 out
    counter: DeviceArray,  # (1,) i4, zero before the first launch (every launch leaves it zero): route_counter()
    ids: DeviceArray,  # (k,) i4 out
    w: DeviceArray,  # (k,) f4 out
    *,
    sigmoid: bool = False,
    bias: DeviceArray | None = None,
    n_groups: int = 1,
    n_groups_used: int = 1,
    norm: bool = True,
    scale: float = 1.0,
    gate_shexp: DeviceArray | None = None,  # (dim,) f4
    sgate: DeviceArray | None = None,  # (1,) f4 out, with gate_shexp
) -> Launch:
    """route's result for one token straight from the residual: the FFN norm, the router matvec and the route in one
    launch (the last block routes). fusable() says when a router can take it."""
    E, dim = router.rows, router.cols
    _route_shape(E, k, n_groups, n_groups_used, 1)
    if not fusable(router):
        raise CudaError(f"moe route_decode: {router.name} must be F32, its width a multiple of 4 up to {ROUTE_MAX_DIM}")
    need_aligned_weight(router)
    for a, name in ((x, "x"), (norm_w, "norm_w"), (xn, "xn")):
        need(a, name, "f4", dim, aligned=True)
    need(logits, "logits", "f4", E)
    need(counter, "counter", "i4", 1)
    need(ids, "ids", "i4", k)
    need(w, "w", "f4", k)
    if bias is not None:
        need(bias, "bias", "f4", E)
    if gate_shexp is not None:
        need(gate_shexp, "gate_shexp", "f4", dim, aligned=True)
        need(sgate, "sgate", "f4", 1)
    fn = driver.module("moe").fn("moe_route_decode")
    args = [ptr(x), ptr(norm_w), f32(eps), i32(dim), ptr(router.ptr), i32(E), i32(k), i32(1 if sigmoid else 0),
            ptr(bias), i32(n_groups), i32(n_groups_used), i32(1 if norm else 0), f32(scale), ptr(gate_shexp), ptr(xn),
            ptr(logits), ptr(counter), ptr(ids), ptr(w), ptr(sgate)]  # fmt: skip
    rows = E + (1 if gate_shexp is not None else 0)
    return Launch(fn, (rows,), (ROUTE_THREADS,), args)  # a block a row


def fusable(router: DeviceWeight) -> bool:
    """Whether route_decode can read this router: F32 rows whose width is a multiple of 4 (float4 loads), at most
    ROUTE_MAX_DIM (a row in registers)."""
    return router.ggml_type == GGMLType.F32 and router.cols % 4 == 0 and router.cols <= ROUTE_MAX_DIM


def route_counter() -> DeviceArray:
    """route_decode's ticket: (1,) i4, zeroed."""
    c = DeviceArray.empty((1,), "i4")
    c.fill_byte(0)
    return c


def group(
    ids: DeviceArray,  # (n_items,) i4 from route
    n_items: int,
    k: int,
    n_experts: int,
    offsets: DeviceArray,  # (n_experts + 1,) i4 out: expert e's permuted rows are [offsets[e], offsets[e + 1])
    perm_tok: DeviceArray,  # (n_items,) i4 out: the token of permuted row p
    inv: DeviceArray,  # (n_items,) i4 out: the permuted row of item i
    tiles: DeviceArray,  # (max_tiles(n_items, n_experts), 3) i4 out: (expert, first row, end row), or (-1, 0, 0)
) -> Launch:
    _items(n_items, "moe group")
    if not 1 <= n_experts <= MAX_EXPERTS:
        raise CudaError(f"moe group: {n_experts} experts (at most {MAX_EXPERTS})")
    need(ids, "ids", "i4", n_items)
    need(offsets, "offsets", "i4", n_experts + 1)
    need(perm_tok, "perm_tok", "i4", n_items)
    need(inv, "inv", "i4", n_items)
    n_tiles = max_tiles(n_items, n_experts)
    need(tiles, "tiles", "i4", 3 * n_tiles)
    fn = driver.module("moe").fn("moe_group")
    args = [ptr(ids), i32(n_items), i32(k), i32(n_experts), i32(n_tiles), ptr(offsets), ptr(perm_tok), ptr(inv),
            ptr(tiles)]  # fmt: skip
    return Launch(fn, (1,), (GROUP_THREADS,), args)


def gather(xn: DeviceArray, dim: int, perm_tok: DeviceArray, n_items: int, xp: DeviceArray) -> Launch:
    """xp[p] = xn[perm_tok[p]] for p < n_items: xn (n, dim), xp (n_items, dim) f4, 16-byte aligned; perm_tok i4."""
    if dim % 4 or n_items < 1:
        raise CudaError(f"moe gather: dim={dim} must be a multiple of 4, n_items={n_items} >= 1")
    need(xn, "xn", "f4", dim, aligned=True)
    need(perm_tok, "perm_tok", "i4", n_items)
    need(xp, "xp", "f4", n_items * dim, aligned=True)
    fn = driver.module("moe").fn("moe_gather")
    return Launch(fn, (n_items,), (256,), [ptr(xn), i32(dim), ptr(perm_tok), ptr(xp)])


def gate_up(
    wg: DeviceWeight,  # expert 0 of ffn_gate_exps: (F, dim) GGUF blocks
    wu: DeviceWeight | None,  # expert 0 of ffn_up_exps, same type and layout; None: y = wg_e . x alone
    x: DeviceArray,  # (n, dim) f4: normed FFN input
    ids: DeviceArray,  # (n_items,) i4
    k: int,
    n_items: int,  # n * k, at most 8 tokens' worth in practice
    y: DeviceArray | Groups16,  # (n_items, F) f4 out; Groups16: the 16-bit form (takes_i16), its rows rounded
    *,
    shared: tuple[DeviceWeight, DeviceWeight] | None = None,  # ffn_gate_shexp, ffn_up_shexp (S, dim), S % F == 0
    hs: DeviceArray | None = None,  # (n, S) f4 out, with shared: silu(gate_shexp . x) * (up_shexp . x)
) -> Launch:
    _items(n_items, "moe gate_up")
    if wu is not None and _layout(wg) != _layout(wu):
        raise CudaError(f"moe gate_up weights differ: {wg.name} {wg.tag} {wg.rows}x{wg.cols}, {wu.name} {wu.tag}")
    stride = _stack(wg)
    if wu is not None:
        _stack(wu)
    need(x, "x", "f4", (n_items - 1) // k * wg.cols + wg.cols, aligned=True)
    need(ids, "ids", "i4", n_items)
    if isinstance(y, Groups16):
        if wu is None or wg.ggml_type not in I16_TYPES or wg.rows % 8:
            raise CudaError(f"moe gate_up: no 16-bit form for {wg.name} {wg.tag} {wg.rows} rows (fused, 8 | rows)")
        y.need(n_items, wg.rows, "y")
        name, out = f"moe_gate_up16_{wg.tag}", [ptr(y.q), ptr(y.meta)]
    else:
        need(y, "y", "f4", n_items * wg.rows)
        name, out = f"moe_gate_up_{wg.tag}", [ptr(y)]
    parts, sg, su, extra = 0, None, None, 0
    if shared is not None:
        if not fuses_shared(wg, wu, *shared):
            raise CudaError(f"moe gate_up: the shared expert {shared[0].name} cannot ride along (types or widths)")
        sg, su = shared
        for w in shared:
            need_aligned_weight(w)
        parts, n = sg.rows // wg.rows, n_items // k
        need(hs, "hs", "f4", n * sg.rows)
        extra = n * parts
    fn = driver.module("moe").fn(name)
    args = [ptr(wg.ptr), ptr(None if wu is None else wu.ptr), i64(wg.row_bytes), i64(stride), i32(wg.rows),
            i32(wg.cols), ptr(x), ptr(ids), i32(k), *out, i32(n_items), ptr(sg), ptr(su), i32(parts),
            ptr(hs)]  # fmt: skip
    _items(n_items + extra, "moe gate_up with the shared expert")
    return Launch(fn, ((wg.rows + MV_ROWS - 1) // MV_ROWS, n_items + extra), (MV_THREADS,), args)


def _layout(w: DeviceWeight) -> tuple:
    return w.ggml_type, w.rows, w.cols, w.row_bytes


def fuses_shared(wg: DeviceWeight, wu: DeviceWeight | None, sg: DeviceWeight, su: DeviceWeight) -> bool:
    """Whether gate_up can run the shared expert's SwiGLU in the same launch: a fused pair (wu given) whose type and
    width the shared gate and up share, the shared width a whole multiple of the experts'."""
    same = (wg.ggml_type, wg.cols, wg.row_bytes)
    return (wu is not None and (sg.ggml_type, sg.cols, sg.row_bytes) == same == (su.ggml_type, su.cols, su.row_bytes)
            and sg.rows == su.rows and sg.rows % wg.rows == 0)  # fmt: skip


def down(
    w: DeviceWeight,  # expert 0 of ffn_down_exps: (dim, F) GGUF blocks
    h: DeviceArray | Groups16,  # (n * k, F) f4: gate_up's output per item (Groups16: its 16-bit form)
    ids: DeviceArray,  # (n * k,) i4
    wts: DeviceArray,  # (n * k,) f4 routing weights
    k: int,
    n: int,  # tokens
    x: DeviceArray,  # (n, dim) f4, in place: x += sum_j wts * (w_e . h) (+ g * shared)
    *,
    shared: DeviceArray | None = None,  # (n, dim) f4: the shared expert's output
    sgate: DeviceArray | None = None,  # (n,) f4: its gate (None: 1)
) -> Launch:
    if not (1 <= k <= MAX_K and 1 <= n <= MAX_GRID_Y):
        raise CudaError(f"moe down: k={k} (at most {MAX_K}), n={n}")
    stride = _stack(w)
    rows_a_block = DOWN_ROWS
    if isinstance(h, Groups16):
        if w.ggml_type not in I16_TYPES:
            raise CudaError(f"moe down: no 16-bit form for {w.name} {w.tag}")
        h.need(n * k, w.cols, "h")
        name, hargs = f"moe_down16_{w.tag}", [ptr(h.q), ptr(h.meta)]
        if staged_down(w, k):
            name, rows_a_block = f"moe_down16s_{w.tag}", STAGED_DOWN_ROWS
    else:
        need(h, "h", "f4", n * k * w.cols, aligned=True)
        name, hargs = f"moe_down_{w.tag}", [ptr(h)]
    need(ids, "ids", "i4", n * k)
    need(wts, "wts", "f4", n * k)
    need(x, "x", "f4", n * w.rows)
    if shared is not None:
        need(shared, "shared", "f4", n * w.rows)
    if sgate is not None:
        need(sgate, "sgate", "f4", n)
    fn = driver.module("moe").fn(name)
    args = [ptr(w.ptr), i64(w.row_bytes), i64(stride), i32(w.rows), i32(w.cols), *hargs, ptr(ids), ptr(wts), i32(k),
            ptr(shared), ptr(sgate), ptr(x)]  # fmt: skip
    return Launch(fn, ((w.rows + rows_a_block - 1) // rows_a_block, n), (MV_THREADS,), args)


def staged_down(w: DeviceWeight, k: int) -> bool:
    """Whether the 16-bit down takes moe_down16s: the block's 8 rows of k experts fit its shared memory (each row at a
    16-byte pitch, its head offset included) and the k * F / 8 (slot, group) pairs its threads. REFLEX_STAGED_DOWN=0
    keeps moe_down16 (for comparisons)."""
    pitch = (w.row_bytes + 30) // 16 * 16  # stage.cuh's pitch
    fits = STAGED_DOWN_ROWS * k * pitch <= STAGED_DOWN_BYTES and k * (w.cols // 8) <= STAGED_DOWN_PAIRS * MV_THREADS
    return fits and os.environ.get("REFLEX_STAGED_DOWN", "1") != "0"


def _gemm_checks(w: DeviceWeight, a: DeviceArray, tiles: DeviceArray, n_items: int, n_experts: int,
                 c: DeviceArray) -> int:  # fmt: skip
    _items(n_items, "moe gemm")
    _need_weight(w)
    need(a, "moe gemm A", "f4", n_items * w.cols, aligned=True)
    need(c, "moe gemm C", "f4", n_items * w.rows, aligned=True)
    if a.ptr < c.ptr + 4 * n_items * w.rows and c.ptr < a.ptr + 4 * n_items * w.cols:
        raise CudaError("moe gemm: A overlaps C")
    n_tiles = max_tiles(n_items, n_experts)
    need(tiles, "tiles", "i4", 3 * n_tiles)
    return n_tiles


def gemm(
    w: DeviceWeight,  # expert 0 of a stack: (R, K) GGUF blocks
    a: DeviceArray,  # (n_items, K) f4: rows in permuted (by expert) order
    tiles: DeviceArray,  # from group(n_items, ..., n_experts)
    n_items: int,
    n_experts: int,
    c: DeviceArray,  # (n_items, R) f4 out: c[p] = w_e . a[p]
) -> Launch:
    n_tiles = _gemm_checks(w, a, tiles, n_items, n_experts, c)
    fn = driver.module("moe").fn(f"moe_gemm_{w.tag}")
    args = [ptr(w.ptr), i64(w.row_bytes), i64(_stack(w)), i32(w.rows), i32(w.cols), ptr(a), ptr(tiles), ptr(c)]
    return Launch(fn, ((w.rows + TILE - 1) // TILE, n_tiles), (GEMM_THREADS,), args)


def gemm_swiglu(
    wg: DeviceWeight,  # expert 0 of ffn_gate_exps: (F, dim) GGUF blocks
    wu: DeviceWeight,  # expert 0 of ffn_up_exps, same type and layout
    a: DeviceArray,  # (n_items, dim) f4, permuted rows
    tiles: DeviceArray,
    n_items: int,
    n_experts: int,
    c: DeviceArray,  # (n_items, F) f4 out: silu(wg_e . a[p]) * (wu_e . a[p])
) -> Launch:
    if (wg.ggml_type, wg.rows, wg.cols, wg.row_bytes) != (wu.ggml_type, wu.rows, wu.cols, wu.row_bytes):
        raise CudaError(f"moe gemm_swiglu weights differ: {wg.name} {wg.tag} {wg.rows}x{wg.cols}, {wu.name} {wu.tag}")
    n_tiles = _gemm_checks(wg, a, tiles, n_items, n_experts, c)
    _need_weight(wu)
    fn = driver.module("moe").fn(f"moe_gemm_swiglu_{wg.tag}")
    args = [ptr(wg.ptr), ptr(wu.ptr), i64(wg.row_bytes), i64(_stack(wg)), i32(wg.rows), i32(wg.cols), ptr(a),
            ptr(tiles), ptr(c)]  # fmt: skip
    return Launch(fn, ((wg.rows + TILE - 1) // TILE, n_tiles), (GEMM_THREADS,), args)


def combine(
    y: DeviceArray,  # (n * k, dim) f4: the experts' outputs in permuted order
    inv: DeviceArray,  # (n * k,) i4 from group
    wts: DeviceArray,  # (n * k,) f4 routing weights
    n: int,
    k: int,
    dim: int,
    x: DeviceArray,  # (n, dim) f4, in place: x[t] += sum_j wts[t, j] * y[inv[t, j]] (+ g_t * shared[t])
    *,
    shared: DeviceArray | None = None,  # (n, dim) f4
    sgate: DeviceArray | None = None,  # (n,) f4 (None: 1)
) -> Launch:
    if dim % 4 or n < 1:
        raise CudaError(f"moe combine: dim={dim} must be a multiple of 4, n={n} >= 1")
    need(y, "y", "f4", n * k * dim, aligned=True)
    need(inv, "inv", "i4", n * k)
    need(wts, "wts", "f4", n * k)
    need(x, "x", "f4", n * dim, aligned=True)
    if shared is not None:
        need(shared, "shared", "f4", n * dim, aligned=True)
    if sgate is not None:
        need(sgate, "sgate", "f4", n)
    fn = driver.module("moe").fn("moe_combine")
    args = [ptr(y), ptr(inv), ptr(wts), i32(k), i32(dim), ptr(shared), ptr(sgate), ptr(x)]
    return Launch(fn, (n,), (256,), args)

"""kernels/norm_rope.cu, attention.cu and sample.cu on the GPU against float64 NumPy references written from the math
of engine/cpu/ops.py, and the device sampler against engine.sampling.sample.

Fresh random inputs every run; the seed is in every failure message (ATTN_SEED=<seed> replays one). Outputs are
poisoned with NaN bytes first, so a value the kernel failed to write shows up; cache rows outside the positions a
kernel may touch are poisoned too and must come back unchanged (writers) or must not leak into results (readers).
"""

from __future__ import annotations

import functools
import os

import numpy as np
import pytest

from engine.cpu import ops
from engine.cuda import dispatch, driver, memory
from engine.cuda import k_attention as ka
from engine.cuda import k_norm_rope as knr
from engine.cuda import k_sample as ks
from engine.cuda.memory import DeviceArray
from engine.errors import CudaError
from engine.sampling import SamplingParams, sample

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def context() -> None:
    driver.start_context(0)


@pytest.fixture
def seed() -> int:
    return int(os.environ.get("ATTN_SEED") or np.random.default_rng().integers(2**63))


def dev(a: np.ndarray, dtype=np.float32) -> DeviceArray:
    return DeviceArray.from_host(np.ascontiguousarray(a, dtype=dtype))


def poisoned(shape: tuple[int, ...], dtype: str = "f4") -> DeviceArray:
    a = DeviceArray.empty(shape, dtype)
    a.fill_byte(0xFF)  # float32 NaN, int32 -1
    return a


def run(launch: driver.Launch) -> None:
    # A Launch holds raw pointers only: every DeviceArray it uses must stay referenced until this returns.
    launch(0)
    memory.synchronize(0)


def cache_with(rows: np.ndarray, max_seq: int, start: int = 0, kv: str = "f4") -> DeviceArray:
    """A poisoned (max_seq, heads, d) cache of f32 ("f4") or f16 ("f2") with rows[j] at position start + j."""
    c = poisoned((max_seq, *rows.shape[1:]), kv)
    c.view(start * rows[0].size, rows.shape).copy_from_host(rows)
    return c


def kv_values(a: np.ndarray, kv: str) -> np.ndarray:
    """The values a cache of element kv holds of a, as float32 (f16: rounded to nearest even)."""
    return a.astype(np.float16).astype(np.float32) if kv == "f2" else a


def is_poison(a: np.ndarray) -> bool:
    """Every element still holds the 0xFF bytes poisoned() wrote."""
    return bool((np.ascontiguousarray(a).view(np.uint8) == 0xFF).all())


# -- references (float64) --------------------------------------------------------------------------------------


def rmsnorm64(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    x = x.astype(np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w.astype(np.float64)


def rope64(x, positions, rope_dim, theta, freq_scale, factors, neox) -> np.ndarray:
    """x (n, heads, hd) rotated as ops.apply_rope does, with angles from the contract's formula in float64."""
    inv = float(theta) ** (-2.0 * np.arange(rope_dim // 2) / rope_dim)
    if factors is not None:
        inv = inv / factors.astype(np.float64)
    ang = positions.astype(np.float64)[:, None] * float(freq_scale) * inv[None, :]
    return ops.apply_rope(x.astype(np.float64), np.cos(ang), np.sin(ang), "neox" if neox else "norm")


def attention64(q, k, v, start: int, scale: float) -> np.ndarray:
    """ops.attention in float64: q (n, H, d), k (T, KVH, d), v (T, KVH, dv) -> (n, H, dv)."""
    n, H, _ = q.shape
    group = H // k.shape[1]
    out = np.empty((n, H, v.shape[2]))
    for h in range(H):
        s = q[:, h].astype(np.float64) @ k[:, h // group].astype(np.float64).T * scale  # (n, T)
        s[np.arange(k.shape[0])[None, :] > start + np.arange(n)[:, None]] = -np.inf
        p = np.exp(s - s.max(axis=1, keepdims=True))
        out[:, h] = (p / p.sum(axis=1, keepdims=True)) @ v[:, h // group].astype(np.float64)
    return out


# -- rmsnorm_rows, qk_rope_kv --------------------------------------------------------------------------------------


@pytest.mark.parametrize("n, K", [(1, 32), (3, 1000), (64, 4096), (5, 2048)])
@pytest.mark.parametrize("in_place", [False, True])
def test_rmsnorm_rows(n: int, K: int, in_place: bool, seed: int) -> None:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((n, K)) * rng.uniform(0.1, 10)).astype(np.float32)
    w = rng.standard_normal(K).astype(np.float32)
    dx, dw = dev(x), dev(w)
    dy = dx if in_place else poisoned((n, K))
    run(knr.rmsnorm_rows(dx, dw, 1e-6, dy, n))
    np.testing.assert_allclose(dy.to_host(), rmsnorm64(x, w, 1e-6), rtol=2e-5, atol=2e-5, err_msg=f"seed {seed}")


ROPE_CASES = [  # (hd, rope_dim, neox, qk_norm, factors, freq_scale, n, pos0)
    (128, 128, True, True, False, 1.0, 5, 0),
    (128, 128, False, False, False, 1.0, 7, 37),
    (128, 64, True, True, True, 1.0, 20, 100),
    (128, 96, False, True, False, 0.25, 3, 11),
    (64, 64, False, False, True, 1.0, 1, 3000),
    (64, 32, True, False, False, 0.5, 9, 2),
    (256, 256, True, True, False, 1.0, 4, 500),
    (256, 64, False, True, True, 1.0, 2, 1),
]


@pytest.mark.parametrize("hd, rope_dim, neox, qk_norm, use_factors, freq_scale, n, pos0", ROPE_CASES)
@pytest.mark.parametrize("kv", ["f4", "f2"])
def test_qk_rope_kv(hd, rope_dim, neox, qk_norm, use_factors, freq_scale, n, pos0, kv, seed) -> None:
    rng = np.random.default_rng(seed)
    H, KVH, vd, max_seq, eps, theta = 8, 2, hd // 2 + 4, pos0 + n + 3, 1e-6, 1e6 if neox else 1e4
    q = rng.standard_normal((n, H, hd)).astype(np.float32)
    k = rng.standard_normal((n, KVH, hd)).astype(np.float32)
    v = rng.standard_normal((n, KVH, vd)).astype(np.float32)
    qn = rng.uniform(0.5, 1.5, hd).astype(np.float32) if qk_norm else None
    kn = rng.uniform(0.5, 1.5, hd).astype(np.float32) if qk_norm else None
    factors = rng.uniform(1.0, 8.0, rope_dim // 2).astype(np.float32) if use_factors else None
    dq, dk, dv, kc, vc = dev(q), dev(k), dev(v), poisoned((max_seq, KVH, hd), kv), poisoned((max_seq, KVH, vd), kv)
    opt = [None if a is None else dev(a) for a in (qn, kn, factors)]
    pos = dev(np.array([pos0]), np.int32)
    run(knr.qk_rope_kv(dq, dk, dv, n, H, KVH, hd, vd, opt[0], opt[1], eps, rope_dim, theta, freq_scale, opt[2], neox,
                      pos, kc, vc))  # fmt: skip

    positions = np.arange(pos0, pos0 + n)
    q_ref = rmsnorm64(q, qn, eps) if qk_norm else q
    k_ref = rmsnorm64(k, kn, eps) if qk_norm else k
    q_ref = rope64(q_ref, positions, rope_dim, theta, freq_scale, factors, neox)
    k_ref = rope64(k_ref, positions, rope_dim, theta, freq_scale, factors, neox)
    # float32 angles (powf, a float32 product) err by ~1e-6 relative, i.e. in proportion to the position
    m = max(np.abs(q_ref).max(), np.abs(k_ref).max())
    atol = m * (2e-5 + 2e-6 * (pos0 + n))
    ctx = f"{kv} seed {seed}"
    np.testing.assert_allclose(dq.to_host(), q_ref, rtol=0, atol=atol, err_msg=ctx)
    got_k, got_v = kc.to_host(), vc.to_host()
    # an f16 key is the float32 one rounded once: half a unit in the last place (2^-11 relative) more
    rtol = 2.0**-11 if kv == "f2" else 0.0
    np.testing.assert_allclose(got_k[pos0 : pos0 + n].astype(np.float32), k_ref, rtol=rtol, atol=atol, err_msg=ctx)
    assert np.array_equal(got_v[pos0 : pos0 + n], v.astype(got_v.dtype)), ctx  # copied (rounded to nearest even)
    untouched = np.r_[0:pos0, pos0 + n : max_seq]
    assert is_poison(got_k[untouched]), f"{ctx}: k_cache written outside the batch"
    assert is_poison(got_v[untouched]), f"{ctx}: v_cache written outside the batch"


# -- attention ------------------------------------------------------------------------------------------------------


def check_decode(L: int, group: int, hd: int, vd: int, n_splits: int, seed: int, KVH: int = 2, kv: str = "f4") -> None:
    rng = np.random.default_rng(seed)
    H, scale = KVH * group, 1.0 / np.sqrt(hd)
    q = rng.standard_normal((1, H, hd)).astype(np.float32)
    k = kv_values(rng.standard_normal((L, KVH, hd)).astype(np.float32), kv)  # what the cache holds, read exactly
    v = kv_values(rng.standard_normal((L, KVH, vd)).astype(np.float32), kv)
    kc, vc = cache_with(k, L + 9, kv=kv), cache_with(v, L + 9, kv=kv)  # rows >= L are NaN and must not be read
    dq, pos = dev(q), dev(np.array([L - 1]), np.int32)
    ref = attention64(q, k, v, L - 1, scale)[0]
    # parts: one block a kv head, and as many as REFLEX_ATTN_PARTS=shared takes; warps: attn_decode's 4 a block, and
    # attn_decode_w8's 8 where its paths take the heads (at most 4 a block, rows at most 128 wide)
    forms = [(m, p, w) for m in (1, 32, 128) for p in sorted({1, dispatch.shared_parts(group)}) for w in (4, 8)
             if w == 4 or (group // p <= 4 and max(hd, vd) <= 128)]  # fmt: skip
    for min_chunk, parts, warps in forms:
        ctx = (f"L={L} group={group} hd={hd}/{vd} splits={n_splits} min_chunk={min_chunk} parts={parts} warps={warps} "
               f"{kv} seed {seed}")  # fmt: skip
        # folded: one launch, the last block of each row of blocks combines
        part_o, part_ml, out = poisoned((H, n_splits, vd)), poisoned((H, n_splits, 2)), poisoned((H, vd))
        tickets = ka.split_counters(KVH * parts)
        launch = ka.attn_decode(dq, kc, vc, pos, H, KVH, hd, vd, scale, n_splits, part_o, part_ml, tickets, out,
                                min_chunk=min_chunk, parts=parts, warps=warps)  # fmt: skip
        assert launch.block[0] == 32 * warps, ctx
        run(launch)
        first = out.to_host()
        np.testing.assert_allclose(first, ref, rtol=1e-4, atol=3e-5, err_msg=ctx)
        assert (tickets.to_host() == 0).all(), f"{ctx}: tickets not reset"
        out.copy_from_host(np.full((H, vd), np.nan, np.float32))
        run(launch)  # the same launch again (as a graph replays it): the same bits, whichever block came last
        assert np.array_equal(out.to_host(), first), ctx
        out.copy_from_host(np.full((H, vd), np.nan, np.float32))
        run(ka.attn_decode(dq, kc, vc, pos, H, KVH, hd, vd, scale, n_splits, part_o, part_ml, tickets, out,
                           min_chunk=min_chunk, parts=parts, prefetch=not dispatch.prefetch_keys(),
                           warps=warps))  # fmt: skip
        assert np.array_equal(out.to_host(), first), f"{ctx}: the L2 prefetch (a hint) changed the result"
        # partials for attn_combine: every split written, empty ones too
        part_o, part_ml, out = poisoned((H, n_splits, vd)), poisoned((H, n_splits, 2)), poisoned((H, vd))
        run(ka.attn_decode(dq, kc, vc, pos, H, KVH, hd, vd, scale, n_splits, part_o, part_ml, min_chunk=min_chunk,
                           parts=parts, warps=warps))  # fmt: skip
        assert not np.isnan(part_o.to_host()).any() and not np.isnan(part_ml.to_host()).any(), ctx
        run(ka.attn_combine(part_o, part_ml, H, n_splits, vd, out))
        combined = out.to_host()
        np.testing.assert_allclose(combined, ref, rtol=1e-4, atol=3e-5, err_msg=ctx)
        chunk = max(-(-L // n_splits), min_chunk)
        if chunk >= L:  # one active split: the folded launch wrote out itself, the combine's very bits
            assert np.array_equal(first, combined), ctx


@pytest.mark.parametrize("L", [1, 7, 33, 64, 1000, 4096])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("hd", [64, 128, 256])
def test_attn_decode(L: int, group: int, hd: int, seed: int) -> None:
    for n_splits in (1, 5, 32, 49, 64):  # 49: dispatch.decode_splits' count for 8 kv heads on an H200
        check_decode(L, group, hd, hd, n_splits, seed)


@pytest.mark.parametrize("L", [1, 33, 50, 129, 4096])
@pytest.mark.parametrize("group", [1, 2, 8])
@pytest.mark.parametrize("hd, vd", [(64, 64), (128, 128), (256, 256), (192, 128)])
def test_attn_decode_f16_cache(L: int, group: int, hd: int, vd: int, seed: int) -> None:
    """attn_decode_f16 (KV_CACHE_TYPE=f16): the f16 rows widened exactly, every split form, against float64."""
    for n_splits in (1, 32, 49):
        check_decode(L, group, hd, vd, n_splits, seed, kv="f2")


@pytest.mark.parametrize("n, L", [(2, 2), (13, 77), (16, 16), (5, 900), (16, 4100)])
@pytest.mark.parametrize("group, hd, vd", [(2, 128, 128), (4, 256, 256), (8, 128, 128), (3, 96, 64)])
@pytest.mark.parametrize("kv", ["f4", "f2"])
@pytest.mark.parametrize("warps", ["4", "8"])
def test_attn_decode_of_a_batch(n, L, group, hd, vd, kv, warps, seed, monkeypatch) -> None:
    """n tokens at positions L-n .. L-1 through attn_decode (grid.z: a token each, its own causal length, partials
    and counters; decode_launches' split count and views), folded or with attn_combine as the dispatch rule picks
    (REFLEX_ATTN_WARPS too): against float64, the rows past the n tokens' outputs untouched, the same bits on a
    second launch."""
    monkeypatch.setenv("REFLEX_ATTN_WARPS", warps)
    rng = np.random.default_rng(seed)
    KVH = 2
    H, scale = KVH * group, 1.0 / np.sqrt(hd)
    q = rng.standard_normal((n, H, hd)).astype(np.float32)
    k = kv_values(rng.standard_normal((L, KVH, hd)).astype(np.float32), kv)
    v = kv_values(rng.standard_normal((L, KVH, vd)).astype(np.float32), kv)
    kc, vc = cache_with(k, L + 9, kv=kv), cache_with(v, L + 9, kv=kv)  # rows >= L are NaN and must not be read
    dq, pos = dev(q), dev(np.array([L - n]), np.int32)
    ref = attention64(q, k, v, L - n, scale)
    splits = 49
    part_o, part_ml = poisoned((H, splits, vd)), poisoned((H, splits, 2))
    tickets = ka.split_counters(dispatch.DECODE_TOKENS * H)
    out = poisoned((n + 1, H * vd))
    ctx = f"n={n} L={L} group={group} hd={hd}/{vd} {kv} warps={warps} seed {seed}"
    launches = ka.decode_launches(dq, kc, vc, pos, H, KVH, hd, vd, scale, part_o, part_ml, tickets, out, n)
    assert all(launch.grid[-1] == n for launch in launches if "attn_decode" in launch.name), ctx
    for launch in launches:
        run(launch)
    got = out.to_host()
    np.testing.assert_allclose(got[:n].reshape(n, H, vd), ref, rtol=1e-4, atol=3e-5, err_msg=ctx)
    assert np.isnan(got[n:]).all(), f"{ctx}: written past the n tokens"
    assert (tickets.to_host() == 0).all(), f"{ctx}: tickets not reset"
    for launch in launches:
        run(launch)
    assert np.array_equal(out.to_host(), got, equal_nan=True), f"{ctx}: a second launch differs"
    chosen = ka.attention_launches(dq, kc, vc, pos, n, H, KVH, hd, vd, scale, part_o, part_ml, tickets, out)
    assert [x.name for x in chosen] == [x.name for x in launches], ctx  # n <= DECODE_TOKENS: the decode form
    with pytest.raises(CudaError, match="tokens over partials"):
        ka.decode_launches(dq, kc, vc, pos, H, KVH, hd, vd, scale, part_o.view(0, (H, n - 1, vd)), part_ml, tickets,
                           out, n)  # fmt: skip


def test_attention_of_a_long_batch_takes_attn_prefill(monkeypatch) -> None:
    """Past DECODE_TOKENS one prefill launch: on tensor cores where dispatch.prefill_tc allows (sm_80 and later, by
    default, two key groups a block), attn_prefill with REFLEX_ATTN_TC=0."""
    monkeypatch.delenv("REFLEX_ATTN_TC_KEYS", raising=False)
    kc, vc, pos = DeviceArray.empty((64, 2, 64)), DeviceArray.empty((64, 2, 64)), dev(np.array([9]), np.int32)
    n, H = dispatch.DECODE_TOKENS + 1, 4
    q, out = DeviceArray.empty((n * H * 64,)), DeviceArray.empty((n * H * 64,))
    part_o, part_ml = DeviceArray.empty((H, 32, 64)), DeviceArray.empty((H, 32, 2))
    tickets = ka.split_counters(dispatch.DECODE_TOKENS * H)
    for setting in ("1", "0"):
        monkeypatch.setenv("REFLEX_ATTN_TC", setting)
        want = "attn_prefill_tc64_k2" if dispatch.prefill_tc(64, 64, driver.compute_major()) else "attn_prefill"
        assert setting == "1" or want == "attn_prefill"
        launches = ka.attention_launches(q, kc, vc, pos, n, H, 2, 64, 64, 0.125, part_o, part_ml, tickets, out)
        assert [launch.name.split(".")[-1] for launch in launches] == [want], setting


@pytest.mark.parametrize("n_splits, vd", [(1, 64), (7, 200), (32, 512), (64, 132)])
def test_attn_combine(n_splits: int, vd: int, seed: int) -> None:
    """Random partials (some splits empty: m = -inf, l = 0), vd not a multiple of 128: the weighted sum over the
    splits, normalised, against float64; the slack of out past H * vd keeps its poison."""
    rng = np.random.default_rng(seed)
    H = 5
    o = rng.standard_normal((H, n_splits, vd)).astype(np.float32)
    m = (3 * rng.standard_normal((H, n_splits))).astype(np.float32)
    l = rng.uniform(0.5, 4.0, (H, n_splits)).astype(np.float32)
    empty = rng.random((H, n_splits)) < 0.3
    empty[:, 0] = False  # split 0 always holds key 0
    m[empty], l[empty], o[empty] = -np.inf, 0.0, 0.0
    ml = np.stack([m, l], axis=-1)
    w = np.where(empty, 0.0, np.exp(m.astype(np.float64) - m.max(axis=1, keepdims=True)))
    ref = (w[..., None] * o).sum(axis=1) / (w * l).sum(axis=1)[:, None]
    out = poisoned((H * vd + 7,))
    run(ka.attn_combine(dev(o), dev(ml), H, n_splits, vd, out))
    got = out.to_host()
    np.testing.assert_allclose(got[: H * vd].reshape(H, vd), ref, rtol=1e-5, atol=1e-6, err_msg=f"seed {seed}")
    assert np.isnan(got[H * vd :]).all(), f"seed {seed}: written past H * vd"
    with pytest.raises(CudaError, match="splits"):
        ka.attn_combine(dev(o), dev(ml), H, 65, vd, out)


def test_attn_decode_bounds_the_folded_weights() -> None:
    """The folded combine keeps each head's split weights in attn_decode's shared memory: a grid whose heads x splits
    would not fit is refused (no model's dispatch asks for one: at most 7 heads a block, 396 splits)."""
    H, KVH, hd, splits = 7, 1, 64, ka.FOLD_FLOATS // 7
    q, kc, vc = DeviceArray.empty((H * hd,)), DeviceArray.empty((8, KVH, hd)), DeviceArray.empty((8, KVH, hd))
    pos, out, counters = dev(np.array([3]), np.int32), DeviceArray.empty((H * hd,)), ka.split_counters(KVH)
    part_o, part_ml = DeviceArray.empty((H, splits, hd)), DeviceArray.empty((H, splits, 2))
    ka.attn_decode(q, kc, vc, pos, H, KVH, hd, hd, 0.1, splits - 1, part_o, part_ml, counters, out)  # fits
    with pytest.raises(CudaError, match="folded combine"):
        ka.attn_decode(q, kc, vc, pos, H, KVH, hd, hd, 0.1, splits, part_o, part_ml, counters, out)


def test_decode_launches_follow_the_dispatch_rule(monkeypatch) -> None:
    """One block a kv head: one folded launch below 8 q heads a kv head, split partials and attn_combine from 8;
    REFLEX_ATTN_PARTS=shared: one folded launch, a kv head's q heads shared among blocks of at most 4."""
    kc, vc, pos = DeviceArray.empty((64, 2, 64)), DeviceArray.empty((64, 2, 64)), dev(np.array([9]), np.int32)
    for parts_env, group, names, grid_x in (("", 2, ["attn_decode"], 2), ("shared", 8, ["attn_decode"], 4),
                                            ("", 8, ["attn_decode", "attn_combine"], 2)):  # fmt: skip
        monkeypatch.setenv("REFLEX_ATTN_PARTS", parts_env)
        H = 2 * group
        q, out = DeviceArray.empty((H * 64,)), DeviceArray.empty((H * 64,))
        part_o, part_ml = DeviceArray.empty((H, 32, 64)), DeviceArray.empty((H, 32, 2))
        launches = ka.decode_launches(q, kc, vc, pos, H, 2, 64, 64, 0.125, part_o, part_ml, ka.split_counters(H), out)
        assert [launch.name.split(".")[-1] for launch in launches] == names, group
        assert launches[0].grid[0] == grid_x, group
    # REFLEX_ATTN_WARPS=8: attn_decode_w8 (256 threads) where a block scores at most 4 heads of at most 128 dims
    monkeypatch.setenv("REFLEX_ATTN_PARTS", "")
    monkeypatch.setenv("REFLEX_ATTN_WARPS", "8")
    for group, hd, name in ((2, 64, "attn_decode_w8"), (4, 128, "attn_decode_w8"), (6, 64, "attn_decode"),
                            (2, 256, "attn_decode")):  # fmt: skip
        H = 2 * group
        kc, vc = DeviceArray.empty((64, 2, hd)), DeviceArray.empty((64, 2, hd))
        q, out = DeviceArray.empty((H * hd,)), DeviceArray.empty((H * hd,))
        part_o, part_ml = DeviceArray.empty((H, 32, hd)), DeviceArray.empty((H, 32, 2))
        launches = ka.decode_launches(q, kc, vc, pos, H, 2, hd, hd, 0.125, part_o, part_ml, ka.split_counters(H), out)
        assert launches[0].name.split(".")[-1] == name and launches[0].block[0] == (256 if name.endswith("w8") else 128)
    with pytest.raises(CudaError, match="warps a block"):
        ka.attn_decode(q, kc, vc, pos, H, 2, 256, 256, 0.1, 32, part_o, part_ml, warps=8)


@pytest.mark.parametrize("L, group, hd, vd, n_splits", [(300, 3, 96, 96, 16), (129, 16, 128, 128, 8),
                                                         (77, 6, 256, 256, 32), (500, 12, 80, 80, 32),
                                                         (260, 4, 192, 128, 32), (64, 5, 128, 64, 3)])  # fmt: skip
def test_attn_decode_odd_shapes(L, group, hd, vd, n_splits, seed) -> None:
    check_decode(L, group, hd, vd, n_splits, seed)


PREFILL_CASES = [(n, pos0) for n in (1, 2, 31, 32, 33, 100, 300) for pos0 in (0, 45)] + [(17, 1000), (64, 300)]


@pytest.mark.parametrize("n, pos0", PREFILL_CASES)
@pytest.mark.parametrize("hd, vd, group", [(128, 128, 2), (64, 64, 1), (256, 256, 4), (96, 64, 8)])
@pytest.mark.parametrize("kv", ["f4", "f2"])
def test_attn_prefill(n: int, pos0: int, hd: int, vd: int, group: int, kv: str, seed: int) -> None:
    check_prefill(ka.attn_prefill, n, pos0, hd, vd, group, kv, seed)


@pytest.fixture
def tensor_cores() -> None:
    if driver.compute_major() < 8:
        pytest.skip("attn_prefill_tc needs sm_80 or later")


@pytest.mark.usefixtures("tensor_cores")
@pytest.mark.parametrize("n, pos0", [*PREFILL_CASES, (65, 0), (128, 7), (200, 2000)])
@pytest.mark.parametrize("hd, group", [(128, 2), (64, 1), (128, 8)])
@pytest.mark.parametrize("kv", ["f4", "f2"])
@pytest.mark.parametrize("key_groups", [1, 2])
def test_attn_prefill_tc(n: int, pos0: int, hd: int, group: int, kv: str, key_groups: int, seed: int) -> None:
    """The tensor-core form against the same float64 reference and tolerance as attn_prefill: its split tf32
    operands keep float32-level sums; with two key groups (8 warps, each half on half of every key tile, merged at
    the end) as with one."""
    check_prefill(functools.partial(ka.attn_prefill, tc=True, key_groups=key_groups), n, pos0, hd, hd, group, kv, seed)


@pytest.mark.usefixtures("tensor_cores")
def test_attn_prefill_tc_takes_its_head_dims_only_and_the_rule_picks_it(monkeypatch) -> None:
    kc, vc, pos = DeviceArray.empty((64, 2, 96)), DeviceArray.empty((64, 2, 96)), dev(np.array([9]), np.int32)
    n, H = dispatch.DECODE_TOKENS + 1, 4
    q, out = DeviceArray.empty((n * H * 96,)), DeviceArray.empty((n * H * 96,))
    with pytest.raises(CudaError, match="head dims 96/96"):
        ka.attn_prefill(q, kc, vc, pos, n, H, 2, 96, 96, 0.1, out, tc=True)
    part_o, part_ml = DeviceArray.empty((H, 32, 64)), DeviceArray.empty((H, 32, 2))
    tickets = ka.split_counters(dispatch.DECODE_TOKENS * H)
    monkeypatch.setenv("REFLEX_ATTN_TC", "1")
    monkeypatch.delenv("REFLEX_ATTN_TC_KEYS", raising=False)  # the default: two key groups, 8 warps a block
    for hd, name in ((64, "attn_prefill_tc64_k2"), (96, "attn_prefill")):
        launches = ka.attention_launches(q, kc, vc, pos, n, H, 2, hd, hd, 0.1, part_o, part_ml, tickets, out)
        assert [launch.name.split(".")[-1] for launch in launches] == [name]
    assert launches[0].block == (128, 1, 1)  # attn_prefill's
    monkeypatch.setenv("REFLEX_ATTN_TC_KEYS", "1")  # the one-key-group form: its entry point and 4 warps
    (launch,) = ka.attention_launches(q, kc, vc, pos, n, H, 2, 64, 64, 0.1, part_o, part_ml, tickets, out)
    assert (launch.name.split(".")[-1], launch.block) == ("attn_prefill_tc64", (128, 1, 1))
    with pytest.raises(CudaError, match="key groups 3"):
        ka.attn_prefill(q, kc, vc, pos, n, H, 2, 64, 64, 0.1, out, tc=True, key_groups=3)


def check_prefill(wrapper, n: int, pos0: int, hd: int, vd: int, group: int, kv: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    KVH = 2
    H, T, scale = KVH * group, pos0 + n, 1.0 / np.sqrt(hd)
    q = rng.standard_normal((n, H, hd)).astype(np.float32)
    k = kv_values(rng.standard_normal((T, KVH, hd)).astype(np.float32), kv)
    v = kv_values(rng.standard_normal((T, KVH, vd)).astype(np.float32), kv)
    kc, vc, out = cache_with(k, T + 40, kv=kv), cache_with(v, T + 40, kv=kv), poisoned((n, H, vd))
    dq, pos = dev(q), dev(np.array([pos0]), np.int32)
    run(wrapper(dq, kc, vc, pos, n, H, KVH, hd, vd, scale, out))
    assert np.array_equal(kc.to_host()[:T], k.astype(kc.to_host().dtype)), "the cache is read-only here"
    assert np.array_equal(vc.to_host()[:T], v.astype(vc.to_host().dtype)), "the cache is read-only here"
    ref = attention64(q, k, v, pos0, scale)
    ctx = f"n={n} pos0={pos0} hd={hd} vd={vd} group={group} {kv} seed {seed}"
    np.testing.assert_allclose(out.to_host(), ref, rtol=1e-4, atol=3e-5, err_msg=ctx)


# -- sampling --------------------------------------------------------------------------------------------------------


def device_pick(launch: driver.Launch, out: DeviceArray) -> int:
    run(launch)
    return int(out.to_host()[0])


@pytest.mark.parametrize("V", [1, 2, 1000, 151936, 262144])
def test_argmax_ties(V: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    logits = np.round(rng.standard_normal(V) * 2).astype(np.float32)  # integers: many equal maxima
    logits[rng.integers(V, size=3)] = logits.max()
    d, out = dev(logits), poisoned((1,), "i4")
    assert device_pick(ks.argmax(d, V, out), out) == int(np.argmax(logits)), f"seed {seed}"
    step = dev(np.array([5]), np.int32)  # the sampler's greedy path: same id, step still advances
    assert device_pick(ks.sample(d, V, 0.0, 0, 1.0, 1, step, out), out) == int(np.argmax(logits)), f"seed {seed}"
    assert device_pick(ks.sample(d, V, 0.8, 1, 1.0, 1, step, out), out) == int(np.argmax(logits)), f"seed {seed}"
    assert int(step.to_host()[0]) == 7


SAMPLE_CASES = [  # (V, temperature, top_k, top_p, logits): flat N(0, 3), flat with ties, or LM-like peaked
    (1000, 1.0, 0, 1.0, "flat"),
    (151936, 0.7, 0, 1.0, "flat"),
    (151936, 0.6, 20, 0.95, "flat"),
    (151936, 0.8, 0, 0.9, "flat"),
    (151936, 0.7, 0, 0.9, "peaked"),
    (151936, 0.6, 20, 0.95, "peaked"),
    (151936, 1.0, 0, 1.0, "peaked"),
    (151936, 1.0, 40, 1.0, "ties"),
    (262144, 1.3, 3000, 0.5, "ties"),
    (32000, 0.5, 0, 0.75, "ties"),
    (50, 2.0, 49, 0.999, "flat"),
]


def sample_logits(V: int, shape: str, rng: np.random.Generator) -> np.ndarray:
    logits = (rng.standard_normal(V) * 3.0).astype(np.float32)
    if shape == "ties":
        logits = np.round(logits * 2) / 2  # many equal values at every threshold
    if shape == "peaked":  # a few dozen likely tokens well above a broad tail, as real logits are
        logits = (rng.standard_normal(V) * 2.0).astype(np.float32)
        top = rng.choice(V, size=min(V, 40), replace=False)
        logits[top] += rng.uniform(6.0, 14.0, top.size).astype(np.float32)
    else:
        logits[rng.integers(V, size=4)] += 6.0
    return logits


@pytest.mark.parametrize("V, temperature, top_k, top_p, shape", SAMPLE_CASES)
def test_sample_matches_host(V, temperature, top_k, top_p, shape, seed) -> None:
    rng = np.random.default_rng(seed)
    logits = sample_logits(V, shape, rng)
    d, out, step = dev(logits), poisoned((1,), "i4"), DeviceArray.empty((1,), "i4")
    draws, same = 300, 0
    for i in range(draws):
        params = SamplingParams.make(temperature, top_k, top_p, seed=int(rng.integers(2**63)))
        s = int(rng.integers(0, 100000))
        step.copy_from_host(np.array([s], np.int32))
        got = device_pick(ks.sample(d, V, temperature, top_k, top_p, params.seed, step, out), out)
        assert 0 <= got < V and int(step.to_host()[0]) == s + 1, f"draw {i} seed {seed}"
        same += got == sample(logits, params, s)
    assert same >= 0.99 * draws, f"{same}/{draws} picks agree with engine.sampling.sample; seed {seed}"


def test_advance() -> None:
    pos = dev(np.array([41]), np.int32)
    run(ks.advance(pos, 1))
    run(ks.advance(pos, 7))
    assert int(pos.to_host()[0]) == 49

"""attention.cu's attn_decode_rope (engine/cuda/k_decode.py) on the GPU: one decode token's QK-norm, RoPE, K/V cache
write and split attention in one launch, against the two launches it replaces (norm_rope.cu's qk_rope_kv, then
attn_decode) bit for bit, and against float64 NumPy (the references of test_cuda_attention.py).

Fresh random inputs every run (ATTN_SEED=<seed> replays one); outputs and the cache rows from the token's position on
start as NaN bytes: the new row must be written, the ones after it left alone and never read.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from engine.cuda import dispatch
from engine.cuda import k_attention as ka
from engine.cuda import k_decode as kd
from engine.cuda import k_norm_rope as knr
from engine.cuda.memory import DeviceArray
from engine.errors import CudaError
from tests.test_cuda_attention import (  # noqa: F401 - context: the autouse fixture starting the CUDA context
    attention64,
    cache_with,
    context,
    dev,
    poisoned,
    rmsnorm64,
    rope64,
    run,
)

pytestmark = pytest.mark.gpu


@pytest.fixture
def seed() -> int:
    return int(os.environ.get("ATTN_SEED") or np.random.default_rng().integers(2**63))


# (L keys with the new one, q heads a kv head, KVH, hd, vd, rope_dim, neox, qk_norm, factors, YaRN)
CASES = [
    (1, 2, 8, 128, 128, 128, True, True, False, False),  # Qwen3-0.6B's grouping, first token
    (65, 8, 4, 128, 128, 128, True, True, False, False),  # Qwen3-30B-A3B's grouping
    (129, 8, 4, 128, 128, 128, True, True, False, False),  # the new key is the first of its split's tile
    (1000, 4, 2, 128, 128, 64, False, False, True, False),  # llama: no QK-norm, rope factors, partial rotary
    (300, 1, 3, 64, 64, 64, False, True, False, True),  # YaRN
    (77, 6, 2, 256, 256, 256, True, True, False, False),  # hd 256, passes of 4 heads
    (4096, 16, 1, 128, 128, 128, True, False, False, False),  # G * hd = ROPE_MAX_GQ, 16 heads in passes
    (33, 3, 2, 96, 64, 96, True, True, True, False),  # odd grouping, vd != hd
    (5000, 2, 2, 64, 64, 32, True, True, False, False),  # past 4096 keys: 157 a split
]


def cache(rows: np.ndarray, max_seq: int) -> DeviceArray:
    """A poisoned (max_seq, heads, d) cache holding rows at positions 0.. (none at all for the first token)."""
    return cache_with(rows, max_seq) if len(rows) else poisoned((max_seq, *rows.shape[1:]))


def two_launch(args: dict, fold: bool, min_chunk: int, n_splits: int):
    """out, k_cache, v_cache of qk_rope_kv then attn_decode (fold or partials + attn_combine)."""
    H, KVH, hd, vd = args["H"], args["KVH"], args["hd"], args["vd"]
    q, kc, vc = dev(args["q"]), cache(args["k_rows"], args["max_seq"]), cache(args["v_rows"], args["max_seq"])
    r = args["rope"]
    run(knr.qk_rope_kv(q, dev(args["k"]), dev(args["v"]), 1, H, KVH, hd, vd, r[0], r[1], r[2], r[3], r[4], r[5], r[6],
                      r[7], args["pos"], kc, vc, yarn=args["yarn"]))  # fmt: skip
    part_o, part_ml, out = poisoned((H, n_splits, vd)), poisoned((H, n_splits, 2)), poisoned((H, vd))
    if fold:
        run(ka.attn_decode(q, kc, vc, args["pos"], H, KVH, hd, vd, args["scale"], n_splits, part_o, part_ml,
                           ka.split_counters(KVH), out, min_chunk=min_chunk))  # fmt: skip
    else:
        run(ka.attn_decode(q, kc, vc, args["pos"], H, KVH, hd, vd, args["scale"], n_splits, part_o, part_ml,
                           min_chunk=min_chunk))  # fmt: skip
        run(ka.attn_combine(part_o, part_ml, H, n_splits, vd, out))
    return out.to_host(), kc.to_host(), vc.to_host()


def inputs(L, group, KVH, hd, vd, rope_dim, neox, qk_norm, factors, yarn, rng) -> dict:
    H, eps, theta = KVH * group, 1e-6, 1e6 if neox else 1e4
    norms = [rng.uniform(0.5, 1.5, hd).astype(np.float32) if qk_norm else None for _ in range(2)]
    ff = rng.uniform(1.0, 8.0, rope_dim // 2).astype(np.float32) if factors else None
    y = knr.Yarn(ext_factor=1.0, corr_lo=3.0, corr_hi=20.0, mscale=1.1) if yarn else knr.NO_YARN
    freq_scale = 0.25 if yarn else 1.0
    a = {"H": H, "KVH": KVH, "hd": hd, "vd": vd, "max_seq": L + 5, "scale": 1.0 / np.sqrt(hd), "yarn": y,
         "q": rng.standard_normal(H * hd).astype(np.float32), "k": rng.standard_normal(KVH * hd).astype(np.float32),
         "v": rng.standard_normal(KVH * vd).astype(np.float32), "pos": dev(np.array([L - 1]), np.int32),
         "k_rows": rng.standard_normal((L - 1, KVH, hd)).astype(np.float32),
         "v_rows": rng.standard_normal((L - 1, KVH, vd)).astype(np.float32), "host_norms": norms, "host_ff": ff,
         "theta": theta, "freq_scale": freq_scale}  # fmt: skip
    qn, kn, dff = (None if x is None else dev(x) for x in (*norms, ff))
    a["rope"] = (qn, kn, eps, rope_dim, theta, freq_scale, dff, neox)
    return a


def fused(a: dict, fold: bool, min_chunk: int, n_splits: int):
    """out, k_cache, v_cache, q of attn_decode_rope; the launch is run twice (as a graph replays it)."""
    H, KVH, hd, vd = a["H"], a["KVH"], a["hd"], a["vd"]
    q, kc, vc = dev(a["q"]), cache(a["k_rows"], a["max_seq"]), cache(a["v_rows"], a["max_seq"])
    part_o, part_ml, out = poisoned((H, n_splits, vd)), poisoned((H, n_splits, 2)), poisoned((H, vd))
    tickets = ka.split_counters(KVH) if fold else None
    k, v = dev(a["k"]), dev(a["v"])
    launch = kd.attn_decode_rope(q, k, v, *a["rope"], kc, vc, a["pos"], H, KVH, hd, vd, a["scale"], n_splits, part_o,
                                 part_ml, tickets, out if fold else None, min_chunk, yarn=a["yarn"])  # fmt: skip
    run(launch)
    if not fold:
        run(ka.attn_combine(part_o, part_ml, H, n_splits, vd, out))
    first = out.to_host()
    if fold:
        assert (tickets.to_host() == 0).all(), "tickets not reset"
        out.copy_from_host(np.full((H, vd), np.nan, np.float32))
        run(launch)
        assert np.array_equal(out.to_host(), first), "a second launch gave other bits"
    return first, kc.to_host(), vc.to_host(), q.to_host()


@pytest.mark.parametrize("L, group, KVH, hd, vd, rope_dim, neox, qk_norm, factors, yarn", CASES)
def test_attn_decode_rope_equals_two_launches(L, group, KVH, hd, vd, rope_dim, neox, qk_norm, factors, yarn, seed):
    rng = np.random.default_rng(seed)
    a = inputs(L, group, KVH, hd, vd, rope_dim, neox, qk_norm, factors, yarn, rng)
    for fold, min_chunk, n_splits in ((True, 128, 32), (True, 1, 32), (False, 1, 32), (False, 7, 5), (True, 1, 1)):
        ctx = (
            f"L={L} G={group} KVH={KVH} hd={hd} vd={vd} fold={fold} min_chunk={min_chunk} splits={n_splits} seed {seed}"
        )
        want = two_launch(a, fold, min_chunk, n_splits)
        out, kc, vc, q = fused(a, fold, min_chunk, n_splits)
        assert np.array_equal(out, want[0]), f"{ctx}: out differs from qk_rope_kv + attn_decode"
        assert np.array_equal(kc[:L].view(np.uint32), want[1][:L].view(np.uint32)), f"{ctx}: k_cache"
        assert np.array_equal(vc[:L].view(np.uint32), want[2][:L].view(np.uint32)), f"{ctx}: v_cache"
        assert (kc[L:].view(np.uint32) == 0xFFFFFFFF).all() and (vc[L:].view(np.uint32) == 0xFFFFFFFF).all(), ctx
        assert np.array_equal(q, a["q"]), f"{ctx}: q is left raw"
    # and against float64 (no YaRN there: rope64 is the plain formula)
    if not yarn:
        qn, kn = a["host_norms"]
        H = a["H"]
        q64 = a["q"].reshape(1, H, hd)
        k64 = a["k"].reshape(1, KVH, hd)
        if qk_norm:
            q64, k64 = rmsnorm64(q64, qn, 1e-6), rmsnorm64(k64, kn, 1e-6)
        at = np.array([L - 1])
        q64 = rope64(q64, at, rope_dim, a["theta"], a["freq_scale"], a["host_ff"], neox)
        k64 = rope64(k64, at, rope_dim, a["theta"], a["freq_scale"], a["host_ff"], neox)
        keys = np.concatenate([a["k_rows"], k64.astype(np.float64)])
        vals = np.concatenate([a["v_rows"], a["v"].reshape(1, KVH, vd)])
        ref = attention64(q64, keys, vals, L - 1, a["scale"])[0]
        atol = 3e-5 + 2e-6 * L  # float32 angles err in proportion to the position (test_qk_rope_kv)
        np.testing.assert_allclose(out, ref, rtol=1e-4, atol=atol, err_msg=f"seed {seed}")


def test_decode_rope_launches_follow_the_rules(monkeypatch) -> None:
    """One launch (folded, G < 8), two (split + attn_combine, G >= 8); the two-launch preamble where the q heads of a
    kv head exceed ROPE_MAX_GQ or REFLEX_ROPE_FOLD=0."""
    KVH = 2

    def names(group: int, hd: int = 64) -> list[str]:
        H = KVH * group
        kc, vc, pos = DeviceArray.empty((64, KVH, hd)), DeviceArray.empty((64, KVH, hd)), dev(np.array([9]), np.int32)
        q, out = DeviceArray.empty((H * hd,)), DeviceArray.empty((H * hd,))
        k, v = DeviceArray.empty((KVH * hd,)), DeviceArray.empty((KVH * hd,))
        part_o, part_ml = DeviceArray.empty((H, 32, hd)), DeviceArray.empty((H, 32, 2))
        launches = kd.decode_rope_launches(q, k, v, None, None, 1e-6, hd, 1e4, 1.0, None, True, kc, vc, pos, H, KVH,
                                           hd, hd, 0.125, part_o, part_ml, ka.split_counters(KVH), out)  # fmt: skip
        return [launch.name.split(".")[-1] for launch in launches]

    assert names(2) == ["attn_decode_rope"]
    assert names(8) == ["attn_decode_rope", "attn_combine"]
    assert dispatch.rope_in_attention(16, 1, 128) and not dispatch.rope_in_attention(16, 1, 256)
    assert names(16, 256) == ["qk_rope_kv", "attn_decode", "attn_combine"]
    monkeypatch.setenv("REFLEX_ROPE_FOLD", "0")
    assert names(2) == ["qk_rope_kv", "attn_decode"]


def test_attn_decode_rope_refusals() -> None:
    hd, KVH, H = 256, 1, 16  # 16 heads of 256 a kv head: 4096 values of q in shared memory, past ROPE_MAX_GQ
    kc, vc, pos = DeviceArray.empty((8, KVH, hd)), DeviceArray.empty((8, KVH, hd)), dev(np.array([0]), np.int32)
    q, k, v = DeviceArray.empty((H * hd,)), DeviceArray.empty((KVH * hd,)), DeviceArray.empty((KVH * hd,))
    part_o, part_ml = DeviceArray.empty((H, 32, hd)), DeviceArray.empty((H, 32, 2))
    with pytest.raises(CudaError, match="exceed"):
        kd.attn_decode_rope(q, k, v, None, None, 1e-6, hd, 1e4, 1.0, None, True, kc, vc, pos, H, KVH, hd, hd, 0.1, 32,
                            part_o, part_ml)  # fmt: skip
    with pytest.raises(CudaError, match="rope_dim"):
        kd.attn_decode_rope(q, k, v, None, None, 1e-6, 7, 1e4, 1.0, None, True, kc, vc, pos, 4, KVH, hd, hd, 0.1, 32,
                            part_o, part_ml)  # fmt: skip

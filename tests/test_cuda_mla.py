"""kernels/mla.cu and norm_rope.cu's MLA and YaRN paths on the GPU against float64 NumPy references written from
engine/models/mla.py and engine/cpu/ops.py, at the fixture's sizes (latent 64, rope 16, 4 heads) and DeepSeek's real
ones (latent 512, rope 64, nope 128, v 128; 16 heads here).

Fresh random inputs every run; the seed is in every failure message (MLA_SEED=<seed> replays one). Outputs are
poisoned with NaN bytes first; slack past the written elements (head padding, cache rows outside the batch) must come
back unchanged. The rope-parameter and kq-scale checks at the end need no GPU.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

from engine.config import ModelConfig, RopeScaling
from engine.cpu import ops
from engine.cpu.dequant import dequantize
from engine.cuda import driver, memory
from engine.cuda import k_attention as ka
from engine.cuda import k_mla as kmla
from engine.cuda import k_norm_rope as knr
from engine.cuda.memory import DeviceArray, DeviceWeight
from engine.models import mla
from engine.quants import BLOCK_SIZES, KERNEL_TAGS, GGMLType, row_bytes
from tests.quant_data import random_weights

gpu = pytest.mark.gpu
FIXTURE = dict(H=4, R=64, P=16, nope=32, v=32)
REAL = dict(H=16, R=512, P=64, nope=128, v=128)
TOKENS = [1, 2, 8, 9, 100]
NO_SCALING = RopeScaling()
# deepseek2-style YaRN (V2/V3 configs: factor 40 over a 4096 context, mscale_all_dim 1) and a qwen3 128K-style one.
DEEPSEEK_YARN = dict(arch="deepseek2", factor=40.0, orig=4096, log_mul=0.1, theta=10000.0)
QWEN3_YARN = dict(arch="qwen3", factor=4.0, orig=32768, log_mul=None, theta=1e6)


@pytest.fixture
def seed() -> int:
    return int(os.environ.get("MLA_SEED") or np.random.default_rng().integers(2**63))


def dev(a: np.ndarray, dtype=np.float32) -> DeviceArray:
    return DeviceArray.from_host(np.ascontiguousarray(a, dtype=dtype))


def poisoned(shape: tuple[int, ...], dtype: str = "f4") -> DeviceArray:
    a = DeviceArray.empty(shape, dtype)
    a.fill_byte(0xFF)  # float32 NaN
    return a


def run(*launches: driver.Launch) -> None:
    driver.start_context(0)
    for launch in launches:
        launch(0)
    memory.synchronize(0)


def is_poison(a: np.ndarray) -> bool:
    """Every element still holds the 0xFF bytes poisoned() wrote (f32 or f16)."""
    a = np.ascontiguousarray(a)
    return bool((a.view(np.uint8) == 0xFF).all())


def f16_rounded(a: np.ndarray) -> np.ndarray:
    """What an f16 cache holds of a (round to nearest even), as float32."""
    return a.astype(np.float16).astype(np.float32)


def yarn_scaling(arch: str, factor: float, orig: int, log_mul: float | None, theta: float) -> RopeScaling:
    """The RopeScaling ModelConfig reads from such a file's metadata."""
    md = {"general.architecture": arch, f"{arch}.embedding_length": 64, f"{arch}.attention.head_count": 4,
          f"{arch}.block_count": 1, f"{arch}.vocab_size": 8, f"{arch}.rope.freq_base": theta,
          f"{arch}.rope.scaling.type": "yarn", f"{arch}.rope.scaling.factor": factor,
          f"{arch}.rope.scaling.original_context_length": orig}  # fmt: skip
    if log_mul is not None:
        md[f"{arch}.rope.scaling.yarn_log_multiplier"] = log_mul
    if arch == "deepseek2":
        md |= {"deepseek2.attention.key_length": 64 + 64, "deepseek2.attention.key_length_mla": 192,
               "deepseek2.attention.value_length_mla": 128, "deepseek2.attention.kv_lora_rank": 64,
               "deepseek2.rope.dimension_count": 64, "deepseek2.expert_count": 4, "deepseek2.expert_used_count": 2,
               "deepseek2.expert_feed_forward_length": 32, "deepseek2.leading_dense_block_count": 1}  # fmt: skip
    return ModelConfig.from_gguf(md).rope_scaling


def rope64(x: np.ndarray, positions: np.ndarray, rope_dim: int, theta: float, s: RopeScaling, neox: bool = False):
    """x (n, heads, >= rope_dim) with its first rope_dim dims rotated by ops.rope_angles' cos/sin, in float64."""
    cos, sin = ops.rope_angles(positions, rope_dim, theta, s)
    return ops.apply_rope(x.astype(np.float64), cos.astype(np.float64), sin.astype(np.float64),
                          "neox" if neox else "norm")  # fmt: skip


# -- per-head matvec (attn_k_b / attn_v_b) -----------------------------------------------------------------------------

HEAD_CASES = {  # name: (H, rows per head, K): absorption (R, nope) and decompression (v, R) at both sizes
    "k_b-fixture": (4, 64, 32),
    "v_b-fixture": (4, 32, 64),
    "k_b-real": (16, 512, 128),
    "v_b-real": (16, 128, 512),
    "k_b-v3": (128, 512, 128),  # DeepSeek V3's 128 heads
    "odd": (3, 13, 96),  # rows a head not a multiple of 8 (the warp kernel's last block), groups not of 32 lanes
}


def check_head_matvec(t: GGMLType, case: str, n: int, seed: int) -> None:
    H, R, K = HEAD_CASES[case]
    rng = np.random.default_rng(seed)
    raw = random_weights(rng, t, (H * R, K))
    w64 = dequantize(raw, t, (H * R, K)).astype(np.float64).reshape(H, R, K)
    w_dev = dev(raw, np.uint8)
    w = DeviceWeight(w_dev.ptr, t, H * R, K, row_bytes(t, K), f"{case}-{t.name}")
    x_head, y_head = K + 8, R + 4  # padded heads, as q (nope + rope) and qa (R + rope) are
    x = rng.standard_normal((n, H, x_head)).astype(np.float32)
    ref = np.einsum("hrk,thk->thr", w64, x[..., :K].astype(np.float64))
    tol = 1e-5 * np.einsum("hrk,thk->thr", np.abs(w64), np.abs(x[..., :K])) + 1e-30
    for warp in (True, False) if n == 1 else (True,):  # one token: the warp-a-row kernel and the thread-a-row one
        y = poisoned((n, H, y_head))
        launch = kmla.head_matvec(w, H, dev(x), H * x_head, x_head, n, y, H * y_head, y_head, warp=warp)
        assert launch.name.endswith("_w") == (n == 1 and warp), launch.name
        run(launch)
        got = y.to_host()
        ctx = f"{t.name} {case} n={n} warp={warp} seed {seed}"
        assert not np.isnan(got[..., :R]).any(), f"{ctx}: unwritten outputs"
        assert (np.abs(got[..., :R] - ref) <= tol).all(), f"{ctx}: max error {np.abs(got[..., :R] - ref).max():.3g}"
        assert is_poison(got[..., R:]), f"{ctx}: written past a head's rows"


@gpu
@pytest.mark.parametrize("case", list(HEAD_CASES))
@pytest.mark.parametrize("n", TOKENS)
@pytest.mark.parametrize("t", [GGMLType.F32, GGMLType.Q8_0])
def test_head_matvec(t: GGMLType, case: str, n: int, seed: int) -> None:
    check_head_matvec(t, case, n, seed)


@gpu
@pytest.mark.parametrize("t", sorted({GGMLType(t) for t in KERNEL_TAGS} - {GGMLType.F32, GGMLType.Q8_0}))
@pytest.mark.parametrize("n", [1, 9])
def test_head_matvec_every_type(t: GGMLType, n: int, seed: int) -> None:
    check_head_matvec(t, "v_b-real", n, seed)  # K = 512: whole blocks of every type
    if HEAD_CASES["k_b-real"][2] % BLOCK_SIZES[t][0] == 0:  # K = 128: half a block of the 256-value types
        check_head_matvec(t, "k_b-real", n, seed)


# -- latent norm + RoPE + cache row (mla_kv_rope) --------------------------------------------------------------------


@gpu
@pytest.mark.parametrize("size", ["fixture", "real"])
@pytest.mark.parametrize("n, pos0", [(1, 0), (2, 5), (9, 37), (100, 1000)])
@pytest.mark.parametrize("scaling", ["none", "deepseek-yarn"])
@pytest.mark.parametrize("kv", ["f4", "f2"])
def test_mla_kv_rope(size: str, n: int, pos0: int, scaling: str, kv: str, seed: int) -> None:
    d = FIXTURE if size == "fixture" else REAL
    H, R, P, nope = d["H"], d["R"], d["P"], d["nope"]
    D, max_seq, eps, theta = R + P, pos0 + n + 3, 1e-6, 10000.0
    s = NO_SCALING if scaling == "none" else yarn_scaling(**DEEPSEEK_YARN)
    rng = np.random.default_rng(seed)
    kva = rng.standard_normal((n, D)).astype(np.float32) * 3
    kv_norm = rng.uniform(0.5, 1.5, R).astype(np.float32)
    q = rng.standard_normal((n, H, nope + P)).astype(np.float32)
    qa, cache, pos = poisoned((n, H, D)), poisoned((max_seq, D), kv), dev(np.array([pos0]), np.int32)
    freq_scale, yarn = knr.rope_scaling(P, theta, s)
    run(knr.mla_kv_rope(dev(kva), dev(kv_norm), eps, dev(q), qa, n, H, R, P, nope, theta, freq_scale, pos, cache,
                        yarn=yarn))  # fmt: skip

    positions = np.arange(pos0, pos0 + n)
    c = kva[:, :R].astype(np.float64)
    c_ref = c / np.sqrt(np.mean(c * c, axis=-1, keepdims=True) + eps) * kv_norm
    kpe_ref = rope64(kva[:, None, R:], positions, P, theta, s)[:, 0]
    qpe_ref = rope64(q[..., nope:], positions, P, theta, s)
    ctx = f"{size} n={n} pos0={pos0} {scaling} {kv} seed {seed}"
    got_cache, got_qa = cache.to_host(), qa.to_host()
    # float32 angles err in proportion to the position (as for qk_rope_kv); the magnitude mscale scales errors too.
    # An f16 row is the float32 one rounded once: half a unit in the last place (2^-11 relative) more.
    atol = 3.0 * max(1.0, s.mscale) * (2e-5 + 2e-6 * (pos0 + n))
    rtol = 2.0**-11 if kv == "f2" else 0.0
    rows = got_cache[pos0 : pos0 + n].astype(np.float32)
    np.testing.assert_allclose(rows[:, :R], c_ref, rtol=1e-5 + rtol, atol=1e-5, err_msg=ctx)
    np.testing.assert_allclose(rows[:, R:], kpe_ref, rtol=rtol, atol=atol, err_msg=ctx)
    np.testing.assert_allclose(got_qa[..., R:], qpe_ref, rtol=0, atol=atol, err_msg=ctx)
    assert is_poison(got_qa[..., :R]), f"{ctx}: wrote the absorbed half of qa"
    assert is_poison(got_cache[np.r_[0:pos0, pos0 + n : max_seq]]), f"{ctx}: cache written outside the batch"


# -- absorbed attention (mla_attn, + attn_combine for decode) ----------------------------------------------------------


def attention64(qa: np.ndarray, rows: np.ndarray, R: int, pos0: int, scale: float) -> np.ndarray:
    """qa (n, H, D) at positions pos0.., rows (T, D) -> (n, H, R): MQA with K = rows, V = rows[:, :R]."""
    n, T = qa.shape[0], rows.shape[0]
    s = np.einsum("nhd,td->nht", qa.astype(np.float64), rows.astype(np.float64)) * scale
    s[np.broadcast_to(np.arange(T)[None, None, :] > (pos0 + np.arange(n))[:, None, None], s.shape)] = -np.inf
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return np.einsum("nht,tr->nhr", p / p.sum(axis=-1, keepdims=True), rows[:, :R].astype(np.float64))


@gpu
@pytest.mark.parametrize("size", ["fixture", "real"])
@pytest.mark.parametrize("n, pos0", [(1, 0), (1, 3), (1, 40), (1, 2999), (2, 0), (8, 11), (9, 300), (100, 0),
                                     (100, 157)])  # fmt: skip
@pytest.mark.parametrize("kv", ["f4", "f2"])
def test_mla_attn(size: str, n: int, pos0: int, kv: str, seed: int) -> None:
    d = FIXTURE if size == "fixture" else REAL
    H, R, P = d["H"], d["R"], d["P"]
    D, T, scale = R + P, pos0 + n, 1.0 / math.sqrt(d["nope"] + P)
    rng = np.random.default_rng(seed)
    qa = rng.standard_normal((n, H, D)).astype(np.float32)
    rows = rng.standard_normal((T, D)).astype(np.float32)
    if kv == "f2":  # the kernel reads the rounded rows exactly: the reference takes the same values
        rows = f16_rounded(rows)
    cache = poisoned((T + 9, D), kv)  # rows >= T are NaN and must not be read
    cache.view(0, rows.shape).copy_from_host(rows)
    pos = dev(np.array([pos0]), np.int32)
    out = poisoned((n, H, R))
    ctx = f"{size} n={n} pos0={pos0} {kv} seed {seed}"
    if n == 1:
        for n_splits in (1, 5, 32):
            part_o, part_ml = poisoned((H, n_splits, R)), poisoned((H, n_splits, 2))
            if n_splits == 1:
                run(kmla.attn(dev(qa), cache, pos, 1, H, R, P, scale, 1, None, None, out))
            else:
                run(kmla.attn(dev(qa), cache, pos, 1, H, R, P, scale, n_splits, part_o, part_ml, None),
                    ka.attn_combine(part_o, part_ml, H, n_splits, R, out))  # fmt: skip
                assert not np.isnan(part_ml.to_host()).any(), f"{ctx} splits={n_splits}: unwritten partials"
            np.testing.assert_allclose(out.to_host(), attention64(qa, rows, R, pos0, scale), rtol=1e-4, atol=3e-5,
                                       err_msg=f"{ctx} splits={n_splits}")  # fmt: skip
    else:
        run(kmla.attn(dev(qa), cache, pos, n, H, R, P, scale, 1, None, None, out))
        np.testing.assert_allclose(out.to_host(), attention64(qa, rows, R, pos0, scale), rtol=1e-4, atol=3e-5,
                                   err_msg=ctx)  # fmt: skip


@gpu
@pytest.mark.parametrize("n, pos0", [(1, 700), (9, 40)])
def test_mla_attn_v3_heads(n: int, pos0: int, seed: int) -> None:
    """DeepSeek V3's 128 heads over the real latent sizes: 16 head groups, decode through 32 key splits."""
    rng = np.random.default_rng(seed)
    H, R, P, n_splits = 128, 512, 64, 32 if n == 1 else 1
    qa = rng.standard_normal((n, H, R + P)).astype(np.float32)
    rows = rng.standard_normal((pos0 + n, R + P)).astype(np.float32)
    out, part_o, part_ml = poisoned((n, H, R)), poisoned((n, H, n_splits, R)), poisoned((n, H, n_splits, 2))
    pos, scale = dev(np.array([pos0]), np.int32), 1.0 / math.sqrt(192)
    if n == 1:
        run(kmla.attn(dev(qa), dev(rows), pos, 1, H, R, P, scale, n_splits, part_o, part_ml, None),
            ka.attn_combine(part_o, part_ml, H, n_splits, R, out))  # fmt: skip
    else:
        run(kmla.attn(dev(qa), dev(rows), pos, n, H, R, P, scale, 1, None, None, out))
    np.testing.assert_allclose(out.to_host(), attention64(qa, rows, R, pos0, scale), rtol=1e-4, atol=3e-5,
                               err_msg=f"n={n} pos0={pos0} seed {seed}")  # fmt: skip


@gpu
def test_mla_attn_heads_not_a_multiple_of_the_block(seed: int) -> None:
    """12 heads: the second block of 8 has 4 padding heads, which must write nothing."""
    rng = np.random.default_rng(seed)
    H, R, P, n, pos0 = 12, 128, 32, 3, 20
    qa = rng.standard_normal((n, H, R + P)).astype(np.float32)
    rows = rng.standard_normal((pos0 + n, R + P)).astype(np.float32)
    out = poisoned((n + 1, H, R))  # one spare row past the batch: must stay poisoned
    run(kmla.attn(dev(qa), dev(rows), dev(np.array([pos0]), np.int32), n, H, R, P, 0.1, 1, None, None, out))
    got = out.to_host()
    np.testing.assert_allclose(got[:n], attention64(qa, rows, R, pos0, 0.1), rtol=1e-4, atol=3e-5, err_msg=str(seed))
    assert is_poison(got[n:])


# -- YaRN in qk_rope_kv ------------------------------------------------------------------------------------------------


@gpu
@pytest.mark.parametrize("config", ["deepseek", "qwen3"])
@pytest.mark.parametrize("n, pos0", [(1, 0), (9, 100), (100, 2000)])
def test_qk_rope_kv_yarn(config: str, n: int, pos0: int, seed: int) -> None:
    c = DEEPSEEK_YARN if config == "deepseek" else QWEN3_YARN
    s = yarn_scaling(**c)
    hd, rope_dim, neox = (64, 64, False) if config == "deepseek" else (128, 128, True)
    H, KVH, vd, max_seq, theta = 4, 2, 64, pos0 + n + 2, c["theta"]
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((n, H, hd)).astype(np.float32)
    k = rng.standard_normal((n, KVH, hd)).astype(np.float32)
    v = rng.standard_normal((n, KVH, vd)).astype(np.float32)
    dq, kc, vc, pos = (
        dev(q),
        poisoned((max_seq, KVH, hd)),
        poisoned((max_seq, KVH, vd)),
        dev(np.array([pos0]), np.int32),
    )
    freq_scale, yarn = knr.rope_scaling(rope_dim, theta, s)
    assert yarn.ext_factor == 1.0 and freq_scale == 1.0 / c["factor"]
    run(knr.qk_rope_kv(dq, dev(k), dev(v), n, H, KVH, hd, vd, None, None, 1e-6, rope_dim, theta, freq_scale, None,
                       neox, pos, kc, vc, yarn=yarn))  # fmt: skip
    positions = np.arange(pos0, pos0 + n)
    atol = 3.0 * s.mscale * (2e-5 + 2e-6 * (pos0 + n))
    ctx = f"{config} n={n} pos0={pos0} seed {seed}"
    np.testing.assert_allclose(dq.to_host(), rope64(q, positions, rope_dim, theta, s, neox), rtol=0, atol=atol,
                               err_msg=ctx)  # fmt: skip
    np.testing.assert_allclose(kc.to_host()[pos0 : pos0 + n], rope64(k, positions, rope_dim, theta, s, neox), rtol=0,
                               atol=atol, err_msg=ctx)  # fmt: skip


# -- no GPU: the kernels' rope parameters and kq scale are the NumPy backend's -----------------------------------------


@pytest.mark.parametrize("config", [DEEPSEEK_YARN, QWEN3_YARN], ids=["deepseek", "qwen3"])
@pytest.mark.parametrize("rope_dim", [16, 64, 128])
def test_rope_scaling_matches_ops(config: dict, rope_dim: int) -> None:
    s = yarn_scaling(**config)
    freq_scale, yarn = knr.rope_scaling(rope_dim, config["theta"], s)
    assert (yarn.corr_lo, yarn.corr_hi) == ops.yarn_corr_dims(rope_dim, config["theta"], s)
    assert freq_scale == 1.0 / s.factor and yarn.mscale == s.mscale and yarn.ext_factor == 1.0
    # The kernel's angle formula (float64 here) reproduces ops.rope_angles.
    i = np.arange(rope_dim // 2)
    inv = config["theta"] ** (-2.0 * i / rope_dim)
    mix = yarn.ext_factor * (1 - np.clip((i - yarn.corr_lo) / max(0.001, yarn.corr_hi - yarn.corr_lo), 0, 1))
    p = np.array([0, 1, 17, 4000])
    a = p[:, None] * (inv * freq_scale * (1 - mix) + inv * mix)
    cos, sin = ops.rope_angles(p, rope_dim, config["theta"], s)
    np.testing.assert_allclose(yarn.mscale * np.cos(a), cos, atol=2e-6)
    np.testing.assert_allclose(yarn.mscale * np.sin(a), sin, atol=2e-6)


def test_rope_scaling_none_and_linear_are_plain() -> None:
    assert knr.rope_scaling(64, 1e4, RopeScaling()) == (1.0, knr.NO_YARN)
    assert knr.rope_scaling(64, 1e4, RopeScaling(kind="linear", factor=4.0)) == (0.25, knr.NO_YARN)


@pytest.mark.parametrize("yarn", [False, True])
def test_kq_scale_matches_the_numpy_model(yarn: bool) -> None:
    from engine.models import mla_cuda

    md = {"general.architecture": "deepseek2", "deepseek2.embedding_length": 64, "deepseek2.block_count": 1,
          "deepseek2.attention.head_count": 4, "deepseek2.vocab_size": 8, "deepseek2.attention.key_length": 80,
          "deepseek2.attention.key_length_mla": 48, "deepseek2.attention.value_length_mla": 32,
          "deepseek2.attention.kv_lora_rank": 64, "deepseek2.rope.dimension_count": 16,
          "deepseek2.expert_count": 4, "deepseek2.expert_used_count": 2,
          "deepseek2.expert_feed_forward_length": 32,
          "deepseek2.leading_dense_block_count": 1}  # fmt: skip
    if yarn:
        md |= {"deepseek2.rope.scaling.type": "yarn", "deepseek2.rope.scaling.factor": 40.0,
               "deepseek2.rope.scaling.original_context_length": 4096,
               "deepseek2.rope.scaling.yarn_log_multiplier": 0.0707}  # fmt: skip
    cfg = ModelConfig.from_gguf(md)
    assert math.isclose(mla_cuda.kq_scale(cfg), mla.kq_scale(cfg), rel_tol=1e-12)

"""matvec3_rope (kernels/matvec.cu): one token's q/k/v matvec3 and qk_rope_kv in one launch. Held bit for bit to
the two launches it replaces (each tested against NumPy in test_cuda_matvec.py / test_cuda_attention.py), on fresh
random inputs, with every output and cache poisoned, over two steps (the tickets must come back to zero); and a
model's greedy decode with and without it."""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest

from engine.cuda import driver, memory
from engine.cuda import k_attention as ka
from engine.cuda import k_matvec as km
from engine.cuda import k_norm_rope as knr
from engine.cuda.memory import DeviceArray, DeviceWeight
from engine.errors import CudaError
from engine.quants import GGMLType
from tests import cuda_util as cu
from tests.cuda_util import Weight

Q4, Q6, Q8, Q5_0 = GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q8_0, GGMLType.Q5_0

# (q/k type, v type, H, KVH, hd, vd, K, rope_dim, neox, qk_norm, factors, yarn, pos0)
CASES = [
    (Q4, Q6, 16, 8, 128, 128, 1024, 128, True, True, False, False, 0),  # Qwen3-0.6B's layer
    (Q4, Q4, 32, 8, 128, 128, 2048, 128, True, True, False, True, 4000),
    (Q8, Q8, 8, 2, 64, 72, 512, 64, False, False, True, False, 37),
    (Q6, Q6, 4, 4, 256, 256, 768, 64, False, True, False, True, 3000),
    (Q5_0, Q5_0, 6, 2, 96, 80, 256, 96, True, True, True, False, 1),
]
IDS = [f"{a.name}+{b.name}-{H}x{hd}-{KVH}x{vd}-K{K}" for a, b, H, KVH, hd, vd, K, *_ in CASES]


@pytest.fixture(scope="module")
def context() -> None:  # for the GPU tests only: the rule's test runs where there is no GPU
    driver.start_context(0)


@pytest.fixture
def seed() -> int:
    return int(os.environ.get("QKV_ROPE_SEED") or np.random.default_rng().integers(2**63))


def poisoned(shape: tuple[int, ...], dtype: str = "f4") -> DeviceArray:
    a = DeviceArray.empty(shape, dtype)
    a.fill_byte(0xFF)  # float32 / float16 NaN
    return a


def dev(a: np.ndarray, dtype=np.float32) -> DeviceArray:
    return DeviceArray.from_host(np.ascontiguousarray(a, dtype=dtype))


def run(*launches: driver.Launch) -> None:
    for launch in launches:
        launch(0)
    memory.synchronize(0)


@pytest.mark.gpu
@pytest.mark.usefixtures("context")
@pytest.mark.parametrize("kv", ["f4", "f2"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_matvec3_rope_equals_matvec3_then_qk_rope_kv(case: tuple, kv: str, seed: int, monkeypatch) -> None:
    ta, tb, H, KVH, hd, vd, K, rope_dim, neox, qk_norm, use_factors, use_yarn, pos0 = case
    monkeypatch.setenv("REFLEX_MATVEC_I16", "1")
    rng = np.random.default_rng(seed)
    ws = [Weight(rng, ta, H * hd, K), Weight(rng, ta, KVH * hd, K), Weight(rng, tb, KVH * vd, K)]
    wd = [w.dev for w in ws]
    assert knr.rope_folds(wd, hd)
    norm_w = dev(1.0 + 0.2 * rng.standard_normal(K))
    qn, kn = (dev(rng.uniform(0.5, 1.5, hd)) for _ in range(2)) if qk_norm else (None, None)
    factors = dev(rng.uniform(1.0, 8.0, rope_dim // 2)) if use_factors else None
    yarn = knr.Yarn(ext_factor=1.0, corr_lo=3.0, corr_hi=20.0, mscale=1.1) if use_yarn else knr.NO_YARN
    theta, freq_scale, eps, max_seq = (1e6, 0.25, 1e-6, pos0 + 4)
    tickets = ka.split_counters(H + KVH)
    caches = {path: (poisoned((max_seq, KVH, hd), kv), poisoned((max_seq, KVH, vd), kv)) for path in ("one", "two")}
    for step in range(2):  # the second launch finds the tickets the first left
        x = dev(rng.standard_normal((1, K)))
        pos = dev(np.array([pos0 + step]), np.int32)
        out = {path: [poisoned((1, H * hd + 3)), poisoned((1, KVH * hd + 3)), poisoned((1, KVH * vd + 3))]
               for path in ("one", "two")}  # fmt: skip
        rope = (qn, kn, eps, rope_dim, theta, freq_scale, factors, neox, pos)
        q, k, v = out["one"]
        fused = knr.matvec3_rope(wd, x, norm_w, eps, q, k, v, H, KVH, hd, vd, *rope, *caches["one"], tickets,
                                 yarn=yarn)  # fmt: skip
        assert fused.name.startswith("matvec.matvec3_rope16_"), fused.name
        run(fused)
        q2, k2, v2 = out["two"]
        run(km.matvec3(wd, x, [q2, k2, v2], norm_w=norm_w, eps=eps),
            knr.qk_rope_kv(q2, k2, v2, 1, H, KVH, hd, vd, *rope, *caches["two"], yarn=yarn))  # fmt: skip
        ctx = f"{fused.name} step {step} seed {seed}"
        for name, a, b in zip("qkv", out["one"], out["two"], strict=True):
            got, want = a.to_host(), b.to_host()
            assert not np.isnan(want[0, :-3]).any(), f"{ctx}: the two launches left {name} unwritten"
            np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), err_msg=f"{ctx}: {name}")
        for name, a, b in zip(("k_cache", "v_cache"), caches["one"], caches["two"], strict=True):
            got, want = a.to_host(), b.to_host()  # every position: those not written still poisoned in both
            np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8), err_msg=f"{ctx}: {name}")
        assert not (tickets.to_host() != 0).any(), f"{ctx}: tickets left {tickets.to_host().tolist()}"


def test_rope_folds_takes_the_16_bit_matvec3_and_whole_row_blocks(monkeypatch) -> None:
    monkeypatch.setenv("REFLEX_MATVEC_I16", "1")

    def w(t: GGMLType, rows: int, cols: int = 1024) -> DeviceWeight:
        return DeviceWeight(0x1000, t, rows, cols, 144 * cols // 256, "w")

    assert knr.rope_folds([w(Q4, 2048), w(Q4, 1024), w(Q6, 1024)], 128)
    assert not knr.rope_folds([w(Q4, 2048), w(Q6, 1024), w(Q4, 1024)], 128)  # v's type last
    assert not knr.rope_folds([w(Q4, 2048), w(Q4, 1024)], 128)  # no v
    assert not knr.rope_folds([w(Q4, 2048), w(Q4, 1024, 512), w(Q4, 1024)], 128)  # widths differ
    assert not knr.rope_folds([w(GGMLType.Q5_K, 2048)] * 3, 128)  # no 16-bit form
    assert not knr.rope_folds([w(Q4, 2052), w(Q4, 1026), w(Q4, 1026)], 102)  # a head splits a row block
    assert not knr.rope_folds([w(Q4, 2048)] * 3, 512)  # past MAX_HEAD_DIM
    monkeypatch.setenv("REFLEX_MATVEC_I16", "0")
    assert not knr.rope_folds([w(Q4, 2048), w(Q4, 1024), w(Q6, 1024)], 128)
    monkeypatch.setenv("REFLEX_MATVEC_I16", "1")
    x, y = DeviceArray(0x2000, (1, 1024), "f4", False), DeviceArray(0x3000, (1, 2048), "f4", False)
    pos, cache = DeviceArray(0x4000, (1,), "i4", False), DeviceArray(0x5000, (64, 8, 128), "f4", False)
    t = DeviceArray(0x6000, (24,), "i4", False)
    rope = (None, None, 1e-6, 128, 1e6, 1.0, None, True, pos, cache, cache, t)
    with pytest.raises(CudaError, match="matvec3_rope takes"):
        knr.matvec3_rope([w(Q4, 2048), w(Q6, 1024), w(Q4, 1024)], x, None, 1e-6, y, y, y, 16, 8, 128, 128, *rope)
    with pytest.raises(CudaError, match="are not"):
        knr.matvec3_rope([w(Q4, 2048), w(Q4, 1024), w(Q6, 1024)], x, None, 1e-6, y, y, y, 16, 4, 128, 128, *rope)
    with pytest.raises(CudaError, match="tickets"):
        short = (*rope[:-1], DeviceArray(0x6000, (23,), "i4", False))
        knr.matvec3_rope([w(Q4, 2048), w(Q4, 1024), w(Q6, 1024)], x, None, 1e-6, y, y, y, 16, 8, 128, 128, *short)


def test_the_q4_k_m_fixture_folds_every_layer(monkeypatch) -> None:
    """So the decode test below compares the folded launch with the two, not the two with themselves."""
    monkeypatch.setenv("REFLEX_MATVEC_I16", "1")
    r = gguf.GGUFReader(cu.C.fixture_path("qwen3-tiny-q4_k_m", ".gguf"))
    f = {k: r.fields[k].parts[-1][0] for k in ("qwen3.embedding_length", "qwen3.attention.head_count")}
    hd = int(f["qwen3.embedding_length"]) // int(f["qwen3.attention.head_count"])
    t = {x.name: x for x in r.tensors}
    layers = sorted({int(name.split(".")[1]) for name in t if name.startswith("blk.")})
    for i in layers:
        ws = [t[f"blk.{i}.attn_{m}.weight"] for m in "qkv"]
        dw = [DeviceWeight(0x1000, GGMLType(int(w.tensor_type)), int(w.shape[1]), int(w.shape[0]), 0, w.name)
              for w in ws]  # fmt: skip
        assert knr.rope_folds(dw, hd), [w.name + " " + w.tensor_type.name for w in ws]


@pytest.mark.gpu
def test_greedy_decode_is_the_same_with_the_preamble_folded() -> None:
    prompts = (cu.LONG_PROMPT, "The capital of France is")
    folded, apart = cu.greedy_ids_per_setting("qwen3-tiny-q4_k_m", "REFLEX_QKV_ROPE", ("1", "0"), prompts, 24)
    assert folded == apart

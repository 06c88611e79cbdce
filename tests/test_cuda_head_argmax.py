"""The LM head's folded argmax (kernels/argmax_key.cuh): matvec_stream's `best` key, then sample.cu's argmax_key.

It must answer what argmax_f32 answers over the same logits: the lowest index among the maxima, -1 for any NaN or
infinite logit, and leave the slot at 0 for the next step. Random heads check it on real dots (ties made by copying
the winning row's bytes to an earlier and a later row: bit-equal dots in other warps and blocks); a zero matrix with
a residual sets every logit exactly (y = resid + 0) for the orders a dot rarely produces: all negative, -0 against
+0, infinities and NaN.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine.cuda import dispatch, k_matvec, k_sample, memory
from engine.cuda.memory import DeviceArray
from engine.errors import CudaError
from engine.quants import GGMLType, row_bytes
from tests.cuda_util import Weight, cuda_context, needs_blocks  # noqa: F401 - cuda_context: autouse fixture

pytestmark = pytest.mark.gpu

SHAPES = [(5, 256), (1003, 1024), (4099, 2048)]  # rows past a block's 64 and a warp's 16; both kernel widths


@pytest.fixture
def seed() -> int:
    return int(np.random.default_rng().integers(2**63))


def head_and_argmax(w: Weight, x: np.ndarray, resid: np.ndarray | None = None) -> tuple[np.ndarray, int, int]:
    """One stream launch with the key folded in, then argmax_key: (the logits it wrote, the id, the slot after)."""
    rows = w.dev.rows
    best, out = DeviceArray.empty((1,), "u8"), DeviceArray.empty((1,), "i4")
    best.fill_byte(0)
    out.fill_byte(0x7F)
    y = DeviceArray.from_host(resid) if resid is not None else DeviceArray.empty((1, rows), "f4")
    launch = k_matvec.matvec(w.dev, DeviceArray.from_host(x), 1, y, resid=y if resid is not None else None,
                             stream=True, best=best)  # fmt: skip
    launch()
    k_sample.argmax_key(best, out)()
    memory.synchronize(0)
    return y.to_host()[0], int(out.to_host()[0]), int(best.to_host()[0])


def first_max(y: np.ndarray) -> int:
    return -1 if not np.isfinite(y).all() else int(np.argmax(y))  # numpy: the first of equal maxima


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("ggml_type", [GGMLType.Q6_K, GGMLType.Q8_0, GGMLType.Q4_K], ids=lambda t: t.name)
def test_the_folded_argmax_is_the_logits_argmax(ggml_type: GGMLType, shape: tuple[int, int], seed: int) -> None:
    rows, cols = shape
    needs_blocks(ggml_type, cols)
    rng = np.random.default_rng(seed)
    w = Weight(rng, ggml_type, rows, cols)
    x = rng.normal(size=(1, cols)).astype(np.float32)
    context = f"{ggml_type.name} {rows}x{cols} seed={seed}"
    for sign in (1.0, -1.0):  # the maximum of one x, then of -x
        y, got, left = head_and_argmax(w, sign * x)
        assert got == first_max(y), context
        assert left == 0, context
    y, a, _ = head_and_argmax(w, x)
    copies = [r for r in (a // 2, (a + rows) // 2, rows - 1) if r != a]  # earlier (unless a is 0) and later rows
    raw = w.array.to_host().reshape(rows, row_bytes(ggml_type, cols))
    raw[copies] = raw[a]
    y, got, _ = head_and_argmax(Weight(rng, ggml_type, rows, cols, raw=raw.reshape(-1)), x)
    assert (y[copies] == y[a]).all(), context
    assert got == first_max(y) == min(*copies, a), context


@pytest.mark.parametrize(
    "case",
    ["negative", "zeros", "signed_zero", "tie_across_blocks", "nan", "plus_inf", "minus_inf", "last_row"],
)
def test_the_folded_argmax_orders_logits_as_argmax_f32(case: str) -> None:
    rows, cols = 300, 256
    rng = np.random.default_rng(7)
    w = Weight(rng, GGMLType.Q8_0, rows, cols, raw=np.zeros(rows * row_bytes(GGMLType.Q8_0, cols), np.uint8))
    y = -np.abs(rng.normal(size=rows)).astype(np.float32) - 1.0  # all below -1
    if case == "zeros":
        y[:] = 0.0
    elif case == "signed_zero":
        y[[40, 3, 250]] = [-0.0, 0.0, -0.0]
    elif case == "tie_across_blocks":
        y[[299, 130, 70]] = 5.0
    elif case == "nan":
        y[[10, 200]] = [9.0, np.nan]
    elif case == "plus_inf":
        y[17] = np.inf
    elif case == "minus_inf":
        y[17] = -np.inf
    elif case == "last_row":
        y[rows - 1] = 1.0
    want = {"negative": int(np.argmax(y)), "zeros": 0, "signed_zero": 3, "tie_across_blocks": 70, "nan": -1,
            "plus_inf": -1, "minus_inf": -1, "last_row": rows - 1}[case]  # fmt: skip
    x = rng.normal(size=(1, cols)).astype(np.float32)
    got_y, got, left = head_and_argmax(w, x, resid=y.reshape(1, rows))
    np.testing.assert_array_equal(got_y, y + np.float32(0.0))  # the zero matrix adds +0: y as it is (-0 becomes +0)
    assert (got, left) == (want, 0), case


def test_only_the_stream_kernel_takes_a_key() -> None:
    rng = np.random.default_rng(0)
    w = Weight(rng, GGMLType.Q8_0, 64, 256)
    x, y = DeviceArray.from_host(np.zeros((1, 256), np.float32)), DeviceArray.empty((1, 64), "f4")
    best = DeviceArray.empty((1,), "u8")
    with pytest.raises(CudaError, match="argmax key"):
        k_matvec.matvec(w.dev, x, 1, y, stream=False, best=best)
    with pytest.raises(CudaError, match="best"):
        k_matvec.matvec(w.dev, x, 1, y, stream=True, best=DeviceArray.empty((1,), "i4"))


@pytest.mark.parametrize("name", ["qwen3-tiny-q4_k_m", "qwen3-tiny-q8_0", "qwen35-tiny-q8_0", "deepseek2-tiny-q8_0"])
def test_greedy_decoding_is_the_same_with_the_folded_argmax(name: str, monkeypatch) -> None:
    """A model's greedy ids with the argmax folded into its LM head (the fixtures' heads take matvec_stream with
    dispatch.STREAM_MIN_ROWS at 1) are argmax_f32's, token for token, through decode_chain."""
    from engine.engine import Engine
    from tests import conformance

    monkeypatch.setattr(dispatch, "STREAM_MIN_ROWS", 1)
    folded: list[int] = []
    key = k_sample.argmax_key
    monkeypatch.setattr(k_sample, "argmax_key", lambda *a, **kw: folded.append(1) or key(*a, **kw))
    path = conformance.fixture_path(name, ".gguf")
    ids = {}
    for setting in ("0", "1"):
        monkeypatch.setenv("REFLEX_HEAD_ARGMAX", setting)
        engine = Engine.load(path, backend="cuda", max_seq_len=128)
        ids[setting] = [engine.generate(p, max_tokens=24)["token_ids"] for p in ("The capital of France is", "1 2 3")]
        del engine
    assert ids["1"] == ids["0"], name
    assert folded, f"{name}: the folded argmax was not taken"

"""kernels/deltanet.cu against the NumPy oracles (engine/cpu/deltanet.py, engine/cpu/ops.py) on fresh random inputs.

The seed is in every failure message and GDN_SEED=<seed> replays it. Outputs are poisoned (0xFF bytes: NaN) first, so
an element a kernel failed to write fails; the states a kernel advances are compared after the launch too. The
references run in float64 (the oracles are dtype-agnostic), so the bounds measure the kernels' float32 rounding.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from engine.cpu import deltanet, ops
from engine.cuda import driver, memory
from engine.cuda import k_deltanet as kd
from engine.cuda.memory import DeviceArray
from engine.errors import CudaError
from tests.cuda_util import cuda_context  # noqa: F401 - autouse fixture

pytestmark = pytest.mark.gpu

TOKENS = [1, 2, 7, 8, 9, 64, 300]


@pytest.fixture
def seed() -> int:
    return int(os.environ.get("GDN_SEED") or np.random.default_rng().integers(2**63))


def dev(a: np.ndarray) -> DeviceArray:
    return DeviceArray.from_host(np.ascontiguousarray(a, dtype=np.float32))


def rand(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> np.ndarray:
    """Normal float32 values (the references then see exactly what the device sees)."""
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def poisoned(shape: tuple[int, ...]) -> DeviceArray:
    a = DeviceArray.empty(shape, "f4")
    a.fill_byte(0xFF)
    return a


def run(*launches: driver.Launch) -> None:
    # A Launch holds raw pointers only: every DeviceArray it uses must stay referenced until this returns.
    for launch in launches:
        launch(0)
    memory.synchronize(0)


def check(got: np.ndarray, want: np.ndarray, atol: float, what: str, seed: int) -> None:
    assert not np.isnan(got).any(), f"{what} (seed {seed}): unwritten (NaN) outputs at {np.argwhere(np.isnan(got))[:4]}"
    err = float(np.abs(got - want).max())
    assert err <= atol, f"{what} (seed {seed}): max abs error {err:.3g} > {atol:.3g}"


# -- inputs shaped like a layer's ----------------------------------------------------------------------------------


def normed_qkv(rng, n: int, H_k: int, Dk: int, H_v: int, Dv: int) -> np.ndarray:
    """(n, C) f32 as gdn_l2norm_gates leaves it: q heads L2-normed and scaled by 1/sqrt(Dk), k heads L2-normed."""
    q = ops.l2norm(rng.standard_normal((n, H_k, Dk)), 1e-6) / np.sqrt(Dk)
    k = ops.l2norm(rng.standard_normal((n, H_k, Dk)), 1e-6)
    v = rng.standard_normal((n, H_v * Dv))
    return np.concatenate([q.reshape(n, -1), k.reshape(n, -1), v], axis=1).astype(np.float32)


def to_v_heads(x: np.ndarray, H_v: int, tiled: bool) -> np.ndarray:
    """(n, H_k, D) -> (n, H_v, D), as hybrid.CpuModel._to_v_heads."""
    r = H_v // x.shape[1]
    return np.tile(x, (1, r, 1)) if tiled else np.repeat(x, r, axis=1)


# -- conv1d + SiLU ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", TOKENS)
@pytest.mark.parametrize("C,K", [(256, 4), (300, 4), (1000, 2), (64, 5)])
def test_conv_silu(n: int, C: int, K: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    x, w, state = rand(rng, n, C), rand(rng, C, K, scale=0.5), rand(rng, K - 1, C)
    want_state = state.astype(np.float64)
    want = ops.silu(deltanet.causal_conv(x.astype(np.float64), want_state, w.astype(np.float64)))
    d_x, d_w, d_state, d_y = dev(x), dev(w), dev(state), poisoned((n, C))
    run(kd.conv_silu(d_x, n, C, d_w, K, d_state, d_y))
    check(d_y.to_host(), want, 1e-5, f"conv_silu n={n} C={C} K={K}", seed)
    check(d_state.to_host(), want_state, 0.0, "conv state", seed)


def test_conv_silu_in_pieces_equals_one_call(seed: int) -> None:
    """The state carries the window across calls: 300 tokens as 1 + 8 + 291 give the outputs of one call."""
    rng = np.random.default_rng(seed)
    n, C, K = 300, 384, 4
    x, w = dev(rand(rng, n, C)), dev(rand(rng, C, K))
    whole, pieces = poisoned((n, C)), poisoned((n, C))
    s1, s2 = dev(np.zeros((K - 1, C))), dev(np.zeros((K - 1, C)))
    run(kd.conv_silu(x, n, C, w, K, s1, whole))
    for at, m in ((0, 1), (1, 8), (9, 291)):
        run(kd.conv_silu(x.view(at * C, (m, C)), m, C, w, K, s2, pieces.view(at * C, (m, C))))
    check(pieces.to_host(), whole.to_host(), 0.0, "conv in pieces", seed)
    check(s2.to_host(), s1.to_host(), 0.0, "conv state in pieces", seed)


# -- L2-norm, beta, decay --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 7, 64, 300])
@pytest.mark.parametrize("H_k,H_v,Dk,Dv", [(2, 4, 32, 32), (16, 16, 128, 128), (3, 9, 64, 16), (16, 32, 128, 128)])
def test_l2norm_gates(n: int, H_k: int, H_v: int, Dk: int, Dv: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    C = 2 * H_k * Dk + H_v * Dv
    mixed = (rng.standard_normal((n, C)) * rng.uniform(0.01, 3.0, (n, 1))).astype(np.float32)
    mixed[0, :Dk] = 0.0  # an all-zero head: divided by eps, stays zero
    b, a = rand(rng, n, H_v, scale=3.0), rand(rng, n, H_v, scale=3.0)
    ssm_a, dt = -np.exp(rng.uniform(-4.0, 2.8, H_v)).astype(np.float32), rand(rng, H_v)
    eps, q_scale = 1e-6, 1.0 / np.sqrt(Dk)
    heads = mixed[:, : 2 * H_k * Dk].reshape(n, 2 * H_k, Dk).astype(np.float64)
    normed = ops.l2norm(heads, eps)
    normed[:, :H_k] *= q_scale
    want = np.concatenate([normed.reshape(n, -1), mixed[:, 2 * H_k * Dk :]], axis=1)
    d_mixed, d_b, d_a = dev(mixed), dev(b), dev(a)
    run(kd.l2norm_gates(d_mixed, n, C, H_k, Dk, eps, q_scale, d_b, d_a, dev(ssm_a), dev(dt), H_v))
    check(d_mixed.to_host(), want, 2e-6, "l2norm q/k (v untouched)", seed)
    b, a, ssm_a, dt = (t.astype(np.float64) for t in (b, a, ssm_a, dt))
    check(d_b.to_host(), ops.sigmoid(b), 1e-6, "beta", seed)
    check(d_a.to_host(), np.exp(ssm_a * ops.softplus(a + dt)), 2e-6, "decay", seed)


# -- the delta rule ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", TOKENS)
@pytest.mark.parametrize(
    "H_k,H_v,Dk,Dv,tiled",
    [(2, 4, 32, 32, True), (2, 4, 32, 32, False), (1, 3, 64, 20, False), (4, 4, 128, 128, True),
     (2, 6, 128, 36, True), (2, 4, 64, 64, False)],
)  # fmt: skip
def test_recurrence(n: int, H_k: int, H_v: int, Dk: int, Dv: int, tiled: bool, seed: int) -> None:
    rng = np.random.default_rng(seed)
    mixed = normed_qkv(rng, n, H_k, Dk, H_v, Dv)
    decay = rng.uniform(0.3, 1.0, (n, H_v)).astype(np.float32)
    beta = rng.uniform(0.0, 1.0, (n, H_v)).astype(np.float32)
    S0 = (rng.standard_normal((H_v, Dk, Dv)) * 0.5).astype(np.float32)
    key = H_k * Dk
    q = to_v_heads(mixed[:, :key].reshape(n, H_k, Dk), H_v, tiled).astype(np.float64)
    k = to_v_heads(mixed[:, key : 2 * key].reshape(n, H_k, Dk), H_v, tiled).astype(np.float64)
    v = mixed[:, 2 * key :].reshape(n, H_v, Dv).astype(np.float64)
    S = S0.astype(np.float64)
    want = deltanet.delta_rule(S, q, k, v, decay.astype(np.float64), beta.astype(np.float64))
    state = dev(S0.transpose(0, 2, 1))  # the device keeps S transposed: (H_v, Dv, Dk)
    out = poisoned((n, H_v * Dv))
    run(kd.recurrence(dev(mixed), dev(decay), dev(beta), n, H_k, H_v, Dk, Dv, tiled, state, out))
    what = f"recurrence n={n} H_k={H_k} H_v={H_v} Dk={Dk} Dv={Dv} tiled={tiled}"
    check(out.to_host().reshape(n, H_v, Dv), want, 2e-5 * max(1.0, np.abs(want).max()), what, seed)
    check(state.to_host().transpose(0, 2, 1), S, 2e-5 * max(1.0, np.abs(S).max()), what + " state", seed)


def test_recurrence_in_pieces_equals_one_call(seed: int) -> None:
    """The state carries across launches: 64 tokens as 1 + 63 equal one launch of 64, bit for bit."""
    rng = np.random.default_rng(seed)
    n, H_k, H_v, Dk, Dv = 64, 2, 4, 128, 128
    mixed = dev(normed_qkv(rng, n, H_k, Dk, H_v, Dv))
    decay, beta = dev(rng.uniform(0.5, 1.0, (n, H_v))), dev(rng.uniform(0.0, 1.0, (n, H_v)))
    C = mixed.shape[1]
    s1, s2 = dev(np.zeros((H_v, Dv, Dk))), dev(np.zeros((H_v, Dv, Dk)))
    whole, pieces = poisoned((n, H_v * Dv)), poisoned((n, H_v * Dv))
    run(kd.recurrence(mixed, decay, beta, n, H_k, H_v, Dk, Dv, True, s1, whole))
    for at, m in ((0, 1), (1, 63)):
        rows = (mixed.view(at * C, (m, C)), decay.view(at * H_v, (m, H_v)), beta.view(at * H_v, (m, H_v)))
        run(kd.recurrence(*rows, m, H_k, H_v, Dk, Dv, True, s2, pieces.view(at * H_v * Dv, (m, H_v * Dv))))
    check(pieces.to_host(), whole.to_host(), 0.0, "recurrence in pieces", seed)
    check(s2.to_host(), s1.to_host(), 0.0, "recurrence state in pieces", seed)


# -- gated RMSNorm, group splits, the sigmoid gate -------------------------------------------------------------------


@pytest.mark.parametrize("rows", [1, 7, 9, 300 * 4])
@pytest.mark.parametrize("Dv", [32, 64, 128, 20])
def test_gated_norm(rows: int, Dv: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    o = (rng.standard_normal((rows, Dv)) * rng.uniform(0.01, 5.0, (rows, 1))).astype(np.float32)
    z, w = rand(rng, rows, Dv, scale=4.0), 1.0 + rand(rng, Dv, scale=0.1)
    want = ops.rmsnorm(o.astype(np.float64), w.astype(np.float64), 1e-6) * ops.silu(z.astype(np.float64))
    d_o = dev(o)
    run(kd.gated_norm(d_o, dev(z), dev(w), 1e-6, rows, Dv))
    check(d_o.to_host(), want, 1e-5 * max(1.0, np.abs(want).max()), f"gated_norm rows={rows} Dv={Dv}", seed)


@pytest.mark.parametrize("n", [1, 9, 300])
def test_split_groups_ssm_in_and_ssm_ba(n: int, seed: int) -> None:
    """qwen3next's fused projections, split as hybrid.CpuModel._projections does."""
    rng = np.random.default_rng(seed)
    H_k, r, Dk, Dv = 3, 2, 32, 16
    key, value = H_k * Dk, H_k * r * Dv
    C = 2 * key + value
    fused = rand(rng, n, C + value)
    m = fused.reshape(n, H_k, -1)
    parts = (m[..., :Dk], m[..., Dk : 2 * Dk], m[..., 2 * Dk : 2 * Dk + r * Dv], m[..., 2 * Dk + r * Dv :])
    q, k, v, z = (p.reshape(n, -1) for p in parts)
    qkv, d_z = poisoned((n, C)), poisoned((n, value))
    dsts = [(qkv.view(at, (n * C - at,)), C) for at in (0, key, 2 * key)] + [(d_z, value)]
    run(kd.split_groups(dev(fused), n, H_k, (Dk, Dk, r * Dv, r * Dv), dsts))
    check(qkv.to_host(), np.concatenate([q, k, v], axis=1), 0.0, "ssm_in -> qkv", seed)
    check(d_z.to_host(), z, 0.0, "ssm_in -> z", seed)
    ba = rand(rng, n, 2 * H_k * r)
    b, a = poisoned((n, H_k * r)), poisoned((n, H_k * r))
    run(kd.split_groups(dev(ba), n, H_k, (r, r), [(b, H_k * r), (a, H_k * r)]))
    grouped = ba.reshape(n, H_k, 2 * r)
    check(b.to_host(), grouped[..., :r].reshape(n, -1), 0.0, "ssm_ba -> b", seed)
    check(a.to_host(), grouped[..., r:].reshape(n, -1), 0.0, "ssm_ba -> a", seed)


@pytest.mark.parametrize("n", [1, 8, 300])
@pytest.mark.parametrize("H,hd", [(4, 64), (8, 256), (3, 32)])
def test_split_q_gate_and_sigmoid_mul(n: int, H: int, hd: int, seed: int) -> None:
    """The gated attention: attn_q rows per head [q | gate] -> q, gate; then out *= sigmoid(gate)."""
    rng = np.random.default_rng(seed)
    qg = rand(rng, n, H, 2 * hd, scale=4.0)
    q, gate = poisoned((n, H * hd)), poisoned((n, H * hd))
    run(kd.split_groups(dev(qg), n, H, (hd, hd), [(q, H * hd), (gate, H * hd)]))
    check(q.to_host(), qg[..., :hd].reshape(n, -1), 0.0, "q", seed)
    check(gate.to_host(), qg[..., hd:].reshape(n, -1), 0.0, "gate", seed)
    att = rand(rng, n, H * hd)
    d_att = dev(att)
    run(kd.sigmoid_mul(d_att, gate, n * H * hd))
    check(d_att.to_host(), att * ops.sigmoid(qg[..., hd:].reshape(n, -1)), 1e-6, "sigmoid_mul", seed)


# -- a whole layer's recurrent half, captured as a graph ----------------------------------------------------------


def test_graph_replay_equals_direct_launches(seed: int) -> None:
    """conv -> l2norm/gates -> recurrence -> gated norm, three steps from the same state: launched directly and
    replayed from one captured graph, the outputs and both states agree bit for bit."""
    rng = np.random.default_rng(seed)
    n, H_k, H_v, Dk, Dv, K = 9, 2, 4, 64, 32, 4
    C = 2 * H_k * Dk + H_v * Dv
    w, dt, norm = dev(rand(rng, C, K)), dev(rand(rng, H_v)), dev(1.0 + rand(rng, Dv, scale=0.1))
    ssm_a = dev(-rng.uniform(0.1, 2.0, H_v))
    inputs = [rand(rng, *s) for s in ((n, C), (n, H_v), (n, H_v), (n, H_v * Dv))]
    results = []
    for use_graph in (False, True):
        qkv, b, a, z = (dev(x) for x in inputs)
        conv, ssm = dev(np.zeros((K - 1, C))), dev(np.zeros((H_v, Dv, Dk)))
        mixed, o = poisoned((n, C)), poisoned((n, H_v * Dv))
        launches = [
            kd.conv_silu(qkv, n, C, w, K, conv, mixed),
            kd.l2norm_gates(mixed, n, C, H_k, Dk, 1e-6, 1 / np.sqrt(Dk), b, a, ssm_a, dt, H_v),
            kd.recurrence(mixed, a, b, n, H_k, H_v, Dk, Dv, True, ssm, o),
            kd.gated_norm(o, z, norm, 1e-6, n * H_v, Dv),
        ]
        stream = memory.stream_create()
        outs = []
        graph = memory.Graph(stream) if use_graph else None
        if graph is not None:
            with graph:
                for launch in launches:
                    launch(stream)
        for _ in range(3):  # b and a are rewritten in place: restore them before each step
            b.copy_from_host(inputs[1])
            a.copy_from_host(inputs[2])
            if graph is not None:
                graph.launch()
            else:
                for launch in launches:
                    launch(stream)
            memory.synchronize(stream)
            outs.append(o.to_host())
        if graph is not None:
            graph.destroy()
        results.append((outs, conv.to_host(), ssm.to_host()))
    (o1, c1, s1), (o2, c2, s2) = results
    assert not np.isnan(np.stack(o1)).any(), seed
    for a1, a2 in zip(o1, o2, strict=True):
        np.testing.assert_array_equal(a1, a2, err_msg=f"seed {seed}")
    np.testing.assert_array_equal(c1, c2)
    np.testing.assert_array_equal(s1, s2)


def test_wrappers_reject_bad_shapes() -> None:
    x = DeviceArray.empty((8, 64), "f4")
    with pytest.raises(CudaError, match="head_k_dim"):
        kd.recurrence(x, x, x, 1, 1, 1, 48, 4, True, x, x)
    with pytest.raises(CudaError, match="conv kernel"):
        kd.conv_silu(x, 1, 8, x, 0, x, x)
    with pytest.raises(CudaError, match="needs"):
        kd.gated_norm(x, x, x, 1e-6, 64, 32)
    with pytest.raises(CudaError, match="stride"):
        kd.split_groups(x, 1, 2, (8, 8), [(x, 8), (x, 16)])

"""deepseek2 beyond the fixtures: q-LoRA, sigmoid routing with exp_probs_b, expert groups, renormalised and
scaled weights, YaRN. A synthetic file runs through the engine and through a naive reference written here
(decompressed per-head K/V, HF-style YaRN, token-by-token routing); both must agree."""

from __future__ import annotations

import math

import numpy as np
import pytest

from engine.config import ModelConfig
from engine.cpu import ops
from engine.errors import UnsupportedArchitecture
from engine.models import mla
from tests import synthetic

D, H, R, NOPE, ROPE, V, VOCAB = 64, 4, 32, 16, 8, 12, 50
FF, E, EFF, TOP_K = 96, 8, 32, 2

V3_LIKE = dict(q_lora=24, gating=2, groups=4, groups_used=2, norm=True, scale=2.5, yarn=True, bias=True)
V2_LIKE = dict(q_lora=None, gating=None, groups=1, groups_used=1, norm=False, scale=1.0, yarn=False, bias=False)
YARN = dict(factor=4.0, orig=64, log_mul=0.707, theta=100.0)


def _metadata(o: dict) -> dict:
    kv = {
        "block_count": 3, "context_length": 256, "embedding_length": D, "feed_forward_length": FF,
        "attention.head_count": H, "attention.head_count_kv": 1, "attention.key_length": R + ROPE,
        "attention.value_length": R, "attention.key_length_mla": NOPE + ROPE, "attention.value_length_mla": V,
        "attention.kv_lora_rank": R, "attention.layer_norm_rms_epsilon": 1e-6, "rope.dimension_count": ROPE,
        "rope.freq_base": YARN["theta"], "expert_count": E, "expert_used_count": TOP_K,
        "expert_group_count": o["groups"], "expert_group_used_count": o["groups_used"],
        "expert_feed_forward_length": EFF, "expert_shared_count": 1, "expert_weights_scale": o["scale"],
        "expert_weights_norm": o["norm"], "leading_dense_block_count": 1,
    }  # fmt: skip
    if o["q_lora"]:
        kv["attention.q_lora_rank"] = o["q_lora"]
    if o["gating"]:
        kv["expert_gating_func"] = o["gating"]
    if o["yarn"]:
        kv |= {"rope.scaling.type": "yarn", "rope.scaling.factor": YARN["factor"],
               "rope.scaling.original_context_length": YARN["orig"],
               "rope.scaling.yarn_log_multiplier": 0.1 * YARN["log_mul"]}  # fmt: skip
    return kv


def _md(o: dict) -> dict:
    """_metadata as a file's full key names (what ModelConfig.from_gguf reads), with the vocabulary size."""
    return {"general.architecture": "deepseek2", "deepseek2.vocab_size": VOCAB} | {
        f"deepseek2.{k}": v for k, v in _metadata(o).items()
    }


def _tensors(o: dict, w: synthetic.Weights) -> dict[str, np.ndarray]:
    t = {"token_embd.weight": w.mat(VOCAB, D, std=1.0), "output_norm.weight": w.norm(D),
         "output.weight": w.mat(VOCAB, D)}  # fmt: skip
    for i in range(3):
        b = f"blk.{i}."
        t |= {b + "attn_norm.weight": w.norm(D), b + "ffn_norm.weight": w.norm(D)}
        if o["q_lora"]:
            t |= {b + "attn_q_a.weight": w.mat(o["q_lora"], D), b + "attn_q_a_norm.weight": w.norm(o["q_lora"]),
                  b + "attn_q_b.weight": w.mat(H * (NOPE + ROPE), o["q_lora"])}  # fmt: skip
        else:
            t[b + "attn_q.weight"] = w.mat(H * (NOPE + ROPE), D)
        t |= {b + "attn_kv_a_mqa.weight": w.mat(R + ROPE, D), b + "attn_kv_a_norm.weight": w.norm(R),
              b + "attn_k_b.weight": w.mat(H, R, NOPE), b + "attn_v_b.weight": w.mat(H, V, R),
              b + "attn_output.weight": w.mat(D, H * V)}  # fmt: skip
        if i == 0:
            t |= {b + "ffn_gate.weight": w.mat(FF, D), b + "ffn_up.weight": w.mat(FF, D),
                  b + "ffn_down.weight": w.mat(D, FF)}  # fmt: skip
            continue
        t |= {b + "ffn_gate_inp.weight": w.mat(E, D, std=0.5), b + "ffn_gate_exps.weight": w.mat(E, EFF, D),
              b + "ffn_up_exps.weight": w.mat(E, EFF, D), b + "ffn_down_exps.weight": w.mat(E, D, EFF),
              b + "ffn_gate_shexp.weight": w.mat(EFF, D), b + "ffn_up_shexp.weight": w.mat(EFF, D),
              b + "ffn_down_shexp.weight": w.mat(D, EFF)}  # fmt: skip
        if o["bias"]:
            t[b + "exp_probs_b.bias"] = w.mat(E, std=0.3)
    return t


# -- the naive reference ----------------------------------------------------------------------------------------


def _rms(x, w, eps=1e-6):
    x = np.asarray(x, np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _silu(x):
    return x / (1.0 + np.exp(-x))


def hf_yarn(positions: np.ndarray, dim: int, theta: float, factor: float, orig: int, mscale_all_dim: float,
            beta_fast: float = 32.0, beta_slow: float = 1.0) -> tuple[np.ndarray, np.ndarray, float]:  # fmt: skip
    """cos, sin (n, dim/2) and the softmax-scale multiplier, the way DeepSeek's reference YaRN computes them
    (with mscale == mscale_all_dim, as in DeepSeek's configs)."""

    def correction_dim(rotations):
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    freq_extra = 1.0 / theta ** (np.arange(0, dim, 2) / dim)
    freq_inter = freq_extra / factor
    interp_weight = np.clip((np.arange(dim // 2) - low) / (high - low), 0.0, 1.0)
    inv_freq = freq_inter * interp_weight + freq_extra * (1.0 - interp_weight)

    def get_mscale(scale, m):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    angles = np.outer(positions, inv_freq)
    magnitude = get_mscale(factor, mscale_all_dim) / get_mscale(factor, mscale_all_dim)
    return magnitude * np.cos(angles), magnitude * np.sin(angles), get_mscale(factor, mscale_all_dim) ** 2


def _rope_pairs(x, cos, sin):
    """Rotate consecutive pairs (x[2i], x[2i+1]) of the last axis as complex numbers. x (n, ..., dim)."""
    z = (x[..., 0::2] + 1j * x[..., 1::2]) * (cos + 1j * sin).reshape(cos.shape[0], *[1] * (x.ndim - 2), -1)
    return np.stack([z.real, z.imag], axis=-1).reshape(x.shape)


def _moe(t, b, x, o):
    logits = t[b + "ffn_gate_inp.weight"] @ x
    p = 1.0 / (1.0 + np.exp(-logits)) if o["gating"] == 2 else np.exp(logits) / np.exp(logits).sum()
    choice = p + t.get(b + "exp_probs_b.bias", 0.0)
    if o["groups"] > 1:
        per = E // o["groups"]
        score = [np.sort(choice[g * per : (g + 1) * per])[-2:].sum() for g in range(o["groups"])]
        for g in np.argsort(score)[: o["groups"] - o["groups_used"]]:
            choice[g * per : (g + 1) * per] = -np.inf
    top = np.argsort(-choice)[:TOP_K]
    weights = p[top] / (p[top].sum() if o["norm"] else 1.0) * o["scale"]
    out = np.zeros(D)
    for j, wj in zip(top, weights, strict=True):
        g, u, dn = (t[b + f"ffn_{k}_exps.weight"][j] for k in ("gate", "up", "down"))
        out += wj * (dn @ (_silu(g @ x) * (u @ x)))
    return out + t[b + "ffn_down_shexp.weight"] @ (_silu(t[b + "ffn_gate_shexp.weight"] @ x)
                                                   * (t[b + "ffn_up_shexp.weight"] @ x))  # fmt: skip


def naive_logits(t: dict[str, np.ndarray], o: dict, ids: list[int]) -> np.ndarray:
    n = len(ids)
    pos = np.arange(n)
    if o["yarn"]:
        cos, sin, mscale2 = hf_yarn(pos, ROPE, YARN["theta"], YARN["factor"], YARN["orig"], YARN["log_mul"])
    else:
        angles = np.outer(pos, YARN["theta"] ** (-np.arange(0, ROPE, 2) / ROPE))
        cos, sin, mscale2 = np.cos(angles), np.sin(angles), 1.0
    x = t["token_embd.weight"][ids].astype(np.float64)
    for i in range(3):
        b = f"blk.{i}."
        h = _rms(x, t[b + "attn_norm.weight"])
        if o["q_lora"]:
            q = _rms(h @ t[b + "attn_q_a.weight"].T, t[b + "attn_q_a_norm.weight"]) @ t[b + "attn_q_b.weight"].T
        else:
            q = h @ t[b + "attn_q.weight"].T
        q = q.reshape(n, H, NOPE + ROPE)
        kva = h @ t[b + "attn_kv_a_mqa.weight"].T
        c = _rms(kva[:, :R], t[b + "attn_kv_a_norm.weight"])
        k_nope = np.einsum("tr,hri->thi", c, t[b + "attn_k_b.weight"])  # decompressed keys, (T, H, nope)
        v = np.einsum("tr,hvr->thv", c, t[b + "attn_v_b.weight"])  # decompressed values, (T, H, v)
        k_pe = np.broadcast_to(_rope_pairs(kva[:, None, R:], cos, sin), (n, H, ROPE))
        qf = np.concatenate([q[..., :NOPE], _rope_pairs(q[..., NOPE:], cos, sin)], -1)
        kf = np.concatenate([k_nope, k_pe], -1)
        s = np.einsum("nhd,thd->hnt", qf, kf) * mscale2 / math.sqrt(NOPE + ROPE)
        s = np.where(np.tril(np.ones((n, n), bool)), s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        x = x + np.einsum("hnt,thv->nhv", p, v).reshape(n, H * V) @ t[b + "attn_output.weight"].T
        h = _rms(x, t[b + "ffn_norm.weight"])
        if i == 0:
            gate, up, down = (t[b + f"ffn_{k}.weight"] for k in ("gate", "up", "down"))
            x = x + (_silu(h @ gate.T) * (h @ up.T)) @ down.T
        else:
            x = x + np.stack([_moe(t, b, h[j], o) for j in range(n)])
    return _rms(x, t["output_norm.weight"]) @ t["output.weight"].T


@pytest.mark.parametrize("o", [V3_LIKE, V2_LIKE], ids=["qlora-sigmoid-groups-yarn", "plain-q-softmax"])
def test_absorbed_mla_model_equals_naive_reference(tmp_path, o):
    t = _tensors(o, synthetic.Weights(11))
    path = synthetic.write(tmp_path / "ds.gguf", "deepseek2", _metadata(o), t)
    r = synthetic.runner(path)
    cfg = r.model.cfg
    assert (cfg.mla.q_lora_rank, cfg.moe.gating, cfg.moe.n_groups, cfg.rope_scaling.kind) == (
        o["q_lora"] or 0,
        "sigmoid" if o["gating"] == 2 else "softmax",
        o["groups"],
        "yarn" if o["yarn"] else "none",
    )
    ids = [int(i) for i in np.random.default_rng(3).integers(0, VOCAB, 40)]
    want = naive_logits(t, o, ids)
    got = synthetic.logits(r, ids, prefill=32)  # 32 tokens as one chunk, then 8 decode steps
    assert np.abs(want).max() > 1.0  # the model is far from trivial
    np.testing.assert_allclose(got, want, atol=5e-5 * np.abs(want).max())
    assert (got.argmax(-1) == want.argmax(-1)).mean() > 0.95


def test_yarn_angles_and_kq_scale_match_the_reference_formula():
    md = _md(V3_LIKE)
    md["deepseek2.rope.dimension_count"] = 64
    md["deepseek2.attention.key_length"] = R + 64
    md["deepseek2.attention.key_length_mla"] = NOPE + 64
    md["deepseek2.rope.freq_base"] = 10000.0
    md["deepseek2.rope.scaling.factor"] = 40.0
    md["deepseek2.rope.scaling.original_context_length"] = 4096
    cfg = ModelConfig.from_gguf(md)
    positions = np.array([0, 1, 17, 1000, 4095, 70000])
    cos, sin = ops.rope_angles(positions, 64, 10000.0, cfg.rope_scaling)
    want_cos, want_sin, mscale2 = hf_yarn(positions, 64, 10000.0, 40.0, 4096, YARN["log_mul"])
    np.testing.assert_allclose(cos, want_cos, atol=2e-6)
    np.testing.assert_allclose(sin, want_sin, atol=2e-6)
    assert math.isclose(mla.kq_scale(cfg), mscale2 / math.sqrt(NOPE + 64), rel_tol=1e-9)
    # The ramp really mixes: some pairs keep their angle, some are divided by the factor, some in between.
    plain = ops.rope_angles(positions, 64, 10000.0, ModelConfig.from_gguf(
        {k: v for k, v in md.items() if "scaling" not in k}).rope_scaling)  # fmt: skip
    ratio = np.arctan2(sin[2], cos[2]) / np.arctan2(plain[1][2], plain[0][2])
    assert np.isclose(ratio[0], 1.0) and np.isclose(ratio[-1], 1 / 40.0) and ((ratio > 0.03) & (ratio < 0.97)).any()


def test_yarn_magnitude_for_other_architectures():
    """Without a log multiplier (e.g. a Qwen3 128K file), cos/sin carry 1 + 0.1 ln(factor)."""
    md = {"general.architecture": "qwen3", "qwen3.embedding_length": 64, "qwen3.attention.head_count": 4,
          "qwen3.block_count": 1, "qwen3.vocab_size": 8, "qwen3.rope.scaling.type": "yarn",
          "qwen3.rope.scaling.factor": 4.0, "qwen3.rope.scaling.original_context_length": 32768}  # fmt: skip
    s = ModelConfig.from_gguf(md).rope_scaling
    assert math.isclose(s.mscale, 1 + 0.1 * math.log(4.0))
    cos, sin = ops.rope_angles(np.array([5]), 16, 10000.0, s)
    np.testing.assert_allclose(cos**2 + sin**2, s.mscale**2, rtol=1e-6)


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda md: md.pop("deepseek2.attention.key_length_mla"),
         r"without 'deepseek2\.attention\.key_length_mla' \(a pre-MLA conversion with attn_kv_b\)"),
        (lambda md: md.update({"deepseek2.expert_gating_func": 3}), r"'deepseek2\.expert_gating_func'=3"),
    ],
    ids=["pre-MLA", "gating"],
)  # fmt: skip
def test_unsupported_variants_name_their_key(change, match):
    """A pre-MLA conversion (attn_kv_b, no key_length_mla) and a gating function llama.cpp does not implement for
    deepseek2 are unsupported_architecture errors naming the key, from the config both backends are built from."""
    md = _md(V3_LIKE)
    ModelConfig.from_gguf(md)  # the file as it is loads
    change(md)
    with pytest.raises(UnsupportedArchitecture, match=match) as e:
        ModelConfig.from_gguf(md)
    assert e.value.kind == "unsupported_architecture"

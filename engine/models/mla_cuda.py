"""`deepseek2` on the CUDA backend: models/mla.py's absorbed multi-head latent attention as kernel launches, leading
dense FFN layers, then engine/models/moe_cuda.py's MoE FFN (the same interface as models/dense_cuda.py, whose LM head
this reuses).

Per layer, for n tokens at positions pos0.. (`ctrl[0]`), the input RMS-normed by attn_norm (fused into the matvecs
for n <= 64, rmsnorm_rows + GEMM above):
  q = attn_q . xn, or attn_q_b . RMSNorm(attn_q_a . xn, attn_q_a_norm)    (n, H, nope + rope)
  kva = attn_kv_a_mqa . xn                                                 (n, R + rope)
  mla_kv_rope: cache row p = [RMSNorm(kva latent) | RoPE(k_pe)], qa[..., R:] = RoPE(q_pe)   (k_norm_rope)
  head_matvec attn_k_b: qa[..., :R] = attn_k_b[h] . q_nope                                  (k_mla)
  mla_attn over the latent cache (n = 1: split keys, then attn_combine) -> o_lat (n, H, R)
  head_matvec attn_v_b: att = attn_v_b[h] . o_lat (n, H * v);  x += attn_output . att
  FFN (ffn_norm): dense SwiGLU below leading_dense_block_count, MoEFFN above.
The cache holds R + rope floats per position and layer, written at device positions: decode is one CUDA graph.
LoRA updates (engine/cuda/lora.py) ride beside the 2-D projections and the dense FFN, as in dense_cuda.
"""

from __future__ import annotations

import math

from engine import cache_type
from engine.config import ModelConfig
from engine.cuda import k_attention as ka
from engine.cuda import k_elementwise as kel
from engine.cuda import k_embed as ke
from engine.cuda import k_mla as kmla
from engine.cuda import k_norm_rope as knr
from engine.cuda import prefill, small_batch, vmm
from engine.cuda.dispatch import combine_splits, use_matvec
from engine.cuda.driver import Launch
from engine.cuda.lora import NO_LORA
from engine.cuda.memory import DeviceArray, DeviceWeight
from engine.cuda.upload import DeviceWeights
from engine.cuda.vmm import position_rows
from engine.errors import UnsupportedArchitecture
from engine.models import dense_cuda, specs
from engine.models.moe_cuda import LORA_TARGETS as MOE_LORA
from engine.models.moe_cuda import MoEFFN
from engine.quants import row_bytes
from engine.weights import group_by_layer, resolve

_PER_HEAD = ("attn_k_b", "attn_v_b")  # 3-D tensors ne [K, rows, H]: one (rows, K) matrix per head


def kq_scale(cfg: ModelConfig) -> float:
    """engine/models/mla.kq_scale (which lives beside NumPy): 1/sqrt(nope + rope) times YaRN's mscale^2."""
    assert cfg.mla is not None
    s = cfg.rope_scaling
    ln_factor = math.log(s.factor)
    a0 = s.mscale if s.kind == "yarn" else s.attn_factor * (1.0 + 0.1 * ln_factor)
    mscale = a0 * (1.0 + 0.1 * s.yarn_log_multiplier * ln_factor)
    return mscale * mscale / math.sqrt(cfg.mla.qk_nope_dim + cfg.rope_dim)


class CudaModel:
    # The LM head is the dense family's: the same buffers (x, normed, logits) and weights (output, output_norm).
    head_logits = dense_cuda.CudaModel.head_logits
    head_argmax = dense_cuda.CudaModel.head_argmax
    head_gather = dense_cuda.CudaModel.head_gather
    # Matmuls with their LoRA updates (two extra launches each), and the matrices that may carry one: not the
    # per-head attn_k_b / attn_v_b (not adaptable: engine/lora.py); the MoE FFN's: engine/models/moe_cuda.py.
    _matmul = dense_cuda.CudaModel._matmul
    _matmuls = dense_cuda.CudaModel._matmuls
    LORA_TARGETS = frozenset({"attn_q", "attn_q_a", "attn_q_b", "attn_kv_a_mqa", "attn_output", "ffn_gate", "ffn_up",
                              "ffn_down"}) | MOE_LORA  # fmt: skip

    def __init__(self, cfg: ModelConfig, weights: DeviceWeights, max_seq: int, max_batch: int, kv_dtype: str = "f4"):
        m = cfg.mla
        assert m is not None
        self.cfg, self.mla = cfg, m
        self.weights = weights  # owns the device allocation every weight handle below points into
        self.max_seq = max_seq
        self.max_batch = max_batch
        self.kv_dtype = kv_dtype  # the latent cache's element, "f4" or "f2" (engine/cache_type.py)
        # State files (engine/state.py): the NumPy backend's LatentCache rows, so states move between the backends.
        self.STATE_LAYOUT = cache_type.layout("latent", kv_dtype)
        self.row_dim = m.kv_lora_rank + cfg.rope_dim  # D: one latent cache row
        self._check_shapes()
        tensors = {}
        for name, info in resolve(weights.gf, specs.mla(cfg)).items():
            short = name.split(".")[2] if name.startswith("blk.") else ""
            tensors[name] = self._per_head(weights, info) if short in _PER_HEAD else weights.tensor(info)
        top, self.layers = group_by_layer(tensors, cfg.n_layers)
        self.token_embd = top["token_embd"]  # (n_vocab rows, dim)
        self.output = self.token_embd if cfg.tied_output else top["output"]
        self.output_norm = top["output_norm"]  # (dim,) f32
        self.freq_scale, self.yarn = knr.rope_scaling(cfg.rope_dim, cfg.rope_theta, cfg.rope_scaling)
        self.kq_scale = kq_scale(cfg)
        self.lora = NO_LORA  # engine/cuda/lora.attach replaces it before the first launch list is built
        moe = cfg.moe
        self.moe = [MoEFFN(cfg, L, max_batch) if moe is not None and i >= moe.n_dense_leading else None
                    for i, L in enumerate(self.layers)]  # fmt: skip
        self._allocate()

    def _check_shapes(self) -> None:
        c, m = self.cfg, self.mla
        ok = (m.kv_lora_rank <= kmla.MAX_LATENT and m.kv_lora_rank % 4 == 0 and c.rope_dim % 4 == 0
              and self.row_dim <= kmla.MAX_ROW and max(m.qk_nope_dim, m.kv_lora_rank) <= kmla.HEAD_MATVEC_MAX_K
              and c.rope_dim <= 256 and c.rope_type == "norm")  # fmt: skip
        if not ok:
            raise UnsupportedArchitecture(
                f"{c.arch}: no CUDA kernels for latent rank {m.kv_lora_rank} + rope {c.rope_dim} ({c.rope_type} "
                f"pairs), nope {m.qk_nope_dim} (multiples of 4, rank <= {kmla.MAX_LATENT}, rank + rope <= "
                f"{kmla.MAX_ROW}, normal rope pairs)"
            )

    @staticmethod
    def _per_head(weights: DeviceWeights, info) -> DeviceWeight:
        """A 3-D tensor ne [K, rows, H] as one matrix of H * rows rows (head h's rows are h*rows .. h*rows+rows-1)."""
        cols, rows, heads = info.ne
        return DeviceWeight(weights.ptr(info), info.ggml_type, rows * heads, cols, row_bytes(info.ggml_type, cols),
                            info.name)  # fmt: skip

    def _allocate(self) -> None:
        c, m, b, D = self.cfg, self.mla, self.max_batch, self.row_dim
        H, R = c.n_heads, m.kv_lora_rank
        self.ctrl = DeviceArray.empty((4 + b,), "i4")  # [pos0, sample step, -, -, token ids (b,)]
        self.pos = self.ctrl.view(0, (1,))
        self.step = self.ctrl.view(1, (1,))
        self.ids = self.ctrl.view(4, (b,))
        self.x = DeviceArray.empty((b, c.dim))  # residual stream (b, dim) f32
        self.xb = DeviceArray.empty((b, c.dim))  # normed rows for the GEMM path (b, dim) f32
        self.q = DeviceArray.empty((b, H * (m.qk_nope_dim + c.rope_dim)))  # (b, H*(nope+rope)) f32
        self.q_a = DeviceArray.empty((b, max(m.q_lora_rank, 1)))  # (b, q_lora) f32: attn_q_a rows (q-LoRA only)
        self.kva = DeviceArray.empty((b, D))  # (b, R+rope) f32: attn_kv_a_mqa rows
        self.qa = DeviceArray.empty((b, H * D))  # (b, H*(R+rope)) f32: absorbed queries
        self.o_lat = DeviceArray.empty((b, H * R))  # (b, H*R) f32: attention output in the latent space
        self.att = DeviceArray.empty((b, H * m.v_head_dim))  # (b, H*v) f32: decompressed, attn_output's input
        hidden = max(c.hidden_dim, 1)
        self.hb = DeviceArray.empty((b, hidden))  # (b, hidden) f32
        self.hb2 = DeviceArray.empty((b, hidden))  # (b, hidden) f32, only when gate/up types differ
        self.n_splits = combine_splits()  # mla_attn's partials, for attn_combine
        self.part_o = DeviceArray.empty((H, self.n_splits, R))  # (H, splits, R) f32
        self.part_ml = DeviceArray.empty((H, self.n_splits, 2))  # (H, splits, 2) f32
        self.cache = vmm.cache((c.n_layers, self.max_seq, D), self.kv_dtype)  # (layers, max_seq, R+rope), by need
        self.caches = (self.cache,)
        self.logits = DeviceArray.empty((dense_cuda.logit_rows(c.n_vocab), c.n_vocab))  # (rows, n_vocab) f32
        self.normed = DeviceArray.empty((b, c.dim))  # final-normed rows for gathered logits (b, dim) f32

    @property
    def kv_cache_bytes(self) -> int:
        return self.cache.nbytes

    def state_arrays(self, n: int) -> list[vmm.StateArray]:
        """The latent rows of positions 0..n-1 as a state file holds them (LatentCache's "rows"): one contiguous
        device run per layer."""
        return [position_rows("rows", self.cache, n)]

    # -- the forward pass ----------------------------------------------------------------------------------

    def forward(self, n: int) -> list[Launch]:
        """Launches that embed ids[:n] at positions pos0.. and run every layer; the result is x[:n] (unnormed)."""
        out = [ke.embed(self.token_embd, self.ids, n, self.x)]
        for i, L in enumerate(self.layers):
            out += self._attention(L, i, n)
            out += self._ffn(L, n) if self.moe[i] is None else self.moe[i].launches(self.x, n, L["ffn_norm"])
        return out

    def _normed(self, norm_w: DeviceArray, n: int) -> tuple[DeviceArray, DeviceArray | None, list[Launch]]:
        """(source rows, norm for the matvecs, launches): x with the norm fused for matvecs, else xb normed here."""
        if use_matvec(n):
            return self.x, norm_w, []
        return self.xb, None, [knr.rmsnorm_rows(self.x, norm_w, self.cfg.norm_eps, self.xb, n)]

    def _queries(self, L: dict, src: DeviceArray, norm: DeviceArray | None, n: int) -> list[Launch]:
        """q[:n] (n, H, nope + rope): attn_q . xn, or with q-LoRA attn_q_b . RMSNorm(attn_q_a . xn, attn_q_a_norm)."""
        if not self.mla.q_lora_rank:
            return self._matmul(L["attn_q"], src, n, self.q, norm_w=norm)
        out = self._matmul(L["attn_q_a"], src, n, self.q_a, norm_w=norm)
        if use_matvec(n):  # the q_a norm rides along in attn_q_b's matvecs
            return out + self._matmul(L["attn_q_b"], self.q_a, n, self.q, norm_w=L["attn_q_a_norm"])
        out.append(knr.rmsnorm_rows(self.q_a, L["attn_q_a_norm"], self.cfg.norm_eps, self.q_a, n))
        return out + self._matmul(L["attn_q_b"], self.q_a, n, self.q)

    def _attention(self, L: dict, layer: int, n: int) -> list[Launch]:
        c, m, D = self.cfg, self.mla, self.row_dim
        H, R, P, nope, v = c.n_heads, m.kv_lora_rank, c.rope_dim, m.qk_nope_dim, m.v_head_dim
        cache = self.cache.view(layer * self.max_seq * D, (self.max_seq, D))
        src, norm, out = self._normed(L["attn_norm"], n)
        if self.mla.q_lora_rank:
            out += self._queries(L, src, norm, n)
            out += self._matmul(L["attn_kv_a_mqa"], src, n, self.kva, norm_w=norm)
        else:  # q and the latent KV read the same normed row: one launch when one token and one type
            out += self._matmuls([(L["attn_q"], self.q), (L["attn_kv_a_mqa"], self.kva)], src, n, norm_w=norm)
        out.append(knr.mla_kv_rope(self.kva, L["attn_kv_a_norm"], c.norm_eps, self.q, self.qa, n, H, R, P, nope,
                                   c.rope_theta, self.freq_scale, self.pos, cache, yarn=self.yarn))  # fmt: skip
        out.append(kmla.head_matvec(L["attn_k_b"], H, self.q, H * (nope + P), nope + P, n, self.qa, H * D, D))
        if n == 1:
            out.append(kmla.attn(self.qa, cache, self.pos, 1, H, R, P, self.kq_scale, self.n_splits, self.part_o,
                                 self.part_ml, None))  # fmt: skip
            out.append(ka.attn_combine(self.part_o, self.part_ml, H, self.n_splits, R, self.o_lat))
        else:
            out.append(kmla.attn(self.qa, cache, self.pos, n, H, R, P, self.kq_scale, 1, None, None, self.o_lat))
        out.append(kmla.head_matvec(L["attn_v_b"], H, self.o_lat, H * R, R, n, self.att, H * v, v))
        return out + self._matmul(L["attn_output"], self.att, n, self.x, resid=self.x)

    def _ffn(self, L: dict, n: int) -> list[Launch]:
        """x[:n] += the dense SwiGLU FFN of RMSNorm(x[:n]) * ffn_norm."""
        gate, up = L["ffn_gate"], L["ffn_up"]
        src, norm, out = self._normed(L["ffn_norm"], n)
        adapted = self.lora.of(gate.name) or self.lora.of(up.name)
        if gate.ggml_type != up.ggml_type or adapted:  # mixed types or LoRA updates cannot share one fused launch
            out += self._matmul(gate, src, n, self.hb, norm_w=norm)
            out += self._matmul(up, src, n, self.hb2, norm_w=norm)
            out.append(kel.swiglu(self.hb, self.hb2, self.hb, n * self.cfg.hidden_dim))
        elif use_matvec(n):
            out += small_batch.swiglu(gate, up, src, n, self.hb, norm_w=norm, eps=self.cfg.norm_eps)
        else:
            out += prefill.swiglu(gate, up, src, n, self.hb)
        return out + self._matmul(L["ffn_down"], self.hb, n, self.x, resid=self.x)

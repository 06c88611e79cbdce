"""The dense family (`qwen3`, `llama`) on the CUDA backend: the same math as models/dense.py, as kernel launches.

Per layer, for a batch of n tokens whose first position is in device memory (`ctrl[0]`):
  n <= 64: small batches (engine/cuda/small_batch.py: matvec passes of <= 8 tokens, or one tc_matvec launch of
           9..64): q, k, v with the attention RMSNorm fused (one launch for the three where their types allow:
           small_batch.matmul3);
           attention; o (+x); gate/up SwiGLU with the FFN RMSNorm fused; down (+x).
  n >  64: RMSNorm rows; GEMM q, k, v; attention; GEMM o (+x); RMSNorm rows; GEMM gate/up SwiGLU; GEMM down (+x).
Attention: qk_rope_kv (QK-norm, RoPE, K/V into the cache), then split-key decode (n <= dispatch.DECODE_TOKENS) or
causal prefill.
MoE layers (qwen3moe, Mixtral-style llama) replace the FFN by engine/models/moe_cuda.py's MoEFFN.
Everything is allocated here, once; building a launch list allocates nothing on the device.
"""

from __future__ import annotations

import math

from engine import cache_type
from engine.config import ModelConfig
from engine.cuda import k_attention as ka
from engine.cuda import k_elementwise as kel
from engine.cuda import k_embed as ke
from engine.cuda import k_gemm as kg
from engine.cuda import k_matvec as km
from engine.cuda import k_norm_rope as knr
from engine.cuda import prefill, small_batch, vmm
from engine.cuda.dispatch import SMALL_BATCH, mixed_matvec3, use_matvec
from engine.cuda.driver import Launch
from engine.cuda.lora import NO_LORA
from engine.cuda.memory import DeviceArray, DeviceWeight
from engine.cuda.upload import DeviceWeights
from engine.cuda.vmm import StateArray, position_rows
from engine.models import specs
from engine.models.moe_cuda import LORA_TARGETS as MOE_LORA
from engine.models.moe_cuda import MoEFFN
from engine.weights import group_by_layer, resolve

LOGIT_BYTES = 8 << 20  # the full-vocabulary logits buffer: rows computed per chunk, as many as fit (8 at least)


def logit_rows(n_vocab: int) -> int:
    """Rows of the logits buffer: 13 at Qwen3's 151,936 ids, 8 at Qwen3.5's 248,320."""
    return max(SMALL_BATCH, LOGIT_BYTES // (4 * n_vocab))


class CudaModel:
    # LoRA updates this model applies (engine/cuda/lora.py: two extra launches beside each adapted matmul; the MoE
    # FFN's router, experts and shared expert: engine/models/moe_cuda.py).
    LORA_TARGETS = frozenset({"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"}) | MOE_LORA

    def __init__(self, cfg: ModelConfig, weights: DeviceWeights, max_seq: int, max_batch: int, kv_dtype: str = "f4"):
        self.cfg = cfg
        self.weights = weights  # owns the device allocation every weight handle below points into
        self.max_seq = max_seq
        self.max_batch = max_batch
        self.kv_dtype = kv_dtype  # the K/V cache's element, "f4" or "f2" (engine/cache_type.py)
        # State files (engine/state.py): the same K/V rows as the NumPy backend's KVCache, so states move between them.
        self.STATE_LAYOUT = cache_type.layout("kv", kv_dtype)
        top, self.layers = group_by_layer(
            {name: weights.tensor(info) for name, info in resolve(weights.gf, specs.dense(cfg)).items()}, cfg.n_layers
        )
        self.token_embd = top["token_embd"]  # (n_vocab rows, dim)
        self.output = self.token_embd if cfg.tied_output else top["output"]
        self.output_norm = top["output_norm"]  # (dim,) f32
        self.rope_freqs = top.get("rope_freqs")  # (rope_dim/2,) f32 or None
        self.lora = NO_LORA  # engine/cuda/lora.attach replaces it before the first launch list is built
        # MoE layers (qwen3moe, llama files with experts) run engine/models/moe_cuda.py's FFN instead of the dense one.
        moe = cfg.moe
        self.moe = [MoEFFN(cfg, L, max_batch) if moe is not None and i >= moe.n_dense_leading else None
                    for i, L in enumerate(self.layers)]  # fmt: skip
        self._allocate()

    def _allocate(self) -> None:
        c, b = self.cfg, self.max_batch
        self.ctrl = DeviceArray.empty((4 + b,), "i4")  # [pos0, sample step, -, -, token ids (b,)]
        self.pos = self.ctrl.view(0, (1,))
        self.step = self.ctrl.view(1, (1,))
        self.ids = self.ctrl.view(4, (b,))
        self.x = DeviceArray.empty((b, c.dim))  # residual stream (b, dim) f32
        self.xb = DeviceArray.empty((b, c.dim))  # normed rows for the GEMM path (b, dim) f32
        self.q = DeviceArray.empty((b, c.n_heads * c.head_dim))  # (b, H*hd) f32
        self.k = DeviceArray.empty((b, c.n_kv_heads * c.head_dim))  # (b, KVH*hd) f32
        self.v = DeviceArray.empty((b, c.n_kv_heads * c.value_dim))  # (b, KVH*vd) f32
        self.att = DeviceArray.empty((b, c.n_heads * c.value_dim))  # (b, H*vd) f32
        self.hb = DeviceArray.empty((b, c.hidden_dim))  # (b, hidden) f32
        self.hb2 = DeviceArray.empty((b, c.hidden_dim))  # (b, hidden) f32, only when gate/up types differ
        # (H, splits, vd) f32, (H, splits, 2) f32, (16*H,) i32: attn_decode's partials and tickets
        self.part_o, self.part_ml, self.tickets = ka.decode_buffers(c.n_heads, c.n_kv_heads, c.value_dim, c.head_dim)
        kv_k = (c.n_layers, self.max_seq, c.n_kv_heads, c.head_dim)
        kv_v = (c.n_layers, self.max_seq, c.n_kv_heads, c.value_dim)
        self.k_cache = vmm.cache(kv_k, self.kv_dtype)  # (layers, max_seq, KVH, hd) f32 or f16, rows mapped by need
        self.v_cache = vmm.cache(kv_v, self.kv_dtype)  # (layers, max_seq, KVH, vd) f32 or f16, rows mapped by need
        self.caches = (self.k_cache, self.v_cache)
        self.logits = DeviceArray.empty((logit_rows(c.n_vocab), c.n_vocab))  # (rows, n_vocab) f32
        self.normed = DeviceArray.empty((b, c.dim))  # final-normed rows for gathered logits (b, dim) f32

    @property
    def kv_cache_bytes(self) -> int:
        return self.k_cache.nbytes + self.v_cache.nbytes

    def state_arrays(self, n: int) -> list[StateArray]:
        """The K/V rows of positions 0..n-1 as a state file holds them. Each layer's n rows are one contiguous run of
        its cache."""
        return [position_rows(name, cache, n) for name, cache in (("k", self.k_cache), ("v", self.v_cache))]

    # -- the forward pass ----------------------------------------------------------------------------------

    def forward(self, n: int) -> list[Launch]:
        """Launches that embed ids[:n] at positions pos0.. and run every layer; the result is x[:n] (unnormed)."""
        c = self.cfg
        out = [ke.embed(self.token_embd, self.ids, n, self.x)]
        for i, L in enumerate(self.layers):
            out += self._qkv(L, n)
            kc = self.k_cache.view(i * self.max_seq * c.n_kv_heads * c.head_dim, self.k_cache.shape[1:])
            vc = self.v_cache.view(i * self.max_seq * c.n_kv_heads * c.value_dim, self.v_cache.shape[1:])
            freq_scale, yarn = knr.rope_scaling(c.rope_dim, c.rope_theta, c.rope_scaling)  # linear, YaRN, magnitude
            out.append(knr.qk_rope_kv(self.q, self.k, self.v, n, c.n_heads, c.n_kv_heads, c.head_dim, c.value_dim,
                                     L.get("attn_q_norm"), L.get("attn_k_norm"), c.norm_eps, c.rope_dim,
                                     c.rope_theta, freq_scale, self.rope_freqs, c.rope_type == "neox",
                                     self.pos, kc, vc, yarn=yarn))  # fmt: skip
            scale = 1.0 / math.sqrt(c.head_dim)
            out += ka.attention_launches(self.q, kc, vc, self.pos, n, c.n_heads, c.n_kv_heads, c.head_dim,
                                         c.value_dim, scale, self.part_o, self.part_ml, self.tickets,
                                         self.att)  # fmt: skip
            out += self._matmul(L["attn_output"], self.att, n, self.x, resid=self.x)
            out += self._ffn(L, n) if self.moe[i] is None else self.moe[i].launches(self.x, n, L["ffn_norm"])
        return out

    def _matmul(self, w, x: DeviceArray, n: int, y: DeviceArray, resid: DeviceArray | None = None,
                norm_w: DeviceArray | None = None) -> list[Launch]:  # fmt: skip
        """y[:n] = (resid +) w · x[:n] (x RMS-normed first when norm_w): a small batch (engine/cuda/small_batch.py)
        or a GEMM;
        then each LoRA update of w: t = A · x[:n] (the same norm), y[:n] += B' · t."""
        if not use_matvec(n):
            assert norm_w is None, "the GEMM path takes rows normed by rmsnorm_rows"
            out = prefill.matmul(w, x, n, y, resid=resid)
        else:
            out = small_batch.matmul(w, x, n, y, norm_w=norm_w, eps=self.cfg.norm_eps, resid=resid)
        for pair in self.lora.of(w.name):
            t = self.lora.scratch(pair)
            out += self._matmul(pair.a, x, n, t, norm_w=norm_w)
            out += self._matmul(pair.b, t, n, y, resid=y)
        return out

    def _matmuls(self, pairs: list[tuple[DeviceWeight, DeviceArray]], x: DeviceArray, n: int,
                 norm_w: DeviceArray | None = None) -> list[Launch]:  # fmt: skip
        """dst[:n] = w · x[:n] for each (w, dst) (x RMS-normed first when norm_w). Up to three matrices of one width
        go in one launch (small_batch.matmul3: matvec3 for one token, tcmv3 for a tensor-core batch) where their
        types allow (k_matvec.matvec3_order: one type, or a Q4_K_M file's Q4_K q/k and Q6_K v), else per type, three
        at most a launch; a GEMM batch through prefill.matmuls (one two-pass GEMM for three where it is picked); other
        batches and LoRA-adapted weights take a _matmul each."""
        if not use_matvec(n) and not any(self.lora.of(w.name) for w, _ in pairs):
            return prefill.matmuls([w for w, _ in pairs], x, n, [dst for _, dst in pairs])
        fusable: list[tuple[DeviceWeight, DeviceArray]] = []
        out: list[Launch] = []
        for w, dst in pairs:
            if small_batch.fuses3(n, w.ggml_type) and not self.lora.of(w.name):
                fusable.append((w, dst))
            else:
                out += self._matmul(w, x, n, dst, norm_w=norm_w)
        order = km.matvec3_order([w.ggml_type for w, _ in fusable]) if mixed_matvec3() else None
        if order is not None and len({w.cols for w, _ in fusable}) == 1:
            groups = [[fusable[i] for i in order]]
        else:
            by_type: dict[tuple[int, int], list[tuple[DeviceWeight, DeviceArray]]] = {}
            for w, dst in fusable:
                by_type.setdefault((w.ggml_type, w.cols), []).append((w, dst))
            groups = [g[at : at + 3] for g in by_type.values() for at in range(0, len(g), 3)]
        for group in groups:
            ws, ys = zip(*group, strict=True)
            out.append(small_batch.matmul3(list(ws), x, n, list(ys), norm_w=norm_w, eps=self.cfg.norm_eps))
        return out

    def _qkv(self, L: dict, n: int) -> list[Launch]:
        if use_matvec(n):  # the attention norm rides along in each matvec
            src, norm, out = self.x, L["attn_norm"], []
        else:
            src, norm = self.xb, None
            out = [knr.rmsnorm_rows(self.x, L["attn_norm"], self.cfg.norm_eps, self.xb, n)]
        pairs = [(L["attn_q"], self.q), (L["attn_k"], self.k), (L["attn_v"], self.v)]
        return out + self._matmuls(pairs, src, n, norm_w=norm)

    def _ffn(self, L: dict, n: int) -> list[Launch]:
        gate, up, eps = L["ffn_gate"], L["ffn_up"], self.cfg.norm_eps
        small = use_matvec(n)
        out = [] if small else [knr.rmsnorm_rows(self.x, L["ffn_norm"], eps, self.xb, n)]
        src, norm = (self.x, L["ffn_norm"]) if small else (self.xb, None)
        adapted = self.lora.of(gate.name) or self.lora.of(up.name)
        if gate.ggml_type != up.ggml_type or adapted:  # mixed types or LoRA updates cannot share one fused launch
            out += self._matmul(gate, src, n, self.hb, norm_w=norm)
            out += self._matmul(up, src, n, self.hb2, norm_w=norm)
            out.append(kel.swiglu(self.hb, self.hb2, self.hb, n * self.cfg.hidden_dim))
        elif small:
            out += small_batch.swiglu(gate, up, src, n, self.hb, norm_w=norm, eps=eps)
        else:
            out += prefill.swiglu(gate, up, src, n, self.hb)
        out += self._matmul(L["ffn_down"], self.hb, n, self.x, resid=self.x)
        return out

    # -- heads ---------------------------------------------------------------------------------------------

    def head_logits(self, first: int, rows: int) -> list[Launch]:
        """Full-vocabulary logits of x rows [first, first + rows) (rows <= logits.shape[0]) into logits[:rows]."""
        c = self.cfg
        src = self.x.view(first * c.dim, (rows, c.dim))
        if use_matvec(rows):  # float32 math up to MATVEC_MAX rows, as every other matmul (the GEMM is TF32)
            return small_batch.matmul(self.output, src, rows, self.logits, norm_w=self.output_norm, eps=c.norm_eps)
        normed = self.normed.view(0, (rows, c.dim))
        return [knr.rmsnorm_rows(src, self.output_norm, c.norm_eps, normed, rows),
                kg.gemm(self.output, normed, rows, self.logits)]  # fmt: skip

    def head_argmax(self, first: int, best: DeviceArray) -> list[Launch] | None:
        """The LM head of x row `first` into logits[0], its argmax key folded into best (1,) u8 as well (for
        k_sample.argmax_key), where the head takes matvec_stream; else None."""
        c, w = self.cfg, self.output
        if not km.takes_stream(w, 1):
            return None
        src = self.x.view(first * c.dim, (1, c.dim))
        return [km.matvec(w, src, 1, self.logits, norm_w=self.output_norm, eps=c.norm_eps, stream=True, best=best)]

    def head_gather(self, first: int, rows: int, vocab_ids: DeviceArray, n_out: int, out: DeviceArray,
                    per_row: bool) -> list[Launch]:  # fmt: skip
        """Selected logits: per_row -> out[j] = logit(row first+j, vocab_ids[j]); else every vocab_ids[j] of row
        `first` (rows must then be 1)."""
        c = self.cfg
        normed = self.normed.view(0, (rows, c.dim))
        norm = knr.rmsnorm_rows(self.x.view(first * c.dim, (rows, c.dim)), self.output_norm, c.norm_eps, normed, rows)
        stride = c.dim if per_row else 0
        return [norm, km.gather_dot(self.output, normed, stride, vocab_ids, n_out, out)]

"""The mixture-of-experts FFN on the CUDA backend (qwen3moe, Mixtral-style llama, and the MoE layers of the hybrid
and MLA families): engine/models/moe.py's math as kernel launches, residual added in place.

Per MoE layer, for n tokens:
  xn = RMSNorm(x) * norm_w;  logits = ffn_gate_inp . xn  (matvec passes or the exact-f32 GEMM);
  moe_route: gating, exp_probs_b, groups, top-k, weights (and the shared expert's sigmoid gate) on the device
  (one token with an F32 router and no LoRA update of it: moe_route_decode, the three in one launch);
  shared expert (when the model has one): the dense matvec / GEMM launches;
  n <= s : moe_gate_up (every chosen expert of every token, one launch; the shared expert's SwiGLU too where its type
           and width allow), moe_down (weighted sum + shared + residual); for the types of k_moe.I16_TYPES their
           16-bit forms (activations rounded to 16 bits a group of 8, integer dots, h handed over as 16-bit groups;
           REFLEX_MOE_I16=0 keeps the float forms);
  n >  s : moe_group (rows sorted by expert), moe_gather, grouped GEMMs gate/up and down, moe_combine;
  s = dispatch.moe_matvec_tokens(k): 8 tokens, or as many as make 128 routed items.
Expert ids never leave the device, so a decode step stays one CUDA graph. Weights stay in their GGUF stacks.

LoRA (engine/cuda/lora.py): the router's and the shared expert's updates are the dense family's two launches beside
the matmul. An expert stack's update is a stack of F32 pairs A_e (rank_pad, in), B'_e (out, rank_pad) run by the same
MoE kernels over the same expert ids, one row per routed item:
  gate / up (the fused SwiGLU split: gate and up as plain products, the deltas added, then swiglu_f32):
    n <= s : t = moe_gate_up(A) ; h += moe_down(B', t) with k = 1 and unit weights (each item its own "token")
    n >  s : t = moe_gemm(A) ; d = moe_gemm(B', t) ; h += d (lora_add_f32), over the tile list
  down: x += sum_j w_j B'_e (A_e h_j), a second weighted sum over the low-rank part:
    n <= s : t = moe_gate_up(A, k = 1) ; moe_down(B', t)
    n >  s : t = moe_gemm(A) ; xp = moe_gemm(B', t) ; moe_combine
"""

from __future__ import annotations

import array
import os
import weakref

from engine.config import ModelConfig
from engine.cuda import k_elementwise as kel
from engine.cuda import k_lora, k_moe, memory, prefill, small_batch
from engine.cuda import k_norm_rope as knr
from engine.cuda.dispatch import moe_matvec_tokens, use_matvec
from engine.cuda.driver import Launch
from engine.cuda.lora import NO_LORA, DeviceLora, Pair
from engine.cuda.memory import DeviceArray, DeviceWeight

# The MoE FFN's matrices that may carry a LoRA update (a model's LORA_TARGETS include them when it has MoE layers).
LORA_TARGETS = frozenset({"ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_shexp",
                          "ffn_up_shexp", "ffn_down_shexp"})  # fmt: skip
_SCRATCH: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _matmul(w: DeviceWeight, x: DeviceArray, n: int, y: DeviceArray, lora: DeviceLora,
            resid: DeviceArray | None = None) -> list[Launch]:  # fmt: skip
    """y[:n] = (resid +) w . x[:n]: a small batch (engine/cuda/small_batch.py), or the GEMM (as the dense family
    chooses); then each LoRA update of w: t = A . x[:n], y[:n] += B' . t."""
    out = small_batch.matmul(w, x, n, y, resid=resid) if use_matvec(n) else prefill.matmul(w, x, n, y, resid=resid)
    for pair in lora.of(w.name):
        t = lora.scratch(pair)
        out += _matmul(pair.a, x, n, t, NO_LORA)
        out += _matmul(pair.b, t, n, y, NO_LORA, resid=y)
    return out


class _Scratch:
    """Activations of one MoE layer, shared by all the MoE layers of a model: they run one after another on one
    stream. Keyed by the model's ModelConfig object, which it keeps alive (so its id cannot be reused meanwhile)."""

    def __init__(self, cfg: ModelConfig, b: int):
        m = cfg.moe
        assert m is not None
        self.cfg = cfg
        k, items, f = m.n_experts_used, b * m.n_experts_used, m.expert_hidden_dim
        self.xn = DeviceArray.empty((b, cfg.dim))  # normed FFN input (b, dim) f32
        self.logits = DeviceArray.empty((b, m.n_experts))  # router logits (b, n_experts) f32
        self.ids = DeviceArray.empty((b, k), "i4")  # chosen experts, best first (b, k) i32
        self.wts = DeviceArray.empty((b, k))  # their weights (b, k) f32
        self.sgate = DeviceArray.empty((b,))  # the shared expert's sigmoid gate (b,) f32
        self.counter = k_moe.route_counter()  # route_decode's ticket (1,) i32, zero between launches
        self.h = DeviceArray.empty((items, f))  # SwiGLU per item, token-major (n <= s) or by expert (b*k, F) f32
        self.h2: DeviceArray | None = None  # up projections when gate/up types differ (b*k, F) f32
        self.small = small = min(b, moe_matvec_tokens(k))  # tokens the decode expert kernels take, fixed at load
        self.h16 = k_moe.Groups16.empty(small * k, f) if f % 8 == 0 else None  # h, 16-bit (n <= small)
        s = m.shared_hidden_dim
        self.hs = DeviceArray.empty((b, s)) if s else None  # shared expert SwiGLU (b, S) f32
        self.hs2: DeviceArray | None = None  # its up projection when types differ (b, S) f32
        self.ys = DeviceArray.empty((b, cfg.dim)) if s else None  # shared expert output (b, dim) f32
        self.grouped = b > small  # the grouped path (more tokens than the decode expert kernels take)
        if self.grouped:
            self.xp = DeviceArray.empty((items, cfg.dim))  # xn rows by expert, then the experts' outputs (b*k, dim)
            self.offsets = DeviceArray.empty((m.n_experts + 1,), "i4")  # rows of expert e: [off[e], off[e+1]) i32
            self.perm_tok = DeviceArray.empty((items,), "i4")  # token of permuted row p (b*k,) i32
            self.inv = DeviceArray.empty((items,), "i4")  # permuted row of item t*k + j (b*k,) i32
            self.tiles = DeviceArray.empty((k_moe.max_tiles(items, m.n_experts), 3), "i4")  # (e, start, end) i32
        self.lt: DeviceArray | None = None  # expert LoRA: A_e . x per item (b*k, rank_pad) f32 (lora_buffers)
        self.ones: DeviceArray | None = None  # unit weights (b*k,) f32
        self.ld: DeviceArray | None = None  # B'_e . t per item, grouped path (b*k, F) f32

    @classmethod
    def of(cls, cfg: ModelConfig, b: int) -> _Scratch:
        key = (id(cfg), b)
        s = _SCRATCH.get(key)
        if s is None or s.cfg is not cfg:
            s = _SCRATCH[key] = cls(cfg, b)
        return s

    def second_buffers(self, experts: bool, shared: bool) -> None:
        """The up-projection buffers a layer whose gate/up run apart needs (allocated at load)."""
        m, b = self.cfg.moe, self.xn.shape[0]
        if experts and self.h2 is None:
            self.h2 = DeviceArray.empty(self.h.shape)  # (b*k, F) f32
        if shared and self.hs2 is None:
            self.hs2 = DeviceArray.empty((b, m.shared_hidden_dim))  # (b, S) f32

    def lora_buffers(self, rank_pad: int, gate_up: bool) -> None:
        """The buffers of expert-stack LoRA updates up to rank_pad wide (allocated at load, grown to the widest):
        lt (b*k, rank_pad) A_e . x per item; with gate/up updates, ones (b*k,) unit weights (decode) and, on the
        grouped path, ld (b*k, F) the delta B'_e . t before it is added."""
        items = self.h.shape[0]
        if self.lt is None or self.lt.shape[1] < rank_pad:
            self.lt = DeviceArray.empty((items, rank_pad))  # (b*k, rank_pad) f32
        if gate_up and self.ones is None:
            self.ones = DeviceArray.empty((items,))  # (b*k,) f32, all 1.0
            host = array.array("f", [1.0]) * items
            memory.memcpy(self.ones.ptr, host.buffer_info()[0], 4 * items, memory.H2D)
        if gate_up and self.ld is None and self.grouped:
            self.ld = DeviceArray.empty(self.h.shape)  # (b*k, F) f32

    def lora_t(self, pair: Pair) -> DeviceArray:
        """lt viewed as (b*k, pair.rank_pad)."""
        return self.lt.view(0, (self.h.shape[0], pair.rank_pad))


class MoEFFN:
    def __init__(self, cfg: ModelConfig, L: dict, max_batch: int):
        assert cfg.moe is not None
        self.cfg, self.moe, self.max_batch = cfg, cfg.moe, max_batch
        self.ffn_gate_inp = L["ffn_gate_inp"]  # router (n_experts rows, dim)
        self.exp_probs_b = L.get("exp_probs_b")  # (n_experts,) f32 or None
        self.ffn_gate_exps = L["ffn_gate_exps"]  # expert 0 of the stack: (F, dim); the stack is n_experts of them
        self.ffn_up_exps = L["ffn_up_exps"]  # (F, dim) x n_experts
        self.ffn_down_exps = L["ffn_down_exps"]  # (dim, F) x n_experts
        self.shexp = None  # (ffn_gate_shexp (S, dim), ffn_up_shexp (S, dim), ffn_down_shexp (dim, S))
        if self.moe.shared_hidden_dim:
            self.shexp = (L["ffn_gate_shexp"], L["ffn_up_shexp"], L["ffn_down_shexp"])
        self.ffn_gate_inp_shexp = L.get("ffn_gate_inp_shexp")  # (dim,) f32 or None
        # gate and up run apart (two products and a SwiGLU) when their types differ, or when a LoRA update adds to one
        self.split_experts = self.ffn_gate_exps.ggml_type != self.ffn_up_exps.ggml_type
        self.split_shared = self.shexp is not None and self.shexp[0].ggml_type != self.shexp[1].ggml_type
        self.s = _Scratch.of(cfg, max_batch)
        self.s.second_buffers(self.split_experts, self.split_shared)
        self.lora = NO_LORA  # use_lora replaces it before the first launch list is built
        self.i16 = os.environ.get("REFLEX_MOE_I16", "1") != "0" and k_moe.takes_i16(
            self.ffn_gate_exps, self.ffn_up_exps, self.ffn_down_exps
        )  # n <= s: the 16-bit expert forms (takes_i16 implies F % 8 == 0, so s.h16 exists)

    def use_lora(self, lora: DeviceLora) -> None:
        """Apply the model's LoRA updates of this layer's router, experts and shared expert (engine/cuda/lora.attach,
        at load): splits the fused SwiGLUs an update adds to and allocates the scratch the updates need."""
        self.lora = lora
        stacks = (self.ffn_gate_exps, self.ffn_up_exps, self.ffn_down_exps)
        widest = max((p.rank_pad for w in stacks for p in lora.of(w.name)), default=0)
        gate_up = bool(lora.of(self.ffn_gate_exps.name) or lora.of(self.ffn_up_exps.name))
        self.split_experts = self.split_experts or gate_up
        if self.shexp is not None:
            self.split_shared = self.split_shared or any(lora.of(w.name) for w in self.shexp[:2])
        self.s.second_buffers(self.split_experts, self.split_shared)
        if widest:
            self.s.lora_buffers(widest, gate_up)

    def launches(self, x: DeviceArray, n: int, norm_w: DeviceArray) -> list[Launch]:
        """x[:n] += MoE(RMSNorm(x[:n]) * norm_w), routed + shared experts, residual added in place."""
        # Tokens are independent here: batches whose n * k routed rows exceed one grid's 65535 go in parts.
        step, dim = k_moe.MAX_GRID_Y // self.moe.n_experts_used, self.cfg.dim
        out: list[Launch] = []
        for at in range(0, n, step):
            m = min(step, n - at)
            out += self._part(x if at == 0 else x.view(at * dim, (m, dim)), m, norm_w)
        return out

    def _part(self, x: DeviceArray, n: int, norm_w: DeviceArray) -> list[Launch]:
        s, m, router = self.s, self.moe, self.ffn_gate_inp
        gate = self.ffn_gate_inp_shexp if self.shexp is not None else None
        rule = {"sigmoid": m.gating == "sigmoid", "bias": self.exp_probs_b, "n_groups": m.n_groups,
                "n_groups_used": m.n_groups_used, "norm": m.weights_norm, "scale": m.weights_scale}  # fmt: skip
        if n == 1 and k_moe.fusable(router) and not self.lora.of(router.name):  # decode: norm + router + route
            out = [k_moe.route_decode(x, norm_w, self.cfg.norm_eps, router, m.n_experts_used, s.xn, s.logits,
                                      s.counter, s.ids, s.wts, gate_shexp=gate, sgate=s.sgate, **rule)]  # fmt: skip
        else:
            out = [knr.rmsnorm_rows(x, norm_w, self.cfg.norm_eps, s.xn, n)]
            out += _matmul(router, s.xn, n, s.logits, self.lora)
            out.append(k_moe.route(s.logits, n, m.n_experts, m.n_experts_used, s.ids, s.wts, xn=s.xn,
                                   gate_shexp=gate, sgate=s.sgate, **rule))  # fmt: skip
        if n <= s.small:  # the bound the scratch was sized for
            return out + self._small(x, n)
        return out + self._shared(n) + self._grouped(x, n)

    def _fused_shared(self) -> bool:
        """Whether the shared expert's SwiGLU rides in the experts' gate_up launch (n <= s; k_moe.fuses_shared)."""
        return (self.shexp is not None and not self.split_experts and not self.split_shared
                and k_moe.fuses_shared(self.ffn_gate_exps, self.ffn_up_exps, *self.shexp[:2]))  # fmt: skip

    def _shared(self, n: int) -> list[Launch]:
        """ys[:n] = the shared expert of xn (its gate is applied where the routed experts are summed)."""
        if self.shexp is None:
            return []
        s, lora, (gate, up, down) = self.s, self.lora, self.shexp
        if self.split_shared:
            out = _matmul(gate, s.xn, n, s.hs, lora) + _matmul(up, s.xn, n, s.hs2, lora)
            out.append(kel.swiglu(s.hs, s.hs2, s.hs, n * gate.rows))
        elif use_matvec(n):
            out = small_batch.swiglu(gate, up, s.xn, n, s.hs)
        else:
            out = prefill.swiglu(gate, up, s.xn, n, s.hs)
        return out + _matmul(down, s.hs, n, s.ys, lora)

    def _shared_args(self) -> dict:
        if self.shexp is None:
            return {}
        return {"shared": self.s.ys, "sgate": self.s.sgate if self.ffn_gate_inp_shexp is not None else None}

    def _small(self, x: DeviceArray, n: int) -> list[Launch]:
        s, k = self.s, self.moe.n_experts_used
        items = n * k
        gate, up, down = self.ffn_gate_exps, self.ffn_up_exps, self.ffn_down_exps
        # the experts' SwiGLU rows: 16-bit groups where both kernels have the form and no update of down reads h
        h = s.h16 if self.i16 and not self.split_experts and not self.lora.of(down.name) else s.h
        if self.split_experts:
            out = self._shared(n)
            out += [k_moe.gate_up(gate, None, s.xn, s.ids, k, items, s.h), *self._small_lora_in(gate, items, s.h),
                    k_moe.gate_up(up, None, s.xn, s.ids, k, items, s.h2), *self._small_lora_in(up, items, s.h2),
                    kel.swiglu(s.h, s.h2, s.h, items * gate.rows)]  # fmt: skip
        elif self._fused_shared():  # the shared expert's SwiGLU in the same launch, then its down projection
            out = [k_moe.gate_up(gate, up, s.xn, s.ids, k, items, h, shared=self.shexp[:2], hs=s.hs)]
            out += _matmul(self.shexp[2], s.hs, n, s.ys, self.lora)
        else:
            out = [*self._shared(n), k_moe.gate_up(gate, up, s.xn, s.ids, k, items, h)]
        out.append(k_moe.down(down, h, s.ids, s.wts, k, n, x, **self._shared_args()))
        for pair in self.lora.of(down.name):  # x[t] += sum_j w_j B'_e (A_e h_j): item p's A_e . h[p] (k = 1), summed
            t = s.lora_t(pair)
            out += [k_moe.gate_up(pair.a, None, s.h, s.ids, 1, items, t), k_moe.down(pair.b, t, s.ids, s.wts, k, n, x)]
        return out

    def _small_lora_in(self, w: DeviceWeight, items: int, y: DeviceArray) -> list[Launch]:
        """y[p] += B'_e (A_e xn[p / k]), e = ids[p], for each update of the gate or up stack w (n <= s). moe_down with
        k = 1 and unit weights takes each item for a token of its own, so it adds B'_e . t[p] to row p."""
        s, k, out = self.s, self.moe.n_experts_used, []
        for pair in self.lora.of(w.name):
            t = s.lora_t(pair)
            out += [k_moe.gate_up(pair.a, None, s.xn, s.ids, k, items, t),
                    k_moe.down(pair.b, t, s.ids, s.ones, 1, items, y)]  # fmt: skip
        return out

    def _grouped(self, x: DeviceArray, n: int) -> list[Launch]:
        s, m = self.s, self.moe
        k, e = m.n_experts_used, m.n_experts
        items = n * k
        gate, up, down = self.ffn_gate_exps, self.ffn_up_exps, self.ffn_down_exps
        out = [k_moe.group(s.ids, items, k, e, s.offsets, s.perm_tok, s.inv, s.tiles),
               k_moe.gather(s.xn, self.cfg.dim, s.perm_tok, items, s.xp)]  # fmt: skip
        if self.split_experts:
            out += [k_moe.gemm(gate, s.xp, s.tiles, items, e, s.h), *self._grouped_lora_in(gate, items, s.h),
                    k_moe.gemm(up, s.xp, s.tiles, items, e, s.h2), *self._grouped_lora_in(up, items, s.h2),
                    kel.swiglu(s.h, s.h2, s.h, items * gate.rows)]  # fmt: skip
        else:
            out.append(k_moe.gemm_swiglu(gate, up, s.xp, s.tiles, items, e, s.h))
        # The down projections overwrite xp: its gathered rows are dead once gate/up have read them. Each update of
        # down is its own weighted sum: xp[p] = B'_e (A_e h[p]), combined into x before the base's.
        for pair in self.lora.of(down.name):
            t = s.lora_t(pair)
            out += [k_moe.gemm(pair.a, s.h, s.tiles, items, e, t), k_moe.gemm(pair.b, t, s.tiles, items, e, s.xp),
                    k_moe.combine(s.xp, s.inv, s.wts, n, k, self.cfg.dim, x)]  # fmt: skip
        out.append(k_moe.gemm(down, s.h, s.tiles, items, e, s.xp))
        out.append(k_moe.combine(s.xp, s.inv, s.wts, n, k, self.cfg.dim, x, **self._shared_args()))
        return out

    def _grouped_lora_in(self, w: DeviceWeight, items: int, y: DeviceArray) -> list[Launch]:
        """y[p] += B'_e (A_e xp[p]) over the tile list, for each update of the gate or up stack w (n > s): the GEMM
        writes its product, so the delta goes through ld and lora_add_f32."""
        s, e, out = self.s, self.moe.n_experts, []
        for pair in self.lora.of(w.name):
            t, d = s.lora_t(pair), s.ld.view(0, (items, w.rows))
            out += [k_moe.gemm(pair.a, s.xp, s.tiles, items, e, t), k_moe.gemm(pair.b, t, s.tiles, items, e, d),
                    k_lora.add(y, d, items * w.rows)]  # fmt: skip
        return out

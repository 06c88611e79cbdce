"""The Gated DeltaNet hybrids (`qwen35`, `qwen35moe`, `qwen3next`) on the CUDA backend: models/hybrid.py's math as
kernel launches (the same interface as models/dense_cuda.py, whose LM head this reuses).

Per layer, for n tokens at positions pos0.. (`ctrl[0]`), the input RMS-normed by attn_norm (fused into the matvecs
for n <= 64, rmsnorm_rows + GEMM above):
  Gated DeltaNet: attn_qkv, attn_gate, ssm_beta, ssm_alpha (or qwen3next's fused ssm_in / ssm_ba, then split_groups)
                  -> gdn_conv_silu (conv state) -> gdn_l2norm_gates -> gdn_recurrence (recurrent state)
                  -> gdn_gated_norm -> ssm_out (+x)
  gated attention: attn_q (per head [q | gate]), attn_k, attn_v -> split_groups -> qk_rope_kv (QK-norm, RoPE on the
                  first rope_dim dims, K/V cache) -> decode / prefill attention -> sigmoid_mul(gate) -> attn_output (+x)
  FFN (post_attention_norm): dense SwiGLU, or engine/models/moe_cuda.py's MoEFFN (qwen35moe, qwen3next).
The conv and recurrent states are rewritten by every token: the runner's snapshot()/restore() save and reload them
(`save_state` / `load_state`, device-to-device copies into buffers allocated here) and reset() zeroes them.
State files (engine/state.py) hold the NumPy backend's HybridCache arrays, so a state moves between the backends: the
K/V rows and conv state as they are, the recurrent state transposed per v head on the way in and out.
LoRA updates (engine/cuda/lora.py) ride beside every matmul of the mixers and of the dense FFN, as in dense_cuda.
"""

from __future__ import annotations

import array
import math

from engine import cache_type
from engine.config import ModelConfig
from engine.cuda import k_attention as ka
from engine.cuda import k_deltanet as kd
from engine.cuda import k_elementwise as kel
from engine.cuda import k_embed as ke
from engine.cuda import k_gemm as kg
from engine.cuda import k_norm_rope as knr
from engine.cuda import memory, prefill, small_batch, vmm
from engine.cuda.dispatch import use_matvec
from engine.cuda.driver import Launch
from engine.cuda.lora import NO_LORA
from engine.cuda.memory import DeviceArray, DeviceWeight
from engine.cuda.upload import DeviceWeights
from engine.cuda.vmm import StateArray, position_rows
from engine.errors import CudaError, UnsupportedArchitecture
from engine.models import dense_cuda, specs
from engine.models.moe_cuda import LORA_TARGETS as MOE_LORA
from engine.models.moe_cuda import MoEFFN
from engine.quants import GGMLType
from engine.weights import group_by_layer, resolve


def _from(a: DeviceArray, offset: int) -> DeviceArray:
    """The flat tail of `a` from element `offset` (a column offset into row 0 of a row-major buffer)."""
    return a.view(offset, (a.size - offset,))


def _identity(d: int) -> DeviceArray:
    """I (d, d) f32 on the device."""
    host = array.array("f", bytes(4 * d * d))
    for j in range(d):
        host[j * d + j] = 1.0
    eye = DeviceArray.empty((d, d))
    memory.memcpy(eye.ptr, host.buffer_info()[0], 4 * d * d, memory.H2D)
    return eye


class CudaModel:
    # The LM head is the dense family's: the same buffers (x, normed, logits) and weights (output, output_norm).
    head_logits = dense_cuda.CudaModel.head_logits
    head_argmax = dense_cuda.CudaModel.head_argmax
    head_gather = dense_cuda.CudaModel.head_gather
    # Matmuls with their LoRA updates (two extra launches each), and the matrices that may carry one (the MoE FFN's
    # router, experts and shared expert: engine/models/moe_cuda.py).
    _matmul = dense_cuda.CudaModel._matmul
    _matmuls = dense_cuda.CudaModel._matmuls
    LORA_TARGETS = MOE_LORA | frozenset({"attn_q", "attn_k", "attn_v", "attn_output", "attn_qkv", "attn_gate", "ssm_in",
                                         "ssm_ba", "ssm_beta", "ssm_alpha", "ssm_out", "ffn_gate", "ffn_up",
                                         "ffn_down"})  # fmt: skip

    def __init__(self, cfg: ModelConfig, weights: DeviceWeights, max_seq: int, max_batch: int, kv_dtype: str = "f4"):
        g = cfg.gdn
        assert g is not None
        if cfg.rope_scaling.kind not in ("none", "linear") or cfg.rope_scaling.mscale != 1.0:
            raise UnsupportedArchitecture(f"{cfg.arch}: RoPE scaling '{cfg.rope_scaling.kind}' has no CUDA path yet")
        if cfg.value_dim != cfg.head_dim or g.head_k_dim not in kd.HEAD_K_DIMS or g.head_v_dim % 4:
            raise UnsupportedArchitecture(
                f"{cfg.arch}: no CUDA kernels for attention heads {cfg.head_dim}/{cfg.value_dim} (the output gate "
                f"needs them equal) or Gated DeltaNet heads {g.head_k_dim}/{g.head_v_dim} (key dims "
                f"{'/'.join(map(str, kd.HEAD_K_DIMS))}, value dims a multiple of 4)"
            )
        self.cfg = cfg
        self.gdn = g
        self.weights = weights  # owns the device allocation every weight handle below points into
        self.max_seq = max_seq
        self.max_batch = max_batch
        self.kv_dtype = kv_dtype  # the attention layers' K/V element, "f4" or "f2" (engine/cache_type.py)
        # State files: k, v (n_attn, n, KVH, hd) of kv_dtype, conv (n_rec, K-1, conv_dim), ssm (n_rec, H_v, Dk, Dv)
        # f32, the NumPy HybridCache's arrays. None (no state files) when Dv is not a multiple of 32: the F32 GEMM
        # transposes ssm.
        self.STATE_LAYOUT: str | None = cache_type.layout("hybrid", kv_dtype)
        infos = resolve(weights.gf, specs.hybrid(cfg))
        # ssm_conv1d (ne [K, conv_dim]) is read as plain float32 values, not as matvec rows.
        top, self.layers = group_by_layer(
            {name: weights.vector(info) if name.endswith(".ssm_conv1d.weight") else weights.tensor(info)
             for name, info in infos.items()}, cfg.n_layers)  # fmt: skip
        self.token_embd = top["token_embd"]  # (n_vocab rows, dim)
        self.output = self.token_embd if cfg.tied_output else top["output"]
        self.output_norm = top["output_norm"]  # (dim,) f32
        # Each layer's index among the layers of its kind: its slot in the K/V cache or in the recurrent state.
        self.slots = [g.recurrent[:i].count(kind) for i, kind in enumerate(g.recurrent)]
        moe = cfg.moe
        self.moe = [MoEFFN(cfg, L, max_batch) if moe is not None and i >= moe.n_dense_leading else None
                    for i, L in enumerate(self.layers)]  # fmt: skip
        self.lora = NO_LORA  # engine/cuda/lora.attach replaces it before the first launch list is built
        if g.head_v_dim % 32:
            self.STATE_LAYOUT = None
        self._allocate()
        self._saved = 0  # serial number of the state in the snapshot buffers (0: none)

    def _allocate(self) -> None:
        c, g, b = self.cfg, self.gdn, self.max_batch
        n_rec = sum(g.recurrent)
        n_attn = c.n_layers - n_rec
        self.ctrl = DeviceArray.empty((4 + b,), "i4")  # [pos0, sample step, -, -, token ids (b,)]
        self.pos = self.ctrl.view(0, (1,))
        self.step = self.ctrl.view(1, (1,))
        self.ids = self.ctrl.view(4, (b,))
        self.x = DeviceArray.empty((b, c.dim))  # residual stream (b, dim) f32
        self.xb = DeviceArray.empty((b, c.dim))  # normed rows for the GEMM path (b, dim) f32
        self.normed = DeviceArray.empty((b, c.dim))  # final-normed rows for gathered logits (b, dim) f32
        self.logits = DeviceArray.empty((dense_cuda.logit_rows(c.n_vocab), c.n_vocab))  # (rows, n_vocab) f32
        hidden = max(c.hidden_dim, 1)
        self.hb = DeviceArray.empty((b, hidden))  # (b, hidden) f32
        self.hb2 = DeviceArray.empty((b, hidden))  # (b, hidden) f32, only when gate/up types differ
        # Gated attention.
        self.qg = DeviceArray.empty((b, 2 * c.n_heads * c.head_dim))  # (b, H*2*hd) f32: per head [q | gate]
        self.q = DeviceArray.empty((b, c.n_heads * c.head_dim))  # (b, H*hd) f32
        self.gate = DeviceArray.empty((b, c.n_heads * c.head_dim))  # (b, H*hd) f32
        self.k = DeviceArray.empty((b, c.n_kv_heads * c.head_dim))  # (b, KVH*hd) f32
        self.v = DeviceArray.empty((b, c.n_kv_heads * c.value_dim))  # (b, KVH*vd) f32
        self.att = DeviceArray.empty((b, c.n_heads * c.value_dim))  # (b, H*vd) f32
        # (H, splits, vd) f32, (H, splits, 2) f32, (16*H,) i32: attn_decode's partials and tickets
        self.part_o, self.part_ml, self.tickets = ka.decode_buffers(c.n_heads, c.n_kv_heads, c.value_dim, c.head_dim)
        kv_k, kv_v = (n_attn, self.max_seq, c.n_kv_heads, c.head_dim), (n_attn, self.max_seq, c.n_kv_heads, c.value_dim)
        self.k_cache = vmm.cache(kv_k, self.kv_dtype)  # f32 or f16, rows mapped by need
        self.v_cache = vmm.cache(kv_v, self.kv_dtype)  # f32 or f16, rows mapped by need
        self.caches = (self.k_cache, self.v_cache)
        # Gated DeltaNet.
        value_dim = g.n_v_heads * g.head_v_dim
        self.qkv = DeviceArray.empty((b, g.conv_dim))  # (b, conv_dim) f32: conv inputs [q | k | v]
        self.mixed = DeviceArray.empty((b, g.conv_dim))  # (b, conv_dim) f32: conv outputs, q/k then normalised
        self.z = DeviceArray.empty((b, value_dim))  # (b, H_v*Dv) f32: the output gate (attn_gate)
        self.beta = DeviceArray.empty((b, g.n_v_heads))  # (b, H_v) f32: ssm_beta, then sigmoid
        self.decay = DeviceArray.empty((b, g.n_v_heads))  # (b, H_v) f32: ssm_alpha, then the decay
        self.o = DeviceArray.empty((b, value_dim))  # (b, H_v*Dv) f32: recurrence output, then gated-normed
        fused_in = any("ssm_in" in L for L in self.layers)
        fused_ba = any("ssm_ba" in L for L in self.layers)
        self.fused = DeviceArray.empty((b, g.conv_dim + value_dim) if fused_in else (1,))  # ssm_in rows f32
        self.ba = DeviceArray.empty((b, 2 * g.n_v_heads) if fused_ba else (1,))  # ssm_ba rows f32
        conv = (n_rec, g.conv_kernel - 1, g.conv_dim)
        ssm = (n_rec, g.n_v_heads, g.head_v_dim, g.head_k_dim)
        self.conv_state = DeviceArray.empty(conv)  # (n_rec, K-1, conv_dim) f32: last K-1 conv inputs
        self.ssm_state = DeviceArray.empty(ssm)  # (n_rec, H_v, Dv, Dk) f32: S transposed per v head
        self.conv_saved = DeviceArray.empty(conv)  # snapshot copies of the two
        self.ssm_saved = DeviceArray.empty(ssm)  # ... also a state file's ssm (n_rec, H_v, Dk, Dv) on its way
        for state in (self.conv_state, self.ssm_state):
            state.fill_byte(0)
        # Identities (Dk, Dk) and (Dv, Dv) f32: the F32 GEMM with A = I computes C = Wᵀ exactly (one product by 1
        # and zeros per output), which is how ssm is transposed between the kernels' order and the file's.
        self.eye_k, self.eye_v = (_identity(d) for d in (g.head_k_dim, g.head_v_dim))
        # The fills run on the legacy stream; load_runner waits for it once the model is built.

    @property
    def kv_cache_bytes(self) -> int:
        """Per-sequence state: the attention layers' K/V and the recurrent layers' conv and delta-rule states."""
        return self.k_cache.nbytes + self.v_cache.nbytes + self.conv_state.nbytes + self.ssm_state.nbytes

    # -- recurrent state -----------------------------------------------------------------------------------

    def reset_state(self, stream: int) -> None:
        """A new sequence starts from zero conv and recurrent state."""
        for state in (self.conv_state, self.ssm_state):
            memory.memset_async(state.ptr, 0, state.nbytes, stream)

    def save_state(self, stream: int) -> int:
        """Copy the states aside (device to device); returns the serial number `load_state` takes."""
        for src, dst in ((self.conv_state, self.conv_saved), (self.ssm_state, self.ssm_saved)):
            memory.memcpy_async(dst.ptr, src.ptr, src.nbytes, memory.D2D, stream)
        self._saved += 1
        return self._saved

    def load_state(self, saved: int, stream: int) -> None:
        """Copy the states saved as `saved` back; only the latest save is kept."""
        if saved != self._saved:
            raise CudaError(f"recurrent state snapshot {saved} was overwritten by snapshot {self._saved}")
        for src, dst in ((self.conv_saved, self.conv_state), (self.ssm_saved, self.ssm_state)):
            memory.memcpy_async(dst.ptr, src.ptr, src.nbytes, memory.D2D, stream)

    # -- state files (engine/state.py) -------------------------------------------------------------------------

    def state_arrays(self, n: int) -> list[StateArray]:
        """A state after n positions: the K/V rows of the attention layers, the conv state, and ssm in the file's
        order, staged in ssm_saved (see `state_export_launches` / `state_import_launches`)."""
        g, conv = self.gdn, self.conv_state
        ssm = (self.ssm_state.shape[0], g.n_v_heads, g.head_k_dim, g.head_v_dim)
        return [position_rows("k", self.k_cache, n), position_rows("v", self.v_cache, n),
                StateArray("conv", "f4", conv.shape, [(conv.ptr, conv.nbytes)], False),
                StateArray("ssm", "f4", ssm, [(self.ssm_saved.ptr, self.ssm_saved.nbytes)], False)]  # fmt: skip

    def _transposes(self, to_file: bool) -> list[Launch]:
        """Every v head's state between ssm_state (Sᵀ, (Dv, Dk)) and the file order in ssm_saved (S, (Dk, Dv)). The
        staging overwrites the snapshot copy, so an earlier snapshot can no longer be restored."""
        g = self.gdn
        Dk, Dv = g.head_k_dim, g.head_v_dim
        self._saved += 1
        src, dst = (self.ssm_state, self.ssm_saved) if to_file else (self.ssm_saved, self.ssm_state)
        rows, cols, eye = (Dv, Dk, self.eye_k) if to_file else (Dk, Dv, self.eye_v)
        out = []
        for head in range(self.ssm_state.shape[0] * g.n_v_heads):
            at = head * Dk * Dv
            w = DeviceWeight(src.ptr + 4 * at, GGMLType.F32, rows, cols, 4 * cols, "ssm state")
            out.append(kg.gemm(w, eye, cols, dst.view(at, (cols, rows))))
        return out

    def state_export_launches(self) -> list[Launch]:
        """Before a state file reads `state_arrays`: ssm into the file's order."""
        return self._transposes(to_file=True)

    def state_import_launches(self) -> list[Launch]:
        """After a state file's arrays were copied to `state_arrays`: ssm into the kernels' order."""
        return self._transposes(to_file=False)

    # -- the forward pass ----------------------------------------------------------------------------------

    def forward(self, n: int) -> list[Launch]:
        """Launches that embed ids[:n] at positions pos0.. and run every layer; the result is x[:n] (unnormed)."""
        out = [ke.embed(self.token_embd, self.ids, n, self.x)]
        for i, L in enumerate(self.layers):
            mixer = self._deltanet if self.gdn.recurrent[i] else self._attention
            out += mixer(L, n, self.slots[i])
            out += self._ffn(L, n, i)
        return out

    def _freq_scale(self) -> float:
        s = self.cfg.rope_scaling
        return 1.0 / s.factor if s.kind == "linear" else 1.0

    def _normed(self, norm_w: DeviceArray, n: int) -> tuple[DeviceArray, DeviceArray | None, list[Launch]]:
        """(source rows, norm for the matvecs to fuse, launches): x itself with norm_w on the matvec path, else
        rows normed into xb for the GEMMs."""
        if use_matvec(n):
            return self.x, norm_w, []
        return self.xb, None, [knr.rmsnorm_rows(self.x, norm_w, self.cfg.norm_eps, self.xb, n)]

    def _deltanet(self, L: dict, n: int, slot: int) -> list[Launch]:
        c, g = self.cfg, self.gdn
        C, K, H_k, H_v, Dk, Dv = g.conv_dim, g.conv_kernel, g.n_k_heads, g.n_v_heads, g.head_k_dim, g.head_v_dim
        r, key_dim, value_dim = H_v // H_k, H_k * Dk, H_v * Dv
        src, norm, out = self._normed(L["attn_norm"], n)
        # qwen3next files fuse [q (Dk) | k (Dk) | v (r*Dv) | z (r*Dv)] (ssm_in) and [b (r) | a (r)] (ssm_ba) per k head
        fused_in, fused_ba = "ssm_in" in L, "ssm_ba" in L
        projections = [(L["ssm_in"], self.fused)] if fused_in else [(L["attn_qkv"], self.qkv), (L["attn_gate"], self.z)]
        gates = [(L["ssm_ba"], self.ba)] if fused_ba else [(L["ssm_beta"], self.beta), (L["ssm_alpha"], self.decay)]
        out += self._matmuls([*projections, *gates], src, n, norm_w=norm)
        if fused_in:
            dsts = [
                (self.qkv, C),
                (_from(self.qkv, key_dim), C),
                (_from(self.qkv, 2 * key_dim), C),
                (self.z, value_dim),
            ]
            out.append(kd.split_groups(self.fused, n, H_k, (Dk, Dk, r * Dv, r * Dv), dsts))
        if fused_ba:
            out.append(kd.split_groups(self.ba, n, H_k, (r, r), [(self.beta, H_v), (self.decay, H_v)]))
        conv_state = self.conv_state.view(slot * (K - 1) * C, ((K - 1) * C,))
        ssm_state = self.ssm_state.view(slot * H_v * Dv * Dk, (H_v * Dv * Dk,))
        out += [
            kd.conv_silu(self.qkv, n, C, L["ssm_conv1d"], K, conv_state, self.mixed),
            kd.l2norm_gates(self.mixed, n, C, H_k, Dk, c.norm_eps, 1.0 / math.sqrt(Dk), self.beta, self.decay,
                            L["ssm_a"], L["ssm_dt"], H_v),
            kd.recurrence(self.mixed, self.decay, self.beta, n, H_k, H_v, Dk, Dv, g.v_head_order == "tiled",
                          ssm_state, self.o),
            kd.gated_norm(self.o, self.z, L["ssm_norm"], c.norm_eps, n * H_v, Dv),
        ]  # fmt: skip
        out += self._matmul(L["ssm_out"], self.o, n, self.x, resid=self.x)
        return out

    def _attention(self, L: dict, n: int, slot: int) -> list[Launch]:
        c = self.cfg
        H, KVH, hd, vd = c.n_heads, c.n_kv_heads, c.head_dim, c.value_dim
        src, norm, out = self._normed(L["attn_norm"], n)
        out += self._matmuls([(L["attn_q"], self.qg), (L["attn_k"], self.k), (L["attn_v"], self.v)], src, n, norm)
        out.append(kd.split_groups(self.qg, n, H, (hd, hd), [(self.q, H * hd), (self.gate, H * hd)]))
        kc = self.k_cache.view(slot * self.max_seq * KVH * hd, self.k_cache.shape[1:])
        vc = self.v_cache.view(slot * self.max_seq * KVH * vd, self.v_cache.shape[1:])
        out.append(knr.qk_rope_kv(self.q, self.k, self.v, n, H, KVH, hd, vd, L["attn_q_norm"], L["attn_k_norm"],
                                 c.norm_eps, c.rope_dim, c.rope_theta, self._freq_scale(), None, c.rope_type == "neox",
                                 self.pos, kc, vc))  # fmt: skip
        scale = 1.0 / math.sqrt(hd)
        out += ka.attention_launches(self.q, kc, vc, self.pos, n, H, KVH, hd, vd, scale, self.part_o, self.part_ml,
                                     self.tickets, self.att)  # fmt: skip
        out.append(kd.sigmoid_mul(self.att, self.gate, n * H * vd))
        out += self._matmul(L["attn_output"], self.att, n, self.x, resid=self.x)
        return out

    def _ffn(self, L: dict, n: int, i: int) -> list[Launch]:
        """x[:n] += FFN(RMSNorm(x, post_attention_norm)): the MoE module's launches, or a dense SwiGLU."""
        norm_w, eps = L["post_attention_norm"], self.cfg.norm_eps
        if self.moe[i] is not None:
            return self.moe[i].launches(self.x, n, norm_w)
        gate, up = L["ffn_gate"], L["ffn_up"]
        small = use_matvec(n)
        src, norm, out = self._normed(norm_w, n)
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

"""The kernel-choice rules of engine/cuda/dispatch.py, on any machine."""

from __future__ import annotations

import pytest

from engine.cuda import dispatch, k_matvec, k_tc_matvec
from engine.cuda.memory import DeviceArray, DeviceWeight
from engine.errors import CudaError, InvalidInput
from engine.quants import GGMLType


def test_the_rule_sends_batches_past_one_pass_to_tc() -> None:
    assert not dispatch.use_tc(dispatch.SMALL_BATCH)
    assert dispatch.use_tc(dispatch.SMALL_BATCH + 1) and dispatch.use_tc(dispatch.MATVEC_MAX)
    assert dispatch.MATVEC_MAX <= k_tc_matvec.MAX_TOKENS


def test_the_split_rule_fills_the_gpu_in_whole_stages() -> None:
    assert dispatch.gemm_splits(dispatch.GEMM_FULL_BLOCKS, 32) == 1  # a full grid: no split
    assert dispatch.gemm_splits(16, 32) == dispatch.GEMM_MAX_SPLITS  # K = 1024 over 16 tiles
    assert dispatch.gemm_splits(100, 32) == 2  # 264 // 100 = 2 fit
    assert dispatch.gemm_splits(16, 6) == 6 and dispatch.gemm_splits(16, 7) == 7 and dispatch.gemm_splits(16, 9) == 3
    for blocks in range(1, 300):
        for stages in range(1, 100):
            s = dispatch.gemm_splits(blocks, stages)
            assert stages % s == 0 and s * blocks <= max(blocks, dispatch.GEMM_FULL_BLOCKS)


def test_decode_splits_fill_one_wave_where_the_form_is_folded(monkeypatch) -> None:
    monkeypatch.delenv("REFLEX_DECODE_SPLITS", raising=False)
    assert dispatch.decode_splits(16, 8, 128) == 49  # Qwen3-0.6B: 8 kv heads x 49 splits <= 396 blocks
    assert dispatch.decode_splits(8, 2, 256) == dispatch.N_SPLITS  # the hybrid: 4 x 256 x splits, a long combine
    assert dispatch.decode_splits(2, 2, 64) == dispatch.MAX_SPLITS  # one q head a kv head: capped by attn_combine
    assert dispatch.decode_splits(32, 4, 128) == dispatch.N_SPLITS  # 30B-A3B: 2 blocks of 4 q heads, 4 x 128 x 32
    assert dispatch.decode_splits(64, 64, 128) == dispatch.N_SPLITS  # many kv heads: never fewer than N_SPLITS
    assert dispatch.combine_splits() == dispatch.N_SPLITS
    for H, KVH, vd in ((16, 8, 128), (8, 2, 256), (32, 4, 128), (40, 8, 128), (4, 1, 64), (2, 2, 64), (64, 4, 128)):
        s = dispatch.decode_splits(H, KVH, vd)
        assert dispatch.N_SPLITS <= s <= dispatch.MAX_SPLITS
        rows = KVH * dispatch.decode_attention(H, KVH)[2]
        fits = rows * s <= dispatch.DECODE_WAVE_BLOCKS[4] and H // rows * vd * s <= dispatch.COMBINE_TAIL
        assert s == dispatch.N_SPLITS or fits
    monkeypatch.setenv("REFLEX_DECODE_SPLITS", "48")  # one count for every form, for comparisons
    assert dispatch.decode_splits(16, 8, 128) == dispatch.decode_splits(32, 4, 128) == dispatch.combine_splits() == 48
    monkeypatch.setenv("REFLEX_DECODE_SPLITS", "500")
    assert dispatch.combine_splits() == dispatch.MAX_SPLITS


def test_decode_warps_are_four_unless_eight_are_asked_for_narrow_heads(monkeypatch) -> None:
    monkeypatch.delenv("REFLEX_DECODE_SPLITS", raising=False)
    monkeypatch.delenv("REFLEX_ATTN_WARPS", raising=False)
    assert {dispatch.decode_warps(G, hd, hd) for G in (1, 2, 4, 8) for hd in (64, 128, 256)} == {4}
    monkeypatch.setenv("REFLEX_ATTN_WARPS", "8")  # attn_decode_w8: at most 4 heads a block, at most 128 wide
    assert dispatch.decode_warps(2, 128, 128) == dispatch.decode_warps(4, 64, 64) == 8
    assert {
        dispatch.decode_warps(5, 128, 128),
        dispatch.decode_warps(2, 256, 256),
        dispatch.decode_warps(2, 192, 128),
    } == {4}
    # its wave: 2 blocks an SM, so the Qwen3-0.6B shape's 8 kv heads take 33 splits (264 blocks), not 49
    assert dispatch.decode_splits(16, 8, 128, 128) == 33 and dispatch.decode_splits(8, 2, 256, 256) == dispatch.N_SPLITS
    monkeypatch.setenv("REFLEX_ATTN_WARPS", "6")
    with pytest.raises(InvalidInput, match="REFLEX_ATTN_WARPS"):
        dispatch.decode_warps(2, 128, 128)


def test_decode_attention_keeps_a_kv_head_in_one_block_unless_shared(monkeypatch) -> None:
    monkeypatch.delenv("REFLEX_ATTN_PARTS", raising=False)
    assert dispatch.decode_attention(32, 4) == (False, 1, 1)  # 8 q heads a block: split + combine
    assert dispatch.decode_attention(16, 4) == (True, 128, 1)
    assert dispatch.decode_attention(28, 4) == (True, 128, 1)  # 7 a block: folded
    monkeypatch.setenv("REFLEX_ATTN_MIN_CHUNK", "64")  # the comparison's chunk
    assert dispatch.decode_attention(16, 4) == (True, 64, 1) and dispatch.decode_attention(32, 4) == (False, 1, 1)
    monkeypatch.delenv("REFLEX_ATTN_MIN_CHUNK")
    monkeypatch.setenv("REFLEX_ATTN_PARTS", "shared")  # blocks of at most 4 q heads, every form folded
    for G, parts in ((1, 1), (2, 1), (4, 1), (5, 5), (6, 2), (8, 2), (12, 3), (16, 4)):
        assert dispatch.shared_parts(G) == parts, G
        assert dispatch.decode_attention(4 * G, 4) == (True, 128, parts), G


def test_matvec3_takes_one_type_or_a_listed_pair_with_the_odd_one_last() -> None:
    Q4, Q6, Q8 = GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q8_0
    assert k_matvec.matvec3_order([Q8, Q8, Q8]) == [0, 1, 2]
    assert k_matvec.matvec3_order([Q4]) == [0]
    assert k_matvec.matvec3_order([Q4, Q4, Q6]) == [0, 1, 2]
    assert k_matvec.matvec3_order([Q6, Q4, Q4]) == [1, 2, 0]  # the Q6_K matrix goes last
    assert k_matvec.matvec3_order([Q4, Q6, Q6]) is None  # (Q6_K, Q4_K) is not a pair
    assert k_matvec.matvec3_order([Q4, Q6]) is None  # a pair takes three matrices
    assert k_matvec.matvec3_order([Q4, Q4, Q8]) is None
    assert k_matvec.matvec3_order([GGMLType.IQ4_XS]) is None  # no matvec3 for the low-bit types
    assert k_matvec.matvec3_order([Q4] * 4) is None


def test_moe_batches_take_the_expert_kernels_up_to_128_routed_items(monkeypatch) -> None:
    monkeypatch.delenv("REFLEX_MOE_MATVEC_ITEMS", raising=False)
    assert dispatch.moe_matvec_tokens(8) == 16  # Qwen3-30B-A3B: system1's 13-token prompts
    assert dispatch.moe_matvec_tokens(6) == 21  # DeepSeek-V2-Lite
    assert dispatch.moe_matvec_tokens(2) == 64
    assert dispatch.moe_matvec_tokens(32) == dispatch.SMALL_BATCH  # never fewer than a decode batch
    monkeypatch.setenv("REFLEX_MOE_MATVEC_ITEMS", "0")  # the grouped GEMM past SMALL_BATCH, for comparisons
    assert dispatch.moe_matvec_tokens(8) == dispatch.SMALL_BATCH


def test_short_batches_take_the_decode_attention(monkeypatch) -> None:
    monkeypatch.delenv("REFLEX_DECODE_TOKENS", raising=False)
    assert dispatch.decode_tokens(1, 1) and dispatch.decode_tokens(dispatch.DECODE_TOKENS, 49)
    assert not dispatch.decode_tokens(dispatch.DECODE_TOKENS + 1, 49)  # attn_prefill
    assert not dispatch.decode_tokens(13, 8)  # 13 tokens do not fit partials of 8 splits
    monkeypatch.setenv("REFLEX_DECODE_TOKENS", "0")
    assert dispatch.decode_tokens(1, 49) and not dispatch.decode_tokens(2, 49)


def test_prefill_attention_takes_tensor_cores_on_sm80_at_its_head_dims_unless_turned_off(monkeypatch) -> None:
    monkeypatch.delenv("REFLEX_ATTN_TC", raising=False)
    assert dispatch.prefill_tc(128, 128, 9) and dispatch.prefill_tc(64, 64, 8)
    assert not dispatch.prefill_tc(128, 128, 7)  # sm_75: no tf32 mma
    assert not any(dispatch.prefill_tc(hd, vd, 9) for hd, vd in ((256, 256), (96, 96), (192, 128), (128, 64)))
    monkeypatch.setenv("REFLEX_ATTN_TC", "0")  # comparisons
    assert not dispatch.prefill_tc(128, 128, 9)


def test_three_matrices_pack_padded_to_three() -> None:
    """matvec3 and tcmv3's shared packing: pointers, row bytes and rows of three matrices (a missing one: no rows),
    the outputs, the type tag (a pair's b last) and the blocks; the order rule's refusals name the kernel."""
    q, k = DeviceWeight(0x1000, GGMLType.Q4_K, 20, 256, 144, "q"), DeviceWeight(0x2000, GGMLType.Q4_K, 8, 256, 144, "k")
    v = DeviceWeight(0x3000, GGMLType.Q6_K, 8, 256, 210, "v")
    ys = [DeviceArray(0x4000 + 0x100 * i, (1, 20), "f4", False) for i in range(3)]
    tags, weights, outs, blocks = k_matvec.matvec3_operands("tcmv3", [q, k, v], ys, 8)
    assert tags == "q4_k_q6_k" and blocks == 3 + 1 + 1
    assert [a.value for a in weights] == [0x1000, 0x2000, 0x3000, 144, 144, 210, 20, 8, 8]
    assert [a.value for a in outs] == [0x4000, 0x4100, 0x4200]
    tags, weights, outs, blocks = k_matvec.matvec3_operands("matvec3", [q], ys[:1], 8)
    assert tags == "q4_k" and blocks == 3
    assert [a.value for a in weights] == [0x1000, 0x1000, 0x1000, 144, 144, 144, 20, 0, 0]
    assert [a.value for a in outs] == [0x4000] * 3
    with pytest.raises(CudaError, match="tcmv3 takes matrices of one width"):
        k_matvec.matvec3_operands("tcmv3", [q, v, k], ys, 8)


def test_prefill_tc_key_groups_are_two_unless_asked(monkeypatch) -> None:
    monkeypatch.delenv("REFLEX_ATTN_TC_KEYS", raising=False)
    assert dispatch.prefill_tc_key_groups() == 2
    monkeypatch.setenv("REFLEX_ATTN_TC_KEYS", "1")
    assert dispatch.prefill_tc_key_groups() == 1
    for bad in ("3", "0", "two"):
        monkeypatch.setenv("REFLEX_ATTN_TC_KEYS", bad)
        with pytest.raises(InvalidInput, match="REFLEX_ATTN_TC_KEYS"):
            dispatch.prefill_tc_key_groups()

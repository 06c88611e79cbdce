"""The kernel-choice rules of engine/cuda/dispatch.py, on any machine."""

from __future__ import annotations

from engine.cuda import dispatch, k_tc_matvec


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

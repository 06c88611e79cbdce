"""The layout's promises, checked: every registry row names modules that exist, every kernel file has its one
wrapper module, and the kernels instantiate exactly the quant types the Python side calls supported."""

from __future__ import annotations

import importlib.util
import pathlib
import re

from engine import archs
from engine.quants import FLOAT_TYPES, KERNEL_TAGS, LOWBIT_TYPES, SUPPORTED_TYPES

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_every_arch_row_names_existing_modules():
    for arch in archs.ARCHS.values():
        assert arch.rope in ("neox", "norm"), arch
        assert arch.moe in (None, "qwen", "deepseek"), arch
        for module in (arch.numpy_module, arch.cuda_module):
            if module is not None:
                assert importlib.util.find_spec(f"engine.models.{module}") is not None, (arch.name, module)


def test_one_wrapper_module_per_kernel_file():
    kernels = {p.stem for p in (ROOT / "kernels").glob("*.cu")}
    wrappers = {p.stem.removeprefix("k_") for p in (ROOT / "engine" / "cuda").glob("k_*.py")}
    assert kernels == wrappers


def test_kernel_type_tags_match_quant_cuh():
    text = (ROOT / "kernels" / "quant.cuh").read_text()

    def tags(macro: str) -> list[str]:
        body = re.search(rf"#define {macro}\(X\)((?:.*\\\n)*.*\n)", text).group(1)
        return re.findall(r"X\((\w+), q::\w+\)", body)

    def defines(macro: str, *parts: str) -> bool:
        return re.search(rf"#define {macro}\(X\) " + " ".join(rf"{p}\(X\)" for p in parts) + "\n", text) is not None

    assert defines("Q_FOR_EACH_TYPE", "Q_FOR_EACH_COMMON_TYPE", "Q_FOR_EACH_LOWBIT_TYPE")
    assert defines("Q_FOR_EACH_COMMON_TYPE", "Q_FOR_EACH_FLOAT_TYPE", "Q_FOR_EACH_QUANT_COMMON_TYPE")
    assert defines("Q_FOR_EACH_QUANTIZED_TYPE", "Q_FOR_EACH_QUANT_COMMON_TYPE", "Q_FOR_EACH_LOWBIT_TYPE")
    common = tags("Q_FOR_EACH_FLOAT_TYPE") + tags("Q_FOR_EACH_QUANT_COMMON_TYPE")
    assert sorted(common + tags("Q_FOR_EACH_LOWBIT_TYPE")) == sorted(KERNEL_TAGS.values())
    assert sorted(tags("Q_FOR_EACH_FLOAT_TYPE")) == sorted(KERNEL_TAGS[t] for t in FLOAT_TYPES)
    assert sorted(tags("Q_FOR_EACH_LOWBIT_TYPE")) == sorted(KERNEL_TAGS[t] for t in LOWBIT_TYPES)
    assert frozenset(KERNEL_TAGS) <= SUPPORTED_TYPES  # the NumPy backend decodes more types than the kernels


def test_registry_and_specs_import_no_numpy_for_the_cuda_cold_path():
    for path in (ROOT / "engine" / "archs.py", ROOT / "engine" / "models" / "specs.py"):
        assert not re.search(r"^\s*(import numpy|from numpy|from engine\.cpu)", path.read_text(), re.M), path


def test_gemm_tc_shared_memory_follows_the_kernel():
    """engine/cuda/k_gemm_tc.py sizes gemm_dense's and gemm_pipe's dynamic shared memory and grids from the kernel's
    constants."""
    from engine.cuda import k_gemm, k_gemm_tc

    text = (ROOT / "kernels" / "gemm_tc.cu").read_text() + (ROOT / "kernels" / "gemm_tc_tile.cuh").read_text()
    tile = re.search(r"constexpr int BM = (\d+), BN = (\d+), BK = (\d+), LD = BK \+ (\d+), THREADS = (\d+);", text)
    stages = re.search(r"constexpr int NSTAGE = (\d+);", text)
    assert tile and stages, "gemm_tc.cu's tile constants moved"
    bm, bn, bk, pad, threads = map(int, tile.groups())
    assert (bm, bn, threads) == (k_gemm_tc.TOKENS, k_gemm.TILE, k_gemm_tc.THREADS)
    assert int(stages.group(1)) == k_gemm_tc.STAGES
    assert 4 * k_gemm_tc.STAGES * (bm + bn) * (bk + pad) == k_gemm_tc.SMEM
    assert k_gemm.SPLIT_STEP % bk == 0  # a split takes whole stages
    pipe = re.search(r"constexpr int RAW_K = (\d+), PIPE_STAGES = (\d+);", text)
    assert pipe, "gemm_tc.cu's pipe constants moved"
    assert (int(pipe.group(1)), int(pipe.group(2))) == (k_gemm_tc.RAW_K, k_gemm_tc.PIPE_STAGES)
    warps = re.search(r"#define PIPE_WARPS (\d+)", text)
    assert warps and 32 * int(warps.group(1)) == k_gemm_tc.PIPE_THREADS[0], "gemm_pipe's default block moved"


def test_tcmv_default_block_follows_the_kernel():
    """k_tc_matvec.ONE_THREADS holds tcmv's default blocks: [0] at 16 tokens, [1] at 32 and 64."""
    from engine.cuda import k_tc_matvec

    text = (ROOT / "kernels" / "tc_matvec.cu").read_text()
    at16 = re.search(r"#define TCMV_ONE16 (\d+)", text)
    wider = re.search(r"constexpr int WARPS_ONE = MT == 1 \? TCMV_ONE16 : (\d+);", text)
    assert at16 and wider, "tc_matvec.cu's tcmv block constants moved"
    assert (32 * int(at16.group(1)), 32 * int(wider.group(1))) == k_tc_matvec.ONE_THREADS


def test_attn_decode_fold_room_follows_the_kernel():
    """k_attention bounds the folded combine's weights (heads x splits) by attn_decode's shared floats."""
    from engine.cuda import k_attention

    text = (ROOT / "kernels" / "attention_decode.cuh").read_text()
    room = re.search(r"constexpr int FOLD_FLOATS = ([^;]+);", text)
    assert room, "attention_decode.cuh's FOLD_FLOATS moved"
    assert eval(room.group(1), {}) == k_attention.FOLD_FLOATS  # an integer expression of literals


def test_attn_decode_blocks_follow_the_kernel():
    """dispatch.DECODE_WAVE_BLOCKS holds each attn_decode entry's blocks an SM (its launch bounds) on 132 SMs."""
    from engine.cuda import dispatch

    text = (ROOT / "kernels" / "attention.cu").read_text()
    entries = re.findall(r"^ATTN_DECODE\((attn_decode\w*), (float|__half), (\d+), (\d+)\)$", text, re.M)
    assert len(entries) == 4, "attention.cu's attn_decode entries moved"
    assert {int(w): 132 * int(b) for _, _, w, b in entries} == dispatch.DECODE_WAVE_BLOCKS
    assert {name for name, _, w, _ in entries if w == "8"} == {"attn_decode_w8", "attn_decode_w8_f16"}

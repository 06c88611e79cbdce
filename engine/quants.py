"""ggml tensor types: ids, block sizes and bytes per block, as stored in GGUF tensor infos."""

from __future__ import annotations

import enum


class GGMLType(enum.IntEnum):
    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39


QK_K = 256

# type -> (values per block, bytes per block)
BLOCK_SIZES: dict[GGMLType, tuple[int, int]] = {
    GGMLType.F32: (1, 4),
    GGMLType.F16: (1, 2),
    GGMLType.BF16: (1, 2),
    GGMLType.F64: (1, 8),
    GGMLType.I8: (1, 1),
    GGMLType.I16: (1, 2),
    GGMLType.I32: (1, 4),
    GGMLType.I64: (1, 8),
    GGMLType.Q4_0: (32, 18),
    GGMLType.Q4_1: (32, 20),
    GGMLType.Q5_0: (32, 22),
    GGMLType.Q5_1: (32, 24),
    GGMLType.Q8_0: (32, 34),
    GGMLType.Q8_1: (32, 36),
    GGMLType.Q2_K: (QK_K, 84),
    GGMLType.Q3_K: (QK_K, 110),
    GGMLType.Q4_K: (QK_K, 144),
    GGMLType.Q5_K: (QK_K, 176),
    GGMLType.Q6_K: (QK_K, 210),
    GGMLType.Q8_K: (QK_K, 292),
    GGMLType.IQ2_XXS: (QK_K, 66),
    GGMLType.IQ2_XS: (QK_K, 74),
    GGMLType.IQ3_XXS: (QK_K, 98),
    GGMLType.IQ1_S: (QK_K, 50),
    GGMLType.IQ4_NL: (32, 18),
    GGMLType.IQ3_S: (QK_K, 110),
    GGMLType.IQ2_S: (QK_K, 82),
    GGMLType.IQ4_XS: (QK_K, 136),
    GGMLType.IQ1_M: (QK_K, 56),
    GGMLType.TQ1_0: (QK_K, 54),
    GGMLType.TQ2_0: (QK_K, 66),
    GGMLType.MXFP4: (32, 17),
}

# The types the CUDA kernels compute with, and the kernel-name tag of each (the suffix of `matvec_{tag}_n8`,
# `gemm_{tag}`, ...: kernels/quant.cuh instantiates Q_FOR_EACH_TYPE for exactly these; tests/test_layout.py holds the
# two equal). A file with a tensor of any other type is refused by the CUDA backend at load, before anything is
# uploaded (engine/cuda/__init__.py `load_runner`), so backend "auto" runs it on the CPU backend.
KERNEL_TAGS: dict[GGMLType, str] = {
    GGMLType.F32: "f32",
    GGMLType.F16: "f16",
    GGMLType.BF16: "bf16",
    GGMLType.Q8_0: "q8_0",
    GGMLType.Q4_0: "q4_0",
    GGMLType.Q4_1: "q4_1",
    GGMLType.Q5_0: "q5_0",
    GGMLType.Q5_1: "q5_1",
    GGMLType.Q4_K: "q4_k",
    GGMLType.Q5_K: "q5_k",
    GGMLType.Q6_K: "q6_k",
    GGMLType.Q2_K: "q2_k",
    GGMLType.Q3_K: "q3_k",
    GGMLType.TQ1_0: "tq1_0",
    GGMLType.TQ2_0: "tq2_0",
    GGMLType.IQ1_S: "iq1_s",
    GGMLType.IQ1_M: "iq1_m",
    GGMLType.IQ2_XXS: "iq2_xxs",
    GGMLType.IQ2_XS: "iq2_xs",
    GGMLType.IQ2_S: "iq2_s",
    GGMLType.IQ3_XXS: "iq3_xxs",
    GGMLType.IQ3_S: "iq3_s",
    GGMLType.IQ4_NL: "iq4_nl",
    GGMLType.IQ4_XS: "iq4_xs",
    GGMLType.MXFP4: "mxfp4",
}
# The low-bit and codebook types among them (kernels/quant.cuh Q_FOR_EACH_LOWBIT_TYPE): matvec.cu builds only its 1-
# and 8-token kernels for these (engine/cuda/k_matvec.py), which keeps their share of the kernel build in bounds.
LOWBIT_TYPES = frozenset(
    {
        GGMLType.Q2_K,
        GGMLType.Q3_K,
        GGMLType.TQ1_0,
        GGMLType.TQ2_0,
        GGMLType.IQ1_S,
        GGMLType.IQ1_M,
        GGMLType.IQ2_XXS,
        GGMLType.IQ2_XS,
        GGMLType.IQ2_S,
        GGMLType.IQ3_XXS,
        GGMLType.IQ3_S,
        GGMLType.IQ4_NL,
        GGMLType.IQ4_XS,
        GGMLType.MXFP4,
    }
)
assert KERNEL_TAGS.keys() >= LOWBIT_TYPES
# Unquantized weights: the kernels keep them in exact float32 arithmetic where quantized types may take tf32.
FLOAT_TYPES = frozenset({GGMLType.F32, GGMLType.F16, GGMLType.BF16})
# The types some backend computes with: the CUDA ones and every type the NumPy backend dequantizes
# (engine/cpu/dequant.py). Any other type is an `unsupported_architecture` error at load, on both backends. Q8_K is
# the NumPy backend's alone: llama.cpp uses it for activations inside its K-quant dot products and writes no weights
# in it, so the kernels are not built for it (a file holding one runs on the CPU backend).
SUPPORTED_TYPES = frozenset(KERNEL_TAGS) | {GGMLType.Q8_K}


def type_name(type_id: int) -> str:
    try:
        return GGMLType(type_id).name
    except ValueError:
        return f"type#{type_id}"


def row_bytes(ggml_type: GGMLType, n_values: int) -> int:
    """Bytes of one row of `n_values` values; the caller has checked that n_values is a whole number of blocks."""
    block, size = BLOCK_SIZES[ggml_type]
    return n_values // block * size

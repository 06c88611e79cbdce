"""Make the low-bit quantization conformance fixtures: quantized copies of tests/fixtures/qwen3-tiny-f32.gguf made by
llama.cpp's own quantizer, and llama.cpp's logits on an all-F32 copy of each whose weights were dequantized with
gguf-py (exact f32 math on the dequantized weights: the reference of docs/design.md §7 for quantized files).

Cases (CASES below):
* `qwen3-tiny-q2_k`, `qwen3-tiny-iq4_xs`: what `llama-quantize F32.gguf OUT.gguf Q2_K` (`IQ4_XS`) makes, with
  llama.cpp's own type mix for that file type and no importance matrix.
* `qwen3-tiny-lowbit-mix`: every matrix a different type (tensor-type overrides), so that one small file holds all
  of Q2_K, Q3_K, IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ4_NL, IQ4_XS, TQ1_0, TQ2_0 and MXFP4. The
  i-quants below 4 bits need an importance matrix; it is synthetic (seeded log-normal per-column weights): the
  quantizer only needs positive weights, and these tests compare decoding, not quantization quality.
(Q8_K is llama.cpp's activation type: its CPU backend has no matmul with Q8_K weights, so no model file holds it;
tests/test_quant_ggml.py checks it at the tensor level.)

llama.cpp is driven through llama-cpp-python's ctypes API (llama_model_quantize, with its imatrix and tensor-type
override arrays), and run with the reference settings of scripts/make_llamacpp_reference.py (CPU, n_ctx 512, one
batch per prompt, F32 K/V, no flash attention) on the three prompts of qwen3-tiny-f32.reference.json, greedy
decoding 8 steps. llama.cpp's run on the quantized file itself (activation-quantized) is recorded for information.

Writes tests/fixtures/<case>.gguf, <case>.quant.json (tensor types, quantizer settings, token ids, greedy ids and
margins of both runs, their differences) and <case>.quant.npz: the exact-math logits at `columns` (every 4th
vocabulary id) for every prompt position and greedy step, with each full row's argmax and logsumexp.

Run in an environment with a CPU build of llama-cpp-python 0.3.36, numpy and gguf 0.19.0, from the repository root:

    PYTHONPATH=. python scripts/make_quant_fixture.py [--only CASE] [--out DIR]

It is a development tool; the engine does not import it.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import importlib.metadata
import json
import tempfile
from pathlib import Path

import gguf
import llama_cpp
import numpy as np

from scripts.make_llamacpp_reference import (
    _LOG_CALLBACK,
    N_BATCH,
    N_CTX,
    N_THREADS,
    VENDORED_LLAMA_CPP_COMMIT,
    LlamaRunner,
    logsumexp,
    margins,
    sha256_of,
    write_dequantized_f32,
)

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures"
BASE = "qwen3-tiny-f32"
COLUMN_STEP = 4
N_GREEDY = 8
IMATRIX_SEED = 20261201

T = gguf.GGMLQuantizationType
# Every matrix of qwen3-tiny (2 layers) and the type it gets in the mix.
MIX = {
    "token_embd.weight": T.Q3_K,
    "blk.0.attn_q.weight": T.IQ2_XXS,
    "blk.0.attn_k.weight": T.IQ2_XS,
    "blk.0.attn_v.weight": T.IQ2_S,
    "blk.0.attn_output.weight": T.IQ3_XXS,
    "blk.0.ffn_gate.weight": T.IQ3_S,
    "blk.0.ffn_up.weight": T.IQ1_S,
    "blk.0.ffn_down.weight": T.IQ1_M,
    "blk.1.attn_q.weight": T.IQ4_NL,
    "blk.1.attn_k.weight": T.IQ4_XS,
    "blk.1.attn_v.weight": T.TQ1_0,
    "blk.1.attn_output.weight": T.TQ2_0,
    "blk.1.ffn_gate.weight": T.MXFP4,
    "blk.1.ffn_up.weight": T.Q2_K,
    "blk.1.ffn_down.weight": T.Q3_K,
}

# case -> (llama_ftype, tensor-type overrides {exact tensor name: type}, token_embd type or None, importance matrix)
CASES = {
    "qwen3-tiny-q2_k": ("LLAMA_FTYPE_MOSTLY_Q2_K", {}, None, False),
    "qwen3-tiny-iq4_xs": ("LLAMA_FTYPE_MOSTLY_IQ4_XS", {}, None, False),
    "qwen3-tiny-lowbit-mix": (
        "LLAMA_FTYPE_MOSTLY_IQ2_XXS",
        {k: v for k, v in MIX.items() if k != "token_embd.weight"},
        MIX["token_embd.weight"],
        True,
    ),
}


def synthetic_imatrix(path: Path) -> dict[str, np.ndarray]:
    """tensor name -> (ne[0],) f32 > 0 for every matrix of the file: seeded log-normal column weights."""
    reader = gguf.GGUFReader(path)
    rng = np.random.default_rng(IMATRIX_SEED)
    out = {}
    for t in sorted(reader.tensors, key=lambda t: t.name):
        if len(t.shape) >= 2:
            out[t.name] = np.exp(rng.normal(size=int(t.shape[0]))).astype(np.float32)
    return out


def quantize(src: Path, dst: Path, ftype: str, overrides: dict, embd_type, imatrix: dict | None) -> None:
    """llama_model_quantize(src -> dst) with the given file type, exact-name overrides and importance matrix."""
    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread = N_THREADS
    params.ftype = getattr(llama_cpp, ftype)
    if embd_type is not None:
        params.token_embedding_type = int(embd_type)
    keep = []  # ctypes buffers that must outlive the call
    if overrides:
        rows = (llama_cpp.llama_model_tensor_override * (len(overrides) + 1))()
        for row, (name, qtype) in zip(rows, overrides.items(), strict=False):
            pattern = ("^" + name.replace(".", r"\.") + "$").encode()
            keep.append(pattern)
            row.pattern, row.type = pattern, int(qtype)
        rows[len(overrides)].pattern = None
        params.tt_overrides = rows
        keep.append(rows)
    if imatrix:
        rows = (llama_cpp.llama_model_imatrix_data * (len(imatrix) + 1))()
        for row, (name, values) in zip(rows, imatrix.items(), strict=False):
            buf = (ctypes.c_float * len(values))(*values.tolist())
            keep += [name.encode(), buf]
            row.name, row.data, row.size = keep[-2], buf, len(values)
        rows[len(imatrix)].name = None
        params.imatrix = rows
        keep.append(rows)
    if llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama_model_quantize failed for {dst.name}")


def tensor_types(path: Path) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}


def run_prompts(path: Path, prompts: list[dict]) -> list[tuple[np.ndarray, np.ndarray, list[int]]]:
    with LlamaRunner(path) as runner:
        for p in prompts:
            if runner.tokenize(p["text"]) != p["token_ids"]:
                raise RuntimeError(f"{path.name} tokenizes {p['text']!r} differently from {BASE}")
        return [runner.run(p["token_ids"], N_GREEDY) for p in prompts]


def compact(arrays: dict, key: str, rows: np.ndarray, cols: np.ndarray) -> None:
    arrays[key] = np.ascontiguousarray(rows[:, cols], dtype=np.float32)
    arrays[f"{key}_argmax"] = rows.argmax(-1).astype(np.int32)
    arrays[f"{key}_lse"] = logsumexp(rows)


def make_case(name: str, prompts: list[dict], out_dir: Path, workdir: Path) -> tuple[dict, dict]:
    ftype, overrides, embd_type, with_imatrix = CASES[name]
    base_path = FIXTURES / f"{BASE}.gguf"
    model_path = out_dir / f"{name}.gguf"
    imatrix = synthetic_imatrix(base_path) if with_imatrix else None
    quantize(base_path, model_path, ftype, overrides, embd_type, imatrix)
    types = tensor_types(model_path)
    for tensor, qtype in overrides.items():
        if types[tensor] != qtype.name:
            raise RuntimeError(f"{tensor}: llama.cpp wrote {types[tensor]}, not the requested {qtype.name}")
    dequant_path = workdir / f"{name}.dequant-f32.gguf"
    converted = write_dequantized_f32(model_path, dequant_path)
    exact = run_prompts(dequant_path, prompts)
    own = run_prompts(model_path, prompts)

    cols = np.arange(0, exact[0][0].shape[1], COLUMN_STEP)
    arrays: dict[str, np.ndarray] = {"columns": cols.astype(np.int32)}
    described = []
    for i, p in enumerate(prompts):
        (logits, steps, greedy), (q_logits, _, q_greedy) = exact[i], own[i]
        compact(arrays, f"prompt{i}_logits", logits, cols)
        compact(arrays, f"prompt{i}_greedy_step_logits", steps, cols)
        described.append(
            {
                "text": p["text"],
                "token_ids": p["token_ids"],
                "greedy_ids": greedy,
                "greedy_top1_minus_top2": margins(steps),
                "llamacpp_quantized": {
                    "greedy_ids": q_greedy,
                    "max_abs_diff_prompt_logits": float(np.abs(q_logits - logits).max()),
                },
            }
        )
    ref = {
        "format": "reflex-quant-reference/1",
        "model_file": model_path.name,
        "model_sha256": sha256_of(model_path),
        "model_size_bytes": model_path.stat().st_size,
        "base": BASE,
        "base_sha256": sha256_of(base_path),
        "tensor_type_counts": dict(collections.Counter(types.values())),
        "tensor_types": types,
        "quantizer": {
            "function": "llama_model_quantize",
            "ftype": ftype,
            "nthread": N_THREADS,
            "tensor_type_overrides": {k: v.name for k, v in overrides.items()},
            "token_embedding_type": embd_type.name if embd_type is not None else None,
            "imatrix": f"synthetic: exp(N(0, 1)) per column, numpy default_rng({IMATRIX_SEED}) over the matrices "
            "in name order"
            if with_imatrix
            else None,
        },
        "dequant_f32": {
            "how": "every non-F32 tensor dequantized with gguf.quants.dequantize (gguf-py "
            f"{importlib.metadata.version('gguf')}) and written as F32, metadata unchanged; run through the same "
            "llama.cpp build and settings: exact f32 math on the dequantized weights",
            "converted_tensor_types": converted,
            "file_sha256": sha256_of(dequant_path),
        },
        "producer": {
            "binding": f"llama-cpp-python {llama_cpp.__version__} (ctypes)",
            "llama_cpp_commit": VENDORED_LLAMA_CPP_COMMIT.get(llama_cpp.__version__),
            "backend": "CPU",
            "n_threads": N_THREADS,
            "n_ctx": N_CTX,
            "n_batch": N_BATCH,
            "kv_cache_type": "f32",
            "flash_attn": "disabled",
        },
        "prompts": described,
        "npz_layout": "columns: int32 vocabulary ids kept; prompt{i}_logits: float32 [n_tokens, len(columns)], row j = "
        "exact-math logits after token j; prompt{i}_greedy_step_logits: float32 [8, len(columns)], row k = the row "
        "greedy_ids[k] was taken from (row 0 = the last prompt row, row k >= 1 from a one-token decode); {key}_argmax "
        "int32 and {key}_lse float32: argmax and logsumexp of each full row",
    }
    return ref, arrays


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", action="append", default=None, help="a case name (repeat); default: all")
    ap.add_argument("--out", type=Path, default=FIXTURES, help="output directory (default: tests/fixtures)")
    ap.add_argument("--verbose", action="store_true", help="show llama.cpp's log")
    args = ap.parse_args()
    if not args.verbose:
        llama_cpp.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p())
    llama_cpp.llama_backend_init()
    with open(FIXTURES / f"{BASE}.reference.json") as f:
        prompts = [{"text": p["text"], "token_ids": p["token_ids"]} for p in json.load(f)["prompts"]]
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as workdir:
        for name in CASES:
            if args.only and name not in args.only:
                continue
            ref, arrays = make_case(name, prompts, args.out, Path(workdir))
            with open(args.out / f"{name}.quant.json", "w") as f:
                json.dump(ref, f, indent=1)
                f.write("\n")
            np.savez_compressed(args.out / f"{name}.quant.npz", **arrays)
            print(name, ref["tensor_type_counts"], f"{ref['model_size_bytes']} bytes")


if __name__ == "__main__":
    main()

"""Make a llama.cpp conformance reference (logits, greedy decoding, tokenizer cases) for a GGUF model.

llama.cpp is driven through llama-cpp-python's ctypes bindings on the CPU with fixed settings: n_ctx 512,
n_batch = n_ubatch 512, flash attention disabled, F32 K and V caches, 2 threads. For every prompt the whole
prompt is decoded in one batch with logits for every position, then greedy decoding runs one token at a time.
Everything is done twice on the model (to check that reruns are bit-identical) and once more on an all-F32
copy of the file whose non-F32 tensors were dequantized with ``gguf.quants.dequantize`` (the
"dequant-f32" oracle: exact f32 math on the dequantized weights, free of llama.cpp's activation quantization).

Writes ``STEM.json`` (token ids, greedy ids and texts, margins, statistics, candidate logits, tokenizer cases,
settings, versions) and ``STEM.npz`` (float32 logits at a per-prompt subset of the vocabulary plus the argmax,
max and logsumexp of every full row; the layout is described under ``npz_layout`` in the JSON).

Run it in an environment with a CPU build of llama-cpp-python, numpy and gguf (0.19.0)::

    python scripts/make_llamacpp_reference.py path/to/SmolLM2-135M-Instruct.Q4_1.gguf \\
        tests/fixtures/smollm2-135m-q4_1.reference

It is a development tool; the engine does not import it.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import hashlib
import importlib.metadata
import json
import os
import tempfile
from pathlib import Path

import gguf
import llama_cpp
import numpy as np

PROMPTS = [
    "The capital of France is",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
    "\n# 1234567 is odd.",
    "Once upon a time",
]

# Continuations of prompt 0 whose first-token logits are recorded.
CANDIDATES = [" Paris", " London", " Berlin"]

TOKENIZER_CASES = [
    "Hello world",
    "Hello, world! How are you today?",
    " leading space",
    "trailing space ",
    "multiple   spaces   between  words",
    "line one\nline two\n\nline four\n",
    "\ttab\tseparated\tvalues\t",
    "windows\r\nline endings\r\n",
    "1234567",
    "3.14159 + 2.71828 = 5.85987",
    "The year 2024 had 366 days and 8784 hours.",
    "def add(a, b):\n    return a + b\n",
    "for (int i = 0; i < n; ++i) { sum += x[i]; }",
    '{"key": "value", "list": [1, 2, 3], "ok": true}',
    "SELECT name, COUNT(*) FROM users WHERE id >= 42 GROUP BY name;",
    "I can't believe it's not butter! We'll see; they're here and you've won.",
    "DON'T SHOUT, I'M RIGHT HERE AND WE'VE HEARD YOU",
    "café naïve résumé Zürich façade",
    "e\u0301 (decomposed accent) vs \u00e9",
    "Hello 👋 world 🌍! Family: 👨\u200d👩\u200d👧",
    "日本語のテキストです。",
    "中文测试：你好，世界。",
    "한국어 텍스트",
    "Привет, мир! Как дела?",
    "https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct?x=1&y=2",
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n",
    "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\nHello! How can I help?<|im_end|>\n",
    "<|endoftext|>",
    "<|fake_token|> is not special",
    "<file_sep>main.py<filename>",
    "   ",
    "",
]

N_CTX = 512
N_BATCH = 512
N_THREADS = 2
N_GREEDY = 8
N_RANDOM_COLS = 3500
TOP_K_COLS = 20
COLUMN_SEED = 20240531

# llama.cpp commit vendored in each llama-cpp-python release (from its CHANGELOG); overridable on the command line.
VENDORED_LLAMA_CPP_COMMIT = {
    "0.3.36": "0c1e57098bba43ac29e6e3b677cdceebdd22334f",
}

_LOG_CALLBACK = llama_cpp.llama_log_callback(lambda level, text, user_data: None)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


class LlamaRunner:
    """One model and one context with the reference settings."""

    def __init__(self, model_path: Path) -> None:
        model_params = llama_cpp.llama_model_default_params()
        model_params.n_gpu_layers = 0
        self.model = llama_cpp.llama_model_load_from_file(str(model_path).encode(), model_params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {model_path}")
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)

        ctx_params = llama_cpp.llama_context_default_params()
        ctx_params.n_ctx = N_CTX
        ctx_params.n_batch = N_BATCH
        ctx_params.n_ubatch = N_BATCH
        ctx_params.n_seq_max = 1
        ctx_params.n_threads = N_THREADS
        ctx_params.n_threads_batch = N_THREADS
        ctx_params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        ctx_params.type_k = llama_cpp.GGML_TYPE_F32
        ctx_params.type_v = llama_cpp.GGML_TYPE_F32
        ctx_params.no_perf = True
        self.ctx = llama_cpp.llama_init_from_model(self.model, ctx_params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.batch = llama_cpp.llama_batch_init(N_BATCH, 0, 1)

    def close(self) -> None:
        llama_cpp.llama_batch_free(self.batch)
        llama_cpp.llama_free(self.ctx)
        llama_cpp.llama_model_free(self.model)

    def __enter__(self) -> LlamaRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def add_bos(self) -> bool:
        return bool(llama_cpp.llama_vocab_get_add_bos(self.vocab))

    def tokenize(self, text: str) -> list[int]:
        data = text.encode("utf-8")
        capacity = len(data) + 8
        tokens = (llama_cpp.llama_token * capacity)()
        n = llama_cpp.llama_tokenize(self.vocab, data, len(data), tokens, capacity, True, True)
        if n < 0:
            raise RuntimeError(f"tokenization of {text!r} needs {-n} tokens")
        return list(tokens[:n])

    def piece(self, token: int) -> bytes:
        buf = ctypes.create_string_buffer(256)
        n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, True)
        if n < 0:
            raise RuntimeError(f"piece of token {token} needs {-n} bytes")
        return buf.raw[:n]

    def detokenize(self, tokens: list[int]) -> str:
        return b"".join(self.piece(t) for t in tokens).decode("utf-8", errors="replace")

    def _decode(self, tokens: list[int], pos0: int) -> np.ndarray:
        batch = self.batch
        batch.n_tokens = len(tokens)
        for i, token in enumerate(tokens):
            batch.token[i] = token
            batch.pos[i] = pos0 + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = 1
        rc = llama_cpp.llama_decode(self.ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        rows = np.empty((len(tokens), self.n_vocab), dtype=np.float32)
        for i in range(len(tokens)):
            ptr = llama_cpp.llama_get_logits_ith(self.ctx, i)
            rows[i] = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))
        return rows

    def run(self, tokens: list[int], n_greedy: int = N_GREEDY) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """Prompt logits [n_tokens, n_vocab], greedy step logits [n_greedy, n_vocab] and the greedy ids."""
        if not 0 < len(tokens) <= N_BATCH or len(tokens) + n_greedy > N_CTX:
            raise ValueError(f"prompt of {len(tokens)} tokens does not fit the reference settings")
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.ctx), True)
        prompt_logits = self._decode(tokens, 0)
        steps = [prompt_logits[-1]]
        greedy = [int(np.argmax(steps[0]))]
        for k in range(1, n_greedy):
            steps.append(self._decode([greedy[-1]], len(tokens) + k - 1)[0])
            greedy.append(int(np.argmax(steps[-1])))
        return prompt_logits, np.stack(steps), greedy


def system_info() -> dict[str, str]:
    info = {
        "llama_cpp_python": llama_cpp.__version__,
        "libllama_version": llama_cpp.llama_version().decode(),
        "system_info": llama_cpp.llama_print_system_info().decode().strip(),
    }
    lib_dir = Path(llama_cpp.__file__).parent / "lib"
    for lib in sorted(lib_dir.glob("libggml-base.*")):
        ggml = ctypes.CDLL(str(lib))
        for name in ("ggml_version", "ggml_commit"):
            if hasattr(ggml, name):
                fn = getattr(ggml, name)
                fn.restype = ctypes.c_char_p
                info[name] = fn().decode()
        break
    return info


def write_dequantized_f32(src: Path, dst: Path) -> dict[str, int]:
    """Copy ``src`` to ``dst`` with every non-F32 tensor dequantized to F32; metadata unchanged."""
    reader = gguf.GGUFReader(src)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(dst, arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub_type)
        if field.name == gguf.Keys.General.ALIGNMENT:
            writer.data_alignment = int(field.contents())
    converted: collections.Counter[str] = collections.Counter()
    for tensor in reader.tensors:
        if tensor.tensor_type == gguf.GGMLQuantizationType.F32:
            data = np.asarray(tensor.data, dtype=np.float32)
        else:
            data = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
            converted[tensor.tensor_type.name] += 1
        expected = tuple(int(n) for n in reversed(tensor.shape.tolist()))
        if data.shape != expected:
            raise RuntimeError(f"{tensor.name}: dequantized shape {data.shape} != {expected}")
        writer.add_tensor(tensor.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dict(converted)


def margins(step_logits: np.ndarray) -> list[float]:
    top2 = -np.partition(-step_logits, 1, axis=-1)[:, :2]
    return [round(float(a - b), 6) for a, b in top2]


def logsumexp(rows: np.ndarray) -> np.ndarray:
    rows = rows.astype(np.float64)
    peak = rows.max(axis=-1, keepdims=True)
    return (peak[:, 0] + np.log(np.exp(rows - peak).sum(axis=-1))).astype(np.float32)


def top_k_columns(rows: np.ndarray, k: int) -> np.ndarray:
    return np.argpartition(-rows, k, axis=-1)[:, :k].ravel()


def row_stats(row: np.ndarray) -> dict[str, float]:
    return {
        "min": float(row.min()),
        "max": float(row.max()),
        "mean": float(row.mean(dtype=np.float64)),
        "std": float(row.std(dtype=np.float64)),
    }


def choose_columns(index: int, n_vocab: int, required: set[int]) -> np.ndarray:
    """Sorted union of ``required`` and ``N_RANDOM_COLS`` columns drawn with a fixed seed."""
    rng = np.random.default_rng([COLUMN_SEED, index])
    drawn = rng.choice(n_vocab, size=N_RANDOM_COLS, replace=False)
    return np.array(sorted(set(required) | {int(c) for c in drawn}), dtype=np.int32)


def run_all(runner: LlamaRunner, prompt_ids: list[list[int]]) -> list[tuple[np.ndarray, np.ndarray, list[int]]]:
    return [runner.run(ids) for ids in prompt_ids]


def first_diff_step(a: list[int], b: list[int]) -> int:
    return next((k for k, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def summarize_greedy(runner: LlamaRunner, prompt_logits: np.ndarray, steps: np.ndarray, greedy: list[int]) -> dict:
    return {
        "greedy_ids": greedy,
        "greedy_text": runner.detokenize(greedy),
        "greedy_top1_minus_top2": margins(steps),
        "last_position_argmax": int(np.argmax(prompt_logits[-1])),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path, help="GGUF model file")
    parser.add_argument("stem", type=Path, help="output stem: writes STEM.json and STEM.npz")
    parser.add_argument("--dequant-path", type=Path, help="where to write the dequantized F32 copy (default: /tmp)")
    parser.add_argument("--keep-dequant", action="store_true", help="keep the dequantized F32 copy")
    parser.add_argument("--llama-cpp-commit", help="llama.cpp commit of the build (default: from the version table)")
    parser.add_argument("--verbose", action="store_true", help="show llama.cpp's log")
    args = parser.parse_args()

    if not args.verbose:
        llama_cpp.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p())
    llama_cpp.llama_backend_init()

    model_path: Path = args.model
    reader = gguf.GGUFReader(model_path)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    type_counts = collections.Counter(t.tensor_type.name for t in reader.tensors)
    del reader

    with LlamaRunner(model_path) as runner:
        n_vocab = runner.n_vocab
        add_bos = runner.add_bos
        bos_id = llama_cpp.llama_vocab_bos(runner.vocab)
        prompt_ids = [runner.tokenize(text) for text in PROMPTS]
        pieces = [[runner.piece(t).decode("utf-8", errors="replace") for t in ids] for ids in prompt_ids]
        results = run_all(runner, prompt_ids)
        tokenizer_cases = []
        for text in TOKENIZER_CASES:
            ids = runner.tokenize(text)
            tokenizer_cases.append({"text": text, "ids": ids, "n_tokens": len(ids)})
        base = prompt_ids[0]
        candidates = []
        for cand in CANDIDATES:
            full = runner.tokenize(PROMPTS[0] + cand)
            if full[: len(base)] != base:
                raise RuntimeError(f"tokens of {PROMPTS[0] + cand!r} do not extend those of the prompt")
            candidates.append(
                {
                    "text": cand,
                    "continuation_ids": full[len(base) :],
                    "first_token_id": full[len(base)],
                    "first_token_piece": runner.piece(full[len(base)]).decode("utf-8", errors="replace"),
                    "standalone_ids": runner.tokenize(cand),
                }
            )
        greedy_info = [summarize_greedy(runner, *r) for r in results]

    with LlamaRunner(model_path) as runner:
        rerun = run_all(runner, prompt_ids)

    dequant_path: Path = args.dequant_path or Path(tempfile.gettempdir()) / f"{model_path.stem}.dequant-f32.gguf"
    converted = write_dequantized_f32(model_path, dequant_path)
    dequant_sha = sha256_of(dequant_path)
    with LlamaRunner(dequant_path) as runner:
        if [runner.tokenize(t) for t in PROMPTS] != prompt_ids:
            raise RuntimeError("the dequantized copy tokenizes differently")
        dequant = run_all(runner, prompt_ids)
        dequant_info = [summarize_greedy(runner, *r) for r in dequant]
    with LlamaRunner(dequant_path) as runner:
        dequant_rerun = run_all(runner, prompt_ids)
    if not args.keep_dequant:
        dequant_path.unlink()

    def rerun_diff(a: tuple, b: tuple) -> float | None:
        if a[2] != b[2]:
            return None
        return float(max(np.abs(a[0] - b[0]).max(), np.abs(a[1] - b[1]).max()))

    arrays: dict[str, np.ndarray] = {}
    prompts_json = []
    for i, text in enumerate(PROMPTS):
        ids = prompt_ids[i]
        logits, steps, greedy = results[i]
        d_logits, d_steps, d_greedy = dequant[i]
        required = set(ids) | set(greedy) | set(d_greedy)
        for rows in (logits, steps, d_logits, d_steps):
            required |= {int(c) for c in top_k_columns(rows, TOP_K_COLS)}
        if i == 0:
            required |= {c["first_token_id"] for c in candidates}
        cols = choose_columns(i, n_vocab, required)

        keys = {"cols": f"prompt{i}_cols"}
        arrays[keys["cols"]] = cols
        for name, rows in (
            ("logits", logits),
            ("greedy_step_logits", steps),
            ("dequant_logits", d_logits),
            ("dequant_greedy_step_logits", d_steps),
        ):
            key = f"prompt{i}_{name}"
            keys[name] = key
            arrays[key] = np.ascontiguousarray(rows[:, cols], dtype=np.float32)
            arrays[f"{key}_argmax"] = rows.argmax(axis=-1).astype(np.int32)
            arrays[f"{key}_max"] = rows.max(axis=-1).astype(np.float32)
            arrays[f"{key}_logsumexp"] = logsumexp(rows)

        # Greedy steps are comparable across the two runs only while their histories agree.
        n_same = first_diff_step(greedy, d_greedy)
        n_cmp = min(n_same + 1, N_GREEDY)
        diff = np.abs(logits - d_logits)
        prompts_json.append(
            {
                "index": i,
                "text": text,
                "token_ids": ids,
                "n_tokens": len(ids),
                "bos_added": bool(add_bos and ids[0] == bos_id),
                "token_pieces": pieces[i],
                **greedy_info[i],
                "last_position_logits_stats": row_stats(logits[-1]),
                "rerun_max_abs_diff": rerun_diff(results[i], rerun[i]),
                "n_cols": len(cols),
                "n_required_cols": len(required),
                "npz_keys": keys,
                "dequant_f32": {
                    **dequant_info[i],
                    "greedy_ids_agree": d_greedy == greedy,
                    "first_differing_greedy_step": n_same if n_same < N_GREEDY else None,
                    "max_abs_diff_prompt_logits": float(diff.max()),
                    "mean_abs_diff_prompt_logits": float(diff.mean(dtype=np.float64)),
                    "argmax_agree_prompt_positions": int((logits.argmax(-1) == d_logits.argmax(-1)).sum()),
                    "n_compared_greedy_steps": n_cmp,
                    "max_abs_diff_greedy_step_logits": float(np.abs(steps[:n_cmp] - d_steps[:n_cmp]).max()),
                    "last_position_logits_stats": row_stats(d_logits[-1]),
                    "rerun_max_abs_diff": rerun_diff(dequant[i], dequant_rerun[i]),
                },
            }
        )

    last, d_last = results[0][0][-1], dequant[0][0][-1]
    lse, d_lse = logsumexp(last[None])[0], logsumexp(d_last[None])[0]
    for cand in candidates:
        t = cand["first_token_id"]
        cand["logit"] = float(last[t])
        cand["log_prob"] = float(last[t] - lse)
        cand["rank"] = int((last > last[t]).sum())
        cand["dequant_logit"] = float(d_last[t])
        cand["dequant_log_prob"] = float(d_last[t] - d_lse)
        cand["dequant_rank"] = int((d_last > d_last[t]).sum())

    all_diffs = [p["dequant_f32"]["max_abs_diff_prompt_logits"] for p in prompts_json]
    reruns = [p["rerun_max_abs_diff"] for p in prompts_json] + [
        p["dequant_f32"]["rerun_max_abs_diff"] for p in prompts_json
    ]
    rerun_max = None if None in reruns else max(reruns)
    versions = system_info()
    commit = args.llama_cpp_commit or VENDORED_LLAMA_CPP_COMMIT.get(llama_cpp.__version__)
    commit = commit or versions.get("ggml_commit", "unknown")

    stem: Path = args.stem
    npz_path = stem.with_name(stem.name + ".npz")
    json_path = stem.with_name(stem.name + ".json")
    npz_layout = {
        "prompt{i}_cols": "int32 [n_cols]: sorted vocabulary ids stored for prompt i (n_cols is prompts[i].n_cols): "
        "the union of the prompt's token ids, every greedy id of both runs, the top-"
        f"{TOP_K_COLS} ids of every row of both runs (for prompt 0 also the first token of each candidate) and "
        f"{N_RANDOM_COLS} ids from numpy.random.default_rng([{COLUMN_SEED}, i]).choice(n_vocab, {N_RANDOM_COLS}, "
        "replace=False).",
        "prompt{i}_logits": "float32 [n_tokens, n_cols]: raw logits at prompt{i}_cols; row j is the output after "
        "token_ids[0..j] (token j at position j, positions from 0), i.e. the scores for token j+1.",
        "prompt{i}_greedy_step_logits": "float32 [n_greedy, n_cols]: row k is the row greedy_ids[k] was taken from; "
        "row 0 equals the last row of prompt{i}_logits, row k >= 1 comes from a single-token decode of "
        "greedy_ids[k-1] at position n_tokens + k - 1 using the KV cache.",
        "prompt{i}_dequant_logits": "float32 [n_tokens, n_cols]: as prompt{i}_logits for the dequantized F32 copy.",
        "prompt{i}_dequant_greedy_step_logits": "float32 [n_greedy, n_cols]: as prompt{i}_greedy_step_logits for the "
        "dequantized F32 copy (its own greedy ids: prompts[i].dequant_f32.greedy_ids).",
        "{key}_argmax": "int32 [rows]: argmax of each full row (all n_vocab columns) of array {key}.",
        "{key}_max": "float32 [rows]: max of each full row of array {key}.",
        "{key}_logsumexp": "float32 [rows]: log(sum(exp(row))) of each full row of array {key} (computed in float64).",
    }
    report = {
        "format": "llamacpp-reference/1",
        "model_file": model_path.name,
        "model_sha256": sha256_of(model_path),
        "model_size_bytes": model_path.stat().st_size,
        "architecture": arch,
        "tensor_type_counts": dict(type_counts),
        "n_vocab": n_vocab,
        "add_bos": add_bos,
        "producer": {
            "binding": f"llama-cpp-python {llama_cpp.__version__} (ctypes) over libllama built from the vendored "
            "llama.cpp",
            "llama_cpp_commit": commit,
            **versions,
            "backend": "CPU",
            "n_threads": N_THREADS,
            "n_ctx": N_CTX,
            "n_batch": N_BATCH,
            "n_ubatch": N_BATCH,
            "flash_attn": "disabled",
            "kv_cache_type": "f32",
            "add_special": True,
            "parse_special": True,
            "prompt_decode": "whole prompt in one llama_decode, logits requested for every position",
            "greedy": "argmax (first index on ties) of the last row, fed back one token per llama_decode",
        },
        "n_greedy": N_GREEDY,
        "npz_file": npz_path.name,
        "npz_layout": npz_layout,
        "rerun_max_abs_diff": rerun_max,
        "prompts": prompts_json,
        "candidates": {
            "prompt_index": 0,
            "note": "first-token logits of each continuation at the last prompt position; ids from tokenizing "
            "prompt + candidate and dropping the prompt's ids",
            "items": candidates,
        },
        "dequant_f32": {
            "file_name": dequant_path.name,
            "file_sha256": dequant_sha,
            "converted_tensor_types": converted,
            "how": "every tensor that is not F32 dequantized with gguf.quants.dequantize (gguf-py "
            f"{importlib.metadata.version('gguf')}) and written as F32 with gguf.GGUFWriter, metadata copied "
            "unchanged (general.file_type included), then run through the same llama.cpp build and settings. "
            "It is exact f32 math on the dequantized weights; the difference to the model's own run is "
            "llama.cpp's activation quantization inside its CPU quantized matmuls.",
            "max_abs_diff_prompt_logits_all_prompts": max(all_diffs),
        },
        "tokenizer_cases_settings": "llama_tokenize(add_special=True, parse_special=True): BOS only if the file's "
        "add_bos_token is true; the UTF-8 bytes of text are fed verbatim",
        "tokenizer_cases": tokenizer_cases,
    }
    npz_path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(npz_path, **arrays)
    with open(json_path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1, ensure_ascii=False)
        f.write("\n")
    print(f"wrote {json_path} and {npz_path} ({os.path.getsize(npz_path)} bytes)")


if __name__ == "__main__":
    main()

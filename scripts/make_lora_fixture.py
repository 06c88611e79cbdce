"""Make the LoRA conformance fixtures: random LoRA adapters in llama.cpp's GGUF adapter format for the tiny F32
fixture models, and llama.cpp's logits with those adapters applied on the three fixture prompts.

The adapters are not stored: each case names its base, target tensors, rank, seed, alpha and scale, and
tests/lora_util.py regenerates the adapter from them (NumPy's PCG64 normals); the JSON keeps the sha256 of the
adapter's tensor values, so a test can prove it rebuilt exactly what llama.cpp saw. llama.cpp applies the adapters
the way llama-cpp-python's `Llama(lora_path=..., lora_scale=...)` does (llama_adapter_lora_init, then
llama_set_adapters_lora on the context; one call takes several adapters), with the reference settings of
scripts/make_llamacpp_reference.py (CPU, n_ctx 512, one batch per prompt, F32 K/V, no flash attention).

Writes tests/fixtures/<case>.lora.json (cases, token ids, greedy ids, sha256s, settings) and <case>.lora.npz:
prompt{i}_logits float32 [n_tokens, len(columns)] at `columns` (every 4th vocabulary id, plus each row's argmax
in prompt{i}_argmax and its logsumexp in prompt{i}_lse over the full row), small enough to keep in the repository.

Run in an environment with a CPU build of llama-cpp-python 0.3.36, numpy and gguf 0.19.0, from the repository root:

    PYTHONPATH=. python scripts/make_lora_fixture.py

It is a development tool; the engine does not import it.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import importlib.metadata
import json
import os
import tempfile
from pathlib import Path

import llama_cpp
import numpy as np

from scripts.make_llamacpp_reference import N_BATCH, N_CTX, N_THREADS, VENDORED_LLAMA_CPP_COMMIT, LlamaRunner
from tests import lora_util

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures"
BASE_PROMPTS = "qwen3-tiny-f32"  # the three prompts (and their ids) of this reference are used for every case
COLUMN_STEP = 4
N_GREEDY = 4

# case -> base fixture and its adapters (each: targets, rank, seed, alpha, user scale)
CASES = {
    "qwen3-tiny-f32.lora-r8": ("qwen3-tiny-f32", [(lora_util.TARGETS["qwen3"], 8, 801, 16.0, 0.75)]),
    "qwen3-tiny-f32.lora-r16": ("qwen3-tiny-f32", [(["attn_q", "attn_v", "attn_output", "ffn_down"], 16, 1601, 8.0,
                                                    1.0)]),
    "qwen3-tiny-f32.lora-r8+r16": ("qwen3-tiny-f32", [(lora_util.TARGETS["qwen3"], 8, 802, 16.0, 0.5),
                                                      (["attn_q", "ffn_up"], 16, 1602, 0.0, -0.3)]),
    "qwen3moe-tiny-f32.lora-r4": ("qwen3moe-tiny-f32", [(lora_util.TARGETS["qwen3moe"], 4, 401, 8.0, 1.0)]),
    "qwen35-tiny-f32.lora-r8": ("qwen35-tiny-f32", [(lora_util.TARGETS["qwen35"], 8, 803, 16.0, 1.0)]),
    "deepseek2-tiny-f32.lora-r8": ("deepseek2-tiny-f32", [(lora_util.TARGETS["deepseek2"], 8, 804, 16.0, 1.0)]),
}  # fmt: skip


class AdaptedRunner(LlamaRunner):
    """The reference runner with LoRA adapters set on its context."""

    def __init__(self, model_path: Path, adapters: list[tuple[str, float]]) -> None:
        super().__init__(model_path)
        handles = []
        for path, _ in adapters:
            handle = llama_cpp.llama_adapter_lora_init(self.model, path.encode())
            if not handle:
                raise RuntimeError(f"llama.cpp refused the adapter {path}")
            handles.append(handle)
        arr = (llama_cpp.llama_adapter_lora_p_ctypes * len(handles))(*handles)
        scales = (ctypes.c_float * len(handles))(*[s for _, s in adapters])
        if llama_cpp.llama_set_adapters_lora(self.ctx, arr, len(handles), scales):
            raise RuntimeError("llama_set_adapters_lora failed")
        self.adapters = handles


def make_case(name: str, base: str, specs: list, prompts: list[dict], workdir: str) -> tuple[dict, dict]:
    from engine.gguf import read

    base_path = FIXTURES / f"{base}.gguf"
    gf = read(base_path)
    adapters, described = [], []
    for i, (targets, rank, seed, alpha, scale) in enumerate(specs):
        pairs = lora_util.random_pairs(gf, targets, rank, seed)
        path = lora_util.write_adapter(os.path.join(workdir, f"{name}.{i}.gguf"), gf.architecture, pairs, alpha)
        adapters.append((path, scale))
        described.append({"targets": targets, "rank": rank, "seed": seed, "alpha": alpha, "scale": scale,
                          "n_tensors": len(pairs), "tensors_sha256": lora_util.pairs_sha256(pairs)})  # fmt: skip
    arrays: dict[str, np.ndarray] = {}
    cols = np.arange(0, len(gf.metadata["tokenizer.ggml.tokens"]), COLUMN_STEP)
    arrays["columns"] = cols.astype(np.int32)
    out_prompts = []
    with AdaptedRunner(base_path, adapters) as runner:
        for i, p in enumerate(prompts):
            logits, _, greedy = runner.run(p["token_ids"], N_GREEDY)
            arrays[f"prompt{i}_logits"] = logits[:, cols]
            arrays[f"prompt{i}_argmax"] = logits.argmax(-1).astype(np.int32)
            m = logits.max(-1, keepdims=True).astype(np.float64)
            arrays[f"prompt{i}_lse"] = (m[:, 0] + np.log(np.exp(logits - m).sum(-1))).astype(np.float32)
            out_prompts.append({"text": p["text"], "token_ids": p["token_ids"], "greedy_ids": greedy})
    ref = {
        "format": "reflex-lora-reference/1",
        "base": base,
        "base_sha256": hashlib.sha256(base_path.read_bytes()).hexdigest(),
        "adapters": described,
        "prompts": out_prompts,
        "producer": {
            "binding": f"llama-cpp-python {importlib.metadata.version('llama-cpp-python')} (ctypes): "
            "llama_adapter_lora_init + llama_set_adapters_lora, as Llama(lora_path=, lora_scale=) does",
            "llama_cpp_commit": VENDORED_LLAMA_CPP_COMMIT.get(importlib.metadata.version("llama-cpp-python")),
            "gguf_py": importlib.metadata.version("gguf"),
            "backend": "CPU",
            "n_threads": N_THREADS,
            "n_ctx": N_CTX,
            "n_batch": N_BATCH,
            "kv_cache_type": "f32",
            "flash_attn": "disabled",
        },
        "npz_layout": "columns: int32 vocabulary ids kept; prompt{i}_logits: float32 [n_tokens, len(columns)], row j "
        "= logits after token j; prompt{i}_argmax: int32 [n_tokens] over the full row; prompt{i}_lse: float32 "
        "[n_tokens] logsumexp of the full row",
    }
    return ref, arrays


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", action="append", default=None, help="a case name (repeat); default: all")
    args = ap.parse_args()
    with open(FIXTURES / f"{BASE_PROMPTS}.reference.json") as f:
        prompts = [{"text": p["text"], "token_ids": p["token_ids"]} for p in json.load(f)["prompts"]]
    with tempfile.TemporaryDirectory() as workdir:
        for name, (base, specs) in CASES.items():
            if args.only and name not in args.only:
                continue
            ref, arrays = make_case(name, base, specs, prompts, workdir)
            with open(FIXTURES / f"{name}.lora.json", "w") as f:
                json.dump(ref, f, indent=1)
            np.savez_compressed(FIXTURES / f"{name}.lora.npz", **arrays)
            print(name, {p["text"][:20]: p["greedy_ids"] for p in ref["prompts"]})


if __name__ == "__main__":
    main()

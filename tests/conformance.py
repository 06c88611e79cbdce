"""Shared checks against the llama.cpp fixtures (tests/fixtures/*.reference.json + .npz), for any backend.

`measure(engine, name)` runs every prompt of a fixture and returns the measured errors; the tests decide the
tolerance (docs/design.md §7), so the CPU and CUDA suites share one measurement.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import numpy as np

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")

TINY = ["qwen3-tiny-f32", "qwen3-tiny-q8_0", "qwen3-tiny-q4_k_m"]
# MoE, Gated DeltaNet hybrid and MLA families: the NumPy backend runs all of them; a backend that gains one of
# these families adds its fixtures to its own parametrisation.
TINY_FAMILIES = [
    "qwen3moe-tiny-f32",
    "qwen3moe-tiny-q8_0",
    "qwen35-tiny-f32",
    "qwen35-tiny-q8_0",
    "deepseek2-tiny-f32",
    "deepseek2-tiny-q8_0",
]


def fixture_path(name: str, suffix: str) -> str:
    return os.path.join(FIXTURES, name + suffix)


def is_quantized(name: str) -> bool:
    return not name.endswith("-f32")


def load_reference(name: str) -> tuple[dict, dict, dict]:
    """(reference JSON, llama.cpp logits, exact-math logits): for F32 files the last two are the same arrays."""
    with open(fixture_path(name, ".reference.json")) as f:
        ref = json.load(f)
    npz = dict(np.load(fixture_path(name, ".reference.npz")))
    exact = dict(np.load(fixture_path(name, ".dequant-f32.npz"))) if is_quantized(name) else npz
    return ref, npz, exact


@dataclass
class Measured:
    prompt_ids_match: bool = True
    max_abs_prompt: float = 0.0  # vs exact math, every prompt position
    max_abs_steps: float = 0.0  # decode-path rows vs exact math (F32) or vs our own prefill rows (quantized)
    max_abs_llamacpp: float = 0.0  # vs llama.cpp's own (for quantized files: activation-quantized) logits
    greedy: list[tuple[list[int], list[int], list[float]]] = field(default_factory=list)  # (ours, want, margins)


def greedy_agrees(ours: list[int], want: list[int], margins: list[float], err: float) -> bool:
    """Identical up to the first step whose top1 - top2 margin is within the measured error."""
    for k, (a, b) in enumerate(zip(ours, want, strict=False)):
        if margins[k] <= 2 * err:
            return True
        if a != b:
            return False
    return True


def measure(engine, name: str) -> Measured:
    ref, npz, exact = load_reference(name)
    m = Measured()
    for i, p in enumerate(ref["prompts"]):
        ids = p["token_ids"]
        m.prompt_ids_match &= engine.tokenizer.encode(p["text"]) == ids
        logits = engine.logits(ids)
        m.max_abs_prompt = max(m.max_abs_prompt, float(np.abs(logits - exact[f"prompt{i}_logits"]).max()))
        m.max_abs_llamacpp = max(m.max_abs_llamacpp, float(np.abs(logits - npz[f"prompt{i}_logits"]).max()))
        # Greedy steps through the decode path: prompt as one batch, then the greedy ids one at a time.
        forced = ids + p["greedy_ids"][:-1]
        steps = engine.logits(forced, prefill=len(ids))[len(ids) - 1 :]
        if is_quantized(name):
            whole = engine.logits(forced)[len(ids) - 1 :]  # the same rows through the batched path
            m.max_abs_steps = max(m.max_abs_steps, float(np.abs(steps - whole).max()))
            want = p.get("dequant_f32_greedy_ids") or _dequant_greedy(ref, i)
        else:
            m.max_abs_steps = max(m.max_abs_steps, float(np.abs(steps - npz[f"prompt{i}_greedy_step_logits"]).max()))
            want = p["greedy_ids"]
        out = engine.generate(p["text"], max_tokens=len(p["greedy_ids"]), temperature=0.0)
        m.greedy.append((out["token_ids"], want, _margins(steps)))
    return m


def _dequant_greedy(ref: dict, i: int) -> list[int]:
    return ref["oracles"]["llamacpp_dequantized_f32"]["per_prompt"][i]["dequant_f32_greedy_ids"]


def _margins(rows: np.ndarray) -> list[float]:
    top2 = np.sort(rows, axis=-1)[:, -2:]
    return (top2[:, 1] - top2[:, 0]).tolist()

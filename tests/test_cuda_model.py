"""The CUDA backend end to end: llama.cpp fixtures, agreement with the NumPy backend, graphs, and no NVRTC."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import pytest

from engine.cuda import driver
from engine.engine import Engine
from tests import conformance as C

pytestmark = pytest.mark.gpu
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = "The capital of France is"


@pytest.fixture(scope="module", params=C.TINY)
def pair(request):
    path = C.fixture_path(request.param, ".gguf")
    return request.param, Engine.load(path, backend="cuda", max_seq_len=512), Engine.load(path, backend="cpu")


def llamacpp_error(name: str) -> float:
    """How far llama.cpp's own quantized run is from exact math on the dequantized weights (docs/design.md §7)."""
    with open(C.fixture_path(name, ".reference.json")) as f:
        return json.load(f)["oracles"]["llamacpp_dequantized_f32"]["max_abs_diff_all_prompts"]


def test_fixture_conformance(pair, record_property):
    name, cuda, _ = pair
    m = C.measure(cuda, name)
    record_property("measured", m.__dict__)
    print(f"{name}: prompt {m.max_abs_prompt:.3g}, steps {m.max_abs_steps:.3g}, vs llama.cpp {m.max_abs_llamacpp:.3g}")
    assert m.prompt_ids_match
    if C.is_quantized(name):
        # docs/design.md §7 for the batched path (TF32 tensor cores), and the same bound between the decode path (exact
        # float32 matvec) and the batched one.
        assert m.max_abs_prompt <= 1.25 * llamacpp_error(name), m
        assert m.max_abs_steps <= 1.25 * llamacpp_error(name), m
    else:
        assert m.max_abs_prompt <= 1e-4 and m.max_abs_steps <= 1e-4, m
    for ours, want, margins in m.greedy:
        assert C.greedy_agrees(ours, want, margins, m.max_abs_prompt), (ours, want, margins)


def test_cuda_matches_cpu_backend(pair):
    """Both backends on the same file: every prefill row and decode step, long enough to use the GEMM path."""
    name, cuda, cpu = pair
    ids = cpu.tokenizer.encode("def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n")
    ids = (ids * 4)[:100]
    for prefill in (len(ids), 7, 1):  # GEMM chunk, small batches, pure decode
        a, b = cuda.logits(ids, prefill=prefill), cpu.logits(ids, prefill=prefill)
        tol = 1e-4 if name.endswith("f32") else 2e-3
        assert np.abs(a - b).max() <= tol * max(1.0, np.abs(b).max()), (name, prefill, np.abs(a - b).max())


@pytest.mark.parametrize("kind", ["dense", "pipe"])
def test_tensor_core_prefill_gemms_match_cpu_backend(pair, kind, monkeypatch):
    """The quantized files with a prefill GEMM of kernels/gemm_tc.cu (REFLEX_PREFILL_GEMM) from 65 tokens on: the
    100-token prefill goes through it, held to test_cuda_matches_cpu_backend's bound."""
    name, _, cpu = pair
    if not C.is_quantized(name) or driver.compute_major() < 9:
        pytest.skip("the tensor-core prefill GEMMs take quantized weights on sm_90")
    monkeypatch.setenv("REFLEX_PREFILL_GEMM", kind)
    monkeypatch.setenv("REFLEX_PREFILL_GEMM_MIN", "65")
    cuda = Engine.load(C.fixture_path(name, ".gguf"), backend="cuda", max_seq_len=512)
    ids = cpu.tokenizer.encode("def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n")
    ids = (ids * 4)[:100]
    names = {launch.name for launch in cuda.runner.batch_launches(ids)}
    assert any(x.startswith(f"gemm_tc.gemm_{kind}") for x in names), sorted(names)
    a, b = cuda.logits(ids), cpu.logits(ids)
    assert np.abs(a - b).max() <= 2e-3 * max(1.0, np.abs(b).max()), (name, kind, np.abs(a - b).max())


def test_system1_and_sampling_agree_with_cpu(pair):
    _, cuda, cpu = pair
    cands = [" Paris", " London", " the city of lights"]
    a, b = cuda.system1(PROMPT, cands), cpu.system1(PROMPT, cands)
    assert [c["token_ids"] for c in a["candidates"]] == [c["token_ids"] for c in b["candidates"]]
    assert np.allclose([c["score"] for c in a["candidates"]], [c["score"] for c in b["candidates"]], atol=2e-3)
    assert a["backend"] == "cuda"
    greedy_a, greedy_b = cuda.generate(PROMPT, max_tokens=8), cpu.generate(PROMPT, max_tokens=8)
    assert greedy_a["token_ids"] == greedy_b["token_ids"]
    same = sum(
        cuda.generate(PROMPT, max_tokens=6, temperature=0.8, top_k=50, top_p=0.9, seed=s)["token_ids"]
        == cpu.generate(PROMPT, max_tokens=6, temperature=0.8, top_k=50, top_p=0.9, seed=s)["token_ids"]
        for s in range(10)
    )
    assert same >= 9, same


def _run_in_fresh_process(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=300)  # fmt: skip


def test_no_runtime_compilation():
    """docs/design.md §3: system1 + generate leave CuPy's kernel cache empty and never map libnvrtc."""
    with tempfile.TemporaryDirectory() as cache:
        code = (
            "from engine.engine import Engine\n"
            f"e = Engine.load({C.fixture_path('qwen3-tiny-q4_k_m', '.gguf')!r}, backend='cuda')\n"
            "e.system1('The capital of France is', [' Paris', ' Rome'])\n"
            "e.generate('Hello', max_tokens=8, temperature=0.7, seed=1)\n"
            "e.generate('Hello', max_tokens=8)\n"
            "maps = open('/proc/self/maps').read()\n"
            "print('NVRTC' if 'nvrtc' in maps else 'CLEAN')\n"
        )
        p = _run_in_fresh_process(code, {"CUPY_CACHE_DIR": cache})
        assert p.returncode == 0, p.stderr
        assert p.stdout.strip().endswith("CLEAN"), p.stdout
        assert os.listdir(cache) == []


def test_graphs_and_direct_launches_agree():
    code = (
        "import json\nfrom engine.engine import Engine\n"
        f"e = Engine.load({C.fixture_path('qwen3-tiny-q8_0', '.gguf')!r}, backend='cuda')\n"
        "r = [e.generate('Hello there', max_tokens=12)['token_ids'] for _ in range(2)]\n"
        "print(json.dumps(r))\n"
    )
    outs = [_run_in_fresh_process(code, {"REFLEX_CUDA_GRAPHS": g}) for g in ("1", "0")]
    for p in outs:
        assert p.returncode == 0, p.stderr
    assert json.loads(outs[0].stdout) == json.loads(outs[1].stdout)


def test_long_context_decode():
    """Decode at positions up to 3000 (split-key attention over long caches) stays equal to the batched path."""
    e = Engine.load(C.fixture_path("qwen3-tiny-f32", ".gguf"), backend="cuda", max_seq_len=4096)
    rng = np.random.default_rng()
    ids = rng.integers(0, 998, size=3000).tolist()
    batched = e.logits(ids)[-3:]
    stepped = e.logits(ids, prefill=2997)[-3:]
    assert np.abs(batched - stepped).max() <= 1e-4

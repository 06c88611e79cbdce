"""Which GGUF the worker serves, chosen at run time from the environment.

    MODEL_PATH       a file: served as it is (wins over everything below)
    MODEL_NAME       a Hugging Face repository, `org/repo` (worker-vllm's name for it)
    MODEL_FILE       a file of it (`Qwen3-0.6B-Q4_K_M.gguf`, or a path inside the repository), or a quant such as
                     `Q4_K_M` (the one .gguf whose name carries that tag); unset: the repository's only .gguf, else
                     its Q4_K_M
    MODEL_REVISION   branch, tag or commit (default main)

With MODEL_NAME set, the file is looked for, in order: the model baked into the image (BAKED_MODEL_NAME /
BAKED_MODEL_FILE, set by the Dockerfile, name what /models/model.gguf is); Runpod's cached models
(RUNPOD_MODEL_CACHE, default /runpod-volume/huggingface-cache/hub, a Hugging Face cache layout); the Hugging Face
cache on the network volume, which is also where a download goes: HF_HUB_CACHE / HF_HOME as huggingface_hub reads
them, else BASE_PATH/huggingface-cache/hub when a volume is mounted at BASE_PATH (default /runpod-volume), else
huggingface_hub's default; then a download with huggingface_hub (HF_TOKEN; none when HF_HUB_OFFLINE is set). Local
caches are read without importing huggingface_hub (it is ~0.2 s of imports: only a download pays for it). Nothing
found is a `ModelNotFound` error naming the variables. A model without a prepare cache beside it gets one written on
first use (where the folder is writable), so the next cold start parses nothing.
"""

from __future__ import annotations

import glob
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from engine.errors import InvalidInput

log = logging.getLogger(__name__)

BAKED_MODEL = "/models/model.gguf"  # where the Docker image puts its model
RUNPOD_MODEL_CACHE = "/runpod-volume/huggingface-cache/hub"
BASE_PATH = "/runpod-volume"
DEFAULT_QUANT = "Q4_K_M"
_REPO = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_SHARD = re.compile(r"-\d{5}-of-\d{5}\.gguf$")
_TRUE = ("1", "on", "yes", "true")


class ModelNotFound(InvalidInput):
    """MODEL_NAME / MODEL_FILE name nothing that can be found or fetched (a configuration error of the worker)."""


@dataclass(frozen=True)
class Resolved:
    path: str  # the GGUF file to load
    source: str  # "path" | "baked" | "runpod_cache" | "volume" | "download" | "default"


def hub_cache_dir(env: Mapping[str, str] = os.environ) -> str:
    """The Hugging Face hub cache as huggingface_hub.constants computes it (HF_HUB_CACHE, the older
    HUGGINGFACE_HUB_CACHE, HF_HOME/hub, XDG_CACHE_HOME/huggingface/hub, ~/.cache/huggingface/hub)."""
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                                              "huggingface")  # fmt: skip
    cache = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE") or os.path.join(home, "hub")
    return os.path.expanduser(cache)


def volume_cache_dir(env: Mapping[str, str] = os.environ) -> str:
    """Where a download goes and the volume's copy is looked for: huggingface_hub's own cache when the environment
    names one, else the network volume's when one is mounted, else huggingface_hub's default."""
    if any(env.get(k) for k in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME")):
        return hub_cache_dir(env)
    base = env.get("BASE_PATH") or BASE_PATH
    if os.path.isdir(base):
        return os.path.join(base, "huggingface-cache", "hub")
    return hub_cache_dir(env)


def snapshot_dir(cache: str, repo: str, revision: str) -> str | None:
    """The snapshot folder of `repo` at `revision` in a Hugging Face cache layout, if it is there."""
    root = os.path.join(cache, "models--" + repo.replace("/", "--"))
    commit = revision if _COMMIT.match(revision) else None
    if commit is None:
        try:
            with open(os.path.join(root, "refs", revision)) as f:
                commit = f.read().strip()
        except OSError:
            snapshots = sorted(glob.glob(os.path.join(glob.escape(root), "snapshots", "*")))
            if revision == "main" and len(snapshots) == 1:  # Runpod's cache may carry the snapshot only
                return snapshots[0]
            return None
    folder = os.path.join(root, "snapshots", commit)
    return folder if os.path.isdir(folder) else None


def pick_file(files: list[str], wanted: str | None, where: str) -> str:
    """The repository file that MODEL_FILE names (paths relative to the repository root)."""
    ggufs = sorted(f for f in files if f.lower().endswith(".gguf"))
    if wanted and wanted.lower().endswith(".gguf"):
        hits = [f for f in ggufs if f == wanted or os.path.basename(f) == wanted]
    else:
        if not wanted and len(ggufs) == 1:
            return ggufs[0]
        tag = (wanted or DEFAULT_QUANT).lower()
        pattern = re.compile(r"(^|[-_./])" + re.escape(tag) + r"([-_.]|$)")
        hits = [f for f in ggufs if pattern.search(os.path.basename(f).lower()[: -len(".gguf")] + ".")]
    whole = [f for f in hits if not _SHARD.search(f)]
    if len(whole) == 1:
        return whole[0]
    if hits and not whole:
        raise ModelNotFound(f"MODEL_FILE={wanted!r}: {where} has it only as a split GGUF ({hits[0]}, ...), which "
                            "this engine does not read; merge it with llama.cpp's gguf-split first")  # fmt: skip
    if len(whole) > 1:
        raise ModelNotFound(f"MODEL_FILE={wanted!r} matches {len(whole)} files in {where}: "
                            f"{', '.join(whole[:8])}; name one of them")  # fmt: skip
    raise ModelNotFound(f"MODEL_FILE={wanted!r}: no such GGUF in {where} (it has: {', '.join(ggufs[:8]) or 'none'})")


def _in_cache(cache: str, repo: str, wanted: str | None, revision: str) -> str | None:
    folder = snapshot_dir(cache, repo, revision)
    if folder is None:
        return None
    files = [os.path.relpath(p, folder) for p in glob.glob(os.path.join(glob.escape(folder), "**", "*.gguf"),
                                                           recursive=True)]  # fmt: skip
    try:
        return os.path.join(folder, pick_file(files, wanted, f"{repo} in {cache}"))
    except ModelNotFound:
        if not files:
            return None
        raise


def _baked(env: Mapping[str, str], repo: str, wanted: str | None, baked: str) -> str | None:
    if env.get("BAKED_MODEL_NAME") != repo or not os.path.exists(baked):
        return None
    baked_file = env.get("BAKED_MODEL_FILE") or os.path.basename(os.path.realpath(baked))
    if not wanted:
        return baked
    try:
        return baked if pick_file([baked_file], wanted, "the image") else None
    except ModelNotFound:
        return None


def _download(env: Mapping[str, str], repo: str, wanted: str | None, revision: str, cache: str) -> str:
    if (env.get("HF_HUB_OFFLINE") or "").strip().lower() in _TRUE:
        raise ModelNotFound(f"MODEL_NAME={repo!r} MODEL_FILE={wanted!r} is in no local cache (the image, "
                            f"{env.get('RUNPOD_MODEL_CACHE') or RUNPOD_MODEL_CACHE}, {cache}) and HF_HUB_OFFLINE is "
                            "set, so it is not downloaded")  # fmt: skip
    import huggingface_hub
    from huggingface_hub.errors import HfHubHTTPError

    token = env.get("HF_TOKEN") or None
    try:
        files = huggingface_hub.list_repo_files(repo, revision=revision, token=token)
        name = pick_file(files, wanted, f"{repo}@{revision}")
        log.info("downloading %s/%s@%s into %s", repo, name, revision, cache)
        return huggingface_hub.hf_hub_download(repo, name, revision=revision, cache_dir=cache, token=token)
    except HfHubHTTPError as e:
        status = getattr(e.response, "status_code", None)
        hint = " (gated or private: set HF_TOKEN)" if status in (401, 403) else ""
        raise ModelNotFound(f"MODEL_NAME={repo!r}: the Hub refused it: HTTP {status}{hint}") from None
    except OSError as e:  # connection failures, a full or read-only cache folder
        raise ModelNotFound(f"MODEL_NAME={repo!r}: download failed: {type(e).__name__}: {e}") from None


def local_path(env: Mapping[str, str] = os.environ, baked: str = BAKED_MODEL) -> str | None:
    """The file resolve() would pick when it is already on this machine (MODEL_PATH, the image's model, a cache, the
    bundled default), else None; never downloads and never raises: what the weight upload may start from while the
    worker still imports (engine/cuda.upload_early; Worker.load resolves for real and reports errors)."""
    try:
        resolved = resolve(env, baked, fetch=False)
        if resolved is not None:
            return resolved.path
        if (env.get("MODEL_NAME") or "").strip():
            return None  # it would be downloaded
        from engine.bundled import default_model_path

        return default_model_path()
    except Exception:
        return None


def resolve(env: Mapping[str, str] = os.environ, baked: str = BAKED_MODEL, fetch: bool = True) -> Resolved | None:
    """The model to load, or None for the engine's bundled default (fetch=False: also None where it would be
    downloaded)."""
    if env.get("MODEL_PATH"):
        return Resolved(env["MODEL_PATH"], "path")
    repo = (env.get("MODEL_NAME") or "").strip()
    if not repo:
        return Resolved(baked, "baked") if os.path.exists(baked) else None
    if not _REPO.match(repo) or ".." in repo:
        raise ModelNotFound(f"MODEL_NAME={repo!r} is not a Hugging Face repository id (org/name)")
    wanted = (env.get("MODEL_FILE") or "").strip() or None
    if wanted and (wanted.startswith("/") or ".." in wanted.split("/")):
        raise ModelNotFound(f"MODEL_FILE={wanted!r} must be a file name or a path inside the repository")
    revision = (env.get("MODEL_REVISION") or "main").strip()
    if path := _baked(env, repo, wanted, baked):
        return Resolved(path, "baked")
    runpod_cache = env.get("RUNPOD_MODEL_CACHE") or RUNPOD_MODEL_CACHE
    volume = volume_cache_dir(env)
    for source, cache in (("runpod_cache", runpod_cache), ("volume", volume)):
        if path := _in_cache(cache, repo, wanted, revision):
            return Resolved(path, source)
    return Resolved(_download(env, repo, wanted, revision, volume), "download") if fetch else None


def parse_reference(spec: str) -> dict[str, str] | None:
    """`org/repo` or `org/repo:FILE` (the CLI's model argument) as MODEL_NAME / MODEL_FILE, else None."""
    repo, _, wanted = spec.partition(":")
    if not _REPO.match(repo) or os.path.exists(spec):
        return None
    return {"MODEL_NAME": repo, **({"MODEL_FILE": wanted} if wanted else {})}


def ensure_prepared(path: str) -> bool:
    """Write the prepare cache beside `path` if it has none of the current format; False where the folder is
    read-only."""
    from engine import prepare

    if prepare.cache_is_current(path):
        return True
    try:
        prepare.write_cache(path)
        return True
    except OSError as e:
        log.warning("no prepare cache beside %s (%s): every cold start parses the GGUF", path, e)
        return False

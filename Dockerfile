# syntax=docker/dockerfile:1.7
# Reflex worker image for Runpod serverless. Stages:
#   kernels  CUDA devel image: ./build_kernels.sh compiles kernels/*.cu with nvcc for CUDA_ARCHS (no GPU needed)
#   pydeps   slim CUDA base + Python 3.12 + a venv with the pinned packages of pyproject.toml (base, cuda, worker:
#            runpod, huggingface_hub, llguidance)
#   model    downloads the GGUF named by the build args, then `python -m engine prepare` writes its cold-start cache
#   runtime  pydeps + kernels + engine + handler + model; CMD python -u handler.py
# Build (linux/amd64; no GPU needed, see serverless/README.md):
#   docker build --platform linux/amd64 -t reflex-worker .
#   docker build --platform linux/amd64 --build-arg MODEL_REPO=Qwen/Qwen3-0.6B-GGUF \
#       --build-arg MODEL_FILE=Qwen3-0.6B-Q8_0.gguf -t reflex-worker:qwen3-q8 .
#   docker build --secret id=HF_TOKEN,env=HF_TOKEN ...      # gated repositories: the token is never a layer
# scripts/ci_docker_steps.sh performs the same build steps without Docker (CI has no Docker engine).

ARG CUDA_VERSION=12.8.1
ARG UBUNTU=ubuntu24.04

FROM nvidia/cuda:${CUDA_VERSION}-devel-${UBUNTU} AS kernels
# SASS for every GPU Runpod serves (Turing T4 for local use, Ampere, Ada, Hopper, Blackwell B200 and RTX 50xx/PRO),
# so no cold start ever JIT-compiles PTX; the 12.8 toolkit has sm_100 and sm_120.
ARG CUDA_ARCHS="75;80;86;89;90;100;120"
WORKDIR /src
COPY build_kernels.sh ./
COPY kernels/ kernels/
# The release build: no line tables (LINEINFO=0), the same SASS in modules a fraction of the size to load.
RUN CUDA_ARCHS="${CUDA_ARCHS}" LINEINFO=0 ./build_kernels.sh

FROM nvidia/cuda:${CUDA_VERSION}-base-${UBUNTU} AS pydeps
# Ubuntu's python3 (3.12) is the only interpreter; packages live in a venv (the system one is externally managed).
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PIP_DISABLE_PIP_VERSION_CHECK=1
COPY pyproject.toml scripts/pyproject_requirements.py /tmp/build/
RUN python3 -m venv /opt/venv \
    && python /tmp/build/pyproject_requirements.py /tmp/build/pyproject.toml cuda worker > /tmp/build/requirements.txt \
    && pip install --no-cache-dir -r /tmp/build/requirements.txt \
    && rm -rf /tmp/build

FROM pydeps AS model
# Default: Qwen3-0.6B Q4_K_M (~397 MB). Qwen's own Qwen/Qwen3-0.6B-GGUF ships only Qwen3-0.6B-Q8_0.gguf.
ARG MODEL_REPO=unsloth/Qwen3-0.6B-GGUF
ARG MODEL_FILE=Qwen3-0.6B-Q4_K_M.gguf
ARG MODEL_REVISION=main
ARG MODEL_URL=""
WORKDIR /build
COPY scripts/fetch_model.py scripts/
RUN --mount=type=secret,id=HF_TOKEN,required=false \
    MODEL_REPO="${MODEL_REPO}" MODEL_FILE="${MODEL_FILE}" MODEL_REVISION="${MODEL_REVISION}" MODEL_URL="${MODEL_URL}" \
    python scripts/fetch_model.py /models
COPY engine/ engine/
# Everything the cold path could parse is parsed now: tokenizer, metadata, tensor table, sha256.
# PREFIX_TEXT (optional): a prompt prefix the jobs share (a system prompt). Its state (K/V rows) is baked beside the
# model as model.gguf.reflex-prefix, on the CPU backend here, and every job whose prompt starts with it resumes from
# it (timings.prefix_tokens_reused). A state is tied to the model and adapters: with LORA_ADAPTERS it is ignored.
# KV_CACHE_TYPE (f32 or f16, engine/cache_type.py; empty: f32): the image's default K/V cache, and the baked state's
# element (a worker run with the other type ignores the baked state, with a log line).
ARG PREFIX_TEXT=""
ARG KV_CACHE_TYPE=""
RUN if [ -n "$PREFIX_TEXT" ]; then KV_CACHE_TYPE="$KV_CACHE_TYPE" python -m engine prepare /models/model.gguf \
    --prefix "$PREFIX_TEXT"; else python -m engine prepare /models/model.gguf; fi

FROM pydeps AS runtime
ARG MODEL_REPO=unsloth/Qwen3-0.6B-GGUF
ARG MODEL_FILE=Qwen3-0.6B-Q4_K_M.gguf
ARG KV_CACHE_TYPE=""
WORKDIR /app
# What /models/model.gguf is: MODEL_NAME / MODEL_FILE at run time pick it, or another model (engine/worker/models.py).
ENV BAKED_MODEL_NAME=${MODEL_REPO} \
    BAKED_MODEL_FILE=${MODEL_FILE} \
    KV_CACHE_TYPE=${KV_CACHE_TYPE} \
    PYTHONUNBUFFERED=1 \
    RUNPOD_SKIP_AUTO_SYSTEM_CHECKS=true \
    RUNPOD_SKIP_GPU_CHECK=true \
    RUNPOD_LOG_LEVEL=INFO
COPY --from=model /models/ /models/
COPY --from=kernels /src/kernels/build/ kernels/build/
COPY engine/ engine/
COPY handler.py test_input.json ./
RUN python -m compileall -q engine
CMD ["python", "-u", "handler.py"]

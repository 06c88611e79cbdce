#!/usr/bin/env bash
# llama.cpp's source for the side-by-side runs (engine bench --peer), from the llama-cpp-python sdist's
# vendor/llama.cpp, without what a CUDA build of llama-simple and llama-bench never reads (vocabulary files, docs,
# tests, the server and its web UI, the other backends): ~5 MB as .tar.xz instead of the sdist's 77 MB, small enough
# to travel to a GPU machine beside this tree. Then: LLAMA_TARBALL=OUT STAGES="llamacpp peer" scripts/device_run.sh.
#   scripts/llama_source.sh [OUT]      # default .carry/llama.cpp.tar.xz; needs pip and the network
set -euo pipefail
cd "$(dirname "$0")/.."
version="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
out="${1:-.carry/llama.cpp.tar.xz}"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$tmp"
tar xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$tmp"
vendor=$(echo "$tmp"/llama_cpp_python-*/vendor)
skip=(models docs tests benches media tools/ui tools/server .git)
for b in vulkan sycl metal opencl cann webgpu zdnn hexagon; do skip+=("ggml/src/ggml-$b"); done
mkdir -p "$(dirname "$out")"
tar cJf "$out" -C "$vendor" "${skip[@]/#/--exclude=llama.cpp/}" llama.cpp
echo "$out: $(du -h "$out" | cut -f1) (llama-cpp-python $version)"

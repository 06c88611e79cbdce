#!/usr/bin/env bash
# A variant of this tree for an A/B on a GPU machine (kernels and the Python that launches them), run from its own
# copy: `python -m engine` puts the working directory first on sys.path, so a patched engine/ on PYTHONPATH alone is
# shadowed by this tree's engine/ whenever the command runs from here (session 20 measured two A/Bs that way, wrongly).
#
#   scripts/variant.sh make NAME [DEST=SRC ...]   # /tmp/variant/NAME: engine/, tests/, scripts/, kernels/ (sources and
#                                                 # build) and pyproject.toml copied, then each DEST (a path in the tree)
#                                                 # replaced by SRC; a replaced kernels/<stem>.cu rebuilds that module,
#                                                 # a replaced .cuh every module, for sm_$ARCH (default 90),
#                                                 # with EXTRA_NVCC's flags (e.g. -DGEMM_STAGE_K=32); a file may
#                                                 # replace itself (DEST=DEST) to rebuild it with those flags
#   scripts/variant.sh run NAME CMD ...           # CMD in that copy, with its kernels: give it absolute paths
#
# Example: scripts/variant.sh make old kernels/tc_matvec.cu=/tmp/tc_old.cu engine/cuda/k_tc_matvec.py=/tmp/k_tc_old.py
#          scripts/variant.sh run old python3 -m engine profile $PWD/bench/models/M.gguf --batch 13
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=/tmp/variant
cmd="${1:-}"; name="${2:-}"
[ -n "$cmd" ] && [ -n "$name" ] || { sed -n '2,15p' "$0" >&2; exit 2; }
V="$ROOT/$name"
case "$cmd" in
make)
  shift 2
  [ -f kernels/build/manifest.json ] || { echo "variant.sh: build the kernels first (./build_kernels.sh)" >&2; exit 1; }
  rm -rf "$V"; mkdir -p "$V"
  cp -r engine tests scripts kernels pyproject.toml "$V/"
  changed=()
  for spec in "$@"; do
    dest="${spec%%=*}"; src="${spec#*=}"
    [ -f "$src" ] || { echo "variant.sh: no file $src" >&2; exit 1; }
    [ "$(realpath "$src")" = "$(realpath "$dest")" ] || cp "$src" "$V/$dest"
    case "$dest" in kernels/*.cu | kernels/*.cuh) changed+=("$(basename "$dest")") ;; esac
  done
  [ ${#changed[@]} -gt 0 ] || exit 0
  arch="${ARCH:-90}"
  all=0
  for c in "${changed[@]}"; do [[ "$c" == *.cuh ]] && all=1; done
  for cu in "$V"/kernels/*.cu; do
    hit=$all
    for c in "${changed[@]}"; do [ "$(basename "$cu")" = "$c" ] && hit=1; done
    [ $hit = 1 ] || continue
    stem="$(basename "$cu" .cu)"
    nvcc -O3 -lineinfo -std=c++17 --fatbin ${EXTRA_NVCC:-} -I"$V/kernels" -gencode="arch=compute_$arch,code=sm_$arch" \
      -o "$V/kernels/build/$stem.fatbin" "$cu"
    echo "variant.sh: $name: rebuilt $stem (sm_$arch)"
  done
  ;;
run)
  shift 2
  [ -d "$V/engine" ] || { echo "variant.sh: no variant $name (scripts/variant.sh make $name ...)" >&2; exit 1; }
  cd "$V"
  PYTHONPATH="/tmp/site:$V" REFLEX_KERNEL_DIR="$V/kernels/build" exec "$@"
  ;;
*)
  sed -n '2,15p' "$0" >&2; exit 2 ;;
esac

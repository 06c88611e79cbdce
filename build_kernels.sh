#!/usr/bin/env bash
# Ahead-of-time kernel build: every kernels/*.cu -> kernels/build/<stem>.fatbin with SASS for each arch in
# CUDA_ARCHS (default "75;80;86;89;90") plus PTX of the highest (PTX=0: none, a build for exactly those GPUs, about
# half the bytes: what a device call carries), -O3 -lineinfo (LINEINFO=0: without, the release
# build the image ships: the same SASS without the line tables, which make a module several times larger to read and
# decompress at load; scripts/pdl_audit.py needs them). Also writes
#   kernels/build/manifest.json   archs, nvcc version, per-module sha256 and size
#   kernels/build/resources.txt   registers / shared memory / spills per kernel and arch (ptxas -v)
# Fails loudly on any compile error or on a spill, prints the manifest. Works with CUDA 12.x and 13.x.
# Incremental: a module is rebuilt only when its inputs changed: the .cu, the kernels/ headers it includes
# (transitively), the flags and arch list, and the nvcc version, all hashed into kernels/build/<stem>.stamp (written
# after a successful compile). FORCE=1 rebuilds everything. Outputs of deleted sources are removed. Compiled modules
# are also kept by stamp in KERNEL_CACHE_DIR (default ~/.cache/reflex-kernels; "" for none; entries unused for 30
# days are pruned), so a fresh build directory (scripts/ci_docker_steps.sh's scratch image) reuses what any earlier
# build compiled from the same inputs.
#   CUDA_ARCHS=90 ./build_kernels.sh      # one arch, for a fast local build
set -euo pipefail
cd "$(dirname "$0")"
NVCC="${NVCC:-nvcc}"
ARCHS="${CUDA_ARCHS:-75;80;86;89;90}"
OUT="${KERNEL_BUILD_DIR:-kernels/build}"
JOBS="${JOBS:-$(nproc)}"

command -v "$NVCC" >/dev/null || { echo "build_kernels.sh: $NVCC not found (install the CUDA toolkit)" >&2; exit 1; }
supported=" $("$NVCC" --list-gpu-code | tr '\n' ' ') "
IFS=';' read -r -a archs <<< "$ARCHS"
gencode=()
highest=0
for a in "${archs[@]}"; do
  [[ "$supported" == *" sm_$a "* ]] || { echo "build_kernels.sh: this nvcc cannot build sm_$a" >&2; exit 1; }
  gencode+=("-gencode=arch=compute_$a,code=sm_$a")
  (( a > highest )) && highest=$a
done
PTX="${PTX:-1}"
[[ $PTX == 0 || $PTX == 1 ]] || { echo "build_kernels.sh: PTX must be 0 or 1" >&2; exit 1; }
[ "$PTX" = 1 ] && gencode+=("-gencode=arch=compute_$highest,code=compute_$highest")

mkdir -p "$OUT"
for f in "$OUT"/*.fatbin; do  # modules whose source is gone
  [ -e "$f" ] || continue
  stem=$(basename "$f" .fatbin)
  [ -f "kernels/$stem.cu" ] || rm -f "$f" "$OUT/$stem.ptxas.log" "$OUT/$stem.stamp"
done
GENCODE_FILE=$(mktemp)
trap 'rm -f "$GENCODE_FILE"' EXIT
LINEINFO="${LINEINFO:-1}"
[[ $LINEINFO == 0 || $LINEINFO == 1 ]] || { echo "build_kernels.sh: LINEINFO must be 0 or 1" >&2; exit 1; }
LINE_FLAG=""
[ "$LINEINFO" = 1 ] && LINE_FLAG="-lineinfo"
NVCC_FLAGS="-O3 $LINE_FLAG -std=c++17 --fatbin -Xptxas -v -Ikernels"
NVCC_VERSION=$("$NVCC" --version | tail -n 1)
FORCE="${FORCE:-0}"
CACHE="${KERNEL_CACHE_DIR-${XDG_CACHE_HOME:-$HOME/.cache}/reflex-kernels}"
if [ -n "$CACHE" ]; then
  if mkdir -p "$CACHE" 2>/dev/null && [ -w "$CACHE" ]; then
    find "$CACHE" -type f -mtime +30 -delete 2>/dev/null || true
  else
    CACHE=""
  fi
fi
export NVCC OUT GENCODE_FILE NVCC_FLAGS NVCC_VERSION FORCE CACHE
printf '%s\n' "${gencode[@]}" > "$GENCODE_FILE"

# The kernels/ headers that $1 includes with #include "...", transitively (<...> ones are the toolkit's, whose
# version is in the stamp), sorted.
includes() {
  local -A seen=()
  local todo=("$1") f h
  while ((${#todo[@]})); do
    f=${todo[-1]}
    unset 'todo[-1]'
    for h in $(sed -n 's/^[[:space:]]*#[[:space:]]*include[[:space:]]*"\([^"]*\)".*/\1/p' "$f"); do
      h="kernels/$h"
      if [[ -f $h && -z ${seen[$h]:-} ]]; then
        seen[$h]=1
        todo+=("$h")
      fi
    done
  done
  if ((${#seen[@]})); then printf '%s\n' "${!seen[@]}" | sort; fi
}

# cp $1 $2, atomically: concurrent builds (and readers) never see a half-written file.
put() { cp "$1" "$2.$$" && mv -f "$2.$$" "$2"; }

compile() {
  local src=$1 stem stamp
  stem=$(basename "$src" .cu)
  mapfile -t gc < "$GENCODE_FILE"
  stamp=$({ printf '%s\n' "$NVCC_VERSION" "$NVCC_FLAGS" "${gc[@]}"
            for f in "$src" $(includes "$src"); do printf '== %s\n' "$f"; cat "$f"; done; } | sha256sum | cut -d' ' -f1)
  if [[ $FORCE != 1 && -f $OUT/$stem.fatbin && -f $OUT/$stem.ptxas.log &&
        $(cat "$OUT/$stem.stamp" 2>/dev/null) == "$stamp" ]]; then
    echo "build_kernels.sh: $stem up to date"
    return 0
  fi
  rm -f "$OUT/$stem.stamp"
  local cached="$CACHE/$stamp"
  if [[ $FORCE != 1 && -n $CACHE && -f $cached.fatbin && -f $cached.ptxas.log ]] &&
     put "$cached.ptxas.log" "$OUT/$stem.ptxas.log" && put "$cached.fatbin" "$OUT/$stem.fatbin"; then
    touch "$cached.fatbin" "$cached.ptxas.log"
    echo "$stamp" > "$OUT/$stem.stamp"
    echo "build_kernels.sh: $stem from the cache"
    return 0
  fi
  # -Xptxas -v writes the resource report to stderr
  # shellcheck disable=SC2086
  if ! "$NVCC" $NVCC_FLAGS "${gc[@]}" -o "$OUT/$stem.fatbin.$$" "$src" 2> "$OUT/$stem.ptxas.log.$$"; then
    cat "$OUT/$stem.ptxas.log.$$" >&2
    rm -f "$OUT/$stem.fatbin.$$" "$OUT/$stem.ptxas.log.$$"
    echo "build_kernels.sh: FAILED $src" >&2
    return 1
  fi
  if [ -n "$CACHE" ]; then  # best effort: a full disk only costs a later build its reuse
    { put "$OUT/$stem.ptxas.log.$$" "$cached.ptxas.log" && put "$OUT/$stem.fatbin.$$" "$cached.fatbin"; } \
      2>/dev/null || true
  fi
  mv -f "$OUT/$stem.ptxas.log.$$" "$OUT/$stem.ptxas.log"
  mv -f "$OUT/$stem.fatbin.$$" "$OUT/$stem.fatbin"
  echo "$stamp" > "$OUT/$stem.stamp"
  echo "build_kernels.sh: $stem built"
}
export -f includes put compile
ls kernels/*.cu | xargs -P "$JOBS" -I{} bash -c 'compile {}'

# ptxas prints "Compiling entry function 'X' for 'sm_Y'", then the stack/spill line, then the registers line.
{
  printf '%-52s %-7s %5s %6s %7s %s\n' kernel arch regs smem stack spills
  for log in "$OUT"/*.ptxas.log; do
    awk -F"'" '
      /Compiling entry function/ { fn = $2; arch = $4; stack = 0; spill = 0 }
      /bytes stack frame/        { split($0, w, " "); stack = w[1]; spill = w[5] + w[9] }
      /Used [0-9]+ registers/    { split($0, w, "Used "); split(w[2], r, " "); regs = r[1]; smem = 0
                                   n = split($0, parts, ","); for (i = 1; i <= n; i++) if (parts[i] ~ /bytes smem/) { split(parts[i], q, " "); smem = q[1] }
                                   printf "%-52s %-7s %5s %6s %7s %s\n", fn, arch, regs, smem, stack, spill }
    ' "$log"
  done
} > "$OUT/resources.txt"
if awk 'NR > 1 && $6 > 0 { bad = 1 } END { exit !bad }' "$OUT/resources.txt"; then
  echo "build_kernels.sh: register spills (see $OUT/resources.txt):" >&2
  awk 'NR == 1 || $6 > 0' "$OUT/resources.txt" >&2
  exit 1
fi

{
  printf '{\n  "archs": "%s",\n  "ptx": %s,\n  "nvcc": "%s",\n  "lineinfo": %s,\n  "modules": {\n' \
    "$ARCHS" "$([ "$PTX" = 1 ] && echo "\"compute_$highest\"" || echo null)" "$NVCC_VERSION" \
    "$([ "$LINEINFO" = 1 ] && echo true || echo false)"
  first=1
  for f in "$OUT"/*.fatbin; do
    [ $first -eq 1 ] || printf ',\n'
    first=0
    printf '    "%s": {"sha256": "%s", "bytes": %s}' "$(basename "$f" .fatbin)" "$(sha256sum "$f" | cut -d' ' -f1)" "$(stat -c %s "$f")"
  done
  printf '\n  }\n}\n'
} > "$OUT/manifest.json"
cat "$OUT/manifest.json"

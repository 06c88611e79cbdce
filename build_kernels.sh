#!/usr/bin/env bash
# Ahead-of-time kernel build: every kernels/*.cu -> kernels/build/<stem>.fatbin with SASS for each arch in
# CUDA_ARCHS (default "75;80;86;89;90") plus PTX of the highest, -O3 -lineinfo. Also writes
#   kernels/build/manifest.json   archs, nvcc version, per-module sha256 and size
#   kernels/build/resources.txt   registers / shared memory / spills per kernel and arch (ptxas -v)
# Fails loudly on any compile error or on a spill, prints the manifest. Works with CUDA 12.x and 13.x.
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
gencode+=("-gencode=arch=compute_$highest,code=compute_$highest")

mkdir -p "$OUT"
rm -f "$OUT"/*.fatbin "$OUT"/*.ptxas.log
GENCODE_FILE=$(mktemp)
trap 'rm -f "$GENCODE_FILE"' EXIT
export NVCC OUT GENCODE_FILE
printf '%s\n' "${gencode[@]}" > "$GENCODE_FILE"
compile() {
  local src=$1 stem
  stem=$(basename "$src" .cu)
  mapfile -t gc < "$GENCODE_FILE"
  if ! "$NVCC" -O3 -lineinfo -std=c++17 --fatbin "${gc[@]}" -Xptxas -v -Ikernels \
       -o "$OUT/$stem.fatbin" "$src" 2> "$OUT/$stem.ptxas.log"; then
    cat "$OUT/$stem.ptxas.log" >&2
    echo "build_kernels.sh: FAILED $src" >&2
    return 1
  fi
}
export -f compile
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

nvcc_version=$("$NVCC" --version | tail -n 1)
{
  printf '{\n  "archs": "%s",\n  "ptx": "compute_%s",\n  "nvcc": "%s",\n  "modules": {\n' "$ARCHS" "$highest" "$nvcc_version"
  first=1
  for f in "$OUT"/*.fatbin; do
    [ $first -eq 1 ] || printf ',\n'
    first=0
    printf '    "%s": {"sha256": "%s", "bytes": %s}' "$(basename "$f" .fatbin)" "$(sha256sum "$f" | cut -d' ' -f1)" "$(stat -c %s "$f")"
  done
  printf '\n  }\n}\n'
} > "$OUT/manifest.json"
cat "$OUT/manifest.json"

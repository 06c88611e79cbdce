#!/usr/bin/env bash
# One full run on a GPU machine, logs under $OUT (or ./device-out): install the carried wheels, build the kernels
# unless a build was carried, doctor + smoke, the GPU test suite, then the stages named in STAGES:
#   tests      pytest -m gpu (+ the CPU suite's fast parts that touch the CUDA path)
#   sanitizer  compute-sanitizer memcheck over the kernel tests (SANITIZER_PATHS picks them)
#   bench      the Qwen3-0.6B-shaped benchmark models: engine bench (warm + cold), conformance report
# Usage: STAGES="tests bench" scripts/device_run.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-device-out}"
mkdir -p "$OUT"
STAGES="${STAGES:-tests}"
export PYTHONUNBUFFERED=1 PYTHONPATH="/tmp/site:$PWD"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$OUT/pip.log" 2>&1 || { cat "$OUT/pip.log"; exit 1; }
fi
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv; nvcc --version | tail -1;
  python3 -c 'import cupy, numpy; print("cupy", cupy.__version__, "numpy", numpy.__version__)'; } > "$OUT/env.txt" 2>&1
[ -f kernels/build/manifest.json ] || CUDA_ARCHS=90 ./build_kernels.sh > "$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
python3 -m engine doctor > "$OUT/doctor.json" 2>&1; python3 -m engine smoke >> "$OUT/doctor.json" 2>&1
cat "$OUT/env.txt" "$OUT/doctor.json"

for stage in $STAGES; do
  case $stage in
    tests)
      timeout "${TEST_TIMEOUT:-420}" python3 -m pytest -m gpu -q -rfE -p no:cacheprovider --continue-on-collection-errors \
        --junitxml "$OUT/gpu_tests.xml" ${TEST_PATHS:-tests} 2>&1 | tee "$OUT/gpu_tests.log" | tail -40 ;;
    sanitizer)
      timeout "${SANITIZER_TIMEOUT:-400}" compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -m gpu -q \
        -x -p no:cacheprovider ${SANITIZER_PATHS:-tests/test_cuda_matvec.py tests/test_cuda_gemm.py tests/test_cuda_attention.py} \
        > "$OUT/sanitizer.log" 2>&1
      echo "sanitizer exit $?"; tail -15 "$OUT/sanitizer.log" ;;
    bench)
      for q in q4_k_m q8_0; do
        [ -f "bench/models/qwen3-0.6b-shaped-$q.gguf" ] || python3 scripts/make_bench_model.py --quant $q >> "$OUT/bench.log" 2>&1
      done
      m=bench/models/qwen3-0.6b-shaped-q4_k_m.gguf
      python3 -m engine prepare "$m" >> "$OUT/bench.log" 2>&1
      timeout 300 python3 -m engine bench "$m" --cold "${COLD_RUNS:-10}" > "$OUT/bench_q4_k_m.json" 2>> "$OUT/bench.log"
      timeout 120 python3 -m engine bench bench/models/qwen3-0.6b-shaped-q8_0.gguf > "$OUT/bench_q8_0.json" 2>> "$OUT/bench.log"
      tail -5 "$OUT/bench.log"; cat "$OUT"/bench_*.json ;;
    conformance)
      python3 scripts/conformance_report.py --backend cuda 2>&1 | tee "$OUT/conformance_cuda.md" ;;
  esac
done

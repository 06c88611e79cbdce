#!/usr/bin/env bash
# One full run on a GPU machine, logs under $OUT (or ./device-out): install the carried wheels, build the kernels
# unless a build was carried, doctor + smoke, the GPU test suite, then the stages named in STAGES:
#   tests      pytest -m gpu (+ the CPU suite's fast parts that touch the CUDA path)
#   sanitizer  compute-sanitizer memcheck over the kernel tests (SANITIZER_PATHS picks them)
#   bench      the Qwen3-0.6B-shaped benchmark models: engine bench (warm + cold), conformance report
#   llamacpp   build llama.cpp (llama-simple, llama-bench; CUDA sm_90) from the source tarball LLAMA_TARBALL
#              (scripts/llama_source.sh makes it from the llama-cpp-python sdist) into $LLAMA_DIR
#   models     the benchmark models: Qwen3-0.6B shaped (make_bench_model.py) and the MoE / MLA / hybrid shapes
#              (make_family_bench_model.py), into bench/models
#   peer       engine bench --cold $COLD_RUNS --peer llama.cpp=$LLAMA_DIR --plot, per model named in PEER_MODELS (a
#              bench/models stem, or a .gguf path: SmolLM2-135M, 98 MB, travels as two halves, one a device call,
#              `split -n 2` here and `cat` there)
#   worker     scripts/worker_cold.py on the Qwen3-0.6B-shaped Q4_K_M model (needs the runpod wheels)
#   profile    engine profile --repeats 50 per model named in PROFILE_MODELS (default: the 4-layer MoE / MLA shapes)
#   longctx    scripts/bench_long_context.py per model named in LONGCTX_MODELS (f32 and f16 K/V caches, decode step
#              against the context length: 0.6B shape to its 40,959 positions, the hybrid to 65,535)
#   synccost   scripts/sync_cost.py: a launch boundary (plain, programmatic) against a grid barrier, a stage
#   release    the release kernel build (LINEINFO=0, as the image) into $RELEASE_DIR (/tmp/build-release; started
#              in the background right after the main build, beside the stages before this one), then
#              scripts/module_load_bench.py: cuModuleLoad per module, main build against release (with LINEINFO=1
#              for the main build: on an H200 the 8 base modules load in 99 ms with line tables, 19 without)
#   variants   a kernel A/B kept as a compile-time switch, VARIANT="MODULE FLAGS..." (e.g. "gemm -DGEMM_STAGE_K=32"):
#              a scripts/variant.sh copy with kernels/MODULE.cu rebuilt, its kernel tests (VARIANT_TESTS, default
#              tests/test_cuda_MODULE.py) and model tests from its copy, then engine bench (warm) and engine profile
#              --batch VARIANT_BATCHES (default "1 13 32", after VARIANT_PROMPT cached tokens, default 64), base and
#              variant interleaved, two rounds
#   attntc     the tensor-core prefill attention (attn_prefill_tc, on by default): its kernel tests, bench_attention.py,
#              then engine bench and engine profile (--batch 512 after 1 and 1,536 cached tokens, --batch 13 after 64)
#              off, on, and on for short batches too (REFLEX_DECODE_TOKENS=0), interleaved, twice
#   attnwarps  attn_decode_w8 (REFLEX_ATTN_WARPS=8, 8 warps a block) against attn_decode's 4: the attention tests, the
#              dense and hybrid model tests with 8 warps, then engine bench and engine profile after 16, 80, 144, 200,
#              1,000 and 4,000 cached tokens and for 13 tokens after 1, for 4 warps, 8, and 8 with a least split of
#              256 keys (REFLEX_ATTN_MIN_CHUNK), interleaved, twice; scripts/ab_table.py's table in attnwarps.md
#   gemmtc     the prefill GEMMs (REFLEX_PREFILL_GEMM: kernels/gemm_tc.cu's "pipe", the default from 256 tokens,
#              and "dense"; gemm.cu's "tile"): their kernel and model tests, then engine bench and engine profile --batch 512 / 256 /
#              128 for tile, dense and pipe (from 65 tokens on), interleaved, twice
#   coldab     scripts/cold_ab.py on the Qwen3-0.6B-shaped Q4_K_M model: cold system1 under the cold path's switches
#              (COLDAB_VARIANTS, default: base, release kernels if built, prefetch, late upload, readahead, modules
#              on first use; session 23's results drop the piece sizes, CUDA_MODULE_LOADING=EAGER and the exit
#              teardown from it), interleaved, with warm and then dropped page caches
#   ncu        Nsight Compute over one decode step's kernels of NCU_MODEL (default the 0.6B shape; NCU_KERNELS a
#              regex, NCU_SKIP / NCU_COUNT launches skipped / profiled; NCU_PROFILE_ARGS for engine profile, e.g.
#              "--batch 512" for a prefill step's), then scripts/ncu_table.py --by-kernel
# Usage: STAGES="tests bench" scripts/device_run.sh
# Detached, for runs longer than one command (logs in RESULTS instead of $OUT, which each command empties):
#   RESULTS=/tmp/res STAGES="llamacpp models tests peer" setsid scripts/device_run.sh > /tmp/run.log 2>&1 &
# then `sleep 100; scripts/device_poll.sh` again and again: a machine left without a command for ~30 s goes back.
# Each stage appends "STAGE exit N" to RESULTS/progress (or $OUT/progress).
# PACK=1: everything the stages wrote ends up in one results.tgz there (a device call brings back only a few files).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${RESULTS:-${OUT:-device-out}}"
mkdir -p "$OUT"
STAGES="${STAGES:-tests}"
export PYTHONUNBUFFERED=1 PYTHONPATH="/tmp/site:$PWD"
# Bytecode compiled at install (no --no-compile), as an image's pip install writes it: cold runs import it.
for d in .whl .whl-worker; do  # once per machine: several stages may run at once, detached
  [ -d $d ] && [ ! -f /tmp/site/.installed$d ] || continue
  python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site $d/*.whl \
    > "$OUT/pip$d.log" 2>&1 || { cat "$OUT/pip$d.log"; exit 1; }
  touch /tmp/site/.installed$d
done
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem,persistence_mode --format=csv; nvcc --version | tail -1;
  python3 -c 'import cupy, numpy; print("cupy", cupy.__version__, "numpy", numpy.__version__)'; } > "$OUT/env.txt" 2>&1
# The image's build (no line tables: LINEINFO=0) unless asked otherwise (LINEINFO=1 for Nsight Compute's source view).
[ -f kernels/build/manifest.json ] || CUDA_ARCHS=90 LINEINFO="${LINEINFO:-0}" ./build_kernels.sh > "$OUT/build.log" 2>&1 ||
  { tail -50 "$OUT/build.log"; exit 1; }
R="${RELEASE_DIR:-/tmp/build-release}"
release_pid=""
if [[ " $STAGES " == *" release "* && ! -f "$R/manifest.json" ]]; then  # beside the stages before it (8 cores)
  CUDA_ARCHS=90 LINEINFO=0 KERNEL_BUILD_DIR="$R" KERNEL_CACHE_DIR= JOBS=8 ./build_kernels.sh > "$OUT/release_build.log" 2>&1 &
  release_pid=$!
fi
python3 -m engine doctor > "$OUT/doctor.json" 2>&1; python3 -m engine smoke >> "$OUT/doctor.json" 2>&1
cat "$OUT/env.txt" "$OUT/doctor.json"

for stage in $STAGES; do
  stage_exit=0
  case $stage in
    tests)  # the two modules that import `openai` (absent from the device image) hold no GPU tests
      timeout "${TEST_TIMEOUT:-420}" python3 -m pytest -m gpu -q -rfE -p no:cacheprovider --continue-on-collection-errors \
        --ignore tests/test_http_mode.py --ignore tests/test_worker_openai.py \
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
    llamacpp)
      LLAMA_DIR="${LLAMA_DIR:-/tmp/llama.cpp}"
      mkdir -p "$LLAMA_DIR" && tar xJf "${LLAMA_TARBALL:-.carry/llama.cpp.tar.xz}" -C "$LLAMA_DIR" --strip-components=1 &&
        cmake -S "$LLAMA_DIR" -B "$LLAMA_DIR/build" -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_CURL=OFF \
          -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF > "$OUT/llamacpp.log" 2>&1 &&
        cmake --build "$LLAMA_DIR/build" -j "$(nproc)" --target llama-simple llama-bench >> "$OUT/llamacpp.log" 2>&1
      echo "llama.cpp build exit $?"; tail -3 "$OUT/llamacpp.log" ;;
    models)
      [ -f bench/models/qwen3-0.6b-shaped-q4_k_m.gguf ] || python3 scripts/make_bench_model.py --quant q4_k_m >> "$OUT/models.log" 2>&1
      for shape in ${SHAPES:-qwen3.5-0.8b deepseek-v2-lite qwen3-30b-a3b}; do
        [ -f "bench/models/$shape-shaped-q4_k_m.gguf" ] || python3 scripts/make_family_bench_model.py --shape "$shape" >> "$OUT/models.log" 2>&1
      done
      tail -12 "$OUT/models.log" ;;
    peer)
      for m in ${PEER_MODELS:-qwen3-0.6b-shaped-q4_k_m}; do
        f=bench/models/$m.gguf
        [[ $m == *.gguf ]] && { f=$m; m=$(basename "$m" .gguf); }  # a file elsewhere (a real model carried in)
        python3 -m engine prepare "$f" >> "$OUT/peer.log" 2>&1
        timeout "${PEER_TIMEOUT:-400}" python3 -m engine bench "$f" --cold "${COLD_RUNS:-5}" \
          --peer "llama.cpp=${LLAMA_DIR:-/tmp/llama.cpp}/build" --plot "$OUT/peer_$m.svg" > "$OUT/peer_$m.json" 2>> "$OUT/peer.log"
        echo "$m: exit $?"; python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(r.get('ours_vs_peer'))" "$OUT/peer_$m.json"
      done ;;
    worker)
      m=bench/models/qwen3-0.6b-shaped-q4_k_m.gguf
      python3 -m engine prepare "$m" > /dev/null 2>&1
      timeout 300 python3 scripts/worker_cold.py "$m" --runs "${COLD_RUNS:-5}" --backend cuda --queue both \
        > "$OUT/worker_cold.json" 2> "$OUT/worker.log"
      echo "worker exit $?"; tail -3 "$OUT/worker.log" ;;
    conformance)
      python3 scripts/conformance_report.py --backend cuda 2>&1 | tee "$OUT/conformance_cuda.md"
      KV_CACHE_TYPE=f16 python3 scripts/conformance_report.py --backend cuda 2>&1 | tee "$OUT/conformance_cuda_f16.md" ;;
    longctx)
      for m in ${LONGCTX_MODELS:-qwen3-0.6b-shaped-q4_k_m qwen3.5-0.8b-shaped-q4_k_m}; do
        case $m in qwen3-0.6b*) ctx=64,1024,4096,16384,40959 ;; *) ctx=64,1024,4096,16384,65535 ;; esac
        timeout "${LONGCTX_TIMEOUT:-300}" python3 scripts/bench_long_context.py "bench/models/$m.gguf" --contexts "$ctx" \
          --out "$OUT/longctx_$m.json" 2>> "$OUT/longctx.log" || stage_exit=$?
      done ;;
    profile)
      for m in ${PROFILE_MODELS:-qwen3-30b-a3b-shaped-4layers deepseek-v2-lite-shaped-4layers}; do
        f=bench/models/$m.gguf
        if [ ! -f "$f" ]; then  # SHAPE-shaped-4layers: made here with --layers 4
          shape=${m%-shaped-4layers}
          python3 scripts/make_family_bench_model.py --shape "$shape" --layers 4 --out "$f" >> "$OUT/models.log" 2>&1
        fi
        python3 -m engine profile "$f" --repeats 50 > "$OUT/profile_$m.json" 2>> "$OUT/profile.log" || stage_exit=$?
        python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(sys.argv[1], r['step_ms'], 'ms a step')" \
          "$OUT/profile_$m.json"
      done ;;
    release)
      [ -z "$release_pid" ] || wait "$release_pid" || { tail -20 "$OUT/release_build.log"; stage_exit=1; }
      timeout 200 python3 scripts/module_load_bench.py kernels/build "$R" --rounds 5 2>&1 | tee "$OUT/module_load.md" ;;
    variants)
      m=$PWD/bench/models/qwen3-0.6b-shaped-q4_k_m.gguf
      [ -f "$m" ] || python3 scripts/make_bench_model.py --quant q4_k_m >> "$OUT/variants.log" 2>&1
      # A variant runs only if it built and its kernel tests pass (a failed build would leave the base's fatbins in it).
      ok=(base)
      set -- ${VARIANT:-}  # "MODULE FLAGS...": kernels/MODULE.cu rebuilt with FLAGS
      if [ $# -ge 2 ]; then
        mod=$1; shift
        # VARIANT_TESTS=none: a measurement-only form (one that no test would pass), timed once it builds
        EXTRA_NVCC="$*" scripts/variant.sh make variant "kernels/$mod.cu=kernels/$mod.cu" >> "$OUT/variants.log" 2>&1 &&
          { [ "${VARIANT_TESTS:-}" = none ] ||
            scripts/variant.sh run variant python3 -m pytest -q -p no:cacheprovider ${VARIANT_TESTS:-tests/test_cuda_$mod.py} \
              tests/test_cuda_model.py > "$OUT/variant_tests_variant.log" 2>&1; } && ok+=(variant)
      else
        echo "variants: VARIANT names no module and flags" | tee -a "$OUT/variants.log"
      fi
      for f in "$OUT"/variant_tests_*.log; do tail -n 2 "$f"; done; echo "variants that built and passed: ${ok[*]}"
      [ ${#ok[@]} = 2 ] || stage_exit=1
      for round in 1 2; do
        for v in "${ok[@]}"; do
          run=(python3 -m engine); [ $v = base ] || run=(scripts/variant.sh run $v python3 -m engine)
          timeout 120 "${run[@]}" bench "$m" > "$OUT/variant_bench_${v}_$round.json" 2>> "$OUT/variants.log"
          for b in ${VARIANT_BATCHES:-1 13 32}; do
            timeout 120 "${run[@]}" profile "$m" --repeats 20 --batch $b --prompt-tokens "${VARIANT_PROMPT:-64}" \
              > "$OUT/variant_profile_${v}_b${b}_$round.json" 2>> "$OUT/variants.log"
          done
          python3 -c "import json,sys; w=json.load(open(sys.argv[1]))['warm']; print(sys.argv[2], sys.argv[3], w)" \
            "$OUT/variant_bench_${v}_$round.json" $v $round 2>&1 | cut -c1-400
        done
      done ;;
    attntc)
      m=$PWD/bench/models/qwen3-0.6b-shaped-q4_k_m.gguf
      [ -f "$m" ] || python3 scripts/make_bench_model.py --quant q4_k_m >> "$OUT/attntc.log" 2>&1
      timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_cuda_attention.py -k "prefill" \
        > "$OUT/attntc_tests.log" 2>&1 || stage_exit=1
      tail -n 3 "$OUT/attntc_tests.log"
      if [ $stage_exit = 0 ]; then  # the tensor-core prefill attention against attn_prefill, interleaved, two rounds
        timeout 120 python3 scripts/bench_attention.py > "$OUT/attntc_kernels.txt" 2>&1; head -4 "$OUT/attntc_kernels.txt"
        # off; on past DECODE_TOKENS; on for every batch (a system1 prompt's 13 tokens too, instead of attn_decode)
        for round in 1 2; do
          for v in "off REFLEX_ATTN_TC=0" "on REFLEX_ATTN_TC=1" "short REFLEX_ATTN_TC=1 REFLEX_DECODE_TOKENS=0"; do
            set -- $v; name=$1; shift
            env "$@" timeout 120 python3 -m engine bench "$m" > "$OUT/attntc_bench_${name}_$round.json" 2>> "$OUT/attntc.log"
            for shape in "512 1" "512 1536" "13 64"; do  # --batch, --prompt-tokens before it
              set -- $shape
              env ${v#* } timeout 120 python3 -m engine profile "$m" --repeats 10 --batch $1 --prompt-tokens $2 \
                > "$OUT/attntc_profile_${name}_b$1_p$2_$round.json" 2>> "$OUT/attntc.log"
            done
            python3 -c "import json,sys; w=json.load(open(sys.argv[1]))['warm']; print(sys.argv[2], sys.argv[3],
              w['system1_ms'], w['prefill_16'], w['prefill_512'])" "$OUT/attntc_bench_${name}_$round.json" $name $round \
              2>&1 | cut -c1-400
          done
        done
      fi ;;
    attnwarps)
      m=$PWD/bench/models/qwen3-0.6b-shaped-q4_k_m.gguf
      [ -f "$m" ] || python3 scripts/make_bench_model.py --quant q4_k_m >> "$OUT/attnwarps.log" 2>&1
      timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_cuda_attention.py \
        > "$OUT/attnwarps_tests.log" 2>&1 || stage_exit=1
      REFLEX_ATTN_WARPS=8 timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_cuda_model.py \
        tests/test_cuda_hybrid_model.py >> "$OUT/attnwarps_tests.log" 2>&1 || stage_exit=1
      grep -E "passed|failed" "$OUT/attnwarps_tests.log"
      if [ $stage_exit = 0 ]; then
        mkdir -p "$OUT/attnwarps"
        for round in 1 2; do
          for v in "w4 4 128" "w8 8 128" "w8mc256 8 256"; do
            set -- $v
            export REFLEX_ATTN_WARPS=$2 REFLEX_ATTN_MIN_CHUNK=$3
            timeout 150 python3 -m engine bench "$m" > "$OUT/attnwarps/bench_${1}_$round.json" 2>> "$OUT/attnwarps.log"
            for p in 16 80 144 200 1000 4000; do
              timeout 100 python3 -m engine profile "$m" --repeats 30 --prompt-tokens $p \
                > "$OUT/attnwarps/profile_${1}_p${p}_$round.json" 2>> "$OUT/attnwarps.log"
            done
            timeout 100 python3 -m engine profile "$m" --repeats 20 --batch 13 --prompt-tokens 1 \
              > "$OUT/attnwarps/profile_${1}_b13_$round.json" 2>> "$OUT/attnwarps.log"
            unset REFLEX_ATTN_WARPS REFLEX_ATTN_MIN_CHUNK
          done
        done
        python3 scripts/ab_table.py "$OUT/attnwarps" | tee "$OUT/attnwarps.md"
      fi ;;
    gemmtc)
      m=$PWD/bench/models/qwen3-0.6b-shaped-q4_k_m.gguf
      [ -f "$m" ] || python3 scripts/make_bench_model.py --quant q4_k_m >> "$OUT/gemmtc.log" 2>&1
      timeout 500 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_cuda_gemm.py tests/test_cuda_model.py \
        -k "dense or pipe or gemm_tc or prefill_picks or tensor_core_prefill" > "$OUT/gemmtc_tests.log" 2>&1 ||
        stage_exit=1
      tail -n 3 "$OUT/gemmtc_tests.log"
      if [ $stage_exit = 0 ]; then  # gemm.cu's tile, dense, pipe (past 64 tokens), interleaved, two rounds
        for round in 1 2; do
          for v in tile dense pipe; do
            export REFLEX_PREFILL_GEMM=$v REFLEX_PREFILL_GEMM_MIN=65
            timeout 120 python3 -m engine bench "$m" > "$OUT/gemmtc_bench_${v}_$round.json" 2>> "$OUT/gemmtc.log"
            for b in 512 256 128; do
              timeout 120 python3 -m engine profile "$m" --repeats 10 --batch $b \
                > "$OUT/gemmtc_profile_${v}_b${b}_$round.json" 2>> "$OUT/gemmtc.log"
            done
            unset REFLEX_PREFILL_GEMM REFLEX_PREFILL_GEMM_MIN
            python3 -c "import json,sys; w=json.load(open(sys.argv[1]))['warm']; print(sys.argv[2], sys.argv[3],
              {k: w.get(k) for k in ('prefill_128', 'prefill_512')})" "$OUT/gemmtc_bench_${v}_$round.json" $v \
              $round 2>&1 | cut -c1-400
            for b in 512 256 128; do
              python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(sys.argv[2], r['step_ms'], 'ms',
                [(k['kernel'], k['us']) for k in r['by_kernel'][:5]])" "$OUT/gemmtc_profile_${v}_b${b}_$round.json" \
                "$v b$b" 2>&1 | cut -c1-400
            done
          done
        done
      fi ;;
    coldab)
      m=bench/models/qwen3-0.6b-shaped-q4_k_m.gguf
      [ -f "$m" ] || python3 scripts/make_bench_model.py --quant q4_k_m >> "$OUT/coldab.log" 2>&1
      python3 -m engine prepare "$m" >> "$OUT/coldab.log" 2>&1
      rel=""; [ -f "$R/manifest.json" ] && rel="--variant release=REFLEX_KERNEL_DIR=$R"
      variants=${COLDAB_VARIANTS:-"--variant base= $rel --variant prefetch=REFLEX_PREFETCH=1 --variant late_upload=REFLEX_EARLY_UPLOAD=0 --variant readahead=REFLEX_READAHEAD=1 --variant modules_on_use=REFLEX_MODULE_PRELOAD=0"}
      timeout "${COLDAB_TIMEOUT:-300}" python3 scripts/cold_ab.py "$m" --rounds "${COLD_RUNS:-5}" $variants \
        --out "$OUT/cold_ab_warm.json" 2>> "$OUT/coldab.log" | tee "$OUT/cold_ab_warm.md" || stage_exit=$?
      timeout "${COLDAB_TIMEOUT:-300}" python3 scripts/cold_ab.py "$m" --rounds "${COLD_RUNS:-5}" $variants \
        --drop-page-cache --out "$OUT/cold_ab_dropped.json" 2>> "$OUT/coldab.log" | tee "$OUT/cold_ab_dropped.md" ;;
    synccost)
      timeout 120 python3 scripts/sync_cost.py > "$OUT/sync_cost.md" 2>&1; stage_exit=$?; cat "$OUT/sync_cost.md" ;;
    ncu)
      m=${NCU_MODEL:-bench/models/qwen3-0.6b-shaped-q4_k_m.gguf}
      [ -f "$m" ] || python3 scripts/make_bench_model.py --quant q4_k_m >> "$OUT/ncu.log" 2>&1
      timeout "${NCU_TIMEOUT:-200}" ncu --launch-skip "${NCU_SKIP:-40}" --launch-count "${NCU_COUNT:-40}" \
        -k "${NCU_KERNELS:-regex:.}" --section SpeedOfLight --section Occupancy --section LaunchStats \
        --section WarpStateStats --section SchedulerStats --section InstructionStats \
        python3 -m engine profile "$m" --repeats 2 ${NCU_PROFILE_ARGS:-} > "$OUT/ncu.txt" 2>&1
      echo "ncu exit $?"; python3 scripts/ncu_table.py "$OUT/ncu.txt" --by-kernel ;;
  esac
  status=$?  # the stage's last command (a stage that loops over models keeps its first failure in stage_exit)
  echo "$stage exit $((stage_exit ? stage_exit : status))" >> "$OUT/progress"
done
if [ "${PACK:-0}" = 1 ]; then
  tar czf /tmp/device-run-pack.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/device-run-pack.tgz "$OUT/results.tgz"
fi

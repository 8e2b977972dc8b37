# Quickstart: `make demo` (plan the default configuration) and `make test` (the whole suite).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
export DS_BUILD_OPS := 0

.PHONY: demo test lint install install-test bench repro clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.core: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q -e .
	touch $@

# torch is installed first, pinned, so megatron-core's `torch>=2.6` cannot pull a CUDA build.
$(VENV)/.test: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $(VENV)/.core $@

install: $(VENV)/.core
install-test: $(VENV)/.test

demo: $(VENV)/.core
	$(BIN)/kareus plan

# ruff (lint) and mypy (the layers below the runtime) are configured in pyproject.toml.
lint: $(VENV)/.test
	$(BIN)/ruff check .
	$(BIN)/mypy

test: lint
	$(BIN)/python -m pytest -q -x --hypothesis-seed=0 --timeout=300 tests  # reproducible (plain `pytest tests` explores new examples); a hung test fails with its stacks

bench: $(VENV)/.test
	$(BIN)/pip install -q -e '.[bench]'
	for b in benchmarks/*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

repro: $(VENV)/.core
	$(BIN)/python benchmarks/reproduce.py

clean:
	rm -rf $(VENV) kareus-out repro-out build *.egg-info

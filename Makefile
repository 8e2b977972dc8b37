# Quickstart: `make demo` (plan the default configuration) and `make test` (the whole suite).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
export DS_BUILD_OPS := 0

.PHONY: demo test lint install install-test bench repro clean try-runtime

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
	# The older supported series (kareus_megatron/versions.py), each in its own directory: a test puts it
	# first on PYTHONPATH to run the runtime against it (tests/runtime/test_framework_versions.py).
	$(BIN)/pip install -q --no-deps --target $(VENV)/alt/megatron-core-0.15.3 megatron-core==0.15.3
	DS_BUILD_OPS=0 $(BIN)/pip install -q --no-deps --target $(VENV)/alt/deepspeed-0.18.9 deepspeed==0.18.9
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

# Try the runtime on a CPU: plan the tiny GPT of examples/, train it on 2 gloo ranks (real megatron-core
# 1F1B schedule, simulated GPUs) under the plan, then compare measured with predicted.
# `make try-runtime ITERATIONS=N OUT=DIR`; DIR (plan/, the run log run, the report's plot) is replaced.
ITERATIONS ?= 6
OUT ?= try-out
TRY_JOB := --tp 1 --pp 2 --mbs 2 --seq 16 --microbatches 4
TRY_POINT := kareus-00
try-runtime: $(VENV)/.test
	@o='$(abspath $(OUT))'; case "$(CURDIR)/" in "$$o"/*) echo "try-runtime: OUT=$(OUT) holds this repository; pick another directory" >&2; exit 2;; esac; \
	if [ -d "$$o" ] && ls -A "$$o" | grep -qvE '^(plan|run.*)$$'; then \
	  echo "try-runtime: $(OUT) holds files other than a try-out's (plan, run*); pick another OUT" >&2; exit 2; fi
	rm -rf $(OUT)
	$(BIN)/kareus plan --model examples/tiny-gpt.yaml --gpu a100-sxm4-40gb $(TRY_JOB) --nodes 1 --gpus-per-node 2 \
	    --precision fp32 --recompute none --out $(OUT)/plan
	# $(OUT)/run: the run log directory (a file per rank); new, since OUT was removed above (--kareus-log-mode new).
	KAREUS_GPU_BACKEND=simulated OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore::UserWarning \
	    $(BIN)/python -m torch.distributed.run --standalone \
	    --nproc-per-node 2 -m kareus_megatron.launch --kareus-plan $(OUT)/plan --kareus-point $(TRY_POINT) \
	    --kareus-log $(OUT)/run -- examples/tiny_train.py --iterations $(ITERATIONS) $(TRY_JOB)
	$(BIN)/kareus report $(OUT)/run --plan $(OUT)/plan/plans/$(TRY_POINT).json

repro: $(VENV)/.core
	$(BIN)/python benchmarks/reproduce.py

clean:
	rm -rf $(VENV) kareus-out repro-out try-out build *.egg-info

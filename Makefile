# Quickstart: `make demo` (plan the default configuration) and `make test` (the whole suite).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
export DS_BUILD_OPS := 0

.PHONY: demo test test-fast lint ruff typecheck suite suite-fast docs install install-test bench repro clean try-runtime

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.core: $(BIN)/python pyproject.toml
	@echo "installing kareus-megatron's planner (numpy, scipy, highspy, matplotlib, rich) into $(VENV): first time only, about a minute"
	$(BIN)/pip install -q -e .
	touch $@

# torch is installed first, pinned, so megatron-core's `torch>=2.6` cannot pull a CUDA build.
# --no-compile: pip byte-compiles what it installs one file at a time (torch alone: 18 s installed so, 6.5 s without).
# Nothing is compiled ahead: the suite's processes write the .pyc of what they import (tests/conftest.py lets them where
# PYTHONDONTWRITEBYTECODE is set, as here and in CI); compiling the whole environment took 19 s of the install's 55 s.
PIP_TEST := $(BIN)/pip install -q --no-compile
$(VENV)/.test: $(BIN)/python pyproject.toml
	@echo "installing the test environment into $(VENV): torch 2.13.0 (CPU), megatron-core 0.16.1 and 0.15.3, DeepSpeed \
	0.19.8 and 0.18.9, pytest, ruff, mypy, mkdocs; first time (or after pyproject.toml changes) only, about a minute"
	$(PIP_TEST) torch==2.13.0
	$(PIP_TEST) -e '.[test,docs]'
	# The older supported series (kareus_megatron/versions.py), each in its own directory: a test puts it
	# first on PYTHONPATH to run the runtime against it (tests/runtime/test_framework_versions.py).
	$(PIP_TEST) --no-deps --target $(VENV)/alt/megatron-core-0.15.3 megatron-core==0.15.3
	DS_BUILD_OPS=0 $(PIP_TEST) --no-deps --target $(VENV)/alt/deepspeed-0.18.9 deepspeed==0.18.9
	touch $(VENV)/.core $@

install: $(VENV)/.core
install-test: $(VENV)/.test

demo: $(VENV)/.core
	$(BIN)/kareus plan

# ruff (lint and format: `$(BIN)/ruff format .` rewrites what --check refuses) and mypy (the whole package) are
# configured in pyproject.toml.
lint: ruff typecheck

ruff: $(VENV)/.test
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(VENV)/.test
	$(BIN)/mypy

# Two workers, --dist loadfile (a file's tests on one worker: its module fixtures are built once); the times and what was
# tried to shorten them: docs/contributing.md; --durations=25 prints the slowest.
# --hypothesis-seed=0: reproducible (plain `pytest tests` explores new examples); --timeout: a hung test fails with its
# stacks. One worker: `make test PYTEST_WORKERS=0`.
# bytecode: the package and the tests, compiled here (under a second) for the processes that keep
# PYTHONDONTWRITEBYTECODE=1 (this machine and CI): pytest's own and the docs build; those the suite starts write theirs.
PYTEST_WORKERS ?= 2
BYTECODE := $(BIN)/python -m compileall -q -j 0 kareus_megatron tests launch examples benchmarks >/dev/null
# mypy and the docs build (~17 s of one core from a clean clone) run beside the suite, whose two workers leave about a
# fifth of the machine idle (sleep-bound end-to-end runs); ruff first (a fraction of a second: style fails at once).
test: ruff
	$(BYTECODE)
	@$(MAKE) --no-print-directory -j 3 typecheck docs suite

# MAKEFLAGS emptied: the makes the tests run (make try-runtime) would otherwise find -j 3's jobserver and warn on stderr
suite: $(VENV)/.test
	MAKEFLAGS= $(BIN)/python -m pytest -q -x -n $(PYTEST_WORKERS) --dist loadfile --hypothesis-seed=0 --timeout=300 \
		--durations=25 tests

# The edit-test loop: lint and every test but the end-to-end runs (tests/conftest.py END_TO_END, marker e2e); mypy
# beside the tests, as in `make test` (a clean clone's first mypy takes ~17 s of one core; later ones read its cache).
test-fast: ruff
	$(BYTECODE)
	@$(MAKE) --no-print-directory -j 2 typecheck suite-fast

suite-fast: $(VENV)/.test
	MAKEFLAGS= $(BIN)/python -m pytest -q -x -n $(PYTEST_WORKERS) --dist loadfile --hypothesis-seed=0 --timeout=300 \
		-m "not e2e" tests

# The docs site into site/ (SITE=DIR: elsewhere; mkdocs.yml), strict: a broken link, anchor or nav entry fails the build. The
# reference pages are generated from the code (docs/gen_reference.py). Seconds. Browse: $(BIN)/mkdocs serve
# (not --quiet: it hides the warnings that strict mode counts, so a broken link would pass)
SITE ?= site
docs: $(VENV)/.test
	NO_MKDOCS_2_WARNING=1 DISABLE_MKDOCS_2_WARNING=true $(BIN)/mkdocs build --strict --site-dir $(SITE)

bench: $(VENV)/.test
	$(BIN)/pip install -q -e '.[bench]'
	for b in benchmarks/*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

# Try the runtime on a CPU: plan the small GPT of examples/ for 2 A40s, train it on 2 gloo ranks (real
# megatron-core schedule, simulated GPUs) under one plan, then compare measured with predicted.
# `make try-runtime PARALLEL="--tp 2 --sp" METHOD=kareus POINT=00 ITERATIONS=N OUT=DIR`:
#   PARALLEL: any layout 2 ranks hold (--pp 2, --tp 2, --tp 2 --sp, --cp 2, --dp 2; unset sizes are 1), passed
#     alike to `kareus plan` and to tiny_train.py, which validate it (bad values: one line, exit 2);
#   METHOD: kareus | nanobatch_perseus | perseus | megatron; POINT: the frontier point, 00 = its fastest plan;
#   DIR (plan/, the run log run, the report's plot) is replaced; PLAN_ARGS: more `kareus plan` flags (e.g.
#     --cross-layer: the plan and the run use cross-layer overlap).
# The model is built with the partitioned (overlap) layer spec when the plan has 2-nanobatch instructions or
# the layout uses SP or CP (megatron's local spec cannot run those without Apex/TE), else megatron's local spec.
ITERATIONS ?= 6
# the simulated GPU's time scale: each instruction takes TIME_SCALE × its predicted GPU time (2-core machine: the
# CPU's own work needs ≥ 250 for the default job; more for larger PARALLEL layouts if the report warns of floors)
TIME_SCALE ?= 500
# iterations `kareus report` skips as warm-up (report/summary.py DEFAULT_SKIP_ITERATIONS; a test keeps them equal)
REPORT_WARMUP := 2
OUT ?= try-out
PARALLEL ?= --pp 2
METHOD ?= kareus
POINT ?= 00
PLAN_ARGS ?=
TRY_MODEL := examples/small-gpt.yaml
TRY_JOB = --tp 1 --pp 1 $(PARALLEL) --mbs 8 --seq 256 --microbatches 4
TRY_PLAN = $(OUT)/plan/plans/$(METHOD)-$(POINT).json
TRY_SPEC := import json, sys; d = json.load(open(sys.argv[1])); p = d["parallel"]; \
  nb = any(i["nanobatches"] > 1 for s in d["stages"] for i in s["instructions"]); \
  print("partitioned" if nb or p["sequence_parallel"] or p["cp"] > 1 else "local")
try-runtime: $(VENV)/.test
	@case '$(ITERATIONS)' in ''|*[!0-9]*) echo "try-runtime: ITERATIONS=$(ITERATIONS) must be a whole number" >&2; exit 2;; esac; \
	if [ '$(ITERATIONS)' -le $(REPORT_WARMUP) ]; then echo "try-runtime: ITERATIONS=$(ITERATIONS) leaves nothing to report: \
	the report skips the first $(REPORT_WARMUP) iterations (warm-up); use ITERATIONS=$$(( $(REPORT_WARMUP) + 1 )) or more" >&2; exit 2; fi
	@case '$(TIME_SCALE)' in ''|*[!0-9.]*|*.*.*|.) echo "try-runtime: TIME_SCALE=$(TIME_SCALE) must be a positive number" >&2; exit 2;; esac
	@case '$(OUT)' in ''|*' '*) echo "try-runtime: OUT='$(OUT)' must be a directory name without spaces" >&2; exit 2;; esac
	@o='$(abspath $(OUT))'; case "$(CURDIR)/" in "$$o"/*) echo "try-runtime: OUT=$(OUT) holds this repository; pick another directory" >&2; exit 2;; esac; \
	if [ -L "$$o" ] || { [ -e "$$o" ] && [ ! -d "$$o" ]; }; then \
	  echo "try-runtime: OUT=$(OUT) is a file or a link, not a try-out's directory; pick a new directory" >&2; exit 2; fi; \
	if [ -d "$$o" ] && ls -A "$$o" | grep -qvE '^(plan|run.*|truth\.json)$$'; then \
	  echo "try-runtime: $(OUT) holds files other than a try-out's (plan, run*, truth.json); pick another OUT" >&2; exit 2; fi
	rm -rf '$(OUT)'
	$(BIN)/kareus plan --model $(TRY_MODEL) --gpu a40 $(TRY_JOB) --nodes 1 --gpus-per-node 2 \
	    --precision fp32 --recompute none --methods '$(METHOD)' $(PLAN_ARGS) --out $(OUT)/plan
	@test -f '$(TRY_PLAN)' || { echo "try-runtime: no plan $(METHOD)-$(POINT) in $(OUT)/plan/plans; use METHOD=kareus, nanobatch_perseus, perseus or megatron and POINT=00 (the fastest) .. 09" >&2; exit 2; }
	# $(OUT)/run: the run log directory (a file per rank); new, since OUT was removed above (--kareus-log-mode new).
	# The simulated GPU runs each instruction TIME_SCALE × its predicted GPU time (a truth equal to the a40
	# preset, runtime/closed_loop/truth.py), long enough to cover the CPU's work; the report scales alike.
	@printf '{"format": "kareus-simulated-truth/1", "gpu": "a40", "params": {"time_scale": %s}}\n' '$(TIME_SCALE)' \
	    > $(OUT)/truth.json
	@spec=$$($(BIN)/python -c '$(TRY_SPEC)' '$(TRY_PLAN)') && echo "layer spec: $$spec" && set -x && \
	KAREUS_GPU_BACKEND=simulated KAREUS_SIMULATED_TRUTH=$(OUT)/truth.json OMP_NUM_THREADS=1 \
	    PYTHONWARNINGS=ignore::UserWarning,ignore::FutureWarning $(BIN)/python -m torch.distributed.run --standalone \
	    --nproc-per-node 2 -m kareus_megatron.launch --kareus-plan $(OUT)/plan --kareus-point $(METHOD)-$(POINT) \
	    --kareus-log $(OUT)/run -- examples/tiny_train.py --iterations $(ITERATIONS) --model $(TRY_MODEL) \
	    $(TRY_JOB) --layer-spec $$spec
	$(BIN)/kareus report $(OUT)/run --plan '$(TRY_PLAN)'

repro: $(VENV)/.core
	$(BIN)/python benchmarks/reproduce.py

clean:
	rm -rf $(VENV) kareus-out repro-out try-out site build *.egg-info

#!/usr/bin/env bash
# The whole comparison on a real cluster: `kareus plan` (unless PLAN_DIR/frontier.json exists), then
# every frontier point of megatron, perseus, nanobatch_perseus and kareus, then `kareus compare`.
#   launch/run_comparison.sh --plan-dir kareus-out --log-dir runs --launcher slurm \
#       --plan-arg=--model --plan-arg=llama3.2-3b [--container-image IMG] [--dry-run]
# With --launcher torchrun, plan first on one node, then run this on every node (shared file system).
# Runs `kareus launch comparison ...` ($PYTHON -m kareus_megatron.cli.main when PYTHON is set or there
# is no `kareus` on PATH).
set -euo pipefail
if [ -z "${PYTHON:-}" ] && command -v kareus >/dev/null 2>&1; then
    exec kareus launch comparison "$@"
fi
exec "${PYTHON:-python3}" -m kareus_megatron.cli.main launch comparison "$@"

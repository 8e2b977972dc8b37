#!/usr/bin/env bash
# The whole comparison on a real cluster: `kareus plan` (unless PLAN_DIR/frontier.json exists), then
# every frontier point of megatron, perseus, nanobatch_perseus and kareus, then `kareus compare`.
#   launch/run_comparison.sh --plan-dir kareus-out --log-dir runs --launcher slurm \
#       --plan-arg=--model --plan-arg=llama3.2-3b [--container-image IMG] [--dry-run]
# With --launcher torchrun, plan first on one node, then run this on every node (shared file system).
set -euo pipefail
exec "${PYTHON:-python3}" "$(dirname "$0")/kareus_launch.py" comparison "$@"

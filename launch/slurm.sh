#!/usr/bin/env bash
# One method of a `kareus plan` directory under Slurm: submits launch/slurm.sbatch (2 nodes x 8 GPUs
# by default), which runs `srun ... torchrun ...` once per selected frontier point.
#   launch/slurm.sh --method perseus --plan-dir kareus-out [--point all] [--container-image IMG] [--dry-run]
set -euo pipefail
exec "${PYTHON:-python3}" "$(dirname "$0")/kareus_launch.py" run --launcher slurm "$@"

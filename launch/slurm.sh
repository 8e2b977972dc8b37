#!/usr/bin/env bash
# One method of a `kareus plan` directory under Slurm: submits launch/slurm.sbatch (2 nodes x 8 GPUs
# by default), which runs `srun ... torchrun ...` once per selected frontier point.
#   launch/slurm.sh --method perseus --plan-dir kareus-out [--point all] [--container-image IMG] [--dry-run]
# Runs `kareus launch run --launcher slurm ...` ($PYTHON -m kareus_megatron.cli.main when PYTHON is set
# or there is no `kareus` on PATH).
set -euo pipefail
if [ -z "${PYTHON:-}" ] && command -v kareus >/dev/null 2>&1; then
    exec kareus launch run --launcher slurm "$@"
fi
exec "${PYTHON:-python3}" -m kareus_megatron.cli.main launch run --launcher slurm "$@"

#!/usr/bin/env bash
# One method of a `kareus plan` directory with torchrun; run the same line on every node.
#   launch/torchrun.sh --method kareus --plan-dir kareus-out --master-addr NODE0 [--point fastest] [--dry-run]
# Defaults: 2 nodes x 8 GPUs. All options: kareus launch run --help
# Runs `kareus launch run --launcher torchrun ...` ($PYTHON -m kareus_megatron.cli.main when PYTHON is set
# or there is no `kareus` on PATH).
set -euo pipefail
if [ -z "${PYTHON:-}" ] && command -v kareus >/dev/null 2>&1; then
    exec kareus launch run --launcher torchrun "$@"
fi
exec "${PYTHON:-python3}" -m kareus_megatron.cli.main launch run --launcher torchrun "$@"

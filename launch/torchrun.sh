#!/usr/bin/env bash
# One method of a `kareus plan` directory with torchrun; run the same line on every node.
#   launch/torchrun.sh --method kareus --plan-dir kareus-out --master-addr NODE0 [--point fastest] [--dry-run]
# Defaults: 2 nodes x 8 GPUs. All options: python launch/kareus_launch.py run --help
set -euo pipefail
exec "${PYTHON:-python3}" "$(dirname "$0")/kareus_launch.py" run --launcher torchrun "$@"

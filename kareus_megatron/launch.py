"""Generic launcher: run any megatron-core training script with a kareus plan.

    python -m kareus_megatron.launch --kareus-plan PLAN [--kareus-log LOG] -- train.py ARGS...
    torchrun --nproc_per_node 8 -m kareus_megatron.launch --kareus-plan DIR --kareus-point 03 -- train.py ...
    python -m kareus_megatron.launch --kareus-plan PLAN -- -m my_package.train ARGS...

The patch is installed before the script runs (as ``__main__``, with ``sys.argv`` = script and its
arguments); the script then calls megatron-core's schedule as usual. When the script returns, the
last iteration is logged and clocks are reset. A kareus error prints one line and exits with status 2.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from kareus_megatron.runtime.frameworks.entry import launch_script

PROG = "python -m kareus_megatron.launch"


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the --kareus-* flags, install the plan, run the script; return the exit status."""
    return launch_script(PROG, list(sys.argv[1:] if argv is None else argv), __doc__.split("\n\n")[0])


if __name__ == "__main__":
    raise SystemExit(main())

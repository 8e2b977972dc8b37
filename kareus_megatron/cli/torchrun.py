"""`kareus torchrun ARGS`: torchrun (``python -m torch.distributed.run ARGS``), ending with one line and exit
status 2 when a kareus error stopped a rank (jobs/torchrun.py); otherwise torchrun's own exit status. A SIGTERM to
kareus goes on to torchrun (jobs/children.py).

    kareus torchrun --nproc-per-node 8 launch/pretrain_gpt.py --kareus-plan kareus-out --kareus-log runs/a ...
"""

from __future__ import annotations

import argparse
import sys

from kareus_megatron.errors import ConfigError
from kareus_megatron.jobs.children import sigterm_passed_on
from kareus_megatron.jobs.torchrun import run_summarised

HELP = "run torchrun ARGS; a kareus error on any rank ends it with that one line, last, and exit status 2"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register `kareus torchrun`: everything after it goes to torchrun unchanged (cli/main.py passes it on)."""
    parser.add_argument(
        "torchrun_args",
        nargs=argparse.REMAINDER,
        metavar="ARGS",
        help="torchrun's arguments, e.g. --nproc-per-node 8 train.py ...",
    )


def run(args: argparse.Namespace) -> int:
    """Run torchrun with ARGS; its exit status, or 2 with the ranks' first kareus error last on stderr."""
    if not args.torchrun_args:
        raise ConfigError(
            "kareus torchrun needs torchrun's arguments, e.g. kareus torchrun --nproc-per-node 8 train.py ..."
        )
    with sigterm_passed_on():  # `kill PID` on kareus reaches torchrun, which stops its ranks
        return run_summarised([sys.executable, "-m", "torch.distributed.run", *args.torchrun_args])

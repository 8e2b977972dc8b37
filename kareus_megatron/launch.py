"""Generic launcher: run any megatron-core training script with a kareus plan.

    python -m kareus_megatron.launch --kareus-plan PLAN [--kareus-log LOG] -- train.py ARGS...
    torchrun --nproc_per_node 8 -m kareus_megatron.launch --kareus-plan DIR --kareus-point 03 -- train.py ...
    python -m kareus_megatron.launch --kareus-plan PLAN -- -m my_package.train ARGS...

The patch is installed before the script runs (as ``__main__``, with ``sys.argv`` = script and its
arguments); the script then calls megatron-core's schedule as usual. When the script returns, the
last iteration is logged and clocks are reset. A kareus error prints one line and exits with status 2.
"""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Sequence

from kareus_megatron.errors import ConfigError
from kareus_megatron.runtime.entry import (
    debug_requested,
    help_requested,
    kareus_parser,
    print_kareus_help,
    run_guarded,
    run_script_in_session,
    split_at_double_dash,
    start_session,
)

PROG = "python -m kareus_megatron.launch"


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the --kareus-* flags, install the plan, run the script; return the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, target = split_at_double_dash(argv)
    if help_requested(ours):
        return print_kareus_help(PROG, f"{PROG} --kareus-plan PATH [--kareus-* ...] -- train.py ARGS | -m MODULE ARGS",
                                 __doc__.split("\n\n")[0])
    debug = debug_requested(ours)

    def body() -> int:
        parser = kareus_parser(PROG)
        ns, unknown = parser.parse_known_args(ours)
        if unknown:
            raise ConfigError(f"unknown launcher argument(s) {' '.join(unknown)}; put the training script and "
                              f"its arguments after '--': {PROG} --kareus-plan PLAN -- train.py ARGS")
        if not target:
            raise ConfigError(f"no training script given; usage: {PROG} --kareus-plan PLAN -- train.py ARGS")
        module = None
        if target[0] == "-m":
            if len(target) < 2:
                raise ConfigError("-m needs a module name, e.g. -- -m my_package.train")
            module, script_argv = target[1], [target[1], *target[2:]]
        else:
            if not os.path.isfile(target[0]):
                raise ConfigError(f"training script {target[0]} does not exist")
            script_argv = target
        session = start_session(ns)

        def run() -> None:
            if module is not None:
                runpy.run_module(module, run_name="__main__", alter_sys=True)
            else:
                sys.path.insert(0, os.path.dirname(os.path.abspath(target[0])))
                runpy.run_path(target[0], run_name="__main__")

        return run_script_in_session(session, script_argv, run)

    return run_guarded(PROG, debug, body)


if __name__ == "__main__":
    raise SystemExit(main())

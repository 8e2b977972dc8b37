"""Drop-in for Megatron-LM's pretrain_gpt.py that runs a kareus plan.

    torchrun --nproc_per_node 8 launch/pretrain_gpt.py \\
        --kareus-plan kareus-out --kareus-point iso-time --kareus-log runs/kareus \\
        --megatron-lm-dir /opt/Megatron-LM  <the usual pretrain_gpt.py arguments>

Takes Megatron-LM's own arguments unchanged plus: --kareus-plan PATH (plan file or `kareus plan`
output directory), --kareus-point POINT (iso-time, the default; NN, METHOD-NN, fastest, min-energy,
METHOD-fastest, METHOD-min-energy), --kareus-robust (iso-time / min-energy met across the prediction bands),
--kareus-log DIR, --kareus-on-error fail|warn, --kareus-debug, and
--megatron-lm-dir DIR (or MEGATRON_LM_DIR). When the plan runs 2-nanobatch instructions it adds
``--spec kareus_megatron.megatron_spec NAME`` (kareus's partitioned layer, runtime/frameworks/layer_choice.py)
unless a --spec is given, and rank 0 says in one line which layer the model is built with and why. It installs
the kareus patch, then runs DIR/pretrain_gpt.py
as ``__main__`` with the remaining arguments, so Megatron-LM's own code (and its megatron.core) does the
training. ``--help`` lists the kareus flags without needing Megatron-LM.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from collections.abc import Sequence

from kareus_megatron.errors import ConfigError
from kareus_megatron.runtime.frameworks.entry import (
    debug_requested,
    help_requested,
    kareus_parser,
    print_kareus_help,
    refuse_cuda_graph_flags,
    run_guarded,
    run_script_in_session,
    start_session,
)
from kareus_megatron.runtime.frameworks.layer_choice import megatron_layer_flags
from kareus_megatron.runtime.frameworks.megatron_lm_hook import choose_megatron_layer

PROG = "pretrain_gpt.py (kareus)"


def _extra(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--megatron-lm-dir",
        default=None,
        metavar="DIR",
        help="Megatron-LM checkout holding pretrain_gpt.py (default: $MEGATRON_LM_DIR)",
    )


def megatron_lm_script(directory: str | None) -> str:
    """Path of Megatron-LM's pretrain_gpt.py from --megatron-lm-dir or MEGATRON_LM_DIR; ConfigError if absent."""
    d = directory or os.environ.get("MEGATRON_LM_DIR")
    if not d:
        raise ConfigError(
            "Megatron-LM not found: pass --megatron-lm-dir DIR or set MEGATRON_LM_DIR to a "
            "Megatron-LM checkout (the directory holding pretrain_gpt.py)"
        )
    script = os.path.join(os.path.abspath(d), "pretrain_gpt.py")
    if not os.path.isfile(script):
        raise ConfigError(f"--megatron-lm-dir {d} has no pretrain_gpt.py; point it at a Megatron-LM checkout")
    return script


def main(argv: Sequence[str] | None = None) -> int:
    """Install the plan and run Megatron-LM's pretrain_gpt.py; return the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if help_requested(argv):  # the kareus flags; Megatron-LM's own are listed by its pretrain_gpt.py --help
        return print_kareus_help(
            PROG,
            "torchrun ... launch/pretrain_gpt.py --kareus-plan PATH [--kareus-* ...] "
            "[--megatron-lm-dir DIR] <pretrain_gpt.py arguments>",
            __doc__.split("\n\n")[0],
            epilog="Every other argument goes to Megatron-LM's pretrain_gpt.py; for those, "
            "run python $MEGATRON_LM_DIR/pretrain_gpt.py --help.",
            extra=_extra,
        )
    debug = debug_requested(argv)

    def body() -> int:
        ns, rest = kareus_parser(PROG, _extra).parse_known_args(argv)
        refuse_cuda_graph_flags(rest)  # before Megatron-LM starts: a plan cannot run under CUDA graphs
        script = megatron_lm_script(ns.megatron_lm_dir)
        sys.path.insert(0, os.path.dirname(script))  # Megatron-LM's megatron/ package wins from here on
        choice = choose_megatron_layer(ns, megatron_layer_flags(rest))
        if choice.spec is not None and not choice.given:  # the partitioned layer, as Megatron-LM's own --spec
            rest = [*rest, "--spec", *choice.spec]
        session = start_session(ns)
        return run_script_in_session(session, [script, *rest], lambda: runpy.run_path(script, run_name="__main__"))

    return run_guarded(PROG, debug, body)


if __name__ == "__main__":
    raise SystemExit(main())

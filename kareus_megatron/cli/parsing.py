"""The argument parser every `kareus` command uses (a usage error is one line and exit status 2), and the flags that
more than one command takes."""

from __future__ import annotations

import argparse
import difflib
import sys
from typing import Any

from kareus_megatron.errors import ConfigError


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports usage errors as one line ("PROG: error: MESSAGE"), exit status 2, and takes flags only as
    spelled in full: argparse's prefix matching read `kareus plan --gpus h100` as --gpus-per-node (a newcomer meant
    --gpu, and the error named the other flag) and `--method` as `--methods`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]  # argparse declares NoReturn
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(2)


def innermost_parser(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.ArgumentParser:
    """The (sub)command parser that `argv` reaches: `kareus launch run ...` -> the parser of `launch run`."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for i, a in enumerate(argv):
                if a in action.choices:
                    return innermost_parser(action.choices[a], argv[i + 1 :])
    return parser


def unrecognized(parser: argparse.ArgumentParser, extras: list[str]) -> str:
    """The one-line error for arguments no flag of `parser` takes, naming the closest flag of each (a typo's fix)."""
    flags = [o for a in parser._actions for o in a.option_strings]
    hints = []
    for e in extras:
        close = difflib.get_close_matches(e.split("=", 1)[0], flags, n=1, cutoff=0.6) if e.startswith("-") else []
        if close:
            hints.append(f"{e.split('=', 1)[0]}: did you mean {close[0]}?")
    return f"unrecognized arguments: {' '.join(extras)}" + (f" ({'; '.join(hints)})" if hints else "")


def add_clock_latency_flag(parser: Any) -> None:
    """``--clock-latency-ms`` (`kareus plan`, `kareus solve`): the clock controller's latency the plans assume."""
    parser.add_argument(
        "--clock-latency-ms",
        type=float,
        default=None,
        metavar="MS",
        help="the clock controller's latency (ms) the plans assume: every clock segment lasts at least "
        "2x it, raises may be requested one latency ahead, and each change's lag is in the prediction "
        "(default: the GPU preset's clock_latency_ms; 0: changes take effect at once; docs/clock_latency.md)",
    )


def clock_latency_s(args: argparse.Namespace, preset_s: float | None = None) -> float | None:
    """``--clock-latency-ms`` in s (`preset_s` where it was not given), checked: 0..1000 ms, else one line."""
    ms = args.clock_latency_ms
    if ms is not None and not 0 <= ms <= 1000:
        raise ConfigError(
            f"--clock-latency-ms {ms} must be a number of milliseconds in 0..1000 "
            "(a locked-clock call takes 10-20 ms; `kareus validate` measures it)."
        )
    return preset_s if ms is None else ms / 1000.0

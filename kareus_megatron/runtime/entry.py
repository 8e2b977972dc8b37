"""Shared by the entry points (generic launcher, pretrain_gpt.py): the --kareus-* flags and plan choice.

``--kareus-plan PATH`` is a plan file, or a ``kareus plan`` output directory (``frontier.json`` +
``plans/NAME-NN.json``) together with ``--kareus-point``: ``NN`` (the kareus method's NN-th plan,
00 = fastest), ``METHOD-NN`` (e.g. perseus-03), ``fastest`` or ``min-energy`` (of the kareus method).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kareus_megatron.errors import ConfigError, KareusError, PlanError
from kareus_megatron.plan.io import load_plan
from kareus_megatron.plan.schema import FRONTIER_FORMAT, Plan

DEFAULT_METHOD = "kareus"
_POINT_RE = re.compile(r"^(?:(?P<method>[a-z_]+)-)?(?P<nn>\d{1,3})$")


def add_kareus_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the --kareus-* flags on `parser`."""
    g = parser.add_argument_group("kareus")
    g.add_argument("--kareus-plan", required=True, metavar="PATH",
                   help="plan file, or a `kareus plan` output directory (then see --kareus-point)")
    g.add_argument("--kareus-point", default=None, metavar="NN|METHOD-NN|fastest|min-energy",
                   help="which plan of a plan directory (default: fastest)")
    g.add_argument("--kareus-log", default=None, metavar="PATH",
                   help="append per-iteration time and energy (JSONL) here; read it with `kareus report`")
    g.add_argument("--kareus-on-error", default="fail", choices=("fail", "warn"),
                   help="without permission to lock clocks: fail before training (default) or warn and "
                        "train at default clocks")
    g.add_argument("--kareus-debug", action="store_true", help="show tracebacks for kareus errors")


def kareus_parser(prog: str, extra: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.ArgumentParser:
    """A parser for the --kareus-* flags that leaves every other argument alone."""
    parser = argparse.ArgumentParser(prog=prog, add_help=False, allow_abbrev=False)
    add_kareus_arguments(parser)
    if extra is not None:
        extra(parser)
    return parser


def _frontier_points(frontier: Path) -> dict[str, list[dict[str, Any]]]:
    try:
        doc = json.loads(frontier.read_text())
    except OSError as e:
        raise PlanError(f"cannot read {frontier}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise PlanError(f"{frontier} is not valid JSON: {e.msg} at line {e.lineno}") from None
    if not isinstance(doc, dict) or doc.get("format") != FRONTIER_FORMAT:
        raise PlanError(f"{frontier}: 'format' must be {FRONTIER_FORMAT!r}; regenerate it with kareus plan")
    methods = doc.get("methods") or {}
    return {m: list(v.get("points") or []) for m, v in methods.items() if isinstance(v, dict)}


def resolve_plan(path: str, point: str | None = None) -> tuple[Plan, str]:
    """Load the plan named by --kareus-plan/--kareus-point; return it and its file path."""
    p = Path(path)
    if p.is_file():
        if point is not None:
            raise ConfigError(f"--kareus-point {point} needs --kareus-plan to be a `kareus plan` directory, "
                              f"but {p} is a file; drop --kareus-point or pass the directory")
        return load_plan(p), str(p)
    if not p.is_dir():
        raise PlanError(f"--kareus-plan {p}: no such file or directory; pass a plan file or a kareus plan "
                        "output directory")
    frontier = p / "frontier.json"
    if not frontier.is_file():
        raise PlanError(f"--kareus-plan {p} is a directory without frontier.json; pass a plan file or the "
                        "--out directory of kareus plan")
    methods = _frontier_points(frontier)
    choice = (point or "fastest").strip()
    method = DEFAULT_METHOD if DEFAULT_METHOD in methods else next(iter(methods), DEFAULT_METHOD)
    m = _POINT_RE.match(choice)
    if m:
        method = m.group("method") or method
    pts = methods.get(method)
    if not pts:
        raise PlanError(f"--kareus-point {choice}: {frontier} has no plans for method {method!r}; methods: "
                        f"{', '.join(sorted(k for k, v in methods.items() if v)) or 'none'}")
    if choice == "fastest":
        chosen = min(pts, key=lambda q: (q["time_s"], q["energy_j"]))
    elif choice == "min-energy":
        chosen = min(pts, key=lambda q: (q["energy_j"], q["time_s"]))
    elif m:
        nn = int(m.group("nn"))
        if nn >= len(pts):
            raise PlanError(f"--kareus-point {choice}: method {method} has plans 00..{len(pts) - 1:02d}")
        chosen = pts[nn]
    else:
        raise ConfigError(f"--kareus-point {choice!r} is not allowed; use NN (e.g. 03), METHOD-NN "
                          "(e.g. perseus-03), fastest or min-energy")
    rel = chosen.get("plan")
    if not rel:
        raise PlanError(f"{frontier}: the chosen point of {method} names no plan file")
    return load_plan(p / rel), str(p / rel)


def start_session(ns: argparse.Namespace) -> Any:
    """Resolve the plan and start a runtime session from parsed --kareus-* flags."""
    import kareus_megatron.megatron as kareus

    plan, source = resolve_plan(ns.kareus_plan, ns.kareus_point)
    return kareus.install(plan, source=source, log_path=ns.kareus_log, on_error=ns.kareus_on_error)


def debug_requested(argv: Sequence[str]) -> bool:
    """Whether tracebacks were asked for (--kareus-debug among `argv`, or KAREUS_DEBUG set)."""
    return "--kareus-debug" in argv or bool(os.environ.get("KAREUS_DEBUG"))


def run_script_in_session(session: Any, argv: list[str], run: Callable[[], Any]) -> int:
    """Run a training script (`run`, with ``sys.argv`` = `argv`) under `session`; return its exit status.

    A clean exit closes the session (the last iteration is logged: a collective); a non-zero exit or
    an exception aborts it (no collective: other ranks may be elsewhere) and the exception propagates.
    """
    sys.argv = argv
    code = 0
    try:
        run()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        session.abort()
        raise
    if code == 0:
        session.close()
    else:
        session.abort()
    return code


def run_guarded(prog: str, debug: bool, body: Callable[[], int]) -> int:
    """Run `body`; a KareusError becomes one line on stderr and exit status 2 (traceback with debug)."""
    try:
        return body()
    except KareusError as e:
        if debug:
            raise
        msg = " ".join(str(e).split())
        sys.stderr.write(f"{prog}: error: {msg}\n")
        return 2


def split_at_double_dash(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """(before '--', after '--'); the second list is empty when there is no '--'."""
    argv = list(argv)
    if "--" in argv:
        k = argv.index("--")
        return argv[:k], argv[k + 1:]
    return argv, []


def install_from_megatron_args(args: Any) -> Any:
    """Start a session from Megatron-LM's parsed arguments (the native --kareus-plan patch calls this)."""
    import kareus_megatron.megatron as kareus

    plan, source = resolve_plan(args.kareus_plan, getattr(args, "kareus_point", None))
    local_rank = getattr(args, "local_rank", None)
    return kareus.install(plan, source=source, log_path=getattr(args, "kareus_log", None),
                          on_error=getattr(args, "kareus_on_error", "fail"),
                          local_rank=local_rank if isinstance(local_rank, int) else None)


def megatron_lm_hook(args: Any) -> Any:
    """For patches/megatron-lm: install when --kareus-plan is set; a kareus error exits 2 with one line."""
    if not getattr(args, "kareus_plan", None):
        return None
    code_or_session: list[Any] = []

    def body() -> int:
        code_or_session.append(install_from_megatron_args(args))
        return 0

    if run_guarded("megatron-lm (kareus)", bool(getattr(args, "kareus_debug", False)), body) != 0:
        raise SystemExit(2)
    return code_or_session[0]

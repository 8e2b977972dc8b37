"""Shared by the entry points (generic launcher, pretrain_gpt.py): the --kareus-* flags and plan choice.

``--kareus-plan PATH`` is a plan file, or a ``kareus plan`` output directory (``frontier.json`` +
``plans/NAME-NN.json``) together with ``--kareus-point`` in plan/points.py's syntax: ``NN`` (the kareus
method's NN-th plan, 00 = fastest), ``METHOD-NN`` (e.g. perseus-03), ``iso-time``, ``fastest``, ``min-energy``,
``METHOD-iso-time``, ``METHOD-fastest`` or ``METHOD-min-energy``. The default is ``iso-time`` (plan/points.py
DEFAULT_POINT): the least predicted energy no slower than Megatron's max-clock plan -- the plan ``kareus plan``
suggests, and the objective ``--kareus-plan auto`` chooses by default. ``--kareus-robust`` meets iso-time or
min-energy across the prediction bands (95th percentiles), as ``kareus plan --robust`` does; with a plan file,
another point, a frontier without bands or ``--kareus-plan auto`` it is refused in one line before training.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import runpy
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from kareus_megatron.environment import kareus_settings
from kareus_megatron.errors import ConfigError, KareusError, print_error
from kareus_megatron.plan.environment import MAX_CONNECTIONS_WHY, required_environment
from kareus_megatron.plan.points import load_point_plan
from kareus_megatron.plan.schema import Plan
from kareus_megatron.runtime.closed_loop.auto import AUTO
from kareus_megatron.runtime.frameworks.cpu_imports import install_cpu_import_hooks
from kareus_megatron.runtime.frameworks.cuda_graphs import cuda_graph_flag_in_argv
from kareus_megatron.runtime.measure.rank_files import LOG_MODES

ROBUST_FLAG = "--kareus-robust"


def add_kareus_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the --kareus-* flags on `parser`."""
    g = parser.add_argument_group("kareus")
    g.add_argument(
        "--kareus-plan",
        required=True,
        metavar="PATH",
        help="plan file, or a `kareus plan` output directory (then see --kareus-point), or 'auto': "
        "measure, calibrate and plan while training (needs --kareus-workload and --kareus-log)",
    )
    g.add_argument(
        "--kareus-workload",
        default=None,
        metavar="PATH",
        help="with --kareus-plan auto: a plan (file or directory; --kareus-point picks one) of this job, "
        "made with the preset model: it names the workload to re-plan",
    )
    g.add_argument(
        "--kareus-objective",
        default="iso-time",
        metavar="OBJ",
        help="with --kareus-plan auto: iso-time (least energy at the max-clock time, default), "
        "min-energy, max-time=S or energy=J",
    )
    g.add_argument(
        "--kareus-point",
        default=None,
        metavar="POINT",
        help="which plan of a plan directory: iso-time, NN, METHOD-NN, fastest, min-energy, "
        "METHOD-iso-time, METHOD-fastest or METHOD-min-energy (default: iso-time of the kareus "
        "method, the least predicted energy no slower than Megatron's max-clock plan)",
    )
    g.add_argument(
        "--kareus-robust",
        action="store_true",
        help="with a plan directory: iso-time and min-energy are met across the prediction bands (95th "
        "percentiles), as kareus plan --robust, not at the point estimate; needs a frontier with bands",
    )
    g.add_argument(
        "--kareus-log",
        default=None,
        metavar="DIR",
        help="log directory: each rank appends its per-iteration time and energy to "
        "DIR/rank-NNNNN.jsonl; read it with `kareus report DIR`",
    )
    g.add_argument(
        "--kareus-log-mode",
        default="new",
        choices=LOG_MODES,
        help="when DIR already holds this run's rank logs: refuse (new, default), append a run, or overwrite them",
    )
    g.add_argument(
        "--kareus-on-error",
        default="fail",
        choices=("fail", "warn"),
        help="without permission to lock clocks: fail before training (default) or warn and train at default clocks",
    )
    g.add_argument("--kareus-debug", action="store_true", help="show tracebacks for kareus errors")


def kareus_parser(prog: str, extra: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.ArgumentParser:
    """A parser for the --kareus-* flags that leaves every other argument alone."""
    parser = argparse.ArgumentParser(prog=prog, add_help=False, allow_abbrev=False)
    add_kareus_arguments(parser)
    if extra is not None:
        extra(parser)
    return parser


def help_requested(argv: Sequence[str]) -> bool:
    """Whether -h or --help is among `argv` (the entry point's own arguments)."""
    return any(a in ("-h", "--help") for a in argv)


def print_kareus_help(
    prog: str,
    usage: str,
    description: str,
    epilog: str | None = None,
    extra: Callable[[argparse.ArgumentParser], None] | None = None,
) -> int:
    """Print the --kareus-* flags (and `extra`'s) as `prog`'s help; return exit status 0."""
    parser = argparse.ArgumentParser(prog=prog, usage=usage, description=description, epilog=epilog, allow_abbrev=False)
    add_kareus_arguments(parser)
    if extra is not None:
        extra(parser)
    parser.print_help()
    return 0


def resolve_plan(path: str, point: str | None = None, robust: bool = False) -> tuple[Plan, str]:
    """Load the plan named by --kareus-plan/--kareus-point/--kareus-robust (plan/points.py's syntax); return it
    and its path."""
    return load_point_plan(
        path, point, flag="--kareus-point", path_flag="--kareus-plan", robust=robust, robust_flag=ROBUST_FLAG
    )


def refuse_robust_auto(robust: bool) -> None:
    """ConfigError when --kareus-robust comes with --kareus-plan auto: the closed loop has no frontier to choose
    from."""
    if robust:
        raise ConfigError(
            f"{ROBUST_FLAG} picks a point of a planned frontier, but --kareus-plan auto re-plans while training "
            f"(its --kareus-objective is met at the point estimate); drop {ROBUST_FLAG}"
        )


def start_session(ns: argparse.Namespace, slot: Any = None) -> Any:
    """Resolve the plan and start a runtime session from parsed --kareus-* flags in `slot` (a SessionSlot;
    default the megatron-core one)."""
    if slot is None:
        from kareus_megatron.runtime.session_slot import MEGATRON_SESSIONS as slot

    if ns.kareus_plan == AUTO:
        return start_auto_session(ns, slot)
    if ns.kareus_workload is not None:
        raise ConfigError("--kareus-workload goes with --kareus-plan auto")
    robust = bool(getattr(ns, "kareus_robust", False))
    plan, source = resolve_plan(ns.kareus_plan, ns.kareus_point, robust)
    apply_required_environment(plan)
    return slot.install(
        plan,
        source=source,
        log_path=ns.kareus_log,
        on_error=ns.kareus_on_error,
        log_mode=ns.kareus_log_mode,
        robust=robust,
    )


def start_auto_session(ns: argparse.Namespace, slot: Any, **session_kwargs: Any) -> Any:
    """``--kareus-plan auto``: start the closed loop (closed_loop/auto.py) for the job --kareus-workload names."""
    from kareus_megatron.plan.objective import parse_objective
    from kareus_megatron.runtime.closed_loop.auto import install_auto

    refuse_robust_auto(bool(getattr(ns, "kareus_robust", False)))
    objective = parse_objective(ns.kareus_objective)
    if not ns.kareus_workload:
        raise ConfigError(
            "--kareus-plan auto needs --kareus-workload PLAN: a plan of this job (e.g. from kareus "
            "plan) that says what to re-plan"
        )
    base, source = load_point_plan(
        ns.kareus_workload, ns.kareus_point, flag="--kareus-point", path_flag="--kareus-workload"
    )
    apply_required_environment(base)
    return install_auto(
        slot,
        base,
        source,
        objective,
        log_path=ns.kareus_log,
        on_error=ns.kareus_on_error,
        log_mode=ns.kareus_log_mode,
        **session_kwargs,
    )


def apply_required_environment(plan: Plan) -> dict[str, str]:
    """Set what `plan`'s framework needs in this process's environment (plan/environment.py) where unset.

    Runs before the training script, so before its first CUDA call. A value the user set stays; rank 0
    says on stderr what it set, or that a different value was kept. Returns what it set.
    """
    done: dict[str, str] = {}
    speak = os.environ.get("RANK", "0") == "0"
    for name, value in required_environment(plan).items():
        have = os.environ.get(name)
        if have is None:
            os.environ[name] = done[name] = value
            if speak:
                sys.stderr.write(f"kareus: set {name}={value} ({MAX_CONNECTIONS_WHY})\n")
        elif have != value and speak:
            sys.stderr.write(
                f"kareus: keeping {name}={have} as set; {MAX_CONNECTIONS_WHY} unless FSDP or "
                "MoE overlap is on, so Megatron-LM may refuse it\n"
            )
    return done


def debug_requested(argv: Sequence[str]) -> bool:
    """Whether tracebacks were asked for (--kareus-debug among `argv`, or KAREUS_DEBUG set)."""
    return "--kareus-debug" in argv or bool(kareus_settings().debug)


@contextlib.contextmanager
def ending_session(session: Any) -> Iterator[None]:
    """Close `session` when the block ends cleanly or exits with status 0 (the last iteration is logged),
    abort it otherwise (no collective: other ranks may be elsewhere); exceptions propagate."""
    try:
        yield
    except SystemExit as e:
        (session.close if e.code in (None, 0) else session.abort)()
        raise
    except BaseException:
        session.abort()
        raise
    session.close()


def run_script_in_session(session: Any, argv: list[str], run: Callable[[], Any]) -> int:
    """Run a training script (`run`, with ``sys.argv`` = `argv`) under `session`; return its exit status
    (the session ends as ``ending_session`` says; an exception propagates)."""
    sys.argv = argv
    try:
        with ending_session(session):
            run()
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0


def run_guarded(prog: str, debug: bool, body: Callable[[], int]) -> int:
    """Run `body`; a KareusError becomes one line on stderr and exit status 2, Ctrl-C one line and exit
    status 130 (tracebacks with debug)."""
    try:
        return body()
    except KareusError as e:
        if debug:
            raise
        return print_error(prog, e)
    except KeyboardInterrupt:
        if debug:
            raise
        sys.stderr.write(f"{prog}: interrupted\n")
        return 130


def launch_script(prog: str, argv: Sequence[str], description: str, slot: Any = None, allow_module: bool = True) -> int:
    """``PROG --kareus-* ... -- train.py ARGS`` (or ``-- -m MODULE ARGS`` with `allow_module`): start the
    session in `slot` (start_session), run the script as ``__main__``; return the exit status.

    Bad flags or a missing script are one line and exit status 2 (run_guarded)."""
    ours, target = split_at_double_dash(argv)
    usage = f"{prog} --kareus-plan PLAN -- train.py ARGS"
    if help_requested(ours):
        return print_kareus_help(
            prog,
            f"{prog} --kareus-plan PATH [--kareus-* ...] -- train.py ARGS"
            + (" | -m MODULE ARGS" if allow_module else ""),
            description,
        )

    def body() -> int:
        ns, unknown = kareus_parser(prog).parse_known_args(ours)
        if unknown:
            raise ConfigError(
                f"unknown launcher argument(s) {' '.join(unknown)}; put the training script and "
                f"its arguments after '--': {usage}"
            )
        if not target:
            raise ConfigError(f"no training script given; usage: {usage}")
        refuse_cuda_graph_flags(target)
        module = None
        if target[0] == "-m" and allow_module:
            if len(target) < 2:
                raise ConfigError("-m needs a module name, e.g. -- -m my_package.train")
            module, script_argv = target[1], [target[1], *target[2:]]
        else:
            if not os.path.isfile(target[0]):
                raise ConfigError(f"training script {target[0]} does not exist; usage: {usage}")
            script_argv = target
        install_cpu_import_hooks()  # CPU-only torch: before the session's patch imports megatron (cpu_imports.py)
        session = start_session(ns, slot)

        def run() -> None:
            if module is not None:
                runpy.run_module(module, run_name="__main__", alter_sys=True)
            else:
                sys.path.insert(0, os.path.dirname(os.path.abspath(target[0])))
                runpy.run_path(target[0], run_name="__main__")

        return run_script_in_session(session, script_argv, run)

    return run_guarded(prog, debug_requested(ours), body)


def refuse_cuda_graph_flags(argv: Sequence[str]) -> None:
    """ConfigError naming a Megatron-LM flag in the training command `argv` that turns CUDA graphs on."""
    problem = cuda_graph_flag_in_argv(argv)
    if problem:
        raise ConfigError(problem)


def split_at_double_dash(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """(before '--', after '--'); the second list is empty when there is no '--'."""
    argv = list(argv)
    if "--" in argv:
        k = argv.index("--")
        return argv[:k], argv[k + 1 :]
    return argv, []

"""The `kareus` command: one thin module per subcommand under kareus_megatron.cli.

Each subcommand module defines ``HELP`` (one line), ``add_arguments(parser)`` and ``run(args) -> int``.
Every command runs inside one error boundary (run_command): a KareusError (bad input, unusable
environment), an OSError or a UnicodeDecodeError is printed as one line and exits with status 2; a
closed stdout pipe exits silently with status 0 (the reader had what it wanted); Ctrl-C prints one line and
exits with status 130, a SIGTERM that stopped the command a subcommand ran (jobs/children.py) with 143. --debug
(before or after the subcommand) or KAREUS_DEBUG=1 shows the traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from kareus_megatron import __version__
from kareus_megatron.cli import torchrun
from kareus_megatron.cli.parsing import OneLineParser, innermost_parser, unrecognized
from kareus_megatron.environment import kareus_settings
from kareus_megatron.errors import KareusError, Terminated, describe_os_error, print_error

# Subcommand name -> module under kareus_megatron.cli. Modules are imported only when listed here.
COMMANDS: dict[str, str] = {
    "env": "env",
    "predict": "predict",
    "calibrate": "calibrate",
    "partitions": "partitions",
    "plan": "plan",
    "solve": "solve",
    "report": "report",
    "compare": "compare",
    "launch": "launch",
    "validate": "validate",
    "torchrun": "torchrun",
}


def _add_debug_flag(parser: argparse.ArgumentParser) -> None:
    """--debug on `parser` and on every subcommand parser below it, so it is accepted after the subcommand too."""
    # SUPPRESS: a subcommand that is not given --debug leaves the top-level value alone
    parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _add_debug_flag(sub)


DEBUG_HELP = "show tracebacks for errors instead of one line (also: KAREUS_DEBUG=1)"


def build_parser() -> argparse.ArgumentParser:
    """Build the top-level parser with every subcommand registered."""
    parser = OneLineParser(prog="kareus", description="Energy-aware planning for megatron-core training.")
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {__version__}", help="print the installed version and exit"
    )
    sub = parser.add_subparsers(dest="command", parser_class=OneLineParser)
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(f"kareus_megatron.cli.{module_name}")
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        _add_debug_flag(p)
        p.set_defaults(_run=module.run)
    return parser


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's last flush into a closed pipe stays silent."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout without a file descriptor (captured in tests)
        pass


def _fd_identity(fd: int) -> tuple[int, int, int] | None:
    """(device, inode, rdev) of what file descriptor `fd` refers to; None when it cannot be read."""
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_rdev


def _devnull_identity() -> tuple[int, int, int] | None:
    try:
        st = os.stat(os.devnull)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_rdev


def run_command(args: argparse.Namespace, prog: str, debug: bool) -> int:
    """Run the parsed subcommand inside the one error boundary of `kareus`; return the exit status.

    KareusError, OSError (naming the path) and UnicodeDecodeError: one line on stderr, exit 2.
    BrokenPipeError (stdout closed early, e.g. `| head`): silent, exit 0, as the reader chose to stop.
    Ctrl-C: one line, exit 130. A SIGTERM passed on to the command it ran (jobs/children.py): one line, exit 143.
    With `debug` every one of them is re-raised with its traceback.
    """
    stdout_was = _fd_identity(1)
    try:
        rc = int(args._run(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, inside the boundary, not at interpreter exit
        return rc
    except SystemExit as e:
        # rich's Console meets a closed pipe by pointing stdout at /dev/null and exiting 1 (its on_broken_pipe):
        # the same closed pipe as below, so the same status
        if e.code == 1 and not debug and stdout_was != _fd_identity(1) == _devnull_identity():
            return 0
        raise
    except BrokenPipeError:
        if debug:
            raise
        _silence_stdout()
        return 0
    except KeyboardInterrupt:
        if debug:
            raise
        sys.stderr.write(f"{prog}: interrupted\n")
        return 130
    except Terminated:
        if debug:
            raise
        sys.stderr.write(f"{prog}: terminated\n")
        return 143
    except KareusError as e:
        if debug:
            raise
        return print_error(prog, e)
    except UnicodeDecodeError as e:
        if debug:
            raise
        return print_error(
            prog,
            f"an input file is not UTF-8 text ({e.reason} at byte {e.start}); give a "
            "text file (rerun with --debug to see which).",
        )
    except OSError as e:
        if debug:
            raise
        return print_error(prog, f"{describe_os_error(e)}.")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `kareus` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        argv = ["plan"]  # the main job on its built-in default
    if argv[0] == "torchrun" and argv[1:2] not in (["-h"], ["--help"]) and "torchrun" in COMMANDS:
        # torchrun's own flags: not for argparse to read
        ns = argparse.Namespace(command="torchrun", torchrun_args=argv[1:], _run=torchrun.run)
        return run_command(ns, "kareus torchrun", bool(kareus_settings().debug))
    try:
        parser = build_parser()
        args, extras = parser.parse_known_args(argv)
        if extras:  # reported by the subcommand that got them, with the flag a typo meant
            sub = innermost_parser(parser, argv)
            sub.error(unrecognized(sub, extras))
    except KeyboardInterrupt:
        sys.stderr.write("kareus: interrupted\n")
        return 130
    if args.command is None:
        parser.print_help()
        return 2
    debug = args.debug or bool(kareus_settings().debug)
    return run_command(args, f"kareus {args.command}", debug)


if __name__ == "__main__":
    raise SystemExit(main())

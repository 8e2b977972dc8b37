"""The `kareus` command: one thin module per subcommand under kareus_megatron.cli.

Each subcommand module defines ``HELP`` (one line), ``add_arguments(parser)`` and ``run(args) -> int``.
A KareusError (bad input, unusable environment) is printed as one line and exits with status 2.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from kareus_megatron import __version__
from kareus_megatron.cli.parsing import OneLineParser
from kareus_megatron.errors import KareusError, print_error

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
}


def build_parser() -> argparse.ArgumentParser:
    """Build the top-level parser with every subcommand registered."""
    parser = OneLineParser(prog="kareus", description="Energy-aware planning for megatron-core training.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}",
                        help="print the installed version and exit")
    sub = parser.add_subparsers(dest="command", parser_class=OneLineParser)
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(f"kareus_megatron.cli.{module_name}")
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `kareus` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        argv = ["plan"]  # the main job on its built-in default
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    debug = args.debug or bool(os.environ.get("KAREUS_DEBUG"))
    try:
        return int(args._run(args) or 0)
    except KareusError as e:
        if debug:
            raise
        return print_error(f"kareus {args.command}", e)
    except KeyboardInterrupt:
        sys.stderr.write("kareus: interrupted\n")
        return 130


if __name__ == "__main__":
    raise SystemExit(main())

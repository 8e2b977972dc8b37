"""`kareus compare LOG_DIR`: reductions table and frontier plot from measured training logs."""

from __future__ import annotations

import argparse

HELP = "render the reductions table and frontier plot from measured logs (same formulas as kareus plan)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register `kareus compare` flags."""
    parser.add_argument("log_dir", help="directory of measured runs (one sub-directory per method run)")


def run(args: argparse.Namespace) -> int:
    """Not implemented yet."""
    print("kareus compare: not implemented yet")
    return 0

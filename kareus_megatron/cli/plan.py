"""`kareus plan`: plan the time–energy frontier of a training configuration (minimal placeholder)."""

from __future__ import annotations

import argparse

HELP = "plan the iteration time-energy frontier of every method and write plan files"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register `kareus plan` flags."""
    parser.add_argument("--out", default="kareus-out", help="output directory (default ./kareus-out)")


def run(args: argparse.Namespace) -> int:
    """Not implemented yet."""
    print("kareus plan: not implemented yet")
    return 0

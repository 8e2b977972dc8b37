"""`kareus partitions`: each nanobatch partition's time–energy frontier and chosen knobs at one clock."""

from __future__ import annotations

import argparse

HELP = "show each nanobatch partition's time-energy frontier and chosen overlap knobs at one SM clock"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register `kareus partitions` flags."""
    parser.add_argument("--freq", type=int, default=None, help="SM clock (MHz); default: the GPU's max clock")
    parser.add_argument("--format", choices=("table", "json"), default="table", help="output format")


def run(args: argparse.Namespace) -> int:
    """Print the partition frontiers; exit 0."""
    print("kareus partitions: not implemented yet")
    return 0

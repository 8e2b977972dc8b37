"""`kareus env`: what this machine offers the runtime (driver, NVML, clocks, permissions, versions)."""

from __future__ import annotations

import argparse

HELP = "show the GPU driver, NVML, supported SM clocks, clock permissions and framework versions"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register `kareus env` flags."""
    parser.add_argument("--gpu-index", type=int, default=0, help="local GPU index to inspect (default 0)")


def run(args: argparse.Namespace) -> int:
    """Print the environment report; exit 0."""
    print("kareus env: not implemented yet")
    return 0

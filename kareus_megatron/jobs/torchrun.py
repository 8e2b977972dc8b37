"""torchrun that ends with one line: the ranks' first kareus error, last on stderr, and exit status 2.

A kareus error on a rank (a plan refused before step 1, a bad flag) is one line on that rank's stderr
(errors.print_error), but torchrun then prints its own ``ChildFailedError`` report and exits 1, so the line is
buried. ``run_summarised`` runs a torchrun command with KAREUS_ERROR_DIR set to a fresh directory, where
print_error also writes each rank's line (rank-RANK.err: {"t": s, "rank": r, "line": ...}); when torchrun
fails and a rank wrote one, it raises RankError with the earliest line and the rank that wrote it, which the
command's error boundary (cli/main.py) prints last, as one line, with exit status 2. Other failures keep
torchrun's own status. ``kareus torchrun ARGS`` (cli/torchrun.py) and ``kareus launch``
(jobs/orchestrate.py) run every training command through it. On several nodes each node's launcher
summarises the ranks it started.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from kareus_megatron.errors import ERROR_DIR_ENV, KareusError
from kareus_megatron.jobs import children


class RankError(KareusError):
    """A kareus error stopped a rank of a torchrun job: its one line, for the launcher's error boundary."""


def first_rank_error(error_dir: str | os.PathLike[str]) -> tuple[str, str] | None:
    """(rank, line) of the earliest kareus error the ranks recorded in `error_dir`; None if none did."""
    found: list[tuple[float, str, str]] = []
    for f in sorted(Path(error_dir).glob("rank-*.err")):
        for text in f.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                rec = json.loads(text)
                found.append((float(rec["t"]), str(rec["rank"]), str(rec["line"])))
            except (ValueError, KeyError, TypeError):
                continue  # a line cut by a killed rank
    if not found:
        return None
    _, rank, line = min(found)
    return rank, line


def run_summarised(argv: list[str], env: dict[str, str] | None = None) -> int:
    """Run `argv` (a torchrun command) with `env` added; its exit status, or RankError (one line) when it failed
    after a kareus error on a rank."""
    with tempfile.TemporaryDirectory(prefix="kareus-errors-") as d:
        rc = children.run(argv, {**(env or {}), ERROR_DIR_ENV: d})
        first = first_rank_error(d) if rc else None
    if first is not None:
        rank, line = first
        sys.stderr.flush()
        raise RankError(f"rank {rank} stopped the job (exit status {rc}): {line}")
    return rc

"""The per-rank log files of a --kareus-log directory: where each rank writes, and what a new run may replace.

Global rank r writes ``DIR/rank-NNNNN.jsonl`` (RANK_FILE). ``open_rank_log`` checks the directory before
training and opens this rank's file in one of LOG_MODES: ``new`` refuses a file that holds a measured
iteration and replaces one that does not (a run refused before step 1, or stopped before its first
iteration ended: nothing to keep, so the corrected rerun starts in the same directory); ``append`` adds a
run after it; ``overwrite`` replaces it.
"""

from __future__ import annotations

import json
import os

from kareus_megatron.errors import ConfigError
from kareus_megatron.jsonl import JsonlAppender

RANK_FILE = "rank-{rank:05d}.jsonl"
LOG_MODES = ("new", "append", "overwrite")


def rank_file(log_dir: str | os.PathLike[str], rank: int) -> str:
    """The path of global rank `rank`'s log in `log_dir`."""
    return os.path.join(os.fspath(log_dir), RANK_FILE.format(rank=rank))


def open_rank_log(log_dir: str | os.PathLike[str], rank: int, mode: str = "new") -> JsonlAppender:
    """Check `log_dir` and open this rank's file; ConfigError (one line) before any training otherwise.

    `mode`: ``new`` refuses an existing rank file with an iteration line (and replaces one without),
    ``append`` adds a run after it, ``overwrite`` replaces it.
    """
    if mode not in LOG_MODES:
        raise ConfigError(f"--kareus-log-mode {mode!r} is not allowed; use {', '.join(LOG_MODES)}")
    d = os.fspath(log_dir)
    if os.path.exists(d) and not os.path.isdir(d):
        raise ConfigError(f"--kareus-log {d} is a file; it must name a directory (one rank-NNNNN.jsonl per rank)")
    try:
        os.makedirs(d, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--kareus-log {d}: cannot create the log directory ({e.strerror})") from None
    path = rank_file(d, rank)
    if os.path.isdir(path):
        raise ConfigError(f"--kareus-log {d}: {path} is a directory, not a rank log")
    if os.path.exists(path):
        if mode == "new" and not holds_iterations(path):
            mode = "overwrite"  # left by a run that stopped before its first iteration: nothing to keep
        if mode == "new":
            raise ConfigError(
                f"--kareus-log {d} already holds a run log ({os.path.basename(path)}); choose a new "
                "directory or pass --kareus-log-mode append or overwrite"
            )
        if mode == "overwrite":
            try:
                os.unlink(path)
            except OSError as e:
                raise ConfigError(f"--kareus-log {d}: cannot replace {path} ({e.strerror})") from None
    try:
        return JsonlAppender(path)
    except OSError as e:
        raise ConfigError(f"--kareus-log {d}: cannot write {path} ({e.strerror})") from None


def remove_if_empty(path: str) -> None:
    """Delete `path` if it is an empty file (a rank log this run created and never wrote)."""
    try:
        if os.path.getsize(path) == 0:
            os.unlink(path)
    except OSError:
        pass


def holds_iterations(path: str) -> bool:
    """Whether the rank log at `path` holds an iteration line (a file that does not is a run refused
    before step 1, or one that stopped before its first iteration ended; unreadable: True, keep it)."""
    try:
        with open(path, "rb") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue  # a torn last line
                if isinstance(rec, dict) and rec.get("kind") == "iteration":
                    return True
    except OSError:
        return True
    return False

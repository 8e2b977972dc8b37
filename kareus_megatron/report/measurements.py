"""What a model can learn from in a run log: per-instruction time samples, per-GPU energy windows, events.

The run log (report/runlog.py; written by runtime/measure/measurement.py) keeps each rank's iteration lines as
written, under ``RunLog.iterations[i]["ranks"]``. This module reads their optional keys:

- *instruction samples* (``instruction_samples``): one per planned instruction of an iteration on one rank,
  from the line's ``instructions`` columns: its measured time (s; CUDA events on a GPU, wall time on a CPU),
  the clock the plan asked for (MHz), pipeline stage, chunk, kind and microbatch, and the iteration's tags.
  Instructions whose time is unknown are left out.
- *energy windows* (``energy_windows``): per rank, consecutive iterations aggregated until they span at
  least ``min_window_s`` (MIN_WINDOW_S, 1 s). NVML's energy counter updates about every 100 ms, so one
  sub-second iteration's energy is quantised; a 1 s window is within about 10-20%, and sums over many
  windows are what a fit should use. A window holds iterations with the same tags and no clock call that
  was skipped as stale or failed (``clock_stale``/``clock_errors`` 0; unknown counts, as in older logs, pass),
  with both time and energy known; anything else ends the window being gathered, and a window that has not
  reached ``min_window_s`` then is dropped. Each has its time (s), energy (J), busy time (s) per (chunk,
  kind, sm_clock_mhz) (the sum of its instructions' times), mean temperature (°C) and tags.
- *events* (``run_events``): the event lines of every rank (``{"kind": "event", "event": ..., "iteration",
  "t", ..., "rank"}``), in time order.

Warm-up: windows start after the first ``skip_iterations`` iterations of the log (default
summary.DEFAULT_SKIP_ITERATIONS, as ``kareus report``), and after any tag change the first iteration is
left out (a clock or plan switch lands inside it). Thermal drift is not corrected here: each window
records its mean temperature, and guarding against drift is the closed loop's business.

*Tags* are the keys of an iteration line other than ITERATION_KEYS, the line's own (runtime/measure/measurement.py
RECORD_KEYS, plus the rank and pp_rank the reader adds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from kareus_megatron.errors import ConfigError
from kareus_megatron.report.runlog import RunLog
from kareus_megatron.report.summary import DEFAULT_SKIP_ITERATIONS, check_skip

MIN_WINDOW_S = 1.0  # shortest energy window (s): about 10 updates of NVML's energy counter
ITERATION_KEYS = frozenset(
    {
        "kind",
        "iteration",
        "t_start",
        "t_end",
        "time_s",
        "energy_j",
        "temperature_c",
        "sm_clock_mhz",
        "clock_stale",
        "clock_errors",
        "clock_applied",
        "clock_late",
        "instructions",
        "power",
        "rank",
        "pp_rank",
    }
)
KIND_NAMES = {"F": "forward", "B": "backward"}
BusyKey = tuple[int, str, int | None]  # (chunk, kind, sm_clock_mhz MHz)


@dataclass(frozen=True, kw_only=True, slots=True)
class InstructionSample:
    """One instruction of one iteration on one rank: measured time_s (s) at the planned sm_clock_mhz (MHz)."""

    rank: int
    pp_rank: int | None
    iteration: int
    index: int  # position in the rank's plan
    chunk: int
    kind: str  # forward or backward
    microbatch: int
    sm_clock_mhz: int | None
    t_start_s: float | None  # start, s after the iteration's own start
    time_s: float
    tags: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True, slots=True)
class EnergyWindow:
    """Consecutive iterations of one rank: time_s (s), energy_j (J), busy_s per (chunk, kind, MHz) (s)."""

    rank: int
    pp_rank: int | None
    iterations: tuple[int, ...]
    time_s: float
    energy_j: float
    busy_s: dict[BusyKey, float]
    temperature_c: float | None  # mean over the iterations that logged one (°C)
    tags: dict[str, Any] = field(default_factory=dict)


def tags_of(line: dict[str, Any]) -> dict[str, Any]:
    """The tags of one rank's iteration line (see the module doc)."""
    return {k: v for k, v in line.items() if k not in ITERATION_KEYS}


def _rank_lines(log: RunLog) -> dict[int, list[tuple[int, dict[str, Any]]]]:
    """rank -> [(position in log.iterations, its raw line)], in iteration order."""
    out: dict[int, list[tuple[int, dict[str, Any]]]] = {}
    for pos, rec in enumerate(log.iterations):
        for line in rec.get("ranks", ()):
            out.setdefault(int(line["rank"]), []).append((pos, line))
    return out


def _rows(line: dict[str, Any]) -> list[tuple[int, int, str, int, int | None, float | None, float | None]]:
    """(index, chunk, kind, microbatch, sm_clock_mhz, t_start_s, time_s) per instruction of a line."""
    cols = line.get("instructions")
    if not isinstance(cols, dict):
        return []
    return [
        (k, c, KIND_NAMES[letter], mb, mhz, t0, t)
        for k, c, letter, mb, mhz, t0, t in zip(
            cols["index"],
            cols["chunk"],
            cols["kind"],
            cols["microbatch"],
            cols["sm_clock_mhz"],
            cols["t_start_s"],
            cols["time_s"],
        )
    ]


def instruction_samples(log: RunLog) -> list[InstructionSample]:
    """Every instruction with a known time in `log`'s rank lines, by rank, then iteration, then as run."""
    out = []
    for rank, lines in sorted(_rank_lines(log).items()):
        for _, line in lines:
            tags = tags_of(line)
            for k, chunk, kind, mb, mhz, t0, t in _rows(line):
                if t is not None:
                    out.append(
                        InstructionSample(
                            rank=rank,
                            pp_rank=line.get("pp_rank"),
                            iteration=line["iteration"],
                            index=k,
                            chunk=chunk,
                            kind=kind,
                            microbatch=mb,
                            sm_clock_mhz=mhz,
                            t_start_s=t0,
                            time_s=float(t),
                            tags=tags,
                        )
                    )
    return out


def _clean(line: dict[str, Any]) -> bool:
    """Both figures known and no clock call of the iteration skipped as stale or failed (unknown: passes)."""
    return (
        line.get("time_s") is not None
        and line.get("energy_j") is not None
        and not line.get("clock_stale")
        and not line.get("clock_errors")
    )


def _window(rank: int, lines: list[dict[str, Any]]) -> EnergyWindow:
    busy: dict[BusyKey, float] = {}
    for line in lines:
        for _, chunk, kind, _, mhz, _, t in _rows(line):
            if t is not None:
                busy[(chunk, kind, mhz)] = busy.get((chunk, kind, mhz), 0.0) + float(t)
    temps = [float(v) for line in lines if isinstance(v := line.get("temperature_c"), (int, float))]
    return EnergyWindow(
        rank=rank,
        pp_rank=lines[0].get("pp_rank"),
        iterations=tuple(x["iteration"] for x in lines),
        time_s=sum(float(x["time_s"]) for x in lines),
        energy_j=sum(float(x["energy_j"]) for x in lines),
        busy_s=busy,
        temperature_c=sum(temps) / len(temps) if temps else None,
        tags=tags_of(lines[0]),
    )


def energy_windows(
    log: RunLog, min_window_s: float = MIN_WINDOW_S, skip_iterations: int = DEFAULT_SKIP_ITERATIONS
) -> list[EnergyWindow]:
    """Per rank, the energy windows of `log` (see the module doc), by rank then time; ConfigError for a
    `min_window_s` that is not a positive number of seconds or a bad `skip_iterations`."""
    skip = check_skip(skip_iterations)
    if (
        isinstance(min_window_s, bool)
        or not isinstance(min_window_s, (int, float))
        or not (math.isfinite(min_window_s) and min_window_s > 0)
    ):
        raise ConfigError(f"the energy window {min_window_s!r} s must be a positive number of seconds, e.g. 1.0")
    out: list[EnergyWindow] = []
    for rank, lines in sorted(_rank_lines(log).items()):
        gathering: list[dict[str, Any]] = []
        span = 0.0
        prev_tags: dict[str, Any] | None = None
        prev_it: int | None = None
        for pos, line in lines:
            tags = tags_of(line)
            switched = prev_tags is not None and tags != prev_tags  # a clock/plan switch lands in this one
            contiguous = prev_it is None or line["iteration"] == prev_it + 1
            prev_tags, prev_it = tags, line["iteration"]
            if switched or not contiguous or pos < skip or not _clean(line):
                gathering, span = [], 0.0  # an unfinished window is dropped
            if switched or pos < skip or not _clean(line):
                continue  # (after a gap the line starts the next window)
            gathering.append(line)
            span += float(line["time_s"])
            if span >= min_window_s:
                out.append(_window(rank, gathering))
                gathering, span = [], 0.0
    return out


def run_events(log: RunLog) -> list[dict[str, Any]]:
    """The event lines of every rank, each with its ``rank``, in time order (unknown times last)."""
    return sorted(
        (dict(e) for e in log.events),
        key=lambda e: (
            not isinstance(e.get("t"), (int, float)),
            e.get("t") if isinstance(e.get("t"), (int, float)) else 0.0,
            e.get("rank", 0),
        ),
    )

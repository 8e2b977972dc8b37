"""One summary of a run log (report/runlog.py), shared by ``kareus report`` and ``kareus compare``.

The first ``skip_iterations`` iterations are warm-up and left out; of the rest, the complete ones with both time
and energy are used (partial ones are counted, never summed as if complete). Time is their median (STATISTIC);
energy is total over total (ENERGY_STATISTIC), so a log gives the same figures in both commands.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from kareus_megatron.errors import ConfigError
from kareus_megatron.report.runlog import RunLog, _is_index

DEFAULT_SKIP_ITERATIONS = 2
STATISTIC = "median"  # of the iteration times: robust to the odd slow iteration
# of the iteration energies: total energy / iterations used. NVML's energy counter moves in steps of about 100 ms,
# so a sub-second iteration's own reading is quantised and a median of them is biased, while the sum over many is not
ENERGY_STATISTIC = "mean"
STATISTICS_TEXT = f"{STATISTIC} time, {ENERGY_STATISTIC} energy"  # how a run's figures are taken, for output


@dataclass(frozen=True, kw_only=True, slots=True)
class RunSummary:
    """A run after warm-up: median iteration time (s) and mean energy (J, all GPUs; total / iterations),
    also per pipeline stage."""

    log: RunLog
    skipped: int
    used: int  # iterations after warm-up with both time and energy
    time_s: float
    energy_j: float
    stage_time_s: dict[int, float | None]
    stage_energy_j: dict[int, float | None]
    partial: int  # iterations after warm-up left out because a rank or stage is missing
    stage_iterations: dict[int, int] = field(default_factory=dict)  # after warm-up, with every rank of the stage
    records: tuple[dict[str, Any], ...] = ()  # the iterations the figures are taken over


def _median(xs: list[Any]) -> float | None:
    vals = [x for x in xs if x is not None]
    return float(statistics.median(vals)) if vals else None


def _total_over_total(xs: list[Any]) -> float | None:
    """Sum of the known values over their number (J per iteration), None when none is known."""
    vals = [float(x) for x in xs if x is not None]
    return sum(vals) / len(vals) if vals else None


def check_skip(skip_iterations: Any) -> int:
    """The warm-up count if it is a non-negative integer; ConfigError naming --skip-iterations otherwise."""
    if not _is_index(skip_iterations):
        raise ConfigError(f"--skip-iterations {skip_iterations!r} must be a non-negative integer")
    return skip_iterations


def summarize(log: RunLog, skip_iterations: int = DEFAULT_SKIP_ITERATIONS) -> RunSummary:
    """Median time and mean (total over total) energy after `skip_iterations` warm-up iterations;
    ConfigError when no iteration is left to use."""
    skip = check_skip(skip_iterations)
    after = log.iterations[skip:]
    partial = sum(1 for r in after if r["iteration"] in log.partial)
    used = [
        r
        for r in after
        if r["iteration"] not in log.partial and r.get("time_s") is not None and r.get("energy_j") is not None
    ]
    if not used:
        raise ConfigError(
            f"{log.path} has {len(log.iterations)} iteration(s) and none with both time and energy after skipping "
            f"{skip} warm-up iteration(s) (complete iterations only, every rank logged)"
            + (f" ({partial} partial: {partial_names(log)})" if partial else "")
            + "; run longer or pass a smaller --skip-iterations"
        )
    ranks = sorted({s["pp_rank"] for r in used for s in r.get("stages", [])})

    def stage(rank: int, key: str) -> float | None:
        figure = _median if key == "time_s" else _total_over_total
        return figure([next((s[key] for s in r.get("stages", []) if s["pp_rank"] == rank), None) for r in used])

    stage_its = {
        rank: sum(
            1 for r in after if any(s["pp_rank"] == rank and s.get("complete", True) for s in r.get("stages", []))
        )
        for rank in ranks
    }
    return RunSummary(
        log=log,
        skipped=skip,
        used=len(used),
        time_s=_median([r["time_s"] for r in used]),  # type: ignore[arg-type]
        energy_j=_total_over_total([r["energy_j"] for r in used]),  # type: ignore[arg-type]
        stage_time_s={r: stage(r, "time_s") for r in ranks},
        stage_energy_j={r: stage(r, "energy_j") for r in ranks},
        partial=partial,
        stage_iterations=stage_its,
        records=tuple(used),
    )


def partial_names(log: RunLog, limit: int = 5) -> str:
    """The partial iterations of `log`, named with what is missing (the first `limit`)."""
    items = sorted(log.partial.items())
    named = ", ".join(f"{i} ({what})" for i, what in items[:limit])
    return named + (f", and {len(items) - limit} more" if len(items) > limit else "")


def partial_note(log: RunLog) -> str | None:
    """The note both commands print for a log with partial iterations (a rank or stage missing), or None."""
    if not log.partial:
        return None
    return (
        f"{len(log.partial)} partial iteration(s) left out of every figure (a rank or stage did not log "
        f"them): {partial_names(log)}"
    )


def truncation_note(log: RunLog) -> str | None:
    """The note both commands print for a log whose last line a killed job cut, or None."""
    return f"the last line of {log.path} was cut (job killed mid-write) and is left out" if log.truncated else None


def log_notes(log: RunLog) -> list[str]:
    """Every note about how a log was read: a cut last line, partial iterations, earlier appended runs."""
    notes = [n for n in (truncation_note(log), partial_note(log)) if n]
    if log.earlier_runs:
        notes.append(f"{log.path} holds {log.earlier_runs} earlier appended run(s); only the last is read")
    return notes

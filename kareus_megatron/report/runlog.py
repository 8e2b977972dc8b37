"""Run logs: the one reader of ``measurement.jsonl`` and the one summary of a run.

A *run log* is the JSONL file the runtime appends to (runtime/measurement.py; ``--kareus-log``,
``KAREUS_LOG``): a header line ``{"kind": "header", "world": N, "plan": ..., "plan_sha256": ..., "gpu": ...}``,
then one line per iteration ``{"kind": "iteration", "iteration": i, "time_s": T, "energy_j": E,
"ranks_reporting": n, "stages": [{"pp_rank": r, "time_s": ..., "energy_j": ..., "gpus": g}, ...]}`` with T
the iteration time (s, the slowest rank), E the GPU energy (J, summed over every rank), each stage's the
same over its ranks, and null where a figure is unknown. A *run directory* (``kareus launch`` writes
LOG_DIR/NAME-NN/) holds the log (MEASUREMENT_FILE) and a manifest (MANIFEST_FILE, format RUN_FORMAT).

Reading: blank lines are skipped. A last line that is not JSON and has no newline is what a job killed
mid-write leaves: it is dropped and ``RunLog.truncated`` is set. Any other bad line is a ConfigError naming
the file and line; so is a second header (two runs appended to one log).

Summary: the first ``skip_iterations`` iterations (default DEFAULT_SKIP_ITERATIONS = 2) are warm-up and
left out; of the rest, those with both time and energy are used, and every figure is their median
(STATISTIC; robust to the odd slow iteration). ``kareus report`` and ``kareus compare`` both summarise
through this module, so a log gives the same figures in both.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kareus_megatron.errors import ConfigError

RUN_FORMAT = "kareus-run/1"
MEASUREMENT_FILE = "measurement.jsonl"
MANIFEST_FILE = "run.json"
DEFAULT_SKIP_ITERATIONS = 2
STATISTIC = "median"
_HINT = "is this a kareus run log (--kareus-log)?"


@dataclass(frozen=True, kw_only=True, slots=True)
class RunLog:
    """A parsed run log: its header ({} when it has none) and its iteration records, by iteration."""

    path: Path
    header: dict[str, Any]
    iterations: list[dict[str, Any]]
    truncated: bool = False  # the last line was cut by a killed job and left out


@dataclass(frozen=True, kw_only=True, slots=True)
class RunSummary:
    """A run after warm-up: median iteration time (s) and energy (J, all GPUs), also per pipeline stage."""

    log: RunLog
    skipped: int
    used: int  # iterations after warm-up with both time and energy
    time_s: float
    energy_j: float
    stage_time_s: dict[int, float | None]
    stage_energy_j: dict[int, float | None]
    partial: int  # used iterations logged by fewer ranks than the job has


def _figure(v: Any) -> bool:
    """A time (s) or energy (J) field: null, or a finite number >= 0."""
    if v is None or isinstance(v, int) and not isinstance(v, bool):
        return v is None or v >= 0
    return isinstance(v, float) and v >= 0 and v != float("inf")  # NaN fails v >= 0


def _is_index(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _iteration_problem(rec: dict[str, Any]) -> str | None:
    """What is wrong with an iteration record, or None."""
    it = rec.get("iteration")
    if not _is_index(it):
        return f"iteration record has iteration = {it!r}, not a non-negative integer"
    for key in ("time_s", "energy_j"):
        if not _figure(rec.get(key)):
            return f"iteration {it}: {key} = {rec.get(key)!r} must be a finite non-negative number or null"
    stages = rec.get("stages", [])
    if not isinstance(stages, list):
        return f"iteration {it}: 'stages' must be a list"
    for st in stages:
        if not (isinstance(st, dict) and _is_index(st.get("pp_rank")) and _figure(st.get("time_s"))
                and _figure(st.get("energy_j"))):
            return f"iteration {it}: a stage entry needs an integer pp_rank and time_s, energy_j >= 0 or null"
    return None


def read_run_log(path: str | Path) -> RunLog:
    """Read a run log (see the module doc); ConfigError naming the file and line when it is malformed."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read run log {p}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{p} is not a text file; {_HINT}") from None
    lines = text.splitlines()
    last = max((n for n, line in enumerate(lines, 1) if line.strip()), default=0)
    header: dict[str, Any] = {}
    header_lines: list[int] = []
    its: dict[int, dict[str, Any]] = {}
    truncated = False
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            if n == last and not text.endswith("\n"):
                truncated = True  # the job was killed while writing its last line
                break
            raise ConfigError(f"{p}:{n} is not valid JSON ({e.msg}); {_HINT}") from None
        kind = rec.get("kind") if isinstance(rec, dict) else None
        if kind == "header":
            header_lines.append(n)
            header = header or rec
        elif kind == "iteration":
            problem = _iteration_problem(rec)
            if problem:
                raise ConfigError(f"{p}:{n}: {problem}; {_HINT}")
            if rec["iteration"] in its and len(header_lines) < 2:
                raise ConfigError(f"{p}:{n}: iteration {rec['iteration']} is logged twice; {_HINT}")
            its.setdefault(rec["iteration"], rec)
        else:
            raise ConfigError(f"{p}:{n}: unknown record kind {kind!r}; {_HINT}")
    if len(header_lines) > 1:
        raise ConfigError(f"{p} holds {len(header_lines)} runs (headers at lines "
                          f"{', '.join(map(str, header_lines))}); keep one run per log file")
    return RunLog(path=p, header=header, iterations=[its[i] for i in sorted(its)], truncated=truncated)


def _median(xs: list[Any]) -> float | None:
    vals = [x for x in xs if x is not None]
    return float(statistics.median(vals)) if vals else None


def check_skip(skip_iterations: Any) -> int:
    """The warm-up count if it is a non-negative integer; ConfigError naming --skip-iterations otherwise."""
    if not _is_index(skip_iterations):
        raise ConfigError(f"--skip-iterations {skip_iterations!r} must be a non-negative integer")
    return skip_iterations


def summarize(log: RunLog, skip_iterations: int = DEFAULT_SKIP_ITERATIONS) -> RunSummary:
    """Medians after `skip_iterations` warm-up iterations; ConfigError when no iteration is left to use."""
    skip = check_skip(skip_iterations)
    used = [r for r in log.iterations[skip:] if r.get("time_s") is not None and r.get("energy_j") is not None]
    if not used:
        raise ConfigError(
            f"{log.path} has {len(log.iterations)} iteration(s) and none with both time and energy after skipping "
            f"{skip} warm-up iteration(s); run longer or pass a smaller --skip-iterations"
        )
    ranks = sorted({s["pp_rank"] for r in used for s in r.get("stages", [])})

    def stage(rank: int, key: str) -> float | None:
        return _median([next((s[key] for s in r.get("stages", []) if s["pp_rank"] == rank), None) for r in used])

    world = log.header.get("world")
    partial = sum(1 for r in used if _is_index(world) and r.get("ranks_reporting") not in (None, world))
    return RunSummary(log=log, skipped=skip, used=len(used), time_s=_median([r["time_s"] for r in used]),  # type: ignore[arg-type]
                      energy_j=_median([r["energy_j"] for r in used]),  # type: ignore[arg-type]
                      stage_time_s={r: stage(r, "time_s") for r in ranks},
                      stage_energy_j={r: stage(r, "energy_j") for r in ranks}, partial=partial)


def truncation_note(log: RunLog) -> str | None:
    """The note both commands print for a log whose last line a killed job cut, or None."""
    return f"the last line of {log.path} was cut (job killed mid-write) and is left out" if log.truncated else None

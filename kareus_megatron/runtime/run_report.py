"""Measured against predicted: read a runtime log (runtime/measurement.py) and compare it with its plan.

Predicted per stage (the planner's model, search/simulate.py): the stage's GPUs (tp * cp * dp of them)
each spend sum(e_i) J on the stage's instructions and p_blocked_w * (T - sum(t_i)) J blocked, with T the
predicted iteration time (s) and t_i, e_i each instruction's predicted time (s) and energy (J, per GPU).
Measured per stage: energy summed over the stage's ranks, time = the slowest of its ranks. Figures are
medians over the iterations after the first ``skip`` (warm-up).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kareus_megatron.errors import ConfigError
from kareus_megatron.plan.io import plan_sha256
from kareus_megatron.plan.schema import Plan


@dataclass
class RunLog:
    """A parsed runtime log: its header and its iteration records, in file order."""

    header: dict[str, Any]
    iterations: list[dict[str, Any]]


def load_run_log(path: str | Path) -> RunLog:
    """Read a JSONL runtime log; ConfigError naming the file and line when it is malformed."""
    p = Path(path)
    try:
        lines = p.read_text().splitlines()
    except OSError as e:
        raise ConfigError(f"cannot read run log {p}: {e.strerror}") from None
    header: dict[str, Any] = {}
    its: list[dict[str, Any]] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{p}:{n} is not JSON ({e.msg}); pass the --kareus-log file of a run") from None
        kind = rec.get("kind") if isinstance(rec, dict) else None
        if kind == "header":
            header = rec
        elif kind == "iteration":
            problem = _iteration_problem(rec)
            if problem:
                raise ConfigError(f"{p}:{n}: {problem}; pass the --kareus-log file of a run")
            its.append(rec)
        else:
            raise ConfigError(f"{p}:{n}: unknown record kind {kind!r}; is this a kareus runtime log?")
    if not its:
        raise ConfigError(f"{p} has no iteration records; run at least two training iterations with --kareus-log")
    return RunLog(header, its)


def _is_num(x: Any, allow_none: bool = True) -> bool:
    return (x is None and allow_none) or (isinstance(x, (int, float)) and not isinstance(x, bool))


def _iteration_problem(rec: dict[str, Any]) -> str | None:
    """What is wrong with an iteration record, or None."""
    if not isinstance(rec.get("iteration"), int) or isinstance(rec.get("iteration"), bool):
        return "iteration record lacks an integer 'iteration'"
    if not (_is_num(rec.get("time_s")) and _is_num(rec.get("energy_j"))):
        return "iteration record needs numeric time_s and energy_j"
    stages = rec.get("stages")
    if not isinstance(stages, list):
        return "iteration record lacks its 'stages' list"
    for st in stages:
        if not (isinstance(st, dict) and isinstance(st.get("pp_rank"), int) and _is_num(st.get("time_s"))
                and _is_num(st.get("energy_j"))):
            return "a stage entry needs an integer pp_rank and numeric time_s and energy_j"
    return None


@dataclass
class Row:
    """One compared quantity: measured and predicted (None when unknown), in `unit`."""

    name: str
    unit: str
    measured: float | None
    predicted: float | None

    @property
    def error(self) -> float | None:
        """(measured - predicted) / predicted, or None."""
        if self.measured is None or not self.predicted:
            return None
        return (self.measured - self.predicted) / self.predicted


@dataclass
class Comparison:
    """Measured against predicted, in total and per pipeline stage."""

    rows: list[Row]
    iteration_time_s: list[float | None]
    iteration_energy_j: list[float | None]
    used: int
    skipped: int
    notes: list[str] = field(default_factory=list)
    stage_energy_j: dict[int, tuple[float | None, float | None]] = field(default_factory=dict)


def _median(xs: list[Any]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def predicted_stage_energy_j(plan: Plan, p_blocked_w: float) -> dict[int, float | None]:
    """Predicted energy (J) of each stage's GPUs per iteration; None where instructions lack predictions."""
    par = plan.parallel
    gpus = par.tp * par.cp * par.dp
    T = plan.predicted.iteration_time_s
    out: dict[int, float | None] = {}
    for st in plan.stages:
        ts = [i.predicted_time_s for i in st.instructions]
        es = [i.predicted_energy_j for i in st.instructions]
        if any(x is None for x in ts + es):
            out[st.pp_rank] = None
            continue
        busy = sum(ts)  # type: ignore[arg-type]
        out[st.pp_rank] = gpus * (sum(es) + p_blocked_w * max(0.0, T - busy))  # type: ignore[arg-type]
    return out


def compare(run: RunLog, plan: Plan, p_blocked_w: float, skip: int = 1) -> Comparison:
    """Compare a run log with its plan (see module doc)."""
    notes = []
    sha = run.header.get("plan_sha256")
    if sha and sha != plan_sha256(plan):
        notes.append("the log was recorded with a different plan than --plan (plan_sha256 differs)")
    if run.header.get("clock_control") is False:
        notes.append("clocks were not controlled in this run (no permission; --kareus-on-error warn)")
    its = run.iterations
    if skip >= len(its):
        skip = max(0, len(its) - 1)
        notes.append(f"only {len(its)} iterations logged: warm-up skip reduced to {skip}")
    used = its[skip:]
    partial = [r for r in used if r.get("ranks_reporting") not in (None, run.header.get("world"))]
    if partial:
        notes.append(f"{len(partial)} iteration(s) were logged by fewer ranks than the job has")
    times = [r.get("time_s") for r in used]
    energies = [r.get("energy_j") for r in used]
    rows = [
        Row("iteration time", "s", _median(times), plan.predicted.iteration_time_s),
        Row("iteration energy", "J", _median(energies), plan.predicted.iteration_energy_j),
    ]
    pred_stage = predicted_stage_energy_j(plan, p_blocked_w)
    stage_energy: dict[int, tuple[float | None, float | None]] = {}
    for st in plan.stages:
        r = st.pp_rank
        e = _median([next((s["energy_j"] for s in it["stages"] if s["pp_rank"] == r), None) for it in used])
        t = _median([next((s["time_s"] for s in it["stages"] if s["pp_rank"] == r), None) for it in used])
        stage_energy[r] = (e, pred_stage.get(r))
        rows.append(Row(f"stage {r} energy", "J", e, pred_stage.get(r)))
        rows.append(Row(f"stage {r} time", "s", t, plan.predicted.iteration_time_s))
    return Comparison(rows=rows, iteration_time_s=[r.get("time_s") for r in its],
                      iteration_energy_j=[r.get("energy_j") for r in its], used=len(used), skipped=skip,
                      notes=notes, stage_energy_j=stage_energy)

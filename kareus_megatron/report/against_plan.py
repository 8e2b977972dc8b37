"""Measured against predicted: one run's summary (report/summary.py) against the plan it ran (``kareus report``).

Predicted per stage: cost/energy.py's iteration energy, the formula the planner's simulator uses. The
stage's GPUs (tp * cp * dp of them) each spend sum(e_i) J on the stage's instructions and
p_blocked_w * (T - sum(t_i)) J blocked, with T the predicted iteration time (s), t_i and e_i each
instruction's predicted time (s) and energy (J, one GPU), and p_blocked_w the blocked power (W, one GPU)
the prediction used: the plan's ``p_blocked_w``, or for a plan written before plans recorded it, its GPU
preset's. Measured per stage: energy summed over the stage's ranks, time the slowest of its ranks; every
measured figure is the median of summary.summarize. Per GPU (report/per_gpu.py): each rank's median energy,
its share of the job's, and its stage's predicted energy divided by the stage's GPUs.

A simulated run under a truth (runtime/closed_loop/truth.py) whose ``time_scale`` S is recorded in the log
header makes each instruction take S times its GPU time at the same power, so its times and energies are S
times a GPU's: every predicted time and energy is multiplied by S (``Comparison.time_scale``) to compare like
with like, and the report says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kareus_megatron.cost.energy import iteration_energy_j
from kareus_megatron.errors import ConfigError, KareusError, PlanError
from kareus_megatron.hardware.gpus import gpu_spec
from kareus_megatron.plan.io import plan_sha256
from kareus_megatron.plan.schema import Plan
from kareus_megatron.report.per_gpu import GpuFigures, per_gpu
from kareus_megatron.report.summary import RunSummary, log_notes


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
    """Measured against predicted, in total and per pipeline stage; per-iteration series for the plot."""

    rows: list[Row]
    iteration_time_s: list[float | None]
    iteration_energy_j: list[float | None]
    used: int
    skipped: int
    p_blocked_w: float
    notes: list[str] = field(default_factory=list)
    stage_energy_j: dict[int, tuple[float | None, float | None]] = field(default_factory=dict)
    stage_iterations: dict[int, int] = field(default_factory=dict)  # after warm-up, every rank of the stage
    gpus: list[GpuFigures] = field(default_factory=list)  # per rank ([] for a log without per-rank lines)
    time_scale: float = 1.0  # the simulated truth's: predicted times and energies are multiplied by it


def truth_time_scale(header: dict) -> float:
    """The simulated truth's time_scale a run log header records (1.0 without a truth or for older logs)."""
    truth = header.get("truth")
    scale = truth.get("time_scale") if isinstance(truth, dict) else None
    if isinstance(scale, (int, float)) and not isinstance(scale, bool) and 0 < scale < float("inf"):
        return float(scale)
    return 1.0


def blocked_power_w(plan: Plan, source: str = "the plan") -> float:
    """The blocked power (W, one GPU) the plan's prediction used; PlanError when neither plan nor preset knows."""
    if plan.p_blocked_w is not None:
        return plan.p_blocked_w
    try:
        return gpu_spec(plan.gpu).p_blocked_w
    except KareusError:
        raise PlanError(
            f"{source} records no blocked power (p_blocked_w) and its GPU {plan.gpu!r} is not a preset; "
            "regenerate it with this version of kareus plan or kareus solve (--p-blocked W)"
        ) from None


def predicted_stage_energy_j(plan: Plan, p_blocked_w: float) -> dict[int, float | None]:
    """Predicted energy (J) of each stage's GPUs per iteration; None where instructions lack predictions."""
    par = plan.parallel
    gpus = par.tp * par.cp * par.dp
    out: dict[int, float | None] = {}
    for st in plan.stages:
        ts = [i.predicted_time_s for i in st.instructions]
        es = [i.predicted_energy_j for i in st.instructions]
        known_ts = [x for x in ts if x is not None]
        known_es = [x for x in es if x is not None]
        if len(known_ts) < len(ts) or len(known_es) < len(es):
            out[st.pp_rank] = None
            continue
        iteration_s = plan.predicted.iteration_time_s
        out[st.pp_rank] = float(
            iteration_energy_j(sum(known_es), sum(known_ts), iteration_s, p_blocked_w, gpus_per_stage=gpus, ranks=1)
        )
    return out


def compare(run: RunSummary, plan: Plan, p_blocked_w: float | None = None) -> Comparison:
    """Compare a run's summary with its plan (see the module doc); `p_blocked_w` None: blocked_power_w(plan)."""
    pb = blocked_power_w(plan) if p_blocked_w is None else p_blocked_w
    header = run.log.header
    log_pp = header.get("pp")
    if isinstance(log_pp, int) and log_pp != plan.parallel.pp:
        raise ConfigError(
            f"run log {run.log.path} is from a PP={log_pp} run but the plan has PP={plan.parallel.pp}; "
            "pass the plan the run used"
        )
    notes = []
    sha = header.get("plan_sha256")
    if sha and sha != plan_sha256(plan):
        notes.append("the log was recorded with a different plan than --plan (plan_sha256 differs)")
    if header.get("clock_control") is False:
        notes.append("clocks were not controlled in this run (no permission; --kareus-on-error warn)")
    notes.extend(log_notes(run.log))
    s = truth_time_scale(header)
    if s != 1.0:
        notes.append(
            f"simulated truth time_scale {s:g}: each instruction took {s:g} × its GPU time at the same "
            f"power, so predicted times and energies are shown × {s:g} (the plan's own: "
            f"{plan.predicted.iteration_time_s * 1e3:.4g} ms, {plan.predicted.iteration_energy_j:.4g} J)"
        )
    rows = [
        Row("iteration time", "s", run.time_s, plan.predicted.iteration_time_s * s),
        Row("iteration energy", "J", run.energy_j, plan.predicted.iteration_energy_j * s),
    ]
    pred_stage = {r: None if e is None else e * s for r, e in predicted_stage_energy_j(plan, pb).items()}
    stage_energy: dict[int, tuple[float | None, float | None]] = {}
    for st in plan.stages:
        r = st.pp_rank
        e = run.stage_energy_j.get(r)
        stage_energy[r] = (e, pred_stage.get(r))
        rows.append(Row(f"stage {r} energy", "J", e, pred_stage.get(r)))
        rows.append(Row(f"stage {r} time", "s", run.stage_time_s.get(r), plan.predicted.iteration_time_s * s))
    its = run.log.iterations
    return Comparison(
        rows=rows,
        iteration_time_s=[r.get("time_s") for r in its],
        iteration_energy_j=[r.get("energy_j") for r in its],
        used=run.used,
        skipped=run.skipped,
        p_blocked_w=pb,
        notes=notes,
        stage_energy_j=stage_energy,
        stage_iterations=dict(run.stage_iterations),
        gpus=per_gpu(run, pred_stage, plan.parallel.tp * plan.parallel.cp * plan.parallel.dp),
        time_scale=s,
    )

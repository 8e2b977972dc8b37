"""A truthful simulated GPU: hidden cost-model parameters a CPU run obeys (``KAREUS_SIMULATED_TRUTH=PATH``).

A *truth* is a set of cost-model parameters (cost/params.py PARAM_NAMES) standing for a GPU whose
behaviour differs from the preset the planner assumes, so the closed loop (measure, calibrate, re-plan)
can be tested on a CPU. The file is JSON::

    {"format": "kareus-simulated-truth/1", "gpu": "<preset>", "params": {NAME: value, ...},
     "drift": [{"after_iteration": N, "params": {...}}, ...]}

or a plain calibration file (``kareus-calibration/1``, cost/calibration.py), a truth without drift.
Values are finite and >= 0 (``time_scale`` > 0). A drift entry takes effect from iteration N on (the
session's iteration counter, 0 first; entries in increasing N): its params replace or extend those in
force before it (base params, then every earlier entry). Drift changes busy power and times only, never
``p_blocked_w`` (the device's blocked power is fixed when the clock controller starts).

Semantics, per instruction (stage, chunk, kind) of the running plan, at SM clock f (MHz):

- ``t_T(f), E_T(f)`` (s, J) = ``KernelModel(preset with the truth's power fields, truth's kernel params)
  .instruction_cost(model, parallel, stage, kind, f, chunk)`` (cost/kernel.py, the way ``kareus plan
  --calibration`` applies a calibration), on the workload the plan records (plan/workload.py
  ``plan_workload``). That is the 1-nanobatch form of the instruction (instruction_cost's baseline):
  2-nanobatch instructions run on CPU as they do, but the truth costs them as 1 nanobatch. Under a
  powercap plan the truth's board limit is lowered to the plan's ``power_limit_w`` (W).
- f is the plan's clock of the instruction when clocks are controlled, else the GPU's default (maximum)
  clock (read-only device, no permission, powercap).
- Time: when the instruction ends (training thread, the session's ends callable) after W s of CPU work,
  it sleeps until ``max(W * t_T(f) / t_T(f_max), t_T(f))``: the truth's absolute time (``time_scale``
  makes model times long enough to cover the CPU's own work), never shorter than the CPU's work
  stretched by the truth's clock ratio. When the stretched CPU work is the longer (the *floor* case:
  the truth's time was not met) the instruction counts in ``floors``; a warning at close names the
  share when it is above FLOOR_WARN_FRACTION.
- Power: while the instruction runs the simulated GPU draws ``E_T(f) / t_T(f)`` W (sent on the begin
  record, runtime/clock/wire.py field e); while none runs, the truth's ``p_blocked_w`` (the clock
  controller gives the simulated device the truth's power fields, ``apply_truth_power``). So an
  iteration's energy is ``sum E_T(f_i) + p_blocked_w * (iteration time - sum t_T(f_i))`` when no
  instruction hits the floor (``Truth.iteration_energy_j``).

How the session uses it (runtime/session.py): ``session_truth(backend, plan)`` at start (one-line refusal
with NVML, without a plan, or for a file that does not load or does not match the plan's GPU; the run log
header records ``truth: {path, sha256}``); ``bind(plan, pp_rank)`` at validation;
``callables(begins, ends)`` wraps the clock client's per-instruction callables; ``bind(plan)`` again at
every plan switch (between iterations: ``RuntimeSession.switch_plan``), which recomputes the
per-instruction rows from tables cached per (workload, drift segment, stage, chunk, kind) over every
supported clock; ``close()`` at the session's close. This module may import cost/ (lazily: a run without
a truth never loads the cost model), never search/.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from time import monotonic, sleep
from typing import TYPE_CHECKING, Any

from kareus_megatron.environment import kareus_settings
from kareus_megatron.errors import CalibrationError, ConfigError
from kareus_megatron.files import read_input_text

if TYPE_CHECKING:
    from kareus_megatron.plan.schema import Plan

TRUTH_ENV = "KAREUS_SIMULATED_TRUTH"
FORMAT = "kareus-simulated-truth/1"
CALIBRATION_FORMAT = "kareus-calibration/1"
FLOOR_WARN_FRACTION = 0.05  # warn at close when more instructions than this hit the floor
_KINDS = ("forward", "backward")
Begins = Callable[..., None]


@dataclass(frozen=True)
class TruthFile:
    """A loaded truth: the parameters in force from each drift segment's first iteration on."""

    path: str
    sha256: str  # of the file's text (UTF-8)
    gpu: str
    params: dict[str, float]  # base params
    segments: tuple[tuple[int, dict[str, float]], ...]  # (first iteration, params in force), first is (0, base)

    def gpu_params(self) -> dict[str, float]:
        """The base params' GPU power-model fields (cost/params.py GPU_PARAM_NAMES)."""
        from kareus_megatron.cost.params import GPU_PARAM_NAMES

        return {k: v for k, v in self.params.items() if k in GPU_PARAM_NAMES}


def _check_params(raw: Any, what: str, path: str) -> dict[str, float]:
    from kareus_megatron.cost.params import PARAM_NAMES

    if not isinstance(raw, dict):
        raise CalibrationError(f"truth file {path!r}: {what} must be an object of parameter values")
    out: dict[str, float] = {}
    for key, value in raw.items():
        if key not in PARAM_NAMES:
            raise CalibrationError(
                f"truth file {path!r}: {what}: unknown parameter {key!r}; allowed: {', '.join(PARAM_NAMES)}"
            )
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
            or value < 0
            or (key == "time_scale" and value <= 0)
        ):
            raise CalibrationError(
                f"truth file {path!r}: {what}: {key} = {value!r} must be a finite number >= 0"
                + (" (> 0)" if key == "time_scale" else "")
            )
        out[key] = float(value)
    return out


def load_truth(path: str | os.PathLike[str]) -> TruthFile:
    """Read and check a truth file (see module doc); CalibrationError names the first problem."""
    p = os.fspath(path)
    text = read_input_text(
        p, CalibrationError, "truth file", not_text_fix=f"give a {FORMAT} or {CALIBRATION_FORMAT} JSON file"
    )
    try:
        data = json.loads(text)
    except ValueError as e:
        raise CalibrationError(f"truth file {p!r} is not JSON ({e})") from e
    sha = hashlib.sha256(text.encode()).hexdigest()
    fmt = data.get("format") if isinstance(data, dict) else None
    if fmt == CALIBRATION_FORMAT:
        from kareus_megatron.cost.calibration import calibration_from_dict

        cal = calibration_from_dict(data, f"truth file {p!r}")
        return TruthFile(p, sha, cal.gpu, dict(cal.params), ((0, dict(cal.params)),))
    if fmt != FORMAT:
        raise CalibrationError(f"truth file {p!r} has format {fmt!r}; use {FORMAT!r} or {CALIBRATION_FORMAT!r}")
    extra = sorted(set(data) - {"format", "gpu", "params", "drift"})
    if extra:
        raise CalibrationError(f"truth file {p!r}: unknown key {extra[0]!r}; allowed: format, gpu, params, drift")
    gpu = data.get("gpu")
    if not isinstance(gpu, str) or not gpu:
        raise CalibrationError(f"truth file {p!r}: gpu must name a GPU preset")
    params = _check_params(data.get("params"), "params", p)
    segments = [(0, params)]
    drift = data.get("drift", [])
    if not isinstance(drift, list):
        raise CalibrationError(f"truth file {p!r}: drift must be a list of {{after_iteration, params}}")
    for k, entry in enumerate(drift):
        what = f"drift[{k}]"
        if not isinstance(entry, dict) or set(entry) != {"after_iteration", "params"}:
            raise CalibrationError(f'truth file {p!r}: {what} must be {{"after_iteration": N, "params": {{...}}}}')
        n = entry["after_iteration"]
        if isinstance(n, bool) or not isinstance(n, int) or n <= segments[-1][0] and not (n == 0 == k):
            raise CalibrationError(
                f"truth file {p!r}: {what}.after_iteration {n!r} must be an integer >= 0, "
                "increasing from entry to entry"
            )
        changes = _check_params(entry["params"], f"{what}.params", p)
        if "p_blocked_w" in changes:
            raise CalibrationError(
                f"truth file {p!r}: {what} sets p_blocked_w; drift may change busy power "
                "and times only (the blocked power is fixed when the run starts)"
            )
        if n == 0:
            segments[0] = (0, {**params, **changes})
        else:
            segments.append((n, {**segments[-1][1], **changes}))
    return TruthFile(p, sha, gpu, params, tuple(segments))


def truth_path_from_env() -> str | None:
    """KAREUS_SIMULATED_TRUTH, or None when unset or empty."""
    return kareus_settings().simulated_truth or None


def apply_truth_power(simulation: Any, spec: Any) -> bool:
    """Clock controller, simulated GPU: give the device the truth's power fields (KAREUS_SIMULATED_TRUTH;
    ``SimulationHooks.use_power_model``); False when no truth is set. CalibrationError for a bad file or a
    truth made for another GPU than `spec` (the device's preset)."""
    path = truth_path_from_env()
    if path is None:
        return False
    from kareus_megatron.cost.params import with_gpu_params

    truth = load_truth(path)
    _check_gpu(truth, spec.name, "the simulated GPU")
    simulation.use_power_model(with_gpu_params(spec, truth.gpu_params()))
    return True


def _check_gpu(truth: TruthFile, gpu: str, whose: str) -> None:
    if truth.gpu != gpu:
        raise CalibrationError(
            f"truth file {truth.path!r} is for GPU {truth.gpu!r}, {whose} is {gpu!r}; make the truth for {gpu}"
        )


def session_truth(backend: str, plan: Plan | None) -> Truth | None:
    """The truth of this run (KAREUS_SIMULATED_TRUTH), checked against `backend` and `plan`; None when unset.
    ConfigError with NVML or without a plan; CalibrationError for a bad file or another GPU than the plan's."""
    path = truth_path_from_env()
    if path is None:
        return None
    if backend != "simulated":
        raise ConfigError(
            f"{TRUTH_ENV}={path!r} needs the simulated GPU (KAREUS_GPU_BACKEND=simulated): a truth "
            f"only makes sense there; unset it to run on the {backend} backend"
        )
    if plan is None:
        raise ConfigError(f"{TRUTH_ENV}={path!r} needs a plan (its instructions are what the truth costs)")
    truth = Truth(load_truth(path))
    _check_gpu(truth.file, plan.gpu, "the plan's")
    return truth


class Truth:
    """The truth's per-instruction rows for one pipeline rank of the bound plan, and the per-instruction
    callables that stretch time and report power (see module doc). Units: s, J, W, MHz."""

    def __init__(self, file: TruthFile, clock_control: bool = True) -> None:
        self.file = file
        self.clock_control = clock_control  # False: every instruction runs at the default (maximum) clock
        self.pp_rank = 0
        self.plan: Plan | None = None
        self.floors = 0  # instructions whose stretched CPU work outlasted the truth's time
        self.instructions = 0  # instructions timed so far
        self._cache: dict[tuple[Any, ...], tuple[Any, Any, Any]] = {}  # -> (clocks MHz, t_s, e_j) arrays
        self._starts: list[int] = [s for s, _ in file.segments]
        self._segment_rows: list[tuple[tuple[float, float, float, float], ...]] = []
        self._rows: tuple[tuple[float, float, float, float], ...] = ()  # per index: t_T s, ratio, P_T W, E_T J
        self._next_switch = -1  # the iteration at which the rows in use change (-1: choose at the next begin)
        self._running: tuple[float, float, float, float] | None = None
        self._t0 = 0.0

    @property
    def p_blocked_w(self) -> float:
        """Blocked power (W): the truth's, else the preset's."""
        from kareus_megatron.hardware.gpus import gpu_spec

        return self.file.params.get("p_blocked_w", gpu_spec(self.file.gpu).p_blocked_w)

    # -- tables ------------------------------------------------------------------------------
    def table(self, plan: Plan, segment: int, stage: int, chunk: int, kind: str) -> tuple[Any, Any, Any]:
        """(clocks MHz, t_T s, E_T J) over every supported clock of the plan's GPU for one instruction
        (stage, chunk, kind) under drift segment `segment`'s params; cached."""
        from kareus_megatron.plan.workload import plan_workload

        gpu, model, par = plan_workload(plan)
        key = (model, par, plan.power_limit_w, segment, stage, chunk, kind)
        hit = self._cache.get(key)
        if hit is None:
            import numpy as np

            from kareus_megatron.cost.calibration import Calibration
            from kareus_megatron.cost.kernel import KernelModel

            if plan.power_limit_w is not None and plan.power_limit_w < gpu.power_limit_w:
                gpu = replace(gpu, power_limit_w=plan.power_limit_w)  # the truth's own limit may be lower still
            params = self.file.segments[segment][1]
            if "power_limit_w" in params and plan.power_limit_w is not None:
                params = {**params, "power_limit_w": min(params["power_limit_w"], plan.power_limit_w)}
            kernel = KernelModel(gpu, Calibration(gpu=gpu.name, params=params))
            clocks = np.asarray(sorted(gpu.sm_clocks_mhz), dtype=float)
            t, e = kernel.instruction_cost(model, par, stage, kind, clocks, chunk)
            if not (np.all(np.isfinite(t)) and np.all(t > 0) and np.all(np.isfinite(e))):
                raise CalibrationError(
                    f"truth file {self.file.path!r}: its parameters give a non-finite or zero "
                    f"time for stage {stage} chunk {chunk} {kind}"
                )
            hit = self._cache[key] = (clocks, t, e)
        return hit

    def _row(
        self, plan: Plan, segment: int, stage: int, chunk: int, kind: str, mhz: int
    ) -> tuple[float, float, float, float]:
        import numpy as np

        clocks, t, e = self.table(plan, segment, stage, chunk, kind)
        f = float(mhz if self.clock_control else clocks[-1])
        t_f, e_f = float(np.interp(f, clocks, t)), float(np.interp(f, clocks, e))  # exact on the grid
        return t_f, t_f / float(t[-1]), e_f / t_f, e_f

    def bind(self, plan: Plan, pp_rank: int | None = None) -> None:
        """Compute this rank's rows for `plan` (`pp_rank`: this rank; None keeps the bound one). Call on the
        training thread, before the first instruction and at every plan switch (between iterations)."""
        if pp_rank is not None:
            self.pp_rank = pp_rank
        stage = plan.stages[self.pp_rank]
        rows = [
            tuple(self._row(plan, k, self.pp_rank, i.chunk, i.kind, i.sm_clock_mhz) for i in stage.instructions)
            for k in range(len(self.file.segments))
        ]
        self.plan, self._segment_rows, self._next_switch = plan, rows, -1
        self._rows = rows[0]

    def rows(self, iteration: int) -> tuple[tuple[float, float, float, float], ...]:
        """Per instruction index of the bound rank at `iteration`: (t_T s, t_T/t_T(f_max), power W, E_T J)."""
        return self._segment_rows[bisect.bisect_right(self._starts, iteration) - 1]

    def iteration_energy_j(self, iteration: int, time_s: float) -> float:
        """The truth's energy (J) of this rank's GPU over an iteration of `time_s` s: every instruction's
        E_T plus the blocked power over the rest (no instruction at the floor)."""
        rows = self.rows(iteration)
        return sum(r[3] for r in rows) + self.p_blocked_w * (time_s - sum(r[0] for r in rows))

    # -- the per-instruction path (training thread) --------------------------------------------
    def _switch(self, iteration: int) -> None:
        k = bisect.bisect_right(self._starts, iteration) - 1
        self._rows = self._segment_rows[k]
        self._next_switch = self._starts[k + 1] if k + 1 < len(self._starts) else 1 << 62

    def callables(
        self, begins: Begins, ends: Callable[[], None]
    ) -> tuple[Callable[[int, int, int, str], None], Callable[[], None]]:
        """(begins, ends) for the patch: the clock client's `begins(iteration, index, mhz, kind, power_w)`
        with the truth's busy power, and `ends()` after the truth's time has passed."""

        def truth_begins(iteration: int, index: int, mhz: int, kind: str) -> None:
            if iteration >= self._next_switch:
                self._switch(iteration)
            row = self._running = self._rows[index]
            self._t0 = monotonic()
            begins(iteration, index, mhz, kind, row[2])

        def truth_ends() -> None:
            row, self._running = self._running, None
            if row is not None:
                w = monotonic() - self._t0
                target = w * row[1]
                if target > row[0]:
                    self.floors += 1
                else:
                    target = row[0]
                self.instructions += 1
                if target > w:
                    sleep(target - w)
            ends()

        return truth_begins, truth_ends

    def close(self) -> None:
        """At the session's close: warn when more than FLOOR_WARN_FRACTION of the instructions hit the floor."""
        if self.instructions and self.floors > FLOOR_WARN_FRACTION * self.instructions:
            warnings.warn(
                f"kareus: simulated truth: {self.floors} of {self.instructions} instructions took longer "
                "on the CPU (stretched by the truth's clock ratio) than the truth's time; raise the "
                f"truth's time_scale in {self.file.path}",
                RuntimeWarning,
                stacklevel=2,
            )

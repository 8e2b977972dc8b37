"""``--kareus-plan auto``: the job measures itself, calibrates, plans, switches, and keeps checking.

Phases (every rank follows the same iteration schedule; the run log tags each iteration with its
``phase``, ``plan_version`` and ``plan_sha256``, and records every phase change and switch as an event):

1. ``warmup``: WARMUP_ITERATIONS at the maximum SM clock (the GPU reaches a steady temperature and the
   framework its steady state; these and the first iteration at every new clock are left out of every
   measurement window, report/measurements.py);
2. ``profile``: PROFILE_CLOCKS SM clocks from the maximum down to about half of it, ITERATIONS_PER_CLOCK
   iterations each, every instruction at that clock and one nanobatch: the clock sweep that makes the time
   ratios and the power curve identifiable (with the warm-up, 17 iterations by default). The clocks run in
   interleaved order (max, lowest, highest left, ...), so a slow drift in temperature during the profile is
   not confounded with the clock; each iteration's GPU temperature is in the run log;
3. ``planning``: training goes on at the maximum clock while rank 0 (runtime/closed_loop/auto_worker.py) waits for
   every rank's profile iterations in the run log, runs ``kareus calibrate --from-log`` and ``kareus plan
   --calibration`` as subprocesses (the runtime never imports the search) and picks the point that meets the
   objective (plan/objective.py);
4. ``plan``: every rank switches to the new plan at the same iteration boundary; rank 0 compares the
   measured iteration time and energy with the plan's prediction over DRIFT_WINDOW iterations, and when either
   differs by more than DRIFT_THRESHOLD it starts a new profile phase (``reprofile``) and re-plans (an event
   ``drift`` says by how much).

An objective no plan meets (``objective-unmet``) or a failed step (``auto-failed``) leaves the job at its
current plan, says why in the run log and on rank 0's stderr, and never stops training.

Agreement: rank 0 decides; at every iteration end after the profile phase each rank takes part in one
broadcast of two integers (command, plan version) over a gloo group of its own (created at the first
iteration end, on every rank), and on a switch one broadcast of the plan's JSON text, so plans need no shared
file system; the run log must be on one (rank 0 reads every rank's file). Without torch.distributed (one
process) no collective is made.
"""

from __future__ import annotations

import json
import sys
import threading
from dataclasses import dataclass
from typing import Any

from kareus_megatron.errors import ConfigError, KareusError
from kareus_megatron.plan.io import plan_from_dict, plan_sha256
from kareus_megatron.plan.objective import Objective
from kareus_megatron.plan.schema import Plan
from kareus_megatron.vocab import KAREUS, PERSEUS

WARMUP_ITERATIONS = 2
PROFILE_CLOCKS = 5
ITERATIONS_PER_CLOCK = 3
LOWEST_PROFILE_FRACTION = 0.5  # the lowest profiled clock, as a fraction of the maximum
DRIFT_THRESHOLD = 0.05  # relative error of iteration time or energy that counts as drift
DRIFT_WINDOW = 8  # iterations of a plan compared with its prediction (after its first)
CMD_NONE, CMD_SWITCH, CMD_REPROFILE = 0, 1, 2
AUTO = "auto"  # the --kareus-plan value that asks for this


@dataclass(frozen=True, slots=True)
class AutoSettings:
    """Knobs of the closed loop (defaults above; the tests shorten them)."""

    objective: Objective
    warmup_iterations: int = WARMUP_ITERATIONS
    profile_clocks: int = PROFILE_CLOCKS
    iterations_per_clock: int = ITERATIONS_PER_CLOCK
    drift_threshold: float = DRIFT_THRESHOLD
    drift_window: int = DRIFT_WINDOW

    def __post_init__(self) -> None:
        if self.warmup_iterations < 0 or self.profile_clocks < 2 or self.iterations_per_clock < 2:
            raise ConfigError(
                "auto: needs >= 0 warm-up iterations, >= 2 profile clocks and >= 2 iterations per "
                "clock (the first at each clock is left out)"
            )
        if not 0 < self.drift_threshold < 1 or self.drift_window < 2:
            raise ConfigError("auto: drift threshold must be in (0, 1) and the drift window >= 2 iterations")


def profile_clocks_mhz(supported_mhz: tuple[int, ...] | list[int], count: int) -> list[int]:
    """`count` distinct lockable clocks (MHz) from the maximum down to ~LOWEST_PROFILE_FRACTION of it."""
    clocks = sorted({int(c) for c in supported_mhz}, reverse=True)
    if not clocks:
        raise ConfigError("auto: the GPU reports no lockable SM clocks")
    top = clocks[0]
    usable = [c for c in clocks if c >= LOWEST_PROFILE_FRACTION * top] or clocks[:1]
    if len(usable) <= count:
        return usable
    step = (len(usable) - 1) / (count - 1)
    return sorted({usable[round(k * step)] for k in range(count)}, reverse=True)


def interleaved(clocks: list[int]) -> list[int]:
    """`clocks` (descending) in profile order: the maximum, then alternately the lowest and highest left (so a
    slow thermal drift during the profile does not line up with the clock)."""
    rest, out, low = list(clocks[1:]), list(clocks[:1]), True
    while rest:
        out.append(rest.pop(-1 if low else 0))
        low = not low
    return out


def uniform_plan(base: Plan, mhz: int) -> Plan:
    """`base`'s instructions, every one at `mhz` MHz and one nanobatch (a profile plan; no predictions)."""
    stages = tuple(
        st.model_copy(
            update={
                "instructions": tuple(
                    i.model_copy(
                        update={
                            "sm_clock_mhz": mhz,
                            "nanobatches": 1,
                            "partitions": {},
                            "predicted_time_s": None,
                            "predicted_energy_j": None,
                        }
                    )
                    for i in st.instructions
                )
            }
        )
        for st in base.stages
    )
    return base.model_copy(update={"stages": stages, "power_limit_w": None})


class AutoController:
    """Drives the phases on this rank (training thread, at iteration ends); rank 0 also runs the worker."""

    def __init__(
        self,
        session: Any,
        base: Plan,
        settings: AutoSettings,
        *,
        log_dir: str,
        supported_mhz: tuple[int, ...],
        rank: int = 0,
        world: int = 1,
        method: str | None = None,
    ) -> None:
        self.session = session
        self.base = base
        self.settings = settings
        self.log_dir = log_dir
        self.rank, self.world = rank, world
        self.clocks = interleaved(profile_clocks_mhz(supported_mhz, settings.profile_clocks))  # max first
        self._profile_plans: dict[int, tuple[Plan, str]] = {}  # MHz -> (plan, sha256): built once each
        self.max_plan = self.profile_plan(self.clocks[0])
        self.version = 0  # 0: the profile / max-clock plans; n: the n-th plan the loop made
        self.plan: Plan = self.max_plan
        self.plan_sha = plan_sha256(self.plan)  # of the plan running now (the tags carry it)
        self.fallback: Plan = self.max_plan  # what runs while planning: max clocks, later the last plan
        self.profile_start = 0  # iteration at which the current profile phase starts
        self.profile_warmup = settings.warmup_iterations
        self.phase = ""
        self._group: Any = None
        self._lock = threading.Lock()
        self._command: tuple[int, int, str | None] = (CMD_NONE, 0, None)  # set by the worker (rank 0)
        self.worker: Any = None
        self.method = method

    # -- the schedule --------------------------------------------------------------------------
    def profile_length(self) -> int:
        """Iterations of the current profile phase (its warm-up included)."""
        return self.profile_warmup + len(self.clocks) * self.settings.iterations_per_clock

    def scheduled(self, iteration: int) -> tuple[str, Plan | None, int | None]:
        """(phase, plan to run or None to keep the current one, profile clock MHz) of `iteration`."""
        k = iteration - self.profile_start
        if self.phase in ("", "warmup", "profile", "reprofile") and 0 <= k < self.profile_length():
            if k < self.profile_warmup:
                return "warmup", self.max_plan, self.clocks[0]
            mhz = self.clocks[(k - self.profile_warmup) // self.settings.iterations_per_clock]
            return ("reprofile" if self.version else "profile"), self.profile_plan(mhz), mhz
        if self.phase in ("warmup", "profile", "reprofile"):  # the profile is over: train on while planning
            return "planning", self.fallback, None
        return self.phase, None, None

    # -- training thread -----------------------------------------------------------------------
    def start(self) -> None:
        """Before the first iteration: run the first scheduled plan; rank 0 starts its worker."""
        if self.rank == 0:
            from kareus_megatron.runtime.closed_loop.auto_worker import AutoWorker

            self.worker = AutoWorker(self)
            self.worker.start()
        self._enter(0)

    def on_iteration_end(self, finished: int) -> None:
        """Iteration `finished` has ended on this rank (every rank calls this at the same boundary)."""
        nxt = finished + 1
        if self.phase in ("planning", "plan"):
            cmd, version, text = self._agree()
            if cmd == CMD_SWITCH and text is not None:
                self._switch(plan_from_dict(json.loads(text), "the auto plan"), version)
                return
            if cmd == CMD_REPROFILE:
                self.profile_start, self.profile_warmup = nxt, 0
                self.phase = "reprofile"
        self._enter(nxt)

    def _enter(self, iteration: int) -> None:
        phase, plan, mhz = self.scheduled(iteration)
        changed = plan is not None and plan is not self.plan  # plans are built once (profile_plan, the switch)
        if not changed and phase == self.phase and iteration:
            return
        if phase != self.phase or not iteration:
            self._event("phase", phase=phase, **({} if mhz is None else {"sm_clock_mhz": mhz}))
        self.phase = phase
        if plan is not None:
            self._run(plan)
        self._tag(profile_mhz=mhz)
        if phase == "planning" and self.worker is not None:
            self.method = self.method or self._method_for_model()
            self.worker.profile_done(self.profile_start, iteration - 1)

    def _switch(self, plan: Plan, version: int) -> None:
        try:
            self.session.switch_plan(plan)  # every rank gets the same plan: all switch, or all refuse alike
        except KareusError as e:
            self._event("auto-failed", reason=f"plan {version} does not run on this job: {e}")
            self.say(f"plan {version} does not run on this job ({e}); training goes on at the current plan")
            return
        self.plan, self.version, self.phase, self.fallback = plan, version, "plan", plan
        self.plan_sha = plan_sha256(plan)
        self._event(
            "switch",
            plan_version=version,
            plan_sha256=self.plan_sha,
            predicted_time_s=plan.predicted.iteration_time_s,
            predicted_energy_j=plan.predicted.iteration_energy_j,
            method=plan.method,
        )
        self._tag(profile_mhz=None)
        if self.worker is not None:
            self.worker.switched(version, plan)

    def _method_for_model(self) -> str:
        """kareus where the model can run 2 nanobatches (megatron-core with partitioned layers), else perseus
        (clocks only): a 2-nanobatch plan on a standard model would be refused at the switch."""
        from kareus_megatron.runtime.frameworks import megatron_patch

        patch = self.session.patch
        if self.session.framework_patch is not megatron_patch or patch is None or patch.live is None:
            return KAREUS  # DeepSpeed's schedule plans 1 nanobatch anyway
        from kareus_megatron.runtime.overlap.layer import PartitionedTransformerLayer

        chunks = patch.live.modules if isinstance(patch.live.modules, (list, tuple)) else [patch.live.modules]
        found = any(isinstance(m, PartitionedTransformerLayer) for c in chunks for m in c.modules())
        return KAREUS if found else PERSEUS

    def _run(self, plan: Plan) -> None:
        """From the next iteration on, run `plan` (a profile plan or the fallback) on this rank."""
        self.plan = plan
        self.plan_sha = next((sha for p, sha in self._profile_plans.values() if p is plan), None) or plan_sha256(plan)
        self.session.switch_plan(plan)

    def profile_plan(self, mhz: int) -> Plan:
        """The profile plan at `mhz` MHz (uniform_plan of the base), built once: the schedule runs on the
        training thread at every iteration end, so it builds no plan and hashes none per iteration."""
        if mhz not in self._profile_plans:
            plan = uniform_plan(self.base, mhz)
            self._profile_plans[mhz] = (plan, plan_sha256(plan))
        return self._profile_plans[mhz][0]

    def _tag(self, **extra: Any) -> None:
        meter = self.session.meter
        if meter is not None:
            meter.set_tags(phase=self.phase, plan_version=self.version, plan_sha256=self.plan_sha, **extra)

    def _event(self, name: str, **fields: Any) -> None:
        meter = self.session.meter
        if meter is not None:
            meter.event(name, **fields)

    # -- agreement -------------------------------------------------------------------------------
    def post(self, command: int, version: int = 0, plan_json: str | None = None) -> None:
        """Rank 0's worker: have every rank do `command` at the next iteration boundary."""
        with self._lock:
            self._command = (command, version, plan_json)

    def _agree(self) -> tuple[int, int, str | None]:
        with self._lock:
            mine, self._command = self._command, (CMD_NONE, 0, None)
        import torch
        import torch.distributed as dist

        if self.world <= 1 or not (dist.is_available() and dist.is_initialized()):
            return mine

        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        msg = torch.tensor(mine[:2], dtype=torch.int64)
        dist.broadcast(msg, src=0, group=self._group)
        cmd, version = int(msg[0]), int(msg[1])
        text = mine[2]
        if cmd == CMD_SWITCH:
            box = [text]
            dist.broadcast_object_list(box, src=0, group=self._group)
            text = box[0]
        return cmd, version, text

    def stop(self) -> None:
        """The session closes: rank 0's worker stops (a subprocess still running is left to finish)."""
        if self.worker is not None:
            self.worker.stop()

    def say(self, message: str) -> None:
        """One line on stderr (rank 0 only): what the closed loop did or why it could not."""
        if self.rank == 0:
            sys.stderr.write(f"kareus auto: {message}\n")


def install_auto(
    slot: Any,
    base: Plan,
    source: str,
    objective: Objective,
    *,
    log_path: str | None,
    settings: AutoSettings | None = None,
    method: str | None = None,
    **session_kwargs: Any,
) -> Any:
    """Start a session in `slot` that runs the closed loop for the job `base` was planned for; return it.

    `log_path` (the run log directory) is required: rank 0 calibrates from it, so on several nodes it must be on
    a file system every rank shares. The session starts at the maximum clock; the phases follow (module doc).
    """
    from kareus_megatron.hardware.gpus import gpu_spec
    from kareus_megatron.runtime.process_env import global_rank_and_world

    if not log_path:
        raise ConfigError("--kareus-plan auto needs --kareus-log DIR: the job calibrates from its own run log")
    if base.method == "powercap" or base.power_limit_w is not None:
        raise ConfigError("--kareus-workload: give a clock plan of the job (any method but powercap)")
    settings = settings or AutoSettings(objective=objective)
    session = slot.install(base, source=source, log_path=log_path, **session_kwargs)
    try:
        supported = tuple(session.ready.get("supported") or ()) or gpu_spec(base.gpu).sm_clocks_mhz
        rank, world = global_rank_and_world()
        ctl = AutoController(
            session,
            base,
            settings,
            log_dir=str(log_path),
            supported_mhz=supported,
            rank=rank,
            world=world,
            method=method,
        )
        session.patch.on_iteration_end = ctl.on_iteration_end
        session.auto = ctl
        ctl.start()
    except BaseException:
        slot.uninstall()
        raise
    return session

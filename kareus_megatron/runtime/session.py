"""A runtime session: one plan executing in one training process (clock client + meter + patch).

The session opens the clock controller for this process's GPU, checks clock permission before
training (``on_error="fail"``: ClockControlError; ``"warn"``: a warning, default clocks), installs
the framework patch (``framework_patch``: runtime.megatron_patch or runtime.deepspeed_patch; each
exposes FRAMEWORK, check_version, install, uninstall, installed_state and validate_plan), and closes
everything on ``close()`` or at interpreter exit. Without a plan (``plan=None``, DeepSpeed only) the
run is only *measured*: no clock controller, the device is read on the training thread. The GPU is
CUDA device ``local_rank``, found in NVML by its UUID (hardware/device/cuda_map.py: torch's UUID, else
CUDA_VISIBLE_DEVICES; MIG is refused). With KAREUS_GPU_READ_ONLY=1 the controller decides and records
every planned clock but nothing on the GPU changes (the run log header: clock_control false, read_only
true). The session a framework API has installed in this process is held by runtime/session_slot.py.
"""

from __future__ import annotations

import atexit
import time
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any, Literal, Self

from kareus_megatron.environment import kareus_settings
from kareus_megatron.errors import ClockControlError, ConfigError
from kareus_megatron.hardware.device.base import SimulationHooks
from kareus_megatron.plan.io import plan_sha256
from kareus_megatron.plan.schema import Plan
from kareus_megatron.runtime import hooks
from kareus_megatron.runtime.clock.client import ClockClient
from kareus_megatron.runtime.clock.transport_gpu import CudaEvents
from kareus_megatron.runtime.closed_loop.truth import Truth, session_truth
from kareus_megatron.runtime.frameworks import megatron_patch, megatron_writers
from kareus_megatron.runtime.measure.measurement import IterationMeter
from kareus_megatron.runtime.measure.rank_files import open_rank_log
from kareus_megatron.runtime.process_env import global_rank_and_world, gpu_target, local_rank_from_env
from kareus_megatron.runtime.session_signals import SignalHandling
from kareus_megatron.vocab import FRAMEWORK_MEGATRON

OnError = Literal["fail", "warn"]
Controller = Literal["process", "thread"]


class _Reading:
    """A measurement point read at once on the training thread (measurement-only sessions)."""

    done = True

    def __init__(self, t: float, energy_j: float, temperature_c: float | None = None) -> None:
        self.t, self.energy_j = t, energy_j
        self.info = {"temperature_c": temperature_c}  # as a clock controller's mark answer (decisions.py)

    def wait(self, timeout: float | None = None) -> bool:
        return True


class RuntimeSession(SignalHandling):
    """Runs `plan` in this process: validate, announce instructions, control clocks, measure."""

    def __init__(
        self,
        plan: Plan | None,
        *,
        source: str = "the plan",
        backend: str | None = None,
        gpu: str | None = None,
        local_rank: int | None = None,
        log_path: str | None = None,
        on_error: OnError = "fail",
        controller: Controller = "process",
        clock_log: str | None = None,
        framework_patch: ModuleType = megatron_patch,
        log_mode: str = "new",
        robust: bool = False,
    ) -> None:
        """Configure; nothing starts until `start()`. `log_path` is a directory of per-rank logs;
        `log_mode` (new, append, overwrite) says what to do when this rank's log exists there; `robust`: the
        plan was chosen across the prediction bands (--kareus-robust), recorded in the log header."""
        if on_error not in ("fail", "warn"):
            raise ConfigError(f"on_error (--kareus-on-error) {on_error!r} is not allowed; use fail or warn")
        if controller not in ("process", "thread"):
            raise ConfigError(f"controller {controller!r} is not allowed; use process or thread")
        if plan is None and framework_patch is megatron_patch:
            raise ConfigError("a Megatron session needs a plan; measurement without a plan is DeepSpeed-only")
        self.plan = plan
        self.source = source
        self.robust = robust
        self.backend = backend
        self.gpu = gpu
        self.local_rank = local_rank_from_env() if local_rank is None else local_rank
        self.log_path = log_path
        self.log_mode = log_mode
        self._old_handlers: dict[int, Any] = {}
        self.on_error = on_error
        self.controller = controller
        self.clock_log = clock_log if clock_log is not None else (kareus_settings().clock_log or None)
        self.framework_patch = framework_patch
        self.client: ClockClient | None = None
        self.device: Any = None  # measurement-only: the device, read on the training thread
        self.simulation: SimulationHooks | None = None  # measurement-only: a simulated device's hooks
        self.ready: dict[str, Any] = {}
        self.meter: IterationMeter | None = None
        self.patch: Any = None  # the framework patch's PatchState
        self.overlap_engine: Any = None  # set up here when the plan runs 2 nanobatches
        self.comm_groups: list[dict[str, Any]] | None = None  # its SM-limited communicators, for the log header
        self.auto: Any = None  # the closed loop's controller under --kareus-plan auto (runtime/closed_loop/auto.py)
        self.truth: Truth | None = None  # a simulated truth (KAREUS_SIMULATED_TRUTH; runtime/closed_loop/truth.py)
        self.closed = False

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> Self:
        """Start the clock controller (measure only: open the device), check permission, install the patch."""
        from kareus_megatron.hardware.device import backend_from_env

        self.framework_patch.check_version()
        backend = backend_from_env(self.backend)
        gpu = (
            self.gpu
            or kareus_settings().gpu
            or (self.plan.gpu if backend == "simulated" and self.plan is not None else None)
        )
        index, uuid = gpu_target(self.local_rank, backend)
        self.truth = session_truth(backend, self.plan)  # refused in one line before anything starts
        rank, world = global_rank_and_world()
        log = open_rank_log(self.log_path, rank, self.log_mode) if self.log_path else None  # before training
        header: dict[str, Any] = {
            "rank": rank,
            "world": world,
            "local_rank": self.local_rank,
            "gpu_index": index,
            "plan": None if self.plan is None else self.source,
            "backend": backend,
        }
        if self.robust:
            header["robust"] = True
        if self.plan is not None:
            par = self.plan.parallel
            header.update(pp=par.pp, tp=par.tp, cp=par.cp, dp=par.dp)
        if self.framework_patch.FRAMEWORK != FRAMEWORK_MEGATRON:
            header["framework"] = self.framework_patch.FRAMEWORK
        if self.truth is not None:
            header["truth"] = {
                "path": self.truth.file.path,
                "sha256": self.truth.file.sha256,
                "time_scale": self.truth.file.params.get("time_scale", 1.0),
            }
        try:
            self._start_measuring(index, uuid, backend, gpu, header, log)
        except BaseException:
            if log is not None:
                log.close()
            raise
        try:
            self.patch = self.framework_patch.install(self.plan, self, self.source)
        except BaseException:
            self._release()
            raise
        atexit.register(self._atexit)
        self._install_signal_handlers()
        return self

    def _start_measuring(
        self, index: int, uuid: str | None, backend: str, gpu: str | None, header: dict[str, Any], log: Any
    ) -> None:
        from kareus_megatron.hardware.device import open_gpu, read_only_from_env, simulation_of

        if self.plan is None:
            self.device = open_gpu(index, backend=backend, gpu=gpu, uuid=uuid)
            self.simulation = simulation_of(self.device)
            header.update(gpu=self.device.spec.name, clock_control=False, read_only=self.device.read_only)
            self.meter = IterationMeter(log, mark=self._read_now, header=header)
        else:
            events = CudaEvents.available(self.local_rank)
            client = ClockClient(
                event_factory=events,
                bind_thread=None if events is None else events.bind_thread,
                recycle=None if events is None else events.give_back,
            )
            cap_w = self.plan.power_limit_w  # powercap: the controller sets it and restores it on every way out
            if self.controller == "thread":
                device = open_gpu(index, backend=backend, gpu=gpu, uuid=uuid)
                self.ready = client.start_thread(
                    device, simulation=simulation_of(device), log_path=self.clock_log, power_limit_w=cap_w
                )
            else:
                self.ready = client.start_process(
                    index, backend=backend, gpu=gpu, log_path=self.clock_log, power_limit_w=cap_w, uuid=uuid
                )
            self.client = client
            if self.ready.get("op") == "error":
                if self.on_error == "fail":
                    client.close()
                    raise ClockControlError(str(self.ready.get("message")))
                warnings.warn(f"kareus: {self.ready.get('message')}; training at default clocks", stacklevel=2)
            read_only = bool(self.ready.get("read_only", read_only_from_env()))
            if self.truth is not None:  # without clock control the truth runs everything at the default clock
                self.truth.clock_control = client.clock_control and not read_only
            header.update(
                plan_sha256=plan_sha256(self.plan),
                gpu=self.ready.get("gpu"),
                clock_control=client.clock_control and not read_only,
                read_only=read_only,
                predicted=self.plan.predicted.model_dump(),
            )
            if cap_w is not None:
                header["power_limit_w"] = self.ready.get("power_limit_w")
            self.meter = IterationMeter(log, mark=client.mark, header=header)

    def close(self) -> None:
        """Write the last iterations (this rank only; no collective), uninstall, reset clocks."""
        if self.closed:
            return
        self.closed = True
        try:
            self._close_meter(wait_s=5.0)
        finally:
            self._release(close_overlap=True)

    def abort(self) -> None:
        """Stop after an error: write what is measured, uninstall, reset clocks, stop."""
        self._atexit()

    def _atexit(self) -> None:
        # At exit (the process group may be gone; nothing here needs it): write, reset clocks, stop.
        if not self.closed:
            self.closed = True
            try:
                self._close_meter(wait_s=2.0)
            finally:
                self._release()

    def _close_meter(self, wait_s: float) -> None:
        self._restore_signal_handlers()
        if self.auto is not None:  # the closed loop (runtime/closed_loop/auto.py) stops planning
            self.auto.stop()
        if self.meter is not None:
            self.meter.close(wait_s)
        if self.truth is not None:
            self.truth.close()  # warns when many instructions outlasted the truth's time

    def _release(self, close_overlap: bool = False) -> None:
        if self.patch is not None and self.framework_patch.installed_state() is self.patch:
            self.framework_patch.uninstall()
        if close_overlap:  # not after a failure or at exit: the engine's communicators may be gone
            self._close_overlap()
        if self.client is not None:
            self.client.close()
        if self.device is not None:
            self.device.close()

    def _close_overlap(self) -> None:
        if self.overlap_engine is not None:
            from kareus_megatron.runtime import overlap

            if overlap.get_engine() is self.overlap_engine:
                overlap.set_engine(None)
            self.overlap_engine = None

    # -- measurement-only reading --------------------------------------------------------------
    def _read_now(self) -> _Reading:
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.synchronize()
        except ImportError:  # pragma: no cover - the frameworks always have torch
            pass
        from kareus_megatron.hardware.measure import temperature_c

        return _Reading(time.monotonic(), float(self.device.energy_j()), temperature_c(self.device))

    # -- called by the patch (training thread) -----------------------------------------------
    def validate(self, plan: Plan | None, live: Any, source: str) -> None:
        """Check the plan against the live run before the first instruction; bind this rank.

        `live` is the patch's view of the run (megatron_patch.LiveRun, deepspeed_patch.LiveEngine).
        """
        if plan is not None:
            supported = tuple(self.ready.get("supported") or ()) or None
            device_gpu = self.ready.get("gpu")
            try:
                self.framework_patch.validate_plan(
                    plan,
                    live,
                    supported if self._clock_control else None,
                    device_gpu if self._clock_control else None,
                    source,
                )
                if self.truth is not None:
                    self.truth.bind(plan, live.pp_rank)  # this rank's per-instruction truth
            except Exception:
                if self.client is not None:
                    self.client.reset(timeout_s=2.0)
                raise
        if plan is not None and self.framework_patch is megatron_patch:
            self._setup_overlap(plan, live)  # DeepSpeed's validate_plan rejects nanobatch plans
        if self.meter is not None:  # comm_groups: the SM-limited communicators' costs (overlap/comm_groups.py)
            self.meter.set_stage(
                live.pp_rank,
                **live.layout(),
                comm_groups=self.comm_groups,  # the job, for report
                num_microbatches=live.num_microbatches,
                micro_batch_size=live.micro_batch_size,
            )
            if plan is not None and live.pp_rank < len(plan.stages):  # what the per-instruction columns name
                self.meter.set_plan(plan.stages[live.pp_rank].instructions)
            if self.framework_patch is megatron_patch:  # Megatron-LM's TensorBoard/W&B writers, where this rank has one
                self.meter.attach_sink(megatron_writers.attach(plan, self.source))

    def _setup_overlap(self, plan: Plan, live: megatron_patch.LiveRun) -> None:
        """With 2-nanobatch instructions: check the model has partitioned layers, start the engine.

        A user who called ``overlap.setup_overlap`` already keeps that engine. Called on every rank
        before the first instruction (the engine builds its communicators collectively).
        """
        if not any(i.nanobatches > 1 for s in plan.stages for i in s.instructions):
            return
        from kareus_megatron.runtime import overlap

        overlap.check_model_for_plan(live.modules, plan)  # PlanMismatchError for a standard model
        if not hooks.is_registered(overlap.get_engine().state.on_instruction):
            self.overlap_engine = overlap.setup_overlap(plan, micro_batch_size=plan.parallel.micro_batch_size)
        self.comm_groups = [c.to_dict() for c in overlap.get_engine().comm.group_infos] or None

    @property
    def _clock_control(self) -> bool:
        return self.client is not None and self.client.clock_control

    def iteration_begins(self, iteration: int) -> None:
        if self.meter is not None:
            self.meter.begin(iteration)

    def iteration_ends(self, iteration: int) -> None:
        if self.meter is not None:
            self.meter.end(iteration)

    def instruction_begins_unplanned(self, kind: str) -> None:
        """A compute instruction outside the plan (measurement only): mark a simulated device busy."""
        if self.simulation is not None:
            self.simulation.set_busy(True)

    def instruction_ends(self) -> None:
        if self.client is not None:
            self.client.instruction_ends()
        elif self.simulation is not None:
            self.simulation.set_busy(False)

    def instruction_callables(self) -> tuple[Callable[[int, int, int, str], None] | None, Callable[[], None]]:
        """What the patch calls at every instruction: (begins(iteration, index, mhz, kind) or None,
        ends()). With a clock controller these are the client's own methods (the shortest path), timed by
        the meter for the run log's per-instruction columns (runtime/measure/instruction_times.py)."""
        pair: tuple[Callable[[int, int, int, str], None] | None, Callable[[], None]]
        if self.client is not None:
            pair = self.client.instruction_begins, self.client.instruction_ends
            if self.truth is not None:  # the truth's busy power and time (the meter times the stretch too)
                pair = self.truth.callables(*pair)
        else:
            pair = None, self.instruction_ends
        return self.meter.instruction_callables(*pair) if self.meter is not None else pair

    def iteration_callables(self) -> tuple[Callable[[int], None], Callable[[int], None]]:
        """What the patch calls at every iteration boundary: the meter's own begin and end."""
        if self.meter is not None:
            return self.meter.begin, self.meter.end
        return self.iteration_begins, self.iteration_ends

    def switch_plan(self, plan: Plan) -> None:
        """Run `plan` (the same job's) from the next iteration on: the closed loop's switch (closed_loop/auto.py).

        Between iterations, on every rank at the same boundary (a 2-nanobatch plan sets up the overlap engine,
        collectively). A plan that does not fit the live run raises PlanMismatchError and the old one stays."""
        patch = self.patch
        if patch is not None and patch.validated and plan is not None:
            self.framework_patch.validate_plan(plan, patch.live, None, None, "the auto plan")
            if self.framework_patch is megatron_patch:
                self._setup_overlap(plan, patch.live)
        self.plan = plan
        if patch is not None:
            patch.switch_plan(plan)
            if self.meter is not None and patch.rank < len(plan.stages):  # the log's columns name the new plan
                self.meter.set_plan(plan.stages[patch.rank].instructions)
        if self.truth is not None:
            self.truth.bind(plan)

    def training_failed(self) -> None:
        """An exception left the schedule: reset clocks now (the next iteration re-applies them)."""
        if self.client is not None:
            self.client.reset(timeout_s=2.0)

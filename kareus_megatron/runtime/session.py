"""A runtime session: one plan executing in one training process (clock client + meter + patch).

The session opens the clock controller for this process's GPU, checks clock permission before
training (``on_error="fail"``: ClockControlError; ``"warn"``: a warning, default clocks), installs
the megatron-core patch, and closes everything on ``close()`` or at interpreter exit. The GPU index
is the local rank, mapped through CUDA_VISIBLE_DEVICES when that lists integer indices (NVML ignores
CUDA_VISIBLE_DEVICES).
"""

from __future__ import annotations

import atexit
import os
import warnings
from typing import Any, Literal

from kareus_megatron.errors import ClockControlError, ConfigError
from kareus_megatron.plan.io import plan_sha256
from kareus_megatron.plan.schema import Plan
from kareus_megatron.runtime import hooks, megatron_patch
from kareus_megatron.runtime.clock_client import ClockClient
from kareus_megatron.runtime.measurement import IterationMeter

OnError = Literal["fail", "warn"]


def local_rank_from_env() -> int:
    """LOCAL_RANK (torchrun, Megatron launchers) or 0."""
    raw = os.environ.get("LOCAL_RANK", "0")
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"LOCAL_RANK={raw!r} is not an integer") from None


def physical_gpu_index(local_index: int) -> int:
    """The NVML index of CUDA device `local_index`, honouring an integer CUDA_VISIBLE_DEVICES list."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if not visible:
        return local_index
    entries = [v.strip() for v in visible.split(",") if v.strip()]
    if all(e.isdigit() for e in entries) and local_index < len(entries):
        return int(entries[local_index])
    return local_index  # UUIDs / MIG: NVML order is assumed to match


def _cuda_event_factory() -> Any:
    try:
        import torch
    except ImportError:  # pragma: no cover
        return None
    if not torch.cuda.is_available():
        return None

    def make() -> Any:
        ev = torch.cuda.Event()
        ev.record()
        return ev

    return make


class RuntimeSession:
    """Runs `plan` in this process: validate, announce instructions, control clocks, measure."""

    def __init__(self, plan: Plan, *, source: str = "the plan", backend: str | None = None,
                 gpu: str | None = None, local_rank: int | None = None, log_path: str | None = None,
                 on_error: OnError = "fail", controller: Literal["process", "thread"] = "process",
                 clock_log: str | None = None) -> None:
        """Configure; nothing starts until `start()`."""
        if on_error not in ("fail", "warn"):
            raise ConfigError(f"--kareus-on-error {on_error!r} is not allowed; use fail or warn")
        self.plan = plan
        self.source = source
        self.backend = backend
        self.gpu = gpu
        self.local_rank = local_rank_from_env() if local_rank is None else local_rank
        self.log_path = log_path
        self.on_error = on_error
        self.controller = controller
        self.clock_log = clock_log if clock_log is not None else os.environ.get("KAREUS_CLOCK_LOG")
        self.client: ClockClient | None = None
        self.ready: dict[str, Any] = {}
        self.meter: IterationMeter | None = None
        self.patch: megatron_patch.PatchState | None = None
        self.overlap_engine: Any = None  # set up here when the plan runs 2 nanobatches
        self.closed = False

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> RuntimeSession:
        """Start the clock controller, check permission, install the patch."""
        from kareus_megatron.hardware.device import backend_from_env

        megatron_patch.check_megatron_core_version()
        backend = backend_from_env(self.backend)
        gpu = self.gpu or os.environ.get("KAREUS_GPU") or (self.plan.gpu if backend == "simulated" else None)
        index = physical_gpu_index(self.local_rank)
        client = ClockClient(event_factory=_cuda_event_factory())
        if self.controller == "thread":
            from kareus_megatron.hardware.device import open_gpu

            self.ready = client.start_thread(open_gpu(index, backend=backend, gpu=gpu), log_path=self.clock_log)
        else:
            self.ready = client.start_process(index, backend=backend, gpu=gpu, log_path=self.clock_log)
        self.client = client
        if self.ready.get("op") == "error":
            if self.on_error == "fail":
                client.close()
                raise ClockControlError(str(self.ready.get("message")))
            warnings.warn(f"kareus: {self.ready.get('message')}; training at default clocks", stacklevel=2)
        header = {"plan": self.source, "plan_sha256": plan_sha256(self.plan), "gpu": self.ready.get("gpu"),
                  "backend": backend, "clock_control": client.clock_control,
                  "predicted": self.plan.predicted.model_dump()}
        self.meter = IterationMeter(self.log_path, mark=client.mark, header=header)
        hooks.add_instruction_listener(self._on_instruction)
        self.patch = megatron_patch.install(self.plan, self, self.source)
        atexit.register(self._atexit)
        return self

    def close(self) -> None:
        """Publish the last iteration (collective: call on every rank), uninstall, reset clocks."""
        if self.closed:
            return
        self.closed = True
        try:
            if self.meter is not None:
                try:
                    self.meter.flush()
                finally:
                    self.meter.close()
        finally:
            hooks.remove_instruction_listener(self._on_instruction)
            if megatron_patch.installed_state() is self.patch:
                megatron_patch.uninstall()
            self._close_overlap()
            if self.client is not None:
                self.client.close()

    def _close_overlap(self) -> None:
        if self.overlap_engine is not None:
            from kareus_megatron.runtime import overlap

            if overlap.get_engine() is self.overlap_engine:
                overlap.set_engine(None)
            self.overlap_engine = None

    def abort(self) -> None:
        """Stop without the final collective (after an error): uninstall, reset clocks, stop."""
        self._atexit()
        if megatron_patch.installed_state() is self.patch:
            megatron_patch.uninstall()

    def _atexit(self) -> None:
        # At exit the process group may be gone: no collective, just reset clocks and stop.
        if self.closed:
            return
        self.closed = True
        hooks.remove_instruction_listener(self._on_instruction)
        if self.client is not None:
            self.client.close()

    # -- called by the patch (training thread) -----------------------------------------------
    def validate(self, plan: Plan, live: megatron_patch.LiveRun, source: str) -> None:
        """Check the plan against the live run before the first instruction; bind this rank."""
        supported = tuple(self.ready.get("supported") or ()) or None
        device_gpu = self.ready.get("gpu")
        try:
            megatron_patch.validate_plan(plan, live, supported if self._clock_control else None,
                                         device_gpu if self._clock_control else None, source)
        except Exception:
            if self.client is not None:
                self.client.reset(timeout_s=2.0)
            raise
        if self.meter is not None:
            self.meter.pp_rank = live.pp_rank
        self._setup_overlap(plan, live)

    def _setup_overlap(self, plan: Plan, live: megatron_patch.LiveRun) -> None:
        """With 2-nanobatch instructions: check the model has partitioned layers, start the engine.

        A user who called ``overlap.setup_overlap`` already keeps that engine. Called on every rank
        before the first instruction (the engine builds its communicators collectively).
        """
        if not any(i.nanobatches > 1 for s in plan.stages for i in s.instructions):
            return
        from kareus_megatron.runtime import overlap

        overlap.check_model_for_plan(live.modules, plan)  # PlanMismatchError for a standard model
        if hooks.is_registered(overlap.get_engine().state.on_instruction):
            return
        self.overlap_engine = overlap.setup_overlap(plan, micro_batch_size=plan.parallel.micro_batch_size)

    @property
    def _clock_control(self) -> bool:
        return self.client is not None and self.client.clock_control

    def iteration_begins(self, iteration: int) -> None:
        if self.meter is not None:
            self.meter.begin(iteration)

    def iteration_ends(self, iteration: int) -> None:
        if self.meter is not None:
            self.meter.end(iteration)

    def instruction_ends(self) -> None:
        if self.client is not None:
            self.client.instruction_ends()

    def training_failed(self) -> None:
        """An exception left the schedule: reset clocks now (the next iteration re-applies them)."""
        if self.client is not None:
            self.client.reset(timeout_s=2.0)

    def _on_instruction(self, event: hooks.InstructionEvent) -> None:
        if self.client is not None:
            self.client.instruction_begins(event.iteration, event.index, event.instruction.sm_clock_mhz,
                                           event.instruction.kind)

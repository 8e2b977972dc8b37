"""Run a kareus plan in a DeepSpeed pipeline-parallel script (PipelineModule + PipelineEngine, 0.19.x).

One line, before ``deepspeed.initialize``, in one of three forms:

    import kareus_megatron.deepspeed as kareus
    kareus.install("plans/kareus-03.json", log_path="runs/kareus-03/measurement.jsonl")
    config = kareus.from_config("ds_config.json")   # reads and removes the config's "kareus" section
    kareus.install_from_env()                       # KAREUS_PLAN, KAREUS_LOG (set by launch/kareus_launch.py)

The config section: ``"kareus": {"plan": PATH, "log": PATH, "on_error": "fail"|"warn"}``; a
``"plan"`` that is a ``kareus plan`` output directory takes ``"point"`` (fastest, min-energy or NN)
and ``"method"`` (default kareus). DeepSpeed 0.19.8 ignores unknown top-level keys, but
``from_config`` returns the config without the section, so no DeepSpeed version can reject it. Without
a plan (``install(None, log_path=...)``) the run is only measured, at the driver's default clocks.

Each step (``train_batch``) is one measured iteration; rank 0 appends it to the log in the runtime's
JSONL format (``runtime.measurement``), which ``kareus report`` and ``kareus compare`` read. Call
``uninstall()`` (or ``session.close()``) on every rank at the end: it writes the last step and resets
clocks; at interpreter exit clocks are reset anyway.
"""

from __future__ import annotations

import atexit
import json
import os
import time
import warnings
from pathlib import Path
from typing import Any, Literal

from kareus_megatron.errors import ClockControlError, ConfigError, PlanError
from kareus_megatron.plan.io import load_plan, plan_sha256
from kareus_megatron.plan.schema import Plan
from kareus_megatron.runtime import deepspeed_patch, hooks
from kareus_megatron.runtime.measurement import IterationMeter

OnError = Literal["fail", "warn"]
CONFIG_KEYS = ("plan", "log", "on_error", "point", "method")


def _cuda_event_factory() -> Any:
    """A maker of recorded CUDA events (GPU-aligned instruction boundaries), or None on CPU."""
    try:
        import torch
    except ImportError:  # pragma: no cover - DeepSpeed always has torch
        return None
    if not torch.cuda.is_available():
        return None

    def make() -> Any:
        ev = torch.cuda.Event()
        ev.record()
        return ev

    return make


class _Reading:
    """A measurement point read at once on the training thread (measurement-only sessions)."""

    def __init__(self, t: float, energy_j: float) -> None:
        self.t, self.energy_j = t, energy_j

    def wait(self, timeout: float | None = None) -> bool:
        return True


class DeepSpeedSession:
    """`plan` running in this DeepSpeed process: clock client, per-step meter, PipelineEngine patch."""

    def __init__(self, plan: Plan | None, *, source: str = "the plan", backend: str | None = None,
                 gpu: str | None = None, local_rank: int | None = None, log_path: str | None = None,
                 on_error: OnError = "fail", controller: Literal["process", "thread"] = "process",
                 clock_log: str | None = None) -> None:
        """Configure; nothing starts until `start()`."""
        from kareus_megatron.runtime.session import local_rank_from_env

        if on_error not in ("fail", "warn"):
            raise ConfigError(f"on_error {on_error!r} is not allowed; use fail or warn")
        if controller not in ("process", "thread"):
            raise ConfigError(f"controller {controller!r} is not allowed; use process or thread")
        self.plan, self.source, self.backend, self.gpu = plan, source, backend, gpu
        self.local_rank = local_rank_from_env() if local_rank is None else local_rank
        self.log_path, self.on_error, self.controller = log_path, on_error, controller
        self.clock_log = clock_log if clock_log is not None else os.environ.get("KAREUS_CLOCK_LOG")
        self.client: Any = None
        self.device: Any = None  # measurement-only: the device, read on the training thread
        self.ready: dict[str, Any] = {}
        self.meter: IterationMeter | None = None
        self.patch: deepspeed_patch.PatchState | None = None
        self.closed = False

    def start(self) -> DeepSpeedSession:
        """Open the device (and, with a plan, the clock controller), then patch DeepSpeed."""
        from kareus_megatron.hardware.device import backend_from_env, open_gpu
        from kareus_megatron.runtime.session import physical_gpu_index

        deepspeed_patch.check_deepspeed_version()
        backend = backend_from_env(self.backend)
        gpu = self.gpu or os.environ.get("KAREUS_GPU") or (
            self.plan.gpu if backend == "simulated" and self.plan is not None else None)
        index = physical_gpu_index(self.local_rank)
        header: dict[str, Any] = {"plan": None if self.plan is None else self.source, "backend": backend,
                                  "framework": "deepspeed"}
        if self.plan is None:
            self.device = open_gpu(index, backend=backend, gpu=gpu)
            header.update(gpu=self.device.spec.name, clock_control=False)
            self.meter = IterationMeter(self.log_path, mark=self._read_now, header=header)
        else:
            from kareus_megatron.runtime.clock_controller import ClockClient

            client = ClockClient(event_factory=_cuda_event_factory())
            self.client = client
            if self.controller == "thread":
                self.ready = client.start_thread(open_gpu(index, backend=backend, gpu=gpu), log_path=self.clock_log)
            else:
                self.ready = client.start_process(index, backend=backend, gpu=gpu, log_path=self.clock_log)
            if self.ready.get("op") == "error":
                if self.on_error == "fail":
                    client.close()
                    raise ClockControlError(str(self.ready.get("message")))
                warnings.warn(f"kareus: {self.ready.get('message')}; training at default clocks", stacklevel=2)
            header.update(plan_sha256=plan_sha256(self.plan), gpu=self.ready.get("gpu"),
                          clock_control=client.clock_control, predicted=self.plan.predicted.model_dump())
            self.meter = IterationMeter(self.log_path, mark=client.mark, header=header)
            hooks.add_instruction_listener(self._on_instruction)
        try:
            self.patch = deepspeed_patch.install(self.plan, self, self.source)
        except BaseException:
            self._release()
            raise
        atexit.register(self._atexit)
        return self

    def close(self) -> None:
        """Publish the last step (collective: call on every rank), unpatch, reset clocks."""
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
            self._release()

    def _release(self) -> None:
        hooks.remove_instruction_listener(self._on_instruction)
        if self.patch is not None and deepspeed_patch.installed_state() is self.patch:
            deepspeed_patch.uninstall()
        if self.client is not None:
            self.client.close()
        if self.device is not None:
            self.device.close()

    def _atexit(self) -> None:
        # At exit the process group may be gone: no collective, just reset clocks and stop.
        if not self.closed:
            self.closed = True
            self._release()

    # -- measurement-only reading --------------------------------------------------------------
    def _read_now(self) -> _Reading:
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.synchronize()
        except ImportError:  # pragma: no cover - DeepSpeed always has torch
            pass
        return _Reading(time.monotonic(), float(self.device.energy_j()))

    # -- called by the patch (training thread) --------------------------------------------------
    def validate(self, plan: Plan | None, live: deepspeed_patch.LiveEngine, source: str) -> None:
        """Check the plan against the engine before the first step; bind the meter to this stage."""
        if plan is not None:
            control = self.client is not None and self.client.clock_control
            supported = tuple(self.ready.get("supported") or ()) if control else None
            try:
                deepspeed_patch.validate_plan(plan, live, supported or None,
                                              self.ready.get("gpu") if control else None, source)
            except Exception:
                if self.client is not None:
                    self.client.reset(timeout_s=2.0)
                raise
        if self.meter is not None:
            self.meter.pp_rank = live.stage_id

    def iteration_begins(self, iteration: int) -> None:
        if self.meter is not None:
            self.meter.begin(iteration)

    def iteration_ends(self, iteration: int) -> None:
        if self.meter is not None:
            self.meter.end(iteration)

    def instruction_begins_unplanned(self, kind: str) -> None:
        set_busy = getattr(self.device, "set_busy", None)
        if set_busy is not None:
            set_busy(True)

    def instruction_ends(self) -> None:
        if self.client is not None:
            self.client.instruction_ends()
        elif self.device is not None and hasattr(self.device, "set_busy"):
            self.device.set_busy(False)

    def training_failed(self) -> None:
        if self.client is not None:
            self.client.reset(timeout_s=2.0)

    def _on_instruction(self, event: hooks.InstructionEvent) -> None:
        if self.client is not None:
            self.client.instruction_begins(event.iteration, event.index, event.instruction.sm_clock_mhz,
                                           event.instruction.kind)


_session: DeepSpeedSession | None = None


def _resolve_plan(plan: Plan | str | os.PathLike[str], point: str = "fastest",
                  method: str = "kareus") -> tuple[Plan, str]:
    if isinstance(plan, Plan):
        return plan, "the plan"
    path = Path(plan)
    if path.is_dir():
        frontier = path / "frontier.json"
        try:
            doc = json.loads(frontier.read_text())
            pts = doc["methods"][method]["points"]
        except (OSError, ValueError, KeyError, TypeError):
            raise PlanError(f"{path} is not a kareus plan directory with {method} points "
                            f"({frontier} missing or without them)") from None
        if point in ("fastest", "min-energy"):
            key = (lambda p: (p["time_s"], p["energy_j"])) if point == "fastest" else (
                lambda p: (p["energy_j"], p["time_s"]))
            i = min(range(len(pts)), key=lambda k: key(pts[k]))
        elif str(point).isascii() and str(point).isdigit() and int(point) < len(pts):
            i = int(point)
        else:
            raise ConfigError(f"point {point!r} is not valid for {method}: use fastest, min-energy or "
                              f"00..{len(pts) - 1:02d}")
        path = path / (pts[i].get("plan") or f"plans/{method}-{i:02d}.json")
    return load_plan(path), str(path)


def install(plan: Plan | str | os.PathLike[str] | None, *, log_path: str | os.PathLike[str] | None = None,
            on_error: OnError = "fail", backend: str | None = None, gpu: str | None = None,
            local_rank: int | None = None, controller: Literal["process", "thread"] = "process",
            clock_log: str | None = None, point: str = "fastest", method: str = "kareus") -> DeepSpeedSession:
    """Run `plan` (a Plan, plan file or `kareus plan` directory; None = measure only); return the session."""
    global _session
    resolved, source = (None, "no plan") if plan is None else _resolve_plan(plan, point, method)
    if _session is not None:
        _session.close()
    _session = DeepSpeedSession(resolved, source=source, backend=backend, gpu=gpu, local_rank=local_rank,
                                log_path=os.fspath(log_path) if log_path else None, on_error=on_error,
                                controller=controller, clock_log=clock_log).start()
    return _session


def uninstall() -> None:
    """Close the installed session (collective: call on every rank); no-op when none is installed."""
    global _session
    if _session is not None:
        _session.close()
        _session = None


def current_session() -> DeepSpeedSession | None:
    """The session installed by `install`, `from_config` or `install_from_env`, if any."""
    return _session


def from_config(config: dict[str, Any] | str | os.PathLike[str], **kwargs: Any) -> dict[str, Any]:
    """Install from the config's "kareus" section (if any) and return the DeepSpeed config without it."""
    if not isinstance(config, dict):
        p = Path(config)
        try:
            config = json.loads(p.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot read DeepSpeed config {p}: {e}") from None
        if not isinstance(config, dict):
            raise ConfigError(f"DeepSpeed config {p} is not a JSON object")
    cleaned = {k: v for k, v in config.items() if k != "kareus"}
    section = config.get("kareus")
    if section is None:
        return cleaned
    if not isinstance(section, dict):
        raise ConfigError(f'the "kareus" config section must be an object with keys {", ".join(CONFIG_KEYS)}')
    unknown = sorted(set(section) - set(CONFIG_KEYS))
    if unknown:
        raise ConfigError(f'unknown key(s) {", ".join(unknown)} in the "kareus" config section; '
                          f'allowed: {", ".join(CONFIG_KEYS)}')
    install(section.get("plan"), log_path=section.get("log"), on_error=section.get("on_error", "fail"),
            point=str(section.get("point", "fastest")), method=section.get("method", "kareus"), **kwargs)
    return cleaned


def install_from_env(**kwargs: Any) -> DeepSpeedSession | None:
    """Install from KAREUS_PLAN / KAREUS_LOG / KAREUS_ON_ERROR; None when neither variable is set."""
    plan, log_path = os.environ.get("KAREUS_PLAN") or None, os.environ.get("KAREUS_LOG") or None
    if plan is None and log_path is None:
        return None
    return install(plan, log_path=log_path, on_error=os.environ.get("KAREUS_ON_ERROR", "fail"), **kwargs)  # type: ignore[arg-type]

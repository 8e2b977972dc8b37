"""The DeepSpeed 0.18.x/0.19.x patch: every planned PipelineEngine compute instruction is announced before it runs.

DeepSpeed's ``PipelineEngine._exec_schedule`` dispatches each ``PipeInstruction`` through the class dict
``PipelineEngine._INSTRUCTION_MAP`` (instruction class -> the original ``_exec_*`` function), so
patching ``PipelineEngine._exec_forward_pass`` has no effect: the map entries of ``ForwardPass`` and
``BackwardPass`` are wrapped instead, and ``PipelineEngine.train_batch`` marks the *step* (one
iteration: ``gradient_accumulation_steps`` micro-batches through ``TrainSchedule``). Instructions carry
only a pipeline ``buffer_id``; the microbatch is counted per step (TrainSchedule runs each stage's
forwards, and its backwards, in microbatch order; buffer = microbatch mod the number of buffers, which
the wrappers check). ``eval_batch`` (InferenceSchedule) runs outside a step and is left alone.

Before the first step the plan is checked against the engine (stages, this stage, micro-batches per
step, micro-batch size, data-parallel size, and each stage's instruction order against DeepSpeed's own
TrainSchedule); every mismatch is listed in one PlanMismatchError, raised before any instruction runs.

Only engines that dispatch through ``PipelineEngine._INSTRUCTION_MAP`` and run ``TrainSchedule`` are
followed. DeepSpeed 0.19's ``DualPipeVEngine`` (``deepspeed/runtime/pipe/dualpipev.py``, chosen by
``deepspeed.initialize`` for a ``DualPipeVModule``) builds its own ``_INSTRUCTION_MAP`` at import
(phase-aware ``_exec_forward_pass(buffer_id, phase)``, ``CommitP2P``) and runs ``DualPipeVSchedule``
(``_train_schedule``): its first ``train_batch`` is refused with one InfeasibleConfigError, in every
mode, before any instruction runs. DeepSpeed 0.18.9 has the same ten-entry map and the same
TrainSchedule as 0.19.8 (it builds TrainSchedule inside ``train_batch``; no ``_train_schedule`` hook, no
DualPipeV), so one patch serves both series.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kareus_megatron.errors import InfeasibleConfigError, UnsupportedVersionError
from kareus_megatron.plan.schema import Plan
from kareus_megatron.runtime.frameworks.patch_common import (
    BasePatchState,
    PatchSlot,
    compare,
    device_mismatches,
    raise_mismatches,
)
from kareus_megatron.versions import is_supported, supported_series, unsupported_message
from kareus_megatron.vocab import FRAMEWORK_DEEPSPEED

log = logging.getLogger(__name__)

FRAMEWORK = FRAMEWORK_DEEPSPEED  # the plan's framework this patch runs


def deepspeed_version() -> str:
    """The installed DeepSpeed version (UnsupportedVersionError when DeepSpeed is missing)."""
    try:
        from importlib.metadata import version

        return version("deepspeed")
    except Exception:
        raise UnsupportedVersionError(
            f"DeepSpeed is not installed; pip install deepspeed=={supported_series('deepspeed')[-1].tested}"
        ) from None


def check_deepspeed_version(v: str | None = None) -> str:
    """Return the DeepSpeed version, or raise UnsupportedVersionError naming the supported series."""
    v = deepspeed_version() if v is None else v
    if not is_supported("deepspeed", v):
        raise UnsupportedVersionError(unsupported_message("deepspeed", v, "the kareus pipeline patch"))
    return v


def check_version() -> str:
    """The framework check a runtime session runs before it starts anything (DeepSpeed's version)."""
    return check_deepspeed_version()


# ---- the engine's facts and validation --------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LiveEngine:
    """What the running PipelineEngine looks like; None = not known."""

    stages: int
    stage_id: int
    micro_batches: int
    micro_batch_size: int | None = None
    dp: int | None = None

    @property
    def pp_rank(self) -> int:
        """The pipeline rank (the stage id), as the runtime session names it."""
        return self.stage_id

    @property
    def num_microbatches(self) -> int:
        """Microbatches per iteration, as megatron_patch.LiveRun names them."""
        return self.micro_batches

    def layout(self) -> dict[str, int | None]:
        """Parallel sizes for the run log's header (None: not known)."""
        return {"pp": self.stages, "tp": None, "cp": None, "dp": self.dp}


def engine_problem(engine_class: type) -> str | None:
    """Why the patch cannot follow an engine of `engine_class` (None: it runs PipelineEngine's TrainSchedule)."""
    from deepspeed.runtime.pipe.engine import PipelineEngine

    name = engine_class.__name__
    try:  # DeepSpeed 0.19+; 0.18 has no DualPipeV
        from deepspeed.runtime.pipe.dualpipev import DualPipeVEngine
    except ImportError:
        DualPipeVEngine = None  # noqa: N806
    if DualPipeVEngine is not None and issubclass(engine_class, DualPipeVEngine):
        return (
            f"{name} runs DeepSpeed's DualPipeV schedule (DualPipeVSchedule, with its own instruction map), "
            "which kareus does not plan; kareus runs PipelineEngine's TrainSchedule: build the model as a "
            "deepspeed.pipe.PipelineModule, not a DualPipeVModule"
        )
    own_map = getattr(engine_class, "_INSTRUCTION_MAP", None) is not PipelineEngine._INSTRUCTION_MAP
    hook = "_train_schedule"  # 0.19: the schedule a train_batch runs (0.18: none, TrainSchedule built inline)
    own_schedule = getattr(engine_class, hook, None) is not getattr(PipelineEngine, hook, None)
    if own_map or own_schedule:
        what = "its own instruction map" if own_map else "its own train schedule"
        return (
            f"{name} overrides PipelineEngine with {what}, so kareus cannot follow its instructions; "
            "kareus runs PipelineEngine's TrainSchedule only"
        )
    return None


def live_engine(engine: Any) -> LiveEngine:
    """Read stages, stage id, micro-batches per step, micro-batch size and DP size from `engine`.

    An engine the patch cannot follow (``engine_problem``) raises InfeasibleConfigError.
    """
    problem = engine_problem(type(engine))
    if problem is not None:
        raise InfeasibleConfigError(problem)
    grid = getattr(engine, "grid", None)
    dp = getattr(grid, "data_parallel_size", None)
    try:
        mbs = int(engine.train_micro_batch_size_per_gpu())
    except Exception:
        mbs = None
    return LiveEngine(
        stages=int(engine.num_stages),
        stage_id=int(engine.stage_id),
        micro_batches=int(engine.micro_batches),
        micro_batch_size=mbs,
        dp=int(dp) if isinstance(dp, int) else None,
    )


def train_schedule_order(micro_batches: int, stages: int, stage_id: int) -> list[tuple[str, int, int]]:
    """(kind, microbatch, buffer_id) of DeepSpeed's TrainSchedule compute instructions on `stage_id`.

    Walks DeepSpeed's own ``TrainSchedule`` (pure Python) and counts forwards and backwards.
    """
    from deepspeed.runtime.pipe import schedule

    sched = schedule.TrainSchedule(micro_batches=micro_batches, stages=stages, stage_id=stage_id)
    out: list[tuple[str, int, int]] = []
    count = {"forward": 0, "backward": 0}
    for step in sched:
        for cmd in step:
            kind = (
                "forward"
                if type(cmd) is schedule.ForwardPass
                else "backward"
                if type(cmd) is schedule.BackwardPass
                else None
            )
            if kind is not None:
                out.append((kind, count[kind], int(cmd.buffer_id)))
                count[kind] += 1
    return out


def plan_mismatches(
    plan: Plan, live: LiveEngine, supported_clocks_mhz: tuple[int, ...] | None = None, device_gpu: str | None = None
) -> list[str]:
    """Every way `plan` does not fit the DeepSpeed engine `live` (empty when it fits)."""
    par = plan.parallel
    out: list[str] = []
    cmp = functools.partial(compare, out, side="engine")

    cmp("pipeline stages", par.pp, live.stages)
    cmp("micro-batches per step (gradient_accumulation_steps)", par.num_microbatches, live.micro_batches)
    cmp("micro-batch size (train_micro_batch_size_per_gpu)", par.micro_batch_size, live.micro_batch_size)
    cmp("data parallel size", par.dp, live.dp)
    if par.vp != 1:
        out.append(f"virtual pipeline chunks: plan {par.vp}, DeepSpeed runs 1")
    if any(i.nanobatches > 1 for s in plan.stages for i in s.instructions):
        out.append(
            "nanobatches: the plan splits microbatches into 2 nanobatches, DeepSpeed runs them whole "
            "(no overlap engine); use a perseus or kareus plan"
        )
    if plan.framework != FRAMEWORK:
        out.append(f"framework: plan {plan.framework}, engine deepspeed (plan with kareus plan --framework deepspeed)")
    if not out and live.stage_id < len(plan.stages):
        want = [(k, mb) for k, mb, _ in train_schedule_order(live.micro_batches, live.stages, live.stage_id)]
        have = [(i.kind, i.microbatch) for i in plan.stages[live.stage_id].instructions]
        if have != want:
            at = next(k for k, (a, b) in enumerate(zip(have + [None] * len(want), want + [None] * len(have))) if a != b)
            out.append(
                f"instruction order of stage {live.stage_id} differs from DeepSpeed's TrainSchedule at "
                f"position {at} (plan {have[at] if at < len(have) else 'nothing'}, "
                f"TrainSchedule {want[at] if at < len(want) else 'nothing'})"
            )
    out.extend(device_mismatches(plan, live.stage_id, supported_clocks_mhz, device_gpu))
    return out


def validate_plan(
    plan: Plan,
    live: LiveEngine,
    supported_clocks_mhz: tuple[int, ...] | None = None,
    device_gpu: str | None = None,
    source: str = "the plan",
) -> None:
    """Raise one PlanMismatchError listing every mismatch between `plan` and the engine."""
    raise_mismatches(
        plan_mismatches(plan, live, supported_clocks_mhz, device_gpu),
        f"{source} does not match this DeepSpeed pipeline (stage {live.stage_id})",
        "Regenerate the plan for this configuration (kareus plan --framework deepspeed) or fix the config.",
    )


# ---- the patch ------------------------------------------------------------------------------


class PatchState(BasePatchState):
    """Per-process state of the installed patch; `session` gets validate/iteration/instruction calls.

    With ``plan=None`` (measurement only, e.g. the Megatron-LM baseline) steps and compute
    instructions are still reported to the session, but nothing is announced to the hooks.
    """

    def __init__(self, plan: Plan | None, session: Any, source: str = "the plan") -> None:
        super().__init__(plan, session, source)
        self.stage_id = 0
        self.num_buffers = 0
        self.count = {"forward": 0, "backward": 0}
        self.buffer_mismatches = 0

    def bind(self, live: LiveEngine) -> None:
        self.stage_id = live.stage_id
        from deepspeed.runtime.pipe import schedule

        self.num_buffers = schedule.TrainSchedule(
            micro_batches=live.micro_batches, stages=live.stages, stage_id=live.stage_id
        ).num_pipe_buffers()
        self.plan_entries(live.stage_id, lambda i: (i.kind, i.microbatch))

    def begin_iteration(self) -> None:
        super().begin_iteration()
        self.count = {"forward": 0, "backward": 0}

    def instruction(self, kind: str, buffer_id: int) -> None:
        """Count the microbatch of this compute instruction and announce it (training thread)."""
        mb = self.count[kind]
        self.count[kind] += 1
        if self.num_buffers and buffer_id != mb % self.num_buffers:
            self.buffer_mismatches += 1
            if self.buffer_mismatches == 1:
                log.warning(
                    "kareus: %s buffer %d is not microbatch %d's buffer (%d buffers); the engine does "
                    "not run TrainSchedule, clocks may follow the wrong microbatches",
                    kind,
                    buffer_id,
                    mb,
                    self.num_buffers,
                )
        if not self.announce((kind, mb)):
            self.position += 1
            self.session.instruction_begins_unplanned(kind)


_slot = PatchSlot()  # the installed state and the PipelineEngine entries it replaced


def installed_state() -> PatchState | None:
    """The live patch state, or None when the patch is not installed."""
    return _slot.state


def _wrap_compute(kind: str, fn: Any) -> Any:
    @functools.wraps(fn)
    def exec_compute(self: Any, *args: Any, **kwargs: Any) -> Any:
        st = _slot.state
        if st is None or not st.active:
            return fn(self, *args, **kwargs)
        buffer_id = kwargs.get("buffer_id", args[0] if args else -1)
        st.instruction(kind, int(buffer_id))
        try:
            return fn(self, *args, **kwargs)
        finally:
            st.instruction_ends()

    return exec_compute


def _wrap_train_batch(fn: Any) -> Any:
    @functools.wraps(fn)
    def train_batch(self: Any, *args: Any, **kwargs: Any) -> Any:
        st = _slot.state
        if st is None or st.active:
            return fn(self, *args, **kwargs)
        return st.run_iteration(lambda: live_engine(self), lambda: fn(self, *args, **kwargs))

    return train_batch


def install(plan: Plan | None, session: Any, source: str = "the plan") -> PatchState:
    """Patch DeepSpeed's PipelineEngine for `plan` (None: measurement only); returns the state."""
    check_deepspeed_version()
    from deepspeed.runtime.pipe import schedule
    from deepspeed.runtime.pipe.engine import PipelineEngine

    imap = PipelineEngine._INSTRUCTION_MAP
    replacements: list[tuple[Any, Any, Callable[[Any], Any]]] = [
        (imap, schedule.ForwardPass, functools.partial(_wrap_compute, "forward")),
        (imap, schedule.BackwardPass, functools.partial(_wrap_compute, "backward")),
        (PipelineEngine, "train_batch", _wrap_train_batch),
    ]
    state: PatchState = _slot.install(replacements, lambda: PatchState(plan, session, source))
    return state


def uninstall() -> None:
    """Restore DeepSpeed's original map entries and train_batch (no-op when not installed)."""
    _slot.uninstall()

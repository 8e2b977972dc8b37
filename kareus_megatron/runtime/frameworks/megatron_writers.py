"""Megatron-LM's TensorBoard and W&B writers: each iteration's kareus figures next to Megatron's own metrics.

Facts from Megatron-LM core_v0.16.1 and core_v0.19.0 (``megatron/training/global_vars.py``,
``megatron/training/training.py``), which agree on all of them:

- ``get_tensorboard_writer()`` is a ``torch.utils.tensorboard.SummaryWriter`` when ``--tensorboard-dir``
  is given (and the tensorboard package is installed), ``get_wandb_writer()`` is the ``wandb`` module
  after ``wandb.init`` when ``--wandb-project`` (with ``--wandb-exp-name``) is given; both are made on
  the last rank only (``args.rank == args.world_size - 1``) and are None elsewhere.
- ``train()`` sets ``args.curr_iteration = iteration`` before ``train_step(..., iteration=iteration)``
  and ``training_log`` writes that step's metrics at ``iteration + 1``; ``iteration`` starts at
  ``args.iteration``, the checkpoint's, so it continues across a resume.
- Scalars go out as ``writer.add_scalar(tag, value, iteration)`` and ``wandb_writer.log({tag: value},
  iteration)``; ``pretrain`` calls ``wandb_writer.finish()`` after training, and flushes the
  SummaryWriter at the end of ``train()``.

``attach`` looks the writers up lazily, at the first training call, and only when
``megatron.training.global_vars`` is already imported (the megatron-core API path never imports it);
without a writer on this rank there is no sink. The *step* of kareus iteration i is Megatron's number
for it (``curr_iteration + 1`` read on the training thread as it ends). Per iteration, under TAGS:
this rank's GPU energy (J) and average power (W), measured and planned iteration time (s), the plan's
predicted job energy (J), and the plan point's index; the plan point is also written once as text
(TensorBoard ``add_text``, W&B config). The job's measured energy needs every rank's figure and is
left to ``kareus report``.

TensorBoard gets each iteration from the log writer thread as it resolves, with its explicit step
(SummaryWriter only queues an event). W&B cannot take that: ``wandb.log`` is not thread-safe and writes
only its current or next step, so the training thread hands over at most one resolved iteration each
time an iteration ends, logged at Megatron's step for the iteration now ending (the one its
training_log writes next) with ``kareus/iteration`` = its own step, which ``define_metric`` makes the
x-axis of every kareus chart. W&B thus trails by an iteration or two, and the iterations still pending
when Megatron finishes its wandb run are only in TensorBoard and the run log. A writer that raises is
warned about once and not used again; nothing here waits or touches the GPU.
"""

from __future__ import annotations

import logging
import re
import sys
from collections import deque
from pathlib import Path
from typing import Any

from kareus_megatron.plan.io import plan_sha256
from kareus_megatron.plan.schema import Plan

log = logging.getLogger(__name__)

GLOBAL_VARS = "megatron.training.global_vars"
PREFIX = "kareus/"
STEP_METRIC = PREFIX + "iteration"  # W&B only: the x-axis of every kareus/ chart
TAGS = {
    "gpu_energy_j": PREFIX + "gpu_energy_j",  # this rank's GPU, J per iteration
    "gpu_power_w": PREFIX + "gpu_power_w",  # its average power over the iteration, W
    "iteration_time_s": PREFIX + "iteration_time_s",  # measured on this rank, s
    "planned_iteration_time_s": PREFIX + "planned_iteration_time_s",
    "planned_job_energy_j": PREFIX + "planned_job_energy_j",  # every GPU of the job, J per iteration
    "plan_point": PREFIX + "plan_point",  # NN of the plan file NAME-NN.json (absent for other names)
}
TEXT_TAG = PREFIX + "plan"
_POINT_RE = re.compile(r"(?P<name>.+)-(?P<index>\d+)")


def plan_point(source: str) -> tuple[str, int | None]:
    """(name, index) of the plan file `source`: ``plans/kareus-03.json`` -> ("kareus-03", 3)."""
    stem = Path(source).stem if source else ""
    m = _POINT_RE.fullmatch(stem)
    return stem, (int(m.group("index")) if m else None)


def plan_text(plan: Plan, source: str) -> str:
    """One line naming the plan point: file name, method, index, path and plan sha256 (first 12 digits)."""
    name, index = plan_point(source)
    point = f", point {index}" if index is not None else ""
    return (
        f"{name or 'plan'} (method {plan.method}{point}; {source}; plan_sha256 {plan_sha256(plan)[:12]}; "
        f"predicted {plan.predicted.iteration_time_s:g} s, {plan.predicted.iteration_energy_j:g} J per iteration)"
    )


class MegatronWriters:
    """The IterationSink (runtime/measure/measurement.py) that copies each iteration to Megatron's writers."""

    def __init__(self, tensorboard: Any, wandb: Any, args: Any, plan: Plan, source: str) -> None:
        """`tensorboard`/`wandb`: Megatron's writers (either may be None); `args`: Megatron's args or None."""
        self._tb = tensorboard
        self._wandb = wandb
        self._args = args
        base = getattr(args, "iteration", 0)
        self._base = base if isinstance(base, int) and not isinstance(base, bool) else 0
        self._planned = {
            "planned_iteration_time_s": plan.predicted.iteration_time_s,
            "planned_job_energy_j": plan.predicted.iteration_energy_j,
        }
        _, index = plan_point(source)
        if index is not None:
            self._planned["plan_point"] = float(index)
        self._text = plan_text(plan, source)
        self._steps: dict[int, int] = {}  # kareus iteration -> Megatron step (set on the training thread)
        self._pending: deque[tuple[int, dict[str, float]]] = deque()  # W&B: resolved, not yet logged
        self._wandb_step = -1  # the last Megatron step a kareus row went to
        self._last_step: int | None = None
        self._announced = False

    # -- the writers, each disabled after its first failure ------------------------------------
    def _call(self, which: str, method: str, *args: Any, **kwargs: Any) -> bool:
        writer = self._tb if which == "tensorboard" else self._wandb
        if writer is None:
            return False
        try:
            getattr(writer, method)(*args, **kwargs)
            return True
        except Exception as e:  # the writer's own problem: warn once, keep training
            log.warning(
                "kareus: Megatron's %s writer failed (%s: %s); no more kareus figures go to it",
                which,
                type(e).__name__,
                e,
            )
            if which == "tensorboard":
                self._tb = None
            else:
                self._wandb = None
            return False

    def _wandb_alive(self) -> bool:
        """Whether the W&B run still takes logs (the wandb module's ``run`` is None after ``finish``)."""
        return self._wandb is not None and getattr(self._wandb, "run", True) is not None

    def _announce(self, step: int) -> None:
        """The plan point as text, once (training thread), and W&B's x-axis for the kareus charts."""
        self._announced = True
        self._call("tensorboard", "add_text", TEXT_TAG, self._text, step)
        if self._wandb_alive():
            self._call("wandb", "define_metric", STEP_METRIC)
            self._call("wandb", "define_metric", PREFIX + "*", step_metric=STEP_METRIC)
            config = getattr(self._wandb, "config", None)
            if config is not None:
                try:
                    config.update({TEXT_TAG: self._text}, allow_val_change=True)
                except Exception as e:
                    log.warning("kareus: could not record the plan in the W&B config (%s)", e)

    # -- IterationSink -------------------------------------------------------------------------
    def step_of(self, iteration: int) -> int:
        """Megatron's iteration number for kareus iteration `iteration` ending now (training thread)."""
        current = getattr(self._args, "curr_iteration", None)
        if isinstance(current, int) and not isinstance(current, bool):
            return current + 1
        return self._base + iteration + 1

    def iteration_ended(self, iteration: int) -> None:
        """Training thread: note the iteration's step; W&B gets the oldest resolved iteration."""
        step = self.step_of(iteration)
        self._steps[iteration] = step
        self._last_step = step
        if not self._announced:
            self._announce(step)
        self._deliver_wandb(step)

    def record(self, record: dict[str, Any]) -> None:
        """Any thread: one iteration's line of the run log; TensorBoard now, W&B at the next iteration end."""
        step = self._steps.pop(record.get("iteration", -1), None)
        if step is None:
            return
        scalars = self.scalars(record)
        if self._tb is not None:
            for key, value in scalars.items():
                if not self._call("tensorboard", "add_scalar", TAGS[key], value, step):
                    break
        if self._wandb is not None:
            self._pending.append((step, scalars))

    def scalars(self, record: dict[str, Any]) -> dict[str, float]:
        """The TAGS keys of one run-log iteration line that are known (a null figure is left out)."""
        out: dict[str, float] = {}
        time_s, energy_j = record.get("time_s"), record.get("energy_j")
        if energy_j is not None:
            out["gpu_energy_j"] = float(energy_j)
        if energy_j is not None and time_s:
            out["gpu_power_w"] = float(energy_j) / float(time_s)
        if time_s is not None:
            out["iteration_time_s"] = float(time_s)
        out.update(self._planned)
        return out

    def _deliver_wandb(self, step: int) -> None:
        if not self._pending or step <= self._wandb_step or not self._wandb_alive():
            return
        own_step, scalars = self._pending.popleft()
        data: dict[str, float] = {TAGS[k]: v for k, v in scalars.items()}
        data[STEP_METRIC] = own_step
        if self._call("wandb", "log", data, step):
            self._wandb_step = step

    def close(self) -> None:
        """After the last line: W&B one more row at the last step if it is still open; flush TensorBoard."""
        if self._last_step is not None:
            self._deliver_wandb(self._last_step)
        self._call("tensorboard", "flush")


def attach(plan: Plan | None, source: str = "the plan") -> MegatronWriters | None:
    """A sink for Megatron-LM's writers on this rank, or None (no megatron.training loaded, no writer here)."""
    gv = sys.modules.get(GLOBAL_VARS)
    if gv is None or plan is None:
        return None
    try:
        tensorboard, wandb = gv.get_tensorboard_writer(), gv.get_wandb_writer()
    except Exception:  # an older or partial megatron.training: no writers to share
        return None
    if tensorboard is None and wandb is None:
        return None
    try:
        args = gv.get_args()
    except Exception:  # not initialised (asserts): the step counts from 0
        args = None
    return MegatronWriters(tensorboard, wandb, args, plan, source)

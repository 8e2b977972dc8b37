"""The overlap engine of a rank: settings, communicators and tracer shared by its partitioned layers.

``setup_overlap`` is called once per rank after megatron-core's ``initialize_model_parallel``: it checks
the plan against the layer (``validate_plan_for_layer``; PlanError on a misfit), creates one TP
communicator per distinct comm SM count on NCCL (and one CP communicator per SM count of the CP
partitions; comm_groups.py: budget, NCCL's environment, shared resources), and registers the hooks
listener that switches the layers' settings before every planned instruction. Layers built with
``get_partitioned_gpt_layer_spec`` read ``get_engine()`` at every call, so they can be built before or after
the set-up.
"""

from __future__ import annotations

import atexit
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kareus_megatron.environment import kareus_settings
from kareus_megatron.runtime import hooks
from kareus_megatron.runtime.overlap.comm import Communicator
from kareus_megatron.runtime.overlap.comm_groups import SmGroupSet, build_sm_group_set, check_budget
from kareus_megatron.runtime.overlap.config import (
    LayerSettings,
    OverlapState,
    backward_nanobatches,
    comm_sms_values,
    validate_plan_for_layer,
)
from kareus_megatron.runtime.overlap.trace import Tracer

if TYPE_CHECKING:
    import torch.distributed as dist

    from kareus_megatron.plan.schema import Plan


class OverlapEngine:
    """Settings (switched per instruction), communicators and tracer of one rank."""

    def __init__(
        self, state: OverlapState | None = None, comm: Communicator | None = None, tracer: Tracer | None = None
    ) -> None:
        self.state = state or OverlapState()
        self.comm = comm or Communicator()
        self.tracer = tracer or Tracer()
        self._calls = 0
        self.carry: Any = None  # cross_layer.ForwardCarry: a layer's pending end, for the next layer's call

    def take_carry(self, x: Any) -> Any:
        """The pending end of the previous layer if `x` is its output (the caller completes it); a pending end
        of some other tensor is completed here first, so no output is ever read half-written."""
        carry, self.carry = self.carry, None
        if carry is None or carry.matches(x):
            return carry
        carry.complete()
        return None

    def next_call_id(self) -> int:
        """A fresh id for one layer call (forward or recompute), used to group trace events."""
        self._calls += 1
        return self._calls

    def install_listener(self) -> None:
        """Register this engine's settings switch with ``runtime.hooks``."""
        hooks.add_instruction_listener(self.state.on_instruction)

    def uninstall_listener(self) -> None:
        """Unregister the settings switch."""
        hooks.remove_instruction_listener(self.state.on_instruction)

    def dump_trace(self, path: str | Path, **meta: object) -> Path:
        """Write this rank's trace JSON to `path`."""
        return self.tracer.dump(path, **meta)


_ENGINE: OverlapEngine | None = None


def _gpu_sm_count(plan: Plan | None) -> int | None:
    """SMs of the current CUDA device, else of the plan's GPU preset, else None (unknown)."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    if plan is None:
        return None
    from kareus_megatron.errors import KareusError
    from kareus_megatron.hardware.gpus import gpu_spec

    try:
        return gpu_spec(plan.gpu).sm_count
    except KareusError:
        return None


def get_engine() -> OverlapEngine:
    """The rank's engine (a default one, 1 nanobatch and the megatron TP group, if none was set up)."""
    global _ENGINE
    if _ENGINE is None:
        _ENGINE = OverlapEngine()
    return _ENGINE


def set_engine(engine: OverlapEngine | None) -> OverlapEngine | None:
    """Replace the rank's engine (None: back to the default on next use); return the previous one."""
    global _ENGINE
    prev, _ENGINE = _ENGINE, engine
    if prev is not None and prev is not engine:
        prev.uninstall_listener()
        prev.comm.close()
    return prev


def setup_overlap(
    plan: Plan | None = None,
    *,
    tp_group: dist.ProcessGroup | None = None,
    micro_batch_size: int | None = None,
    gpu_sm_count: int | None = None,
    trace: bool | str | Path = False,
    settings: LayerSettings | None = None,
    delay_s: float = 0.0,
    delay_s_per_byte: float = 0.0,
    comm_sms: tuple[int, ...] = (),
    cp_comm_sms: tuple[int, ...] = (),
) -> OverlapEngine:
    """Set up the rank's engine (call on every rank, same arguments, after model-parallel init).

    With a plan: validate it (PlanError on a misfit, over the comm-SM budget too), build the SM-limited
    communicators (NCCL; comm_groups.py, their costs in ``engine.comm.group_infos``) and register the hooks
    listener. Without one: run with fixed ``settings`` (tests, benchmarks);
    ``comm_sms`` lists extra SM counts to build TP communicators for (benchmarks switching knobs), ``cp_comm_sms``
    CP ones (the K/V collectives of context parallelism).
    ``delay_s`` / ``delay_s_per_byte`` slow every collective by a fixed delay (s) plus a delay per byte
    (s/byte) (CPU benchmarks only).
    ``tp_group`` defaults to megatron-core's TP group, ``gpu_sm_count`` to the CUDA device's (on a CPU,
    the plan's GPU preset's).
    """
    import torch.distributed as tdist

    if gpu_sm_count is None:
        gpu_sm_count = _gpu_sm_count(plan)
    if plan is not None:
        validate_plan_for_layer(plan, micro_batch_size=micro_batch_size, gpu_sm_count=gpu_sm_count)
    if tp_group is None:
        from megatron.core import parallel_state

        tp_group = parallel_state.get_tensor_model_parallel_group()
    wanted = set(comm_sms) | (set(comm_sms_values(plan)) if plan is not None else set())
    cp_wanted = set(cp_comm_sms) | (set(comm_sms_values(plan, cp=True)) if plan is not None else set())
    check_budget(wanted, "tp")  # both before any communicator is built
    check_budget(cp_wanted, "cp")
    tp_set = build_sm_group_set(wanted, tp_group, "tp")
    cp_set = SmGroupSet()
    if cp_wanted:  # the CP K/V collectives' communicators, one per SM count (NCCL; none on gloo)
        from megatron.core import parallel_state

        cp_set = build_sm_group_set(cp_wanted, parallel_state.get_context_parallel_group(), "cp")
    rank = tdist.get_rank() if tdist.is_initialized() else 0
    if trace is False and kareus_settings().overlap_trace:
        trace = kareus_settings().overlap_trace
    engine = OverlapEngine(
        state=OverlapState(
            settings,
            cross_layer=bool(plan is not None and plan.cross_layer),
            backward=backward_nanobatches(plan) if plan is not None else None,
        ),
        comm=Communicator(
            tp_group=tp_group,
            sm_groups=tp_set.groups,
            cp_sm_groups=cp_set.groups,
            delay_s=delay_s,
            delay_s_per_byte=delay_s_per_byte,
            group_infos=tp_set.infos + cp_set.infos,
        ),
        tracer=Tracer(enabled=bool(trace), rank=rank),
    )
    set_engine(engine)
    if isinstance(trace, (str, Path)):
        atexit.register(engine.dump_trace, Path(trace) / f"overlap_trace.rank{rank}.json")
    if plan is not None:
        engine.install_listener()
    return engine

"""Partition builder: cut one layer's op list at collectives and lay out the nanobatch overlap schedule.

Terms (names from ``kareus_megatron/vocab.py``):

- *segment*: a maximal run of compute ops of one nanobatch, ended by a tensor- or context-parallel
  collective (or by the end of the layer: a *tail*, e.g. the backward ``input_norm``);
- *step*: one nanobatch running one segment;
- *partition instance*: a step that runs beside the pending collective of the step before it (the other
  nanobatch's); its name is the partition name of the segment's compute (``fwd_attn``, ``bwd_mlp``,
  ``fwd_cp_kv``, ...) and its knobs (comm SMs, launch slot) are shared by every instance of that name in
  the instruction. Launch slots are the segment's compute op names.

Schedule of one layer with ``n`` nanobatches (what the overlap engine, runtime/overlap/schedule.py, runs;
for n = 2):

    nb0 s1 alone | nb1 s1 ‖ nb0 c1 | nb0 s2 ‖ nb1 c1 | … | nb1 sK ‖ nb0 cK | nb1 cK ‖ nb0 tail | nb1 tail

i.e. steps walk the segments in order, nanobatch by nanobatch; each step overlaps the collective issued
by the step before it, and the next step's first op waits for it. The layer's last collective has no
partner segment: it is issued at once on the default communicator (NCCL's default comm SMs) and runs
beside the tails of nanobatches 0..n-2 (the backward ``input_norm``; launched before their first op),
or fully exposed when there is no tail (forward); the last nanobatch's tail runs alone.
Per layer with TP only, forward: ``fwd_attn`` × 1 and ``fwd_mlp`` × 2 instances, nb0's ``attn``
segment alone and the last MLP all-reduce exposed; backward: ``bwd_mlp`` × 1, ``bwd_attn`` × 2, and the
last all-reduce beside nb0's ``input_norm``. With one nanobatch the layer is Megatron's sequential
order: every collective exposed on NCCL's default comm SMs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kareus_megatron.errors import InfeasibleConfigError
from kareus_megatron.vocab import PARTITION_COLLECTIVE, PARTITION_SLOTS
from kareus_megatron.workload.opgraph import layer_ops

COMPUTE_KINDS = ("gemm", "attention", "memory")
COLLECTIVE_KIND = "collective"
# Sequence parallelism's all-gather / reduce-scatter pairs: not modelled as partitions yet.
UNSUPPORTED_COLLECTIVES = ("tp_all_gather", "tp_reduce_scatter")


@dataclass(frozen=True, slots=True)
class Segment:
    """Compute ops of one nanobatch in execution order and the collective that ends them (None: tail).

    slot_positions: indices into `compute` of the ops the collective may be launched before (the ops
    that the vocabulary lists as launch slots of the partition).
    """

    compute: tuple[Any, ...]
    collective: Any | None
    partition: str | None  # vocab partition name of this compute (None for a tail)
    slot_positions: tuple[int, ...] = ()

    @property
    def slots(self) -> tuple[str, ...]:
        """Launch slot names, in execution order."""
        return tuple(self.compute[k].name for k in self.slot_positions)


@dataclass(frozen=True, slots=True)
class PartitionInstance:
    """One step that runs beside a pending collective: `name`'s compute + the other nanobatch's collective."""

    name: str
    compute: tuple[Any, ...]
    collective: Any
    slot_positions: tuple[int, ...]

    @property
    def slots(self) -> tuple[str, ...]:
        """Launch slot names, in execution order."""
        return tuple(self.compute[k].name for k in self.slot_positions)


@dataclass(frozen=True, slots=True)
class LayerSchedule:
    """One layer of one phase with `nanobatches` nanobatches, as the overlap engine runs it.

    alone: compute ops with no collective beside them (all SMs); instances: the partition instances
    (knobs from the plan); fixed: instances on NCCL's default comm SMs launched before their first op
    (the last collective beside the tails; name ``"tail"``); exposed: collectives run alone on NCCL's
    default comm SMs.
    """

    phase: str
    nanobatches: int
    alone: tuple[Any, ...]
    instances: tuple[PartitionInstance, ...]
    fixed: tuple[PartitionInstance, ...]
    exposed: tuple[Any, ...]

    def partition_names(self) -> tuple[str, ...]:
        """Names of the partitions in this layer, in first-appearance order."""
        return tuple(dict.fromkeys(i.name for i in self.instances))

    def slots(self) -> dict[str, tuple[str, ...]]:
        """Partition name → its launch slots (compute op names of the segment, execution order)."""
        return {i.name: i.slots for i in self.instances}

    def count(self, name: str) -> int:
        """Number of instances of partition `name` in the layer."""
        return sum(1 for i in self.instances if i.name == name)


def _is_cp(op: Any) -> bool:
    return str(getattr(op, "collective", "") or "").startswith("cp_")


def partition_name(phase: str, compute: Sequence[Any], collective: Any | None) -> str | None:
    """vocab partition name of a segment's compute in `phase` (None for a tail with no collective).

    The segment ending in a CP collective is ``{fwd,bwd}_cp_kv``; otherwise the op graph's segment label
    of the compute (``attn`` / ``mlp``) names it.
    """
    if collective is None:
        return None
    prefix = "bwd" if phase == "backward" else "fwd"
    if _is_cp(collective):
        return f"{prefix}_cp_kv"
    label = getattr(compute[-1], "segment", None)
    if label not in ("attn", "mlp"):
        names = {op.name for op in compute}
        label = "mlp" if names & {"fc1", "fc2", "activation"} else "attn"
    return f"{prefix}_{label}"


def split_segments(phase: str, ops: Sequence[Any]) -> list[Segment]:
    """Cut one nanobatch's layer op list (execution order) at each collective into segments.

    Raises InfeasibleConfigError for layouts the overlap model does not cover yet (a collective with no
    compute before it, as sequence parallelism's leading all-gather).
    """
    segments: list[Segment] = []
    run: list[Any] = []
    for op in ops:
        if op.kind == COLLECTIVE_KIND:
            if not run or op.collective in UNSUPPORTED_COLLECTIVES:
                raise InfeasibleConfigError(
                    f"nanobatch overlap does not cover {op.collective or op.name} ({phase}) yet: sequence "
                    "parallelism is not supported with 2 nanobatches; drop --sp or plan with 1 nanobatch."
                )
            name = partition_name(phase, run, op)
            assert name is not None  # op is a collective, so the segment has a partition name
            segments.append(Segment(tuple(run), op, name, _slot_positions(name, run)))
            run = []
        elif op.kind in COMPUTE_KINDS:
            run.append(op)
        else:
            raise ValueError(f"{phase}: op {op.name!r} of kind {op.kind!r} does not belong in a layer")
    if run:
        segments.append(Segment(tuple(run), None, None, ()))
    return segments


def _slot_positions(name: str, compute: Sequence[Any]) -> tuple[int, ...]:
    """Positions of the segment's ops that the vocabulary lists as launch slots of `name`."""
    assert name in PARTITION_SLOTS, f"partition {name!r} not in the vocabulary"  # our own invariant
    pos = tuple(k for k, op in enumerate(compute) if op.name in PARTITION_SLOTS[name])
    assert pos, f"{name}: none of {[op.name for op in compute]} is a launch slot {PARTITION_SLOTS[name]}"
    return pos


def layer_schedule(phase: str, ops: Sequence[Any], nanobatches: int) -> LayerSchedule:
    """The layer's overlap schedule with `nanobatches` nanobatches; `ops` is ONE nanobatch's op list."""
    if nanobatches < 1:
        raise ValueError(f"nanobatches must be ≥ 1, not {nanobatches}")
    if nanobatches == 1:  # Megatron's order: every collective exposed, on NCCL's default SMs
        alone1 = tuple(op for op in ops if op.kind in COMPUTE_KINDS)
        colls = tuple(op for op in ops if op.kind == COLLECTIVE_KIND)
        return LayerSchedule(phase, 1, alone1, (), (), colls)
    segments = split_segments(phase, ops)
    body = [s for s in segments if s.collective is not None]
    tail = tuple(op for s in segments if s.collective is None for op in s.compute)
    alone: list[Any] = []
    instances: list[PartitionInstance] = []
    pending: Segment | None = None  # segment whose collective the previous step issued
    for seg in body:
        for _ in range(nanobatches):
            if pending is None:
                alone.extend(seg.compute)
            else:
                assert seg.partition is not None  # body segments end in a collective: split_segments named them
                instances.append(
                    PartitionInstance(seg.partition, seg.compute, pending.collective, seg.slot_positions)
                )
            pending = seg
    fixed: tuple[PartitionInstance, ...] = ()
    exposed: tuple[Any, ...] = ()
    if pending is not None and tail:
        fixed = (PartitionInstance("tail", tail * (nanobatches - 1), pending.collective, (0,)),)
        alone.extend(tail)
    elif pending is not None:
        exposed = (pending.collective,)
    else:  # no collective at all: every nanobatch's tail runs alone
        alone.extend(tail * nanobatches)
    return LayerSchedule(phase, nanobatches, tuple(alone), tuple(instances), fixed, exposed)


def collective_kind(name: str) -> str:
    """Collective kind whose comm-SM range applies to partition `name` (kareus_megatron.vocab)."""
    return PARTITION_COLLECTIVE[name]


def layout_slots(model: Any, par: Any, nanobatches: int = 2) -> dict[str, tuple[str, ...]]:
    """Partition name → launch slots of every partition an instruction of this layout has."""
    slots: dict[str, tuple[str, ...]] = {}
    for phase in ("forward", "recompute", "backward"):
        ops = layer_ops(model, par, phase, nanobatches)
        if ops:
            slots.update(layer_schedule(phase, ops, nanobatches).slots())
    return slots

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

Sequence parallelism (vocab.py): the norms form their own segments (``sp_attn_norm``, ``sp_mlp_norm``,
ending in the all-gathers) and the GEMM blocks end in reduce-scatters. The backward starts with the
all-gather of the output gradient, which has no compute before it inside the layer: it is a *leading*
collective, exposed (run alone on NCCL's default comm SMs) once per nanobatch, and the first segment's
nanobatch-0 step runs alone after it. Forward with SP and 2 nanobatches: ``fwd_sp_attn_norm`` × 1,
the other three SP partitions × 2, the last reduce-scatter exposed; backward: ``bwd_sp_mlp`` × 1,
``bwd_sp_attn_norm`` and ``bwd_sp_attn`` × 2, the last reduce-scatter beside nb0's ``input_norm``.

Cross-layer overlap (run by the overlap engine with and without SP, runtime/overlap/cross_layer.py; with CP a
planner model only): inside a model chunk
of L alike layers, the last collective of layer l runs beside the other nanobatch's first step of layer
l+1 (forward: nb1's last MLP collective beside nb0's first segment of l+1; backward: the mirror, where
layer l's tail and l+1's first segment form one step, nb0's beside that collective on NCCL's default SMs
as the tail is today), so only the chunk's last layer leaves it exposed (or beside the tail alone).
``chunk_schedule`` lays out a whole chunk; ``layer_schedule(.., cross_layer=True)`` is what one more
layer adds (``chunk(L) = layer + (L - 1) × increment``, exact: the steps repeat from the
second layer on). The added instances use the existing partition names and knobs.

``LayerSchedule.issues`` lists the same collectives in the order the engine issues them, each with its
partner (the partition whose compute runs beside it, ``"tail"``, or ``"exposed"``); search/collective_list.py
turns them into the per-instruction list that tests replay against the engine's trace. ``schedule_ops`` is the
op list a 2-nanobatch schedule is cut from: the layer's, except that Megatron's selective recompute (core
attention only) runs inside the backward, just before the attention backward that needs it (where the engine's
checkpointed core attention recomputes it), not as a phase of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kareus_megatron.errors import InfeasibleConfigError
from kareus_megatron.vocab import PARTITION_COLLECTIVE, PARTITION_SLOTS
from kareus_megatron.workload.opgraph import layer_ops

PARTNER_TAIL = "tail"  # a collective issued at once on NCCL's default SMs beside the tails (LayerSchedule.fixed)
PARTNER_EXPOSED = "exposed"  # a collective with no compute beside it

COMPUTE_KINDS = ("gemm", "attention", "memory")
COLLECTIVE_KIND = "collective"
SP_COLLECTIVES = ("tp_all_gather", "tp_reduce_scatter")  # sequence parallelism's TP collectives


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
class CollectiveIssue:
    """One collective of a schedule, in issue order: its op, its partner (a partition name, PARTNER_TAIL or
    PARTNER_EXPOSED) and the layer that produced it (0 = the first layer the phase walks)."""

    collective: Any
    partner: str
    layer: int = 0


@dataclass(frozen=True, slots=True)
class LayerSchedule:
    """One layer of one phase with `nanobatches` nanobatches, as the overlap engine runs it.

    alone: compute ops with no collective beside them (all SMs); instances: the partition instances
    (knobs from the plan); fixed: instances on NCCL's default comm SMs launched before their first op
    (the last collective beside the tails; name ``"tail"``); exposed: collectives run alone on NCCL's
    default comm SMs; issues: every collective of the above in issue order (empty for an increment).
    """

    phase: str
    nanobatches: int
    alone: tuple[Any, ...]
    instances: tuple[PartitionInstance, ...]
    fixed: tuple[PartitionInstance, ...]
    exposed: tuple[Any, ...]
    issues: tuple[CollectiveIssue, ...] = ()

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
    of the compute (``attn`` / ``mlp``) names it: ``{fwd,bwd}_{label}`` after a TP all-reduce, with SP
    ``{fwd,bwd}_sp_{label}`` before a reduce-scatter and ``{fwd,bwd}_sp_{label}_norm`` before an
    all-gather (the label is that of the all-gather, i.e. of the TP block the norm feeds).
    """
    if collective is None:
        return None
    prefix = "bwd" if phase == "backward" else "fwd"
    if _is_cp(collective):
        return f"{prefix}_cp_kv"
    kind = getattr(collective, "collective", None)
    if kind == "tp_all_gather":
        return f"{prefix}_sp_{collective.segment}_norm"
    label = getattr(compute[-1], "segment", None)
    if label not in ("attn", "mlp"):
        names = {op.name for op in compute}
        label = "mlp" if names & {"fc1", "fc2", "activation"} else "attn"
    return f"{prefix}_sp_{label}" if kind == "tp_reduce_scatter" else f"{prefix}_{label}"


def split_segments(phase: str, ops: Sequence[Any]) -> list[Segment]:
    """Cut one nanobatch's layer op list (execution order) at each collective into segments.

    A collective with no compute before it at the start of the layer (SP's backward all-gather of the
    output gradient) becomes a *leading* segment: empty compute, no partition name. Raises
    InfeasibleConfigError for a collective with no compute before it anywhere else (two collectives in a
    row: a layout the overlap model does not cover).
    """
    segments: list[Segment] = []
    run: list[Any] = []
    for op in ops:
        if op.kind == COLLECTIVE_KIND:
            if not run and not segments:
                segments.append(Segment((), op, None, ()))
                continue
            if not run:
                raise InfeasibleConfigError(
                    f"nanobatch overlap does not cover {op.collective or op.name} ({phase}) right after another "
                    "collective; plan with 1 nanobatch."
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
    first: dict[str, int] = {}  # a name twice (selective recompute's attention before the backward's): the first
    for k, op in enumerate(compute):
        if op.name in PARTITION_SLOTS[name]:
            first.setdefault(op.name, k)
    pos = tuple(first.values())
    assert pos, f"{name}: none of {[op.name for op in compute]} is a launch slot {PARTITION_SLOTS[name]}"
    return pos


def layer_schedule(phase: str, ops: Sequence[Any], nanobatches: int, cross_layer: bool = False) -> LayerSchedule:
    """The layer's overlap schedule with `nanobatches` nanobatches; `ops` is ONE nanobatch's op list.

    cross_layer: the *increment* of one more layer inside a chunk with cross-layer overlap instead, so that
    ``chunk_schedule(.., L)`` = this layer's schedule + (L - 1) × the increment (see the module docstring).
    """
    if nanobatches < 1:
        raise ValueError(f"nanobatches must be ≥ 1, not {nanobatches}")
    if nanobatches == 1:  # Megatron's order: every collective exposed, on NCCL's default SMs
        alone1 = tuple(op for op in ops if op.kind in COMPUTE_KINDS)
        colls = tuple(op for op in ops if op.kind == COLLECTIVE_KIND)
        return LayerSchedule(phase, 1, alone1, (), (), colls, tuple(CollectiveIssue(c, PARTNER_EXPOSED) for c in colls))
    if cross_layer:
        return _increment(chunk_schedule(phase, ops, nanobatches, 2), chunk_schedule(phase, ops, nanobatches, 1))
    return chunk_schedule(phase, ops, nanobatches, 1)


def chunk_schedule(phase: str, ops: Sequence[Any], nanobatches: int, layers: int) -> LayerSchedule:
    """Schedule of `layers` alike layers run back to back with cross-layer overlap (`ops`: one layer, one nanobatch).

    With 1 layer this is the layer's own schedule; with more, each layer's last collective runs beside the
    other nanobatch's first step of the next layer (the previous layer's tail, if any, joins that step).
    """
    if layers < 1:
        raise ValueError(f"layers must be ≥ 1, not {layers}")
    if nanobatches == 1:
        one = layer_schedule(phase, ops, 1)
        every = tuple(CollectiveIssue(i.collective, i.partner, k) for k in range(layers) for i in one.issues)
        return LayerSchedule(phase, 1, one.alone * layers, (), (), one.exposed * layers, every)
    segments = split_segments(phase, ops)
    lead = [s for s in segments if not s.compute]  # at most one: split_segments refuses two collectives in a row
    body = [s for s in segments if s.collective is not None and s.compute]
    tail = tuple(op for s in segments if s.collective is None for op in s.compute)
    steps: list[tuple[Segment, bool, int]] = [(seg, False, 0) for seg in body]  # (segment, joins a tail, layer)
    for k in range(1, layers):
        steps += [(seg, joined, k) for seg, joined in _next_layer(phase, lead, body, tail)]
    if not body and not lead:  # no collective at all: every op runs alone
        return LayerSchedule(phase, nanobatches, tail * (nanobatches * layers), (), (), ())
    leading = tuple(s.collective for s in lead) * nanobatches  # exposed, one per nanobatch
    issues = [CollectiveIssue(c, PARTNER_EXPOSED) for c in leading]
    alone: list[Any] = []
    instances: list[PartitionInstance] = []
    fixed: list[PartitionInstance] = []
    pending: tuple[Segment, int] | None = None  # segment whose collective the previous step issued, its layer
    for seg, joined, k in steps:
        for nb in range(nanobatches):
            if pending is None:
                alone.extend(seg.compute)
            elif seg.partition is None or (joined and nb == 0):  # beside the previous layer's last collective
                fixed.append(PartitionInstance("tail", seg.compute, pending[0].collective, (0,)))
                issues.append(CollectiveIssue(pending[0].collective, PARTNER_TAIL, pending[1]))
            else:
                instances.append(
                    PartitionInstance(seg.partition, seg.compute, pending[0].collective, seg.slot_positions)
                )
                issues.append(CollectiveIssue(pending[0].collective, seg.partition, pending[1]))
            pending = (seg, k)
    exposed: tuple[Any, ...] = ()
    if pending is not None and tail:
        fixed.append(PartitionInstance("tail", tail * (nanobatches - 1), pending[0].collective, (0,)))
        issues.append(CollectiveIssue(pending[0].collective, PARTNER_TAIL, pending[1]))
        alone.extend(tail)
    elif pending is not None:
        exposed = (pending[0].collective,)
        issues.append(CollectiveIssue(pending[0].collective, PARTNER_EXPOSED, pending[1]))
    else:
        alone.extend(tail * nanobatches)
    return LayerSchedule(
        phase, nanobatches, tuple(alone), tuple(instances), tuple(fixed), leading + exposed, tuple(issues)
    )


def _next_layer(
    phase: str, lead: list[Segment], body: list[Segment], tail: tuple[Any, ...]
) -> list[tuple[Segment, bool]]:
    """Steps of one more layer after a layer whose `tail` (the ops after its last collective) joins them.

    Without a tail, nanobatch 0's first segment runs beside the previous layer's last collective as an
    instance of its partition (its knobs). With one, the tail and the next layer's first segment are one
    run of compute, one step (flag True): nanobatch 0's runs beside the previous layer's last collective as
    today's model runs that collective beside the tail (NCCL's default comm SMs, issued at once), now
    with a longer partner; the other nanobatches' are instances of the first segment's partition, launch
    slots at its ops. A tail that ends in the next layer's leading collective (SP backward: the
    output-gradient all-gather) is a step of its own on NCCL's default comm SMs for every nanobatch.
    """
    if lead:
        if not tail:
            raise InfeasibleConfigError(
                f"cross-layer overlap does not cover {phase} layers that start and end with a collective; "
                "plan without --cross-layer."
            )
        return [(Segment(tail, lead[0].collective, None, (0,)), False), *((seg, False) for seg in body)]
    if not tail:
        return [(seg, False) for seg in body]
    first = body[0]
    shifted = tuple(len(tail) + k for k in first.slot_positions)
    merged = Segment(tail + first.compute, first.collective, first.partition, shifted)
    return [(merged, True), *((seg, False) for seg in body[1:])]


def _increment(more: LayerSchedule, one: LayerSchedule) -> LayerSchedule:
    """`more` minus `one` (multisets of ops and instances): what one more layer adds to a chunk."""

    def minus(a: tuple[Any, ...], b: tuple[Any, ...]) -> tuple[Any, ...]:
        rest = list(a)
        for x in b:
            hit = next(k for k, y in enumerate(rest) if y == x)  # StopIteration: our own invariant broke
            del rest[hit]
        return tuple(rest)

    return LayerSchedule(
        more.phase,
        more.nanobatches,
        minus(more.alone, one.alone),
        minus(more.instances, one.instances),
        minus(more.fixed, one.fixed),
        minus(more.exposed, one.exposed),
    )


def collective_kind(name: str) -> str:
    """Collective kind whose comm-SM range applies to partition `name` (kareus_megatron.vocab)."""
    return PARTITION_COLLECTIVE[name]


def schedule_ops(model: Any, par: Any, phase: str, nanobatches: int) -> tuple[Any, ...]:
    """One nanobatch's op list of `phase` that the `nanobatches` schedule is cut from (see module docstring).

    With selective recompute the recomputed core attention joins the backward just before its attention
    backward (same op name, so launch slot ``attention`` precedes it, as the engine's marker does) and the
    recompute phase is empty; otherwise ``layer_ops``.
    """
    ops = layer_ops(model, par, phase, nanobatches)
    if par.recompute != "selective" or phase == "forward":
        return ops
    if phase == "recompute":
        return ()
    again = layer_ops(model, par, "recompute", nanobatches)
    at = next(k for k, op in enumerate(ops) if op.name == "attention")
    return ops[:at] + again + ops[at:]


def layout_slots(model: Any, par: Any, nanobatches: int = 2) -> dict[str, tuple[str, ...]]:
    """Partition name → launch slots of every partition an instruction of this layout has."""
    slots: dict[str, tuple[str, ...]] = {}
    for phase in ("forward", "recompute", "backward"):
        ops = schedule_ops(model, par, phase, nanobatches) if nanobatches > 1 else layer_ops(model, par, phase, 1)
        if ops:
            slots.update(layer_schedule(phase, ops, nanobatches).slots())
    return slots

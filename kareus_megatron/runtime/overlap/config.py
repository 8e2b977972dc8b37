"""Overlap settings of the running instruction, the hooks listener, and plan checks at load (no torch).

Terms (names from ``kareus_megatron.vocab``):

- *nanobatches*: 1 (the microbatch runs whole, collectives blocking) or 2 (halves of the microbatch along
  the batch dimension, collectives of one half overlapped with compute of the other).
- *partition knobs*: per partition (``fwd_attn``, ``fwd_mlp``, ``bwd_mlp``, ``bwd_attn``; with sequence
  parallelism the ``*_sp_*`` partitions of vocab.SP_PARTITION_SLOTS; with context parallelism also
  ``fwd_cp_kv`` / ``bwd_cp_kv``, the K/V all-gather and dK/dV reduce-scatter, see ``cp_engine_slots``) the SM count of
  the collective kernel (``comm_sms``; on NCCL the communicator's CTA limit) and the launch slot (the
  compute op of the other nanobatch just before which the pending collective is issued).
- *phase*: ``forward``, ``backward``, or ``recompute`` (a forward run inside a backward instruction, under
  full activation recompute; it uses the forward partition names with the backward instruction's knobs).

``OverlapState`` holds the settings the layers read when they run. The runtime's megatron patch calls
``runtime.hooks.notify_instruction`` before each planned instruction; ``OverlapState.on_instruction``
(registered by ``install_listener``) switches the settings there. Partitions missing from a 2-nanobatch
instruction get the default knobs: launch at the segment's first op, the default TP communicator.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kareus_megatron.errors import PlanError
from kareus_megatron.vocab import (
    CP_PARTITION_SLOTS,
    ENGINE_PARTITION_SLOTS,
    MAX_COMM_SM_VALUES,
    PARTITION_SLOTS,
    SP_PARTITION_SLOTS,
    TP_PARTITION_SLOTS,
)

if TYPE_CHECKING:
    from kareus_megatron.plan.schema import Instruction, Plan
    from kareus_megatron.runtime.hooks import InstructionEvent


@dataclass(frozen=True, slots=True)
class Knobs:
    """Overlap knobs of one partition: comm SMs (None = the default communicator) and launch slot."""

    comm_sms: int | None
    launch_slot: str


def default_knobs(partition: str) -> Knobs:
    """Knobs used when a plan gives none for `partition`: issue at the segment's first op."""
    return Knobs(comm_sms=None, launch_slot=PARTITION_SLOTS[partition][0])


def cp_engine_slots() -> dict[str, tuple[str, ...]]:
    """Partition → launch slots the engine runs with context parallelism (no SP): the CP K/V partitions and
    the TP all-reduce ones, whose attn segments keep only the ops after the K/V collective's cut (as the
    planner's segments do: search/partition.py split_segments)."""
    fwd_cut, bwd_cut = CP_PARTITION_SLOTS["fwd_cp_kv"], CP_PARTITION_SLOTS["bwd_cp_kv"]
    return {
        "fwd_cp_kv": fwd_cut,
        "fwd_attn": tuple(o for o in TP_PARTITION_SLOTS["fwd_attn"] if o not in fwd_cut),
        "fwd_mlp": TP_PARTITION_SLOTS["fwd_mlp"],
        "bwd_mlp": TP_PARTITION_SLOTS["bwd_mlp"],
        "bwd_cp_kv": bwd_cut,
        "bwd_attn": tuple(o for o in TP_PARTITION_SLOTS["bwd_attn"] if o not in bwd_cut),
    }


def cp_sp_engine_slots() -> dict[str, tuple[str, ...]]:
    """Partition → launch slots the engine runs with context and sequence parallelism: the SP partitions and the
    CP K/V ones; the K/V collective cuts SP's attn segments in two (forward: qkv, rope | attention, proj;
    backward: proj, attention | rope, qkv), as search/partition.py split_segments cuts the planner's."""
    fwd_cut, bwd_cut = CP_PARTITION_SLOTS["fwd_cp_kv"], CP_PARTITION_SLOTS["bwd_cp_kv"]
    sp = SP_PARTITION_SLOTS
    return {
        "fwd_sp_attn_norm": sp["fwd_sp_attn_norm"],
        "fwd_cp_kv": tuple(o for o in fwd_cut if o not in sp["fwd_sp_attn_norm"]),
        "fwd_sp_attn": tuple(o for o in sp["fwd_sp_attn"] if o not in fwd_cut),
        "fwd_sp_mlp_norm": sp["fwd_sp_mlp_norm"],
        "fwd_sp_mlp": sp["fwd_sp_mlp"],
        "bwd_sp_mlp": sp["bwd_sp_mlp"],
        "bwd_sp_attn_norm": sp["bwd_sp_attn_norm"],
        "bwd_cp_kv": tuple(o for o in bwd_cut if o not in sp["bwd_sp_attn_norm"]),
        "bwd_sp_attn": tuple(o for o in sp["bwd_sp_attn"] if o not in bwd_cut),
    }


@dataclass(frozen=True, slots=True)
class LayerSettings:
    """What a partitioned layer does in the current instruction."""

    nanobatches: int = 1
    knobs: dict[str, Knobs] = field(default_factory=dict)
    kind: str | None = None  # "forward"/"backward" of the running instruction; None outside a plan
    microbatch: int | None = None
    index: int | None = None  # position of the instruction in the rank's plan
    cross_layer: bool = False  # the plan's cross-layer overlap (cross_layer.py), with 2 nanobatches
    backward_nanobatches: int | None = None  # a forward's: its microbatch's backward's (None: unknown, the same)

    def halves(self, phase: str, grad: bool) -> int:
        """Nanobatch halves a layer call records its graph in: a forward with grad that the plan backs with a
        2-nanobatch backward records halves even when it runs 1 nanobatch itself (steps.py: merged)."""
        if phase == "forward" and grad and self.backward_nanobatches is not None:
            return max(self.nanobatches, self.backward_nanobatches)
        return self.nanobatches

    def knobs_for(self, partition: str) -> Knobs:
        """Knobs of `partition` (the plan's, or the defaults)."""
        return self.knobs.get(partition) or default_knobs(partition)


def settings_from_instruction(
    instr: Instruction, index: int | None = None, cross_layer: bool = False, backward_nanobatches: int | None = None
) -> LayerSettings:
    """Layer settings for one plan instruction (`cross_layer`: its plan's ``cross_layer``; a forward's
    `backward_nanobatches`: those of its microbatch's backward instruction)."""
    knobs = {
        name: Knobs(comm_sms=k.comm_sms, launch_slot=k.launch_slot)
        for name, k in instr.partitions.items()
        if name in PARTITION_SLOTS
    }
    return LayerSettings(
        nanobatches=instr.nanobatches,
        knobs=knobs,
        kind=instr.kind,
        microbatch=instr.microbatch,
        index=index,
        cross_layer=cross_layer and instr.nanobatches > 1,
        backward_nanobatches=backward_nanobatches if instr.kind == "forward" else None,
    )


def backward_nanobatches(plan: Plan) -> dict[tuple[int, int, int], int]:
    """(pp rank, chunk, microbatch) → nanobatches of that microbatch's backward instruction in `plan`."""
    return {
        (st.pp_rank, ins.chunk, ins.microbatch): ins.nanobatches
        for st in plan.stages
        for ins in st.instructions
        if ins.kind == "backward"
    }


class OverlapState:
    """The settings partitioned layers read; switched per instruction by the hooks listener."""

    def __init__(
        self,
        settings: LayerSettings | None = None,
        cross_layer: bool = False,
        backward: dict[tuple[int, int, int], int] | None = None,
    ) -> None:
        self.settings = settings or LayerSettings()
        self.cross_layer = cross_layer  # the plan's: every 2-nanobatch instruction runs cross-layer overlap
        self.backward = backward or {}  # the plan's backward_nanobatches
        self.instructions_seen = 0

    def set(self, settings: LayerSettings) -> None:
        """Use `settings` from now on (tests and benchmarks set them directly)."""
        self.settings = settings

    def on_instruction(self, event: InstructionEvent) -> None:
        """Hooks listener: switch to the settings of the instruction about to run (no blocking)."""
        ins = event.instruction
        self.settings = settings_from_instruction(
            ins,
            index=event.index,
            cross_layer=self.cross_layer,
            backward_nanobatches=self.backward.get((event.pp_rank, ins.chunk, ins.microbatch)),
        )
        self.instructions_seen += 1

    def forward_phase(self) -> str:
        """'recompute' when a forward runs inside a backward instruction, else 'forward'."""
        return "recompute" if self.settings.kind == "backward" else "forward"


def comm_sms_values(plan: Plan, cp: bool = False) -> list[int]:
    """Distinct comm SM counts (sorted) that `plan`'s TP partitions (`cp`: its CP K/V partitions) use: one
    communicator each on NCCL (TP groups; with `cp`, CP groups)."""
    names = CP_PARTITION_SLOTS if cp else ENGINE_PARTITION_SLOTS
    return sorted(
        {
            k.comm_sms
            for st in plan.stages
            for ins in st.instructions
            for name, k in ins.partitions.items()
            if name in names
        }
    )


def validate_plan_for_layer(
    plan: Plan,
    *,
    micro_batch_size: int | None = None,
    gpu_sm_count: int | None = None,
    cp: int | None = None,
    sequence_parallel: bool | None = None,
) -> None:
    """Check that `plan`'s overlap knobs fit the partitioned layer; raise a one-line PlanError if not.

    Refuses a plan predicted with cross-layer overlap (``plan.cross_layer``) for context parallelism (the
    engine runs it for TP layers with and without SP, cross_layer.py). Checks every instruction:
    nanobatches divide the micro-batch size, each partition is one this engine runs for the layout (TP
    all-reduce partitions; with sequence parallelism the SP ones; with context parallelism the TP and CP K/V
    ones of ``cp_engine_slots``; with both, those of ``cp_sp_engine_slots``), its launch slot is an op of that
    partition's segment, and ``comm_sms`` is below the GPU's SM count (``gpu_sm_count``; skipped when unknown,
    e.g. on CPU). The plan uses at most vocab.MAX_COMM_SM_VALUES distinct comm SM counts per group (TP, CP):
    the runtime's budget of SM-limited communicators, which the planner's grid respects.
    Live values (micro-batch size, CP, sequence parallelism) default to the plan's own layout.
    """
    layout = plan.parallel
    mbs = layout.micro_batch_size if micro_batch_size is None else micro_batch_size
    cp = layout.cp if cp is None else cp
    sp = layout.sequence_parallel if sequence_parallel is None else sequence_parallel
    uses_overlap = any(i.nanobatches > 1 for s in plan.stages for i in s.instructions)
    if plan.cross_layer and uses_overlap and cp > 1:
        raise PlanError(
            f"the overlap engine runs cross-layer overlap without context parallelism only (this plan: cp={cp}); "
            "re-plan without --cross-layer."
        )
    for kind, values in (("TP", comm_sms_values(plan)), ("CP", comm_sms_values(plan, cp=True))):
        if len(values) > MAX_COMM_SM_VALUES:
            raise PlanError(
                f"the plan uses {len(values)} distinct comm SM counts for the {kind} group "
                f"({', '.join(map(str, values))}); the overlap engine builds at most {MAX_COMM_SM_VALUES} "
                "SM-limited communicators per group. Re-plan with this version of kareus plan (its grid fits)."
            )
    engine_slots = (
        (cp_sp_engine_slots() if sp else cp_engine_slots())
        if cp > 1
        else SP_PARTITION_SLOTS
        if sp
        else TP_PARTITION_SLOTS
    )
    other = "with" if sp else "without"  # the --sp of a plan that fits this live layout
    for st in plan.stages:
        for pos, ins in enumerate(st.instructions):
            where = f"stage {st.pp_rank} instruction {pos} ({ins.kind} mb {ins.microbatch})"
            if mbs % ins.nanobatches:
                raise PlanError(
                    f"{where}: nanobatches={ins.nanobatches} does not divide micro-batch size {mbs}; "
                    "use 1, or a micro-batch size divisible by 2."
                )
            for name in sorted(ins.partitions, key=lambda n: n in engine_slots):  # a layout mismatch first
                if name not in engine_slots:
                    raise PlanError(
                        f"{where}: partition {name!r} is not run by the overlap engine for this layout "
                        f"(cp={cp}, {'with' if sp else 'without'} sequence parallelism); supported: "
                        f"{', '.join(engine_slots)}. Re-plan for this layout (cp={cp}, {other} --sp) or use "
                        "nanobatches=1."
                    )
            for name, k in ins.partitions.items():
                slots = engine_slots[name]
                if k.launch_slot not in slots:
                    raise PlanError(
                        f"{where}: partition {name} launch_slot {k.launch_slot!r} is not an op of its "
                        f"segment; use one of {', '.join(slots)}."
                    )
                if k.comm_sms < 1 or (gpu_sm_count is not None and k.comm_sms >= gpu_sm_count):
                    limit = f"1..{gpu_sm_count - 1}" if gpu_sm_count else ">= 1"
                    raise PlanError(
                        f"{where}: partition {name} comm_sms={k.comm_sms} does not fit a GPU with "
                        f"{gpu_sm_count} SMs; use {limit}."
                    )

"""Per-rank compute order of the pipeline schedules the planner knows.

An *instruction* is the forward or backward pass of one microbatch through one model chunk on one
pipeline rank; its key is ``(kind, microbatch, chunk)`` with kind ``"forward"`` or ``"backward"``.
``chunk`` is the virtual pipeline chunk (0 without interleaving). A schedule maps (pp, microbatches,
vp) to, for every pipeline rank, the order in which that rank runs its instructions.

Schedules (facts read from the frameworks' public sources; the code here is our own):

- ``1f1b``: megatron-core ``forward_backward_pipelining_without_interleaving``: rank r runs
  ``min(pp - r - 1, M)`` warm-up forwards, then alternates one forward and one backward, then drains
  the remaining backwards.
- ``interleaved-1f1b``: megatron-core ``forward_backward_pipelining_with_interleaving``: virtual
  microbatches follow the schedule table (groups of ``group_size`` microbatches, default pp, each group
  walked chunk by chunk); rank r runs ``2 (pp - r - 1) + (vp - 1) group_size`` warm-up forwards (capped at
  M vp), then one forward and one backward per step; backwards walk the same table with the chunk
  reversed (``vp - 1 - chunk``).
- ``deepspeed-train``: DeepSpeed ``TrainSchedule``: 2 (M + pp - 1) steps; at step t rank s runs a
  forward when t and s have the same parity, else a backward; forward microbatch ``t//2 - s//2``,
  backward microbatch ``t//2 - pp + (s + 2)//2``; ids outside 0..M-1 are idle steps.

Nanobatches each schedule's runtime executes (``SCHEDULE_NANOBATCHES``): megatron-core's schedules run
2 through the overlap engine (runtime/overlap); DeepSpeed's PipelineEngine has no overlap engine, so a
``deepspeed-train`` plan keeps every microbatch whole (1 nanobatch: ``kareus`` then plans clocks only).
The option builder (search/options.py) reads this; the DeepSpeed patch refuses any other plan.
"""

from __future__ import annotations

from kareus_megatron.errors import ConfigError, InfeasibleConfigError
from kareus_megatron.vocab import SCHEDULE_1F1B, SCHEDULE_DEEPSPEED, SCHEDULE_INTERLEAVED, SCHEDULES, InstructionKind

InstrKey = tuple[InstructionKind, int, int]  # (kind, microbatch, chunk)

# Nanobatch counts the runtime of each schedule can execute (see the module docstring).
SCHEDULE_NANOBATCHES: dict[str, tuple[int, ...]] = {
    SCHEDULE_1F1B: (1, 2),
    SCHEDULE_INTERLEAVED: (1, 2),
    SCHEDULE_DEEPSPEED: (1,),
}
_NO_OVERLAP_WHY: dict[str, str] = {
    SCHEDULE_DEEPSPEED: "DeepSpeed's PipelineEngine runs every microbatch whole (it has no nanobatch overlap engine)"
}


def overlap_blocker(schedule: str) -> str | None:
    """Why `schedule`'s runtime cannot run 2 nanobatches (None: it can)."""
    if schedule not in SCHEDULE_NANOBATCHES:
        raise ConfigError(f"unknown pipeline schedule {schedule!r}; known: {', '.join(SCHEDULES)}")
    if 2 in SCHEDULE_NANOBATCHES[schedule]:
        return None
    return _NO_OVERLAP_WHY.get(schedule, f"the {schedule} schedule runs every microbatch whole")


def _check_counts(pp: int, num_microbatches: int, vp: int) -> None:
    for name, v in (("pp", pp), ("num_microbatches", num_microbatches), ("vp", vp)):
        if not isinstance(v, int) or v < 1:
            raise ConfigError(f"{name}={v!r} must be a positive integer")


def one_f_one_b_order(pp: int, num_microbatches: int) -> list[list[InstrKey]]:
    """Megatron non-interleaved 1F1B: per rank, warm-up forwards, 1F1B steady state, cool-down backwards."""
    orders = []
    m = num_microbatches
    for r in range(pp):
        warm = min(pp - r - 1, m)
        order: list[InstrKey] = [("forward", i, 0) for i in range(warm)]
        for i in range(m - warm):
            order.append(("forward", i + warm, 0))
            order.append(("backward", i, 0))
        order.extend(("backward", i, 0) for i in range(m - warm, m))
        orders.append(order)
    return orders


def interleaved_table(num_microbatches: int, vp: int, group_size: int) -> list[tuple[int, int]]:
    """Megatron's virtual-microbatch table: (microbatch, chunk) for each virtual microbatch id."""
    table: list[tuple[int, int]] = []
    for lo in range(0, num_microbatches, group_size):
        hi = num_microbatches if lo + group_size >= num_microbatches else lo + group_size
        table.extend((mb, c) for c in range(vp) for mb in range(lo, hi))
    return table


def interleaved_warmup(pp: int, rank: int, num_microbatches: int, vp: int, group_size: int) -> int:
    """Warm-up forwards of rank `rank` in megatron's interleaved schedule (capped at M vp)."""
    warm = 2 * (pp - rank - 1) + (vp - 1) * group_size
    return min(warm, num_microbatches * vp)


def interleaved_order(pp: int, num_microbatches: int, vp: int, group_size: int | None = None) -> list[list[InstrKey]]:
    """Megatron interleaved 1F1B order per rank; `group_size` = microbatch_group_size_per_vp_stage (default pp)."""
    g = pp if group_size is None else group_size
    if g < 1:
        raise ConfigError(f"microbatch group size {g} must be >= 1")
    # megatron-core 0.16.1 refuses these (its interleaved schedule would stall on dependency bubbles).
    if not pp <= g <= num_microbatches:
        raise InfeasibleConfigError(
            f"{SCHEDULE_INTERLEAVED}: the microbatch group size ({g}) must lie in "
            f"[pp={pp}, microbatches={num_microbatches}]; use more microbatches"
        )
    if 0 < num_microbatches % g < pp:
        raise InfeasibleConfigError(
            f"{SCHEDULE_INTERLEAVED}: microbatches ({num_microbatches}) modulo the group size "
            f"({g}) must be 0 or at least pp={pp}; use a multiple of {g}"
        )
    table = interleaved_table(num_microbatches, vp, g)
    total = len(table)

    def fwd(k: int) -> InstrKey:
        mb, c = table[k]
        return ("forward", mb, c)

    def bwd(k: int) -> InstrKey:
        mb, c = table[k]
        return ("backward", mb, vp - 1 - c)

    orders = []
    for r in range(pp):
        warm = interleaved_warmup(pp, r, num_microbatches, vp, g)
        order = [fwd(k) for k in range(warm)]
        for k in range(total - warm):
            order.append(fwd(k + warm))
            order.append(bwd(k))
        order.extend(bwd(k) for k in range(total - warm, total))
        orders.append(order)
    return orders


def deepspeed_train_order(pp: int, num_microbatches: int) -> list[list[InstrKey]]:
    """DeepSpeed TrainSchedule compute order per stage (idle steps dropped)."""
    m = num_microbatches
    orders = []
    for s in range(pp):
        order: list[InstrKey] = []
        kind: InstructionKind
        for t in range(2 * (m + pp - 1)):
            if t % 2 == s % 2:
                mb, kind = t // 2 - s // 2, "forward"
            else:
                mb, kind = t // 2 - pp + (s + 2) // 2, "backward"
            if 0 <= mb < m:
                order.append((kind, mb, 0))
        orders.append(order)
    return orders


def instruction_order(
    schedule: str, pp: int, num_microbatches: int, vp: int = 1, group_size: int | None = None
) -> list[list[InstrKey]]:
    """Order of (kind, microbatch, chunk) instructions on each pipeline rank for `schedule`."""
    _check_counts(pp, num_microbatches, vp)
    if schedule not in SCHEDULES:
        raise ConfigError(f"unknown pipeline schedule {schedule!r}; known: {', '.join(SCHEDULES)}")
    if schedule == SCHEDULE_INTERLEAVED:
        if pp < 2:
            raise InfeasibleConfigError(f"{SCHEDULE_INTERLEAVED} needs pp >= 2; use schedule {SCHEDULE_1F1B} for pp=1")
        return interleaved_order(pp, num_microbatches, vp, group_size)
    if vp != 1:
        raise InfeasibleConfigError(
            f"schedule {schedule} has no virtual chunks (vp={vp}); use {SCHEDULE_INTERLEAVED} or vp=1"
        )
    if schedule == SCHEDULE_1F1B:
        return one_f_one_b_order(pp, num_microbatches)
    return deepspeed_train_order(pp, num_microbatches)

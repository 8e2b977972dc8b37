"""The collectives the planner costs for one instruction, in the order the overlap engine issues them.

Terms: an *instruction* is the forward or the backward (with activation recompute: recompute, then backward)
of one microbatch through a chunk of ``layers`` alike transformer layers, run with 1 or 2 nanobatches, with or
without cross-layer overlap. Its *planned collectives* are those of the schedules its cost comes from
(search/partition.py ``chunk_schedule``, the same op lists and cuts as search/tables.py), one
``PlannedCollective`` each: phase, layer (0-based, model order inside the chunk), the collective (vocab
kind: ``tp_all_reduce``, ``tp_all_gather``, ``tp_reduce_scatter``, ``cp_all_gather``, ``cp_reduce_scatter``),
its message size (bytes, nccl-tests convention as in workload/opgraph.py: all-reduce the buffer, all-gather
the gathered output, reduce-scatter the input), the global ranks of its group, and its partner: the
partition whose compute runs beside it, ``"tail"`` (issued at once on NCCL's default SMs beside the
tails), or ``"exposed"``.

A 1-nanobatch instruction is costed as Megatron's order whatever the nanobatch count of its pair: the
engine keeps it so (runtime/overlap: a microbatch whose forward ran as two halves runs a 1-nanobatch
backward's collectives whole). tests/runtime/overlap/test_planned_is_run.py replays these lists against
the engine's trace (runtime/overlap/trace.py ``traced_collectives``) for every instruction kind.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kareus_megatron.search.options import instruction_phases
from kareus_megatron.search.partition import chunk_schedule, schedule_ops
from kareus_megatron.workload.opgraph import layer_ops


@dataclass(frozen=True, slots=True)
class PlannedCollective:
    """One collective an instruction's cost includes (see module docstring); bytes of the message."""

    phase: str
    layer: int
    collective: str
    bytes: int
    ranks: tuple[int, ...]
    partner: str

    def key(self) -> tuple[str, int, str, int, tuple[int, ...], str]:
        """The fields as a tuple (what the replay test compares)."""
        return (self.phase, self.layer, self.collective, self.bytes, self.ranks, self.partner)


def group_ranks(par: Any, group: str, rank: int) -> tuple[int, ...]:
    """Global ranks of `rank`'s "tp" or "cp" group in Megatron's rank order (TP innermost, then CP, DP, PP)."""
    grid = np.arange(par.pp * par.dp * par.cp * par.tp).reshape(par.pp, par.dp, par.cp, par.tp)
    if not 0 <= rank < grid.size:
        raise ValueError(f"rank {rank} is not in a job of {grid.size} GPUs")
    p, d, c, t = (int(i) for i in np.argwhere(grid == rank)[0])
    if group == "tp":
        return tuple(int(r) for r in grid[p, d, c, :])
    if group == "cp":
        return tuple(int(r) for r in grid[p, d, :, t])
    raise ValueError(f"group must be 'tp' or 'cp', not {group!r}")


def instruction_collectives(
    model: Any, par: Any, kind: str, nanobatches: int, layers: int = 1, cross_layer: bool = False, rank: int = 0
) -> list[PlannedCollective]:
    """Planned collectives of a `kind` instruction through `layers` layers with `nanobatches` nanobatches, on
    global rank `rank`, phases in order, each phase in issue order (cross_layer: the chunk's layers overlap
    across layer boundaries, 2 nanobatches only, as the planner's options model it)."""
    out: list[PlannedCollective] = []
    for phase in instruction_phases(par, kind):
        if nanobatches > 1:
            ops = schedule_ops(model, par, phase, nanobatches)
        else:
            ops = layer_ops(model, par, phase, 1)
        if cross_layer and nanobatches > 1:
            issues = chunk_schedule(phase, ops, nanobatches, layers).issues
        else:
            one = chunk_schedule(phase, ops, nanobatches, 1).issues
            issues = tuple(type(i)(i.collective, i.partner, k) for k in range(layers) for i in one)
        for i in issues:
            op = i.collective
            model_layer = layers - 1 - i.layer if phase == "backward" else i.layer  # backward walks top down
            out.append(
                PlannedCollective(
                    phase=phase,
                    layer=model_layer,
                    collective=op.collective,
                    bytes=int(round(op.comm_bytes)),
                    ranks=group_ranks(par, op.collective.split("_", 1)[0], rank),
                    partner=i.partner,
                )
            )
    return out

"""The planner's per-instruction collective list (search/collective_list.py) and what it is made of: the issue
order of the schedules (search/partition.py ``LayerSchedule.issues``), group ranks, and selective recompute
inside the backward (``schedule_ops``). The replay against the engine: tests/runtime/overlap/test_planned_is_run.py.
"""

from __future__ import annotations

from collections import Counter

import pytest

from kareus_megatron.search.collective_list import group_ranks, instruction_collectives
from kareus_megatron.search.partition import PARTNER_EXPOSED, PARTNER_TAIL, chunk_schedule, schedule_ops
from kareus_megatron.workload.models import model_spec
from kareus_megatron.workload.opgraph import layer_ops
from kareus_megatron.workload.parallel import make_parallel

MODEL = model_spec("llama3.2-3b")
LAYOUTS = {
    "tp": dict(tp=8),
    "tp+sp": dict(tp=8, sequence_parallel=True),
    "tp+cp": dict(tp=4, cp=2),
    "tp+sp+cp": dict(tp=4, cp=2, sequence_parallel=True),
    "cp": dict(tp=1, cp=2, nodes=1, gpus_per_node=4),
}


def _par(recompute="none", **kw):
    base = dict(
        tp=8,
        pp=2,
        micro_batch_size=8,
        seq_length=4096,
        num_microbatches=8,
        recompute=recompute,
        nodes=2,
        gpus_per_node=8,
        first_stage_layers=15,
        last_stage_layers=13,
    )
    base.update(kw)
    return make_parallel(MODEL, **base)


@pytest.mark.parametrize("layers", [1, 3])
@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("phase", ["forward", "recompute", "backward"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_issues_are_the_costed_collectives_with_their_partners(layout, phase, n, layers):
    """Every collective the schedule costs (instances: their partition; fixed: tail; exposed) appears once in
    ``issues``, and nothing else."""
    par = _par("full", **LAYOUTS[layout])
    s = chunk_schedule(phase, layer_ops(MODEL, par, phase, n), n, layers)
    costed = Counter(
        [(id(i.collective), i.name if i.name != "tail" else PARTNER_TAIL) for i in s.instances]
        + [(id(i.collective), PARTNER_TAIL) for i in s.fixed]
        + [(id(c), PARTNER_EXPOSED) for c in s.exposed]
    )
    assert Counter((id(i.collective), i.partner) for i in s.issues) == costed
    assert {i.layer for i in s.issues} == (set(range(layers)) if s.issues else set())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_one_nanobatch_is_megatrons_order_whatever_the_pair(layout):
    par = _par("full", **LAYOUTS[layout])
    got = instruction_collectives(MODEL, par, "backward", 1, layers=2)
    want = [
        (ph, k, op.collective, round(op.comm_bytes))
        for ph in ("recompute", "backward")
        for k in ((0, 1) if ph == "recompute" else (1, 0))
        for op in layer_ops(MODEL, par, ph, 1)
        if op.kind == "collective"
    ]
    assert [(c.phase, c.layer, c.collective, c.bytes) for c in got] == want
    assert {c.partner for c in got} == {PARTNER_EXPOSED}


def test_sp_backward_counts_and_halves():
    """TP+SP: a 1-nanobatch backward has 4 whole collectives per layer; a 2-nanobatch one 8 halves."""
    par = _par(**LAYOUTS["tp+sp"])
    one = instruction_collectives(MODEL, par, "backward", 1)
    two = instruction_collectives(MODEL, par, "backward", 2)
    assert len(one) == 4 and len(two) == 8
    assert {c.bytes for c in one} == {2 * c.bytes for c in two}
    assert [c.partner for c in two] == [
        PARTNER_EXPOSED,
        PARTNER_EXPOSED,
        "bwd_sp_mlp",
        "bwd_sp_attn_norm",
        "bwd_sp_attn_norm",
        "bwd_sp_attn",
        "bwd_sp_attn",
        PARTNER_TAIL,
    ]


def test_group_ranks_in_megatrons_order():
    par = make_parallel(MODEL, tp=2, cp=2, pp=2, dp=2, micro_batch_size=2, seq_length=4096, gpus_per_node=8, nodes=2)
    assert group_ranks(par, "tp", 5) == (4, 5)  # TP innermost
    assert group_ranks(par, "cp", 5) == (5, 7)  # then CP
    assert group_ranks(par, "tp", 13) == (12, 13)
    with pytest.raises(ValueError, match="rank 16"):
        group_ranks(par, "tp", 16)
    with pytest.raises(ValueError, match="'tp' or 'cp'"):
        group_ranks(par, "dp", 0)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_selective_recompute_runs_inside_the_backward(layout):
    """Selective recompute: the core attention is recomputed right before the attention backward, in the segment
    that ends at its collective (so beside the collective that segment's partition overlaps); the recompute phase
    of a 2-nanobatch schedule is empty; every op still runs once per nanobatch; slot ``attention`` is before it."""
    par = _par("selective", **LAYOUTS[layout])
    assert schedule_ops(MODEL, par, "recompute", 2) == ()
    ops = schedule_ops(MODEL, par, "backward", 2)
    names = [op.name for op in ops]
    at = names.index("attention")
    assert ops[at].phase == "recompute" and ops[at + 1].name == "attention" and ops[at + 1].phase == "backward"
    s = chunk_schedule("backward", ops, 2, 1)
    ran = list(s.alone) + [op for i in (*s.instances, *s.fixed) for op in i.compute]
    compute = [op for op in ops if op.kind != "collective"]
    assert Counter(map(id, ran)) == Counter({id(op): 2 for op in compute})
    holder = next(i for i in s.instances if ops[at] in i.compute)
    assert (
        holder.slots.count("attention") == 1
        and holder.compute[holder.slot_positions[holder.slots.index("attention")]] is ops[at]
    )
    assert schedule_ops(MODEL, _par("full", **LAYOUTS[layout]), "backward", 2) == layer_ops(
        MODEL, _par("full", **LAYOUTS[layout]), "backward", 2
    )

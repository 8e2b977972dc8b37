"""Sequence-parallel partitions: the SP layer cut into segments, its schedule, tables and options."""

from __future__ import annotations

import numpy as np
import pytest

from kareus_megatron.cost.kernel import KernelModel
from kareus_megatron.cost.overlap import OverlapCost
from kareus_megatron.hardware.gpus import gpu_spec
from kareus_megatron.search import options as opt
from kareus_megatron.search.partition import layer_schedule, split_segments
from kareus_megatron.search.tables import comm_sms_range
from kareus_megatron.vocab import PARTITION_COLLECTIVE, PARTITION_SLOTS, SP_PARTITION_SLOTS, partitions_for
from kareus_megatron.workload.models import model_spec
from kareus_megatron.workload.opgraph import layer_ops
from kareus_megatron.workload.parallel import make_parallel

GPU = gpu_spec("a100-sxm4-40gb")
MODEL = model_spec("llama3.2-3b")


def _par(**kw):
    base = dict(
        tp=8,
        pp=2,
        micro_batch_size=8,
        seq_length=4096,
        num_microbatches=8,
        recompute="full",
        nodes=2,
        gpus_per_node=8,
        first_stage_layers=15,
        last_stage_layers=13,
        sequence_parallel=True,
    )
    base.update(kw)
    return make_parallel(MODEL, **base)


PAR = _par()


@pytest.fixture(scope="module")
def kernel():
    return KernelModel(GPU)


def test_sp_segments_and_partition_names():
    fwd = split_segments("forward", layer_ops(MODEL, PAR, "forward", 2))
    assert [(s.partition, s.collective.collective) for s in fwd] == [
        ("fwd_sp_attn_norm", "tp_all_gather"),
        ("fwd_sp_attn", "tp_reduce_scatter"),
        ("fwd_sp_mlp_norm", "tp_all_gather"),
        ("fwd_sp_mlp", "tp_reduce_scatter"),
    ]
    bwd = split_segments("backward", layer_ops(MODEL, PAR, "backward", 2))
    # the leading all-gather of the output gradient: no compute before it, no partition
    assert bwd[0].compute == () and bwd[0].partition is None and bwd[0].collective.collective == "tp_all_gather"
    assert [s.partition for s in bwd[1:]] == ["bwd_sp_mlp", "bwd_sp_attn_norm", "bwd_sp_attn", None]
    for seg in (*fwd, *bwd[1:-1]):
        assert seg.slots == SP_PARTITION_SLOTS[seg.partition]  # slots are exactly the segment's ops
        assert PARTITION_COLLECTIVE[seg.partition] == seg.collective.collective
    assert [op.name for op in bwd[-1].compute] == ["input_norm"]


def test_sp_schedule_counts_and_exposed_collectives():
    fwd = layer_schedule("forward", layer_ops(MODEL, PAR, "forward", 2), 2)
    assert [i.name for i in fwd.instances] == [
        "fwd_sp_attn_norm",
        "fwd_sp_attn",
        "fwd_sp_attn",
        "fwd_sp_mlp_norm",
        "fwd_sp_mlp_norm",
        "fwd_sp_mlp",
        "fwd_sp_mlp",
    ]
    assert [op.name for op in fwd.alone] == ["input_norm"] and fwd.fixed == ()
    assert [op.name for op in fwd.exposed] == ["mlp_tp_reduce_scatter"]
    bwd = layer_schedule("backward", layer_ops(MODEL, PAR, "backward", 2), 2)
    assert [i.name for i in bwd.instances] == [
        "bwd_sp_mlp",
        "bwd_sp_attn_norm",
        "bwd_sp_attn_norm",
        "bwd_sp_attn",
        "bwd_sp_attn",
    ]
    assert [op.name for op in bwd.exposed] == ["mlp_tp_all_gather"] * 2  # leading all-gather, each nanobatch
    assert [(i.slots, i.collective.collective) for i in bwd.fixed] == [(("input_norm",), "tp_reduce_scatter")]
    for s in (fwd, bwd):
        for name, slots in s.slots().items():
            assert slots == PARTITION_SLOTS[name]
    assert set(fwd.partition_names()) == set(partitions_for("forward", 1, sp=True))
    assert set(bwd.partition_names()) == set(partitions_for("backward", 1, sp=True))


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize(("cp", "phase"), [(1, "forward"), (1, "backward"), (2, "forward"), (2, "backward")])
def test_sp_schedule_runs_every_op_and_collective_once_per_nanobatch(n, cp, phase):
    par = _par(tp=8 // cp, cp=cp)
    ops = layer_ops(MODEL, par, phase, n)
    compute = [op for op in ops if op.kind != "collective"]
    colls = [op for op in ops if op.kind == "collective"]
    s = layer_schedule(phase, ops, n)
    ran = list(s.alone) + [op for i in (*s.instances, *s.fixed) for op in i.compute]
    assert sorted(op.name for op in ran) == sorted(op.name for op in compute * n)
    issued = [i.collective for i in (*s.instances, *s.fixed)] + list(s.exposed)
    assert sorted(c.name for c in issued) == sorted(c.name for c in colls * n)
    if n > 1:
        leading = 1 if phase == "backward" else 0
        assert len(s.instances) == n * (len(colls) - leading) - 1


def test_two_nanobatch_compute_is_twice_one_nanobatch_compute():
    """Work is conserved: 2 nanobatches of half the batch do the FLOP and bytes of 1 whole microbatch."""
    for phase in ("forward", "backward"):
        one = layer_ops(MODEL, PAR, phase, 1)
        two = layer_ops(MODEL, PAR, phase, 2)
        s = layer_schedule(phase, two, 2)
        ran = list(s.alone) + [op for i in (*s.instances, *s.fixed) for op in i.compute]
        assert sum(op.flops for op in ran) == pytest.approx(sum(op.flops for op in one if op.kind != "collective"))
        issued = [i.collective for i in (*s.instances, *s.fixed)] + list(s.exposed)
        assert sum(c.comm_bytes for c in issued) == pytest.approx(
            sum(op.comm_bytes for op in one if op.kind == "collective")
        )


def test_sp_tables_cost_every_partition_within_bounds(kernel):
    ad = OverlapCost(kernel)
    clocks = np.array([1410.0, 1110.0])
    for phase in ("forward", "backward"):
        for inst in layer_schedule(phase, layer_ops(MODEL, PAR, phase, 2), 2).instances:
            sms = comm_sms_range(GPU, inst.name).astype(float)
            t, e = ad.instance(inst, clocks, sms)
            assert t.shape == (2, len(inst.slots), sms.size) and np.all(np.isfinite(e))
            a, _, _, _ = ad.compute(inst.compute, clocks[:, None])
            coll, _, _, _ = ad.collective(inst.collective, clocks, sms)
            assert np.all(t >= np.maximum(a.sum(axis=0), coll)[:, None, :] * (1 - 1e-9)), inst.name
            assert np.all(e >= GPU.static_power_w * t), inst.name


def test_kareus_plans_two_nanobatches_with_sp(kernel):
    opts = opt.build_options(GPU, MODEL, PAR, kernel, "kareus", clocks_mhz=(1410, 1110))
    for (_s, _c, kind), o in opts.items():
        assert 2 in set(o.nanobatches.tolist()), kind
        names = set(partitions_for(kind, 1, recompute=True, sp=True))
        for nb, parts in zip(o.nanobatches, o.partitions):
            assert parts == {} if nb == 1 else set(parts) == names
            for name, (sms, slot) in parts.items():
                assert 1 <= sms < GPU.sm_count and slot in SP_PARTITION_SLOTS[name]
    nbp = opt.build_options(GPU, MODEL, PAR, kernel, "nanobatch_perseus", clocks_mhz=(1410,))
    assert all(set(o.nanobatches.tolist()) == {2} for o in nbp.values())


def test_sp_comm_sm_grid_uses_gather_algorithms_on_hopper():
    h100 = gpu_spec("h100-sxm5-80gb")
    sp, ar = comm_sms_range(h100, "fwd_sp_attn"), comm_sms_range(h100, "fwd_attn")
    assert sp[0] == 1 and np.all(np.diff(sp) == 1) and ar[0] == 2  # all-gather/reduce-scatter grid, step 1
    assert comm_sms_range(GPU, "bwd_sp_attn_norm").tolist() == comm_sms_range(GPU, "bwd_attn").tolist()

"""Cross-layer overlap in the planner's model: chunk schedules, their tables and options, and the plan flag."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from kareus_megatron.cost.kernel import KernelModel
from kareus_megatron.cost.overlap import OverlapCost
from kareus_megatron.hardware.gpus import gpu_spec
from kareus_megatron.search import options as opt
from kareus_megatron.search.partition import chunk_schedule, layer_schedule
from kareus_megatron.search.tables import _overlap_tables, phase_table
from kareus_megatron.vocab import BACKWARD_TAIL, PARTITION_SLOTS
from kareus_megatron.workload.models import model_spec
from kareus_megatron.workload.opgraph import layer_ops
from kareus_megatron.workload.parallel import make_parallel

GPU = gpu_spec("a100-sxm4-40gb")
MODEL = model_spec("llama3.2-3b")
LAYOUTS = {  # name -> make_parallel overrides
    "tp": dict(tp=8),
    "tp+sp": dict(tp=8, sequence_parallel=True),
    "tp+cp": dict(tp=4, cp=2),
    "tp+sp+cp": dict(tp=4, cp=2, sequence_parallel=True),
    "cp": dict(tp=1, cp=2, nodes=1, gpus_per_node=4),
}
PHASES = ("forward", "recompute", "backward")


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
    )
    base.update(kw)
    return make_parallel(MODEL, **base)


@pytest.fixture(scope="module")
def kernel():
    return KernelModel(GPU)


def _ran(s):
    return list(s.alone) + [op for i in (*s.instances, *s.fixed) for op in i.compute]


def _issued(s):
    return [i.collective for i in (*s.instances, *s.fixed)] + list(s.exposed)


@pytest.mark.parametrize("layers", [1, 2, 3, 5])
@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_chunk_runs_every_op_and_collective_once_per_nanobatch_per_layer(layout, phase, layers):
    par = _par(**LAYOUTS[layout])
    ops = layer_ops(MODEL, par, phase, 2)
    whole = layer_ops(MODEL, par, phase, 1)  # the microbatch, 1 nanobatch
    s = chunk_schedule(phase, ops, 2, layers)
    compute = [op for op in ops if op.kind != "collective"]
    colls = [op for op in ops if op.kind == "collective"]
    assert Counter(op.name for op in _ran(s)) == Counter(op.name for op in compute * (2 * layers))
    flops_2 = sum(op.flops for op in _ran(s))
    flops_1 = layers * sum(op.flops for op in whole if op.kind != "collective")
    assert np.isclose(flops_2, flops_1)  # 2 nanobatches compute what 1 microbatch does
    assert Counter(op.name for op in _issued(s)) == Counter(op.name for op in colls * (2 * layers))
    # only the chunk's ends are outside a partition: as many as in ONE layer without cross-layer overlap
    one = layer_schedule(phase, ops, 2)
    assert len(s.exposed) == len(one.exposed)  # exposed: only the chunk's ends, as in ONE layer
    assert len(s.fixed) == len(one.fixed) + (layers - 1) * _boundary_fixed(one)
    assert len(s.instances) == len(_issued(s)) - len(s.exposed) - len(s.fixed)
    for inst in s.instances:  # added instances use the existing names and launch slots
        assert set(inst.slots) <= set(PARTITION_SLOTS[inst.name]) and inst.slots == one.slots()[inst.name]


def _boundary_fixed(one):
    """Steps on NCCL's default SMs per inner layer boundary: the tail (+ next first segment) beside the last
    collective, and with a leading collective (SP backward) the tail of each nanobatch."""
    if not one.fixed:
        return 0  # no tail: the boundary is a partition instance
    leading = len(one.exposed)  # exposed with a tail: the leading collective of each nanobatch
    return leading or 1


@pytest.mark.parametrize("phase", PHASES)
def test_tp_chunk_exposes_exactly_one_collective_per_phase(phase):
    ops = layer_ops(MODEL, _par(), phase, 2)
    for layers in (1, 4, 15):
        s = chunk_schedule(phase, ops, 2, layers)
        # the chunk's last collective only: forward exposed; backward beside nb0's tail and nothing else
        lone = [i for i in s.fixed if {op.name for op in i.compute} <= set(BACKWARD_TAIL)]
        assert len(s.exposed) + len(lone) == 1
        assert [op.name for op in s.alone] == [op.name for op in layer_schedule(phase, ops, 2).alone]


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_chunk_is_first_layer_plus_increments(layout, phase):
    ops = layer_ops(MODEL, _par(**LAYOUTS[layout]), phase, 2)
    one, inc = layer_schedule(phase, ops, 2), layer_schedule(phase, ops, 2, cross_layer=True)
    assert inc.exposed == () and inc.alone == ()  # inside a chunk nothing runs alone or exposed
    for layers in (1, 2, 6):
        s = chunk_schedule(phase, ops, 2, layers)
        for field in ("alone", "instances", "fixed", "exposed"):
            want = Counter(map(repr, getattr(one, field) + getattr(inc, field) * (layers - 1)))
            assert Counter(map(repr, getattr(s, field))) == want, field


def test_one_nanobatch_is_unchanged():
    ops = layer_ops(MODEL, _par(), "forward", 1)
    assert layer_schedule("forward", ops, 1, cross_layer=True) == layer_schedule("forward", ops, 1)


def _chunk_cost(adapter, phase, par, clock, layers, knob):
    """(time s, energy J) of a whole chunk costed directly from chunk_schedule, every partition at `knob`."""
    sched = chunk_schedule(phase, layer_ops(MODEL, par, phase, 2), 2, layers)
    clocks = np.array([float(clock)])
    t, e, tables = _overlap_tables(adapter, sched, clocks)
    t, e = float(t[0]), float(e[0])
    for pt in tables.values():
        j = int(np.flatnonzero(pt.comm_sms == knob)[0])
        t, e = t + float(pt.time_s[0, 0, j]), e + float(pt.energy_j[0, 0, j])
    return t, e


@pytest.mark.parametrize("layout", ["tp", "tp+sp", "tp+cp", "cp"])
def test_tables_cost_the_chunk_schedule_exactly(kernel, layout):
    par = _par(**LAYOUTS[layout])
    adapter = OverlapCost(kernel, precision=par.precision)
    tables = opt.LayerTables(GPU, MODEL, par, kernel, (1410,), cross_layer=True)
    sms = adapter.default_sms
    for kind in ("forward", "backward"):
        layers = par.chunk_layers(0, 0)
        config = {
            n: (sms, pt.slots[0])
            for ph in opt.instruction_phases(par, kind)
            for n, pt in tables.phases[ph].partitions.items()
        }
        t, e = opt.evaluate_overlap(tables, 0, 0, kind, 1410, config)
        et, ee = tables.extras(0, 0, kind)
        want_t, want_e = float(et[0]), float(ee[0])
        for ph in opt.instruction_phases(par, kind):
            ct, ce = _chunk_cost(adapter, ph, par, 1410, layers, sms)
            want_t, want_e = want_t + ct, want_e + ce
        assert np.isclose(t, want_t, rtol=1e-9) and np.isclose(e, want_e, rtol=1e-9), kind


@pytest.mark.parametrize("layout", LAYOUTS)
def test_cross_layer_is_never_slower(kernel, layout):
    par = _par(**LAYOUTS[layout])
    clocks = (1410, 1110, 810)
    plain = opt.LayerTables(GPU, MODEL, par, kernel, clocks)
    cross = opt.LayerTables(GPU, MODEL, par, kernel, clocks, cross_layer=True)
    assert all(t.inner is None for t in plain.phases.values())
    for stage in range(par.pp):
        for kind in ("forward", "backward"):
            for ci in range(len(clocks)):
                for default_only in (True, False):
                    tp, _, _ = plain.overlapped(stage, 0, kind, ci, default_only)
                    tc, _, _ = cross.overlapped(stage, 0, kind, ci, default_only)
                    assert tc.min() <= tp.min() * (1 + 1e-12), (stage, kind, ci, default_only)
                    if layout in ("tp", "tp+sp"):  # an exposed collective per layer is gone: strictly faster
                        assert tc.min() < tp.min() * (1 - 1e-3)


def test_phase_table_terms(kernel):
    clocks = [1410, 1110]
    adapter = OverlapCost(kernel)
    p = _par()
    for ph in PHASES:
        a = phase_table(adapter, MODEL, p, ph, clocks, 2)
        b = phase_table(adapter, MODEL, p, ph, clocks, 2, cross_layer=True)
        assert b.terms(1) == [(1, b)] and a.terms(7) == [(7, a)]
        assert np.array_equal(a.alone_time_s, b.alone_time_s)
        assert [m for m, _ in b.terms(7)] == [1, 6]

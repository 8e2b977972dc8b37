"""Per-instruction options: the joint search against the baselines on the reference configuration."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kareus_megatron.cost.kernel import KernelModel
from kareus_megatron.errors import InfeasibleConfigError
from kareus_megatron.hardware.gpus import gpu_spec
from kareus_megatron.search import options as opt
from kareus_megatron.search import partition as partition_mod
from kareus_megatron.search import tables as tables_mod
from kareus_megatron.search.partition import layer_schedule
from kareus_megatron.vocab import MAX_COMM_SM_VALUES, PARTITION_SLOTS, partitions_for
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
    )
    base.update(kw)
    return make_parallel(MODEL, **base)


PAR = _par()


@pytest.fixture(scope="module")
def kernel():
    return KernelModel(GPU)


@pytest.fixture(scope="module")
def all_options(kernel):
    return {m: opt.build_options(GPU, MODEL, PAR, kernel, m) for m in opt.OPTION_METHODS}


def test_layer_partition_counts_match_the_engine_schedule():
    fwd = layer_schedule("forward", layer_ops(MODEL, PAR, "forward", 2), 2)
    assert [i.name for i in fwd.instances] == ["fwd_attn", "fwd_mlp", "fwd_mlp"]
    assert [op.name for op in fwd.alone] == list(PARTITION_SLOTS["fwd_attn"])  # nb0's first segment
    assert [op.name for op in fwd.exposed] == ["mlp_tp_all_reduce"] and fwd.fixed == ()
    bwd = layer_schedule("backward", layer_ops(MODEL, PAR, "backward", 2), 2)
    assert [i.name for i in bwd.instances] == ["bwd_mlp", "bwd_attn", "bwd_attn"]
    assert [op.name for op in bwd.alone] == ["fc2", "activation", "fc1", "input_norm"]  # nb0 first, nb1 tail
    assert [(i.slots, i.collective.name) for i in bwd.fixed] == [(("input_norm",), "attn_tp_all_reduce")]
    assert bwd.exposed == ()
    for sched in (fwd, bwd):
        for name, slots in sched.slots().items():
            assert slots == PARTITION_SLOTS[name]


def test_options_are_sorted_pareto_sets_with_valid_knobs(all_options):
    for opts in all_options.values():
        assert set(opts) == {(s, 0, k) for s in range(2) for k in ("forward", "backward")}
        for (_stage, _chunk, kind), o in opts.items():
            assert len(o) >= 1 and o.time_s.shape == o.energy_j.shape == o.clock_mhz.shape == o.nanobatches.shape
            assert np.all(np.diff(o.time_s) > 0) and np.all(np.diff(o.energy_j) < 0)
            assert len(o.partitions) == len(o)
            names = set(partitions_for(kind, PAR.cp, recompute=True))
            for nb, parts in zip(o.nanobatches, o.partitions):
                assert parts == {} if nb == 1 else set(parts) == names
                for name, (sms, slot) in parts.items():
                    assert 1 <= sms < GPU.sm_count and slot in PARTITION_SLOTS[name]
    assert len(all_options["megatron"][(0, 0, "forward")]) == 1
    assert set(all_options["perseus"][(1, 0, "backward")].nanobatches) == {1}
    assert set(all_options["nanobatch_perseus"][(1, 0, "backward")].nanobatches) == {2}


def test_one_nanobatch_matches_the_kernel_model(all_options, kernel):
    for (stage, chunk, kind), o in all_options["megatron"].items():
        t, e = kernel.instruction_cost(MODEL, PAR, stage, kind, np.array([1410.0]), chunk)
        assert o.clock_mhz[0] == 1410 and np.isclose(o.time_s[0], t[0]) and np.isclose(o.energy_j[0], e[0])
    o = all_options["perseus"][(0, 0, "backward")]
    t, e = kernel.instruction_cost(MODEL, PAR, 0, "backward", o.clock_mhz.astype(float), 0)
    assert np.allclose(o.time_s, t) and np.allclose(o.energy_j, e)


def test_nanobatch_baseline_uses_nccl_defaults(all_options, kernel):
    default = opt.layer_tables(GPU, MODEL, PAR, kernel, GPU.clock_grid_mhz()).adapter.default_sms
    assert default == 24
    for o in all_options["nanobatch_perseus"].values():
        for parts in o.partitions:
            assert all(sms == default and slot == PARTITION_SLOTS[n][0] for n, (sms, slot) in parts.items())


def test_no_baseline_option_dominates_the_joint_frontier(all_options):
    for key, joint in all_options["kareus"].items():
        for method in ("megatron", "perseus", "nanobatch_perseus"):
            base = all_options[method][key]
            strictly = (base.time_s[:, None] < joint.time_s[None, :]) & (
                base.energy_j[:, None] < joint.energy_j[None, :]
            )
            assert not strictly.any(), (key, method)
            # and every baseline option is matched or beaten by some joint option
            covered = (joint.time_s[None, :] <= base.time_s[:, None] * (1 + 1e-12)) & (
                joint.energy_j[None, :] <= base.energy_j[:, None] * (1 + 1e-12)
            )
            assert covered.any(axis=1).all(), (key, method)


def test_chosen_knobs_shift_with_the_clock(kernel):
    grid = GPU.clock_grid_mhz()
    tables = opt.layer_tables(GPU, MODEL, PAR, kernel, grid)
    hi = {(f.phase, f.name): (int(f.comm_sms[0]), f.slot[0]) for f in opt.partition_frontiers(tables, grid[0])}
    lo = {(f.phase, f.name): (int(f.comm_sms[0]), f.slot[0]) for f in opt.partition_frontiers(tables, grid[-1])}
    assert set(hi) == set(lo) and len(hi) == 6
    assert any(hi[k] != lo[k] for k in hi), (hi, lo)


def test_evaluate_overlap_reproduces_the_joint_options(all_options, kernel):
    tables = opt.layer_tables(GPU, MODEL, PAR, kernel, GPU.clock_grid_mhz())
    o = all_options["kareus"][(1, 0, "backward")]
    for k in (0, len(o) // 2, len(o) - 1):
        if o.nanobatches[k] == 2:
            t, e = opt.evaluate_overlap(tables, 1, 0, "backward", int(o.clock_mhz[k]), o.partitions[k])
            assert np.isclose(t, o.time_s[k]) and np.isclose(e, o.energy_j[k])


def _patch_layer_ops(monkeypatch, fn):
    """The op lists of both the 1-nanobatch tables (tables.py) and the overlap schedules (partition.py)."""
    monkeypatch.setattr(tables_mod, "layer_ops", fn)
    monkeypatch.setattr(partition_mod, "layer_ops", fn)


def test_zero_byte_collectives_never_make_two_nanobatches_win(kernel, monkeypatch):
    def no_bytes(ops):
        return tuple(dataclasses.replace(op, comm_bytes=0.0) if op.kind == "collective" else op for op in ops)

    _patch_layer_ops(monkeypatch, lambda *a, **k: no_bytes(layer_ops(*a, **k)))
    clocks = (1410, 1110, 870)
    tables = opt.LayerTables(GPU, MODEL, PAR, kernel, clocks)
    for kind in ("forward", "backward"):
        t1, e1 = tables.sequential(0, 0, kind)
        for ci in range(len(clocks)):
            t2, e2, _ = tables.overlapped(0, 0, kind, ci)
            assert np.all(t2 >= t1[ci] * (1 - 1e-12)) and np.all(e2 >= e1[ci] * (1 - 1e-12))


def test_context_parallel_partitions(kernel):
    par = _par(tp=4, cp=2)
    opts = opt.build_options(GPU, MODEL, par, kernel, "kareus", clocks_mhz=(1410, 1110))
    o = opts[(0, 0, "backward")]
    two = [p for p, nb in zip(o.partitions, o.nanobatches) if nb == 2]
    assert two and set(two[0]) == set(partitions_for("backward", 2, recompute=True))
    tables = opt.layer_tables(GPU, MODEL, par, kernel, (1410, 1110))
    cp_range = tables.phases["forward"].partitions["fwd_cp_kv"].comm_sms
    # CP range 1..20 + NCCL default 24, thinned to the comm-SM budget (ends and default kept; test_knob_budget.py)
    assert {1, 20, 24} <= set(cp_range.tolist()) and cp_range.size == MAX_COMM_SM_VALUES


def test_layouts_without_overlap(kernel):
    # sequence parallelism is planned with 2 nanobatches: tests/search/test_partition_sp.py
    odd = _par(micro_batch_size=3)
    with pytest.raises(InfeasibleConfigError, match="divide the microbatch"):
        opt.build_options(GPU, MODEL, odd, kernel, "nanobatch_perseus", clocks_mhz=(1410,))


def test_comm_sm_ranges_scale_with_the_gpu():
    h100 = gpu_spec("h100-sxm5-80gb")
    assert tables_mod.scale_sms(GPU, tables_mod.TP_COMM_SMS_A100).tolist() == list(range(3, 31, 3))
    scaled = tables_mod.scale_sms(h100, tables_mod.TP_COMM_SMS_A100)
    assert scaled[0] == 4 and scaled[-1] == 37 and np.all(np.diff(scaled) > 0)


def test_long_collectives_bound_the_overlap_gain_by_compute(kernel, monkeypatch):
    def scaled(factor):
        def ops(*a, **k):
            return tuple(
                dataclasses.replace(op, comm_bytes=op.comm_bytes * factor) if op.kind == "collective" else op
                for op in layer_ops(*a, **k)
            )

        return ops

    clocks = (1410, 870)
    _patch_layer_ops(monkeypatch, scaled(0.0))
    compute_only = opt.LayerTables(GPU, MODEL, PAR, kernel, clocks)
    _patch_layer_ops(monkeypatch, scaled(1000.0))
    slow_comm = opt.LayerTables(GPU, MODEL, PAR, kernel, clocks)
    for kind in ("forward", "backward"):
        t_compute, _ = compute_only.sequential(0, 0, kind)
        t1, _ = slow_comm.sequential(0, 0, kind)
        for ci in range(len(clocks)):
            # same comm SMs as the 1-nanobatch run, so the whole difference is the overlap
            t2, _, _ = slow_comm.overlapped(0, 0, kind, ci, default_only=True)
            gain = t1[ci] - t2.min()
            assert 0.0 < gain <= t_compute[ci]


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize(("cp", "phase"), [(1, "forward"), (1, "backward"), (2, "forward"), (2, "backward")])
def test_schedule_runs_every_op_of_every_nanobatch_once(n, cp, phase):
    par = _par(tp=8 // cp, cp=cp)
    ops = layer_ops(MODEL, par, phase, n)
    compute = [op for op in ops if op.kind != "collective"]
    colls = [op for op in ops if op.kind == "collective"]
    s = layer_schedule(phase, ops, n)
    ran = list(s.alone) + [op for i in (*s.instances, *s.fixed) for op in i.compute]
    assert sorted(op.name for op in ran) == sorted(op.name for op in compute * n)
    issued = [i.collective for i in (*s.instances, *s.fixed)] + list(s.exposed)
    assert len(issued) == len(colls) * n  # every collective of every nanobatch runs once
    if n > 1:
        assert len(s.instances) == n * len(colls) - 1


def test_max_points_thins_keeping_both_ends(all_options, kernel):
    full = all_options["kareus"][(0, 0, "backward")]
    thin = opt.build_options(GPU, MODEL, PAR, kernel, "kareus", max_points=5)[(0, 0, "backward")]
    assert 2 <= len(thin) <= 5 < len(full)
    assert thin.time_s[0] == full.time_s[0] and thin.energy_j[-1] == full.energy_j[-1]

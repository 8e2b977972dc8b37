"""Partition simulation: properties of the overlap model on random inputs and on the real cost model."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kareus_megatron.cost.partition import PhaseArrays, contention, sequential_time_energy, simulate_overlap

STATIC_W = 56.0

pos = st.floats(1e-6, 1e-2, allow_nan=False)


@st.composite
def partitions(draw, max_ops=5):
    """Random partition: per op alone time a, reduced-SM time b ≥ a, contention r in [1, 2], collective C."""
    n = draw(st.integers(1, max_ops))
    a = np.array(draw(st.lists(pos, min_size=n, max_size=n)))
    slow = np.array(draw(st.lists(st.floats(1.0, 3.0), min_size=n, max_size=n)))
    r = np.array(draw(st.lists(st.floats(1.0, 2.0), min_size=n, max_size=n)))
    coll = draw(st.floats(0.0, 5e-2))
    pa = np.array(draw(st.lists(st.floats(STATIC_W, 400.0), min_size=n, max_size=n)))
    po = np.array(draw(st.lists(st.floats(STATIC_W, 400.0), min_size=n, max_size=n)))
    pc = draw(st.floats(STATIC_W, 200.0))
    b = a * slow
    return a, b, r, coll, pa, po, pc


def _arrays(a, b, r, coll, pa, po, pc) -> PhaseArrays:
    return PhaseArrays(a_s=a, pa_w=pa, w_s=b * r, rho=1.0 / r, po_w=po, coll_s=np.asarray(coll), pc_w=np.asarray(pc))


def _reference(a, b, r, coll, pa, po, pc, k):
    """Event-by-event scalar simulation of slot k (the test oracle)."""
    t = e = 0.0
    left = coll
    for i in range(len(a)):
        if i < k or left <= 0.0:
            t += a[i]
            e += a[i] * pa[i]
            continue
        full_prog = b[i]  # progress of the collective if it stays beside op i throughout
        f = min(left / full_prog, 1.0)
        t += f * b[i] * r[i] + (1 - f) * a[i]
        e += f * b[i] * r[i] * po[i] + (1 - f) * a[i] * pa[i]
        left -= f * full_prog
    left = max(left, 0.0)
    return t + left, e + left * pc


@settings(max_examples=200, deadline=None)
@given(partitions())
def test_vectorised_matches_event_simulation(p):
    t, e = simulate_overlap(_arrays(*p))
    for k in range(len(p[0])):
        rt, re_ = _reference(*p, k)
        assert np.isclose(t[k], rt, rtol=1e-9, atol=1e-15)
        assert np.isclose(e[k], re_, rtol=1e-9, atol=1e-12)


@settings(max_examples=300, deadline=None)
@given(partitions())
def test_overlap_bounds(p):
    a, b, r, coll, pa, po, pc = p
    t, e = simulate_overlap(_arrays(*p))
    lower = max(a.sum(), coll)
    upper = b.sum() + coll  # compute on the reduced SM count, then the whole collective
    assert np.all(t >= lower * (1 - 1e-12))
    assert np.all(t <= upper * (1 + 1e-12))
    assert np.all(e >= STATIC_W * t * (1 - 1e-12))  # every phase draws at least static power


@settings(max_examples=200, deadline=None)
@given(partitions(), st.floats(10.0, 1000.0))
def test_long_collective_gain_bounded_by_compute(p, factor):
    a, b, r, _, pa, po, pc = p
    coll = factor * b.sum() * 2.0  # far longer than compute
    t, _ = simulate_overlap(_arrays(a, b, r, coll, pa, po, pc))
    seq_t, _ = sequential_time_energy(a, pa, coll, pc)
    gain = seq_t - t
    assert np.all(gain <= a.sum() * (1 + 1e-12))


@settings(max_examples=100, deadline=None)
@given(partitions())
def test_zero_collective_is_compute_alone(p):
    a, b, r, _, pa, po, pc = p
    t, e = simulate_overlap(_arrays(a, b, r, 0.0, pa, po, pc))
    assert np.allclose(t, a.sum()) and np.allclose(e, (a * pa).sum())


def test_grid_broadcast_shapes():
    rng = np.random.default_rng(0)
    n, n_clk, n_sms = 4, 3, 5
    a = rng.uniform(1e-4, 1e-3, (n, n_clk, 1))
    b = a * rng.uniform(1.0, 2.0, (n, n_clk, n_sms))
    coll = rng.uniform(1e-4, 1e-3, (1, n_sms))
    t, e = simulate_overlap(PhaseArrays(a, 200.0, b, 1.0, 250.0, coll, 80.0))
    assert t.shape == e.shape == (n, n_clk, n_sms)


def test_contention_factor():
    assert contention(0.0, 0.0, 100.0) == 1.0
    assert contention(60.0, 60.0, 100.0) == 1.2
    assert contention(500.0, 500.0, 100.0) == 2.0  # demands are capped at the peak


# ---- the same properties on the real cost model, over the whole knob grid -------------------------


def _real_instances():
    from kareus_megatron.cost.kernel import KernelModel
    from kareus_megatron.cost.overlap import OverlapCost
    from kareus_megatron.hardware.gpus import gpu_spec
    from kareus_megatron.search.partition import layer_schedule
    from kareus_megatron.search.tables import comm_sms_range
    from kareus_megatron.workload.models import model_spec
    from kareus_megatron.workload.opgraph import layer_ops
    from kareus_megatron.workload.parallel import make_parallel

    gpu, model = gpu_spec("a100-sxm4-40gb"), model_spec("llama3.2-3b")
    par = make_parallel(
        model,
        tp=4,
        cp=2,
        pp=2,
        micro_batch_size=8,
        seq_length=4096,
        num_microbatches=8,
        recompute="full",
        nodes=2,
        gpus_per_node=8,
    )
    adapter = OverlapCost(KernelModel(gpu))
    for phase in ("forward", "backward"):
        for inst in layer_schedule(phase, layer_ops(model, par, phase, 2), 2).instances:
            yield gpu, adapter, inst, comm_sms_range(gpu, inst.name).astype(float)


def test_real_partitions_obey_the_bounds():
    clocks = np.array([1410.0, 1110.0, 870.0])
    seen = 0
    for gpu, ad, inst, sms in _real_instances():
        t, e = ad.instance(inst, clocks, sms)  # (n_clk, n_slots, n_sms)
        a, _, _, _ = ad.compute(inst.compute, clocks[:, None])  # (n_ops, n_clk, 1)
        b, _, _, _ = ad.compute(inst.compute, clocks[:, None], sms=(gpu.sm_count - sms)[None, :])
        coll, _, _, _ = ad.collective(inst.collective, clocks, sms)  # (n_clk, n_sms)
        lower = np.maximum(a.sum(axis=0), coll)[:, None, :]
        # compute on the reduced SM count (never credited faster than on all SMs), then the whole collective
        upper = (np.maximum(a, b).sum(axis=0) + coll)[:, None, :]
        assert np.all(t >= lower * (1 - 1e-9)), inst.name
        assert np.all(t <= upper * (1 + 1e-9)), inst.name
        assert np.all(e >= gpu.static_power_w * t), inst.name
        seen += 1
    assert seen == 10  # CP×TP: 5 forward + 5 backward instances per layer

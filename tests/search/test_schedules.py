"""Per-rank instruction orders against the orders megatron-core and DeepSpeed run."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kareus_megatron.errors import ConfigError, InfeasibleConfigError
from kareus_megatron.search.pipeline import build_dag
from kareus_megatron.search.schedules import instruction_order, interleaved_table, interleaved_warmup


def _fmt(order):
    return " ".join(f"{k[0].upper()}{mb}" + (f"c{c}" if c or any(x[2] for x in order) else "") for k, mb, c in order)


def test_1f1b_matches_observed_megatron_order():
    o = instruction_order("1f1b", 2, 4)
    assert _fmt(o[0]) == "F0 F1 B0 F2 B1 F3 B2 B3"
    assert _fmt(o[1]) == "F0 B0 F1 B1 F2 B2 F3 B3"


def test_interleaved_matches_observed_megatron_order():
    o = instruction_order("interleaved-1f1b", 2, 4, vp=2)
    assert _fmt(o[0]) == "F0c0 F1c0 F0c1 F1c1 F2c0 B0c1 F3c0 B1c1 F2c1 B0c0 F3c1 B1c0 B2c1 B3c1 B2c0 B3c0"


def _pp_comm(pp, rank, vp):
    group = SimpleNamespace(size=lambda: pp, rank=lambda: rank)
    return SimpleNamespace(pp_group=group, virtual_pipeline_model_parallel_size=vp)


@pytest.fixture(scope="module")
def megatron_schedules():
    return pytest.importorskip("megatron.core.pipeline_parallel.schedules")


@pytest.mark.parametrize("m,vp,g", [(4, 2, 2), (5, 2, 3), (8, 3, 4), (6, 2, 6), (7, 4, 2), (16, 2, 8)])
def test_interleaved_table_equals_megatron(megatron_schedules, m, vp, g):
    assert interleaved_table(m, vp, g) == list(megatron_schedules.get_schedule_table(m, vp, g))


@pytest.mark.parametrize("pp,m,vp", [(2, 4, 2), (4, 8, 2), (4, 4, 3), (8, 16, 2), (3, 6, 2), (3, 9, 2), (4, 8, None)])
def test_warmup_counts_equal_megatron(megatron_schedules, pp, m, vp):
    for rank in range(pp):
        total, _, warm, rest = megatron_schedules.get_pp_rank_microbatches(
            m, vp or 1, pp, p2p_communicator=_pp_comm(pp, rank, vp)
        )
        if vp is None:
            order = instruction_order("1f1b", pp, m)[rank]
        else:
            assert warm == interleaved_warmup(pp, rank, m, vp, pp)
            order = instruction_order("interleaved-1f1b", pp, m, vp=vp)[rank]
        lead = next(i for i, k in enumerate(order) if k[0] == "backward")
        # The first backward comes after the warm-up forwards plus the first steady-state forward.
        assert lead == min(warm + 1, total) if rest else lead == total
        assert len(order) == 2 * total


def test_deepspeed_train_order_is_1f1b_for_small_cases():
    for pp, m in [(2, 4), (4, 4), (4, 8), (3, 5)]:
        assert instruction_order("deepspeed-train", pp, m) == instruction_order("1f1b", pp, m)


@settings(max_examples=40, deadline=None)
@example(schedule="interleaved-1f1b", pp=4, m=9, vp=3)  # megatron-core refuses it: it would deadlock
@example(schedule="interleaved-1f1b", pp=4, m=12, vp=3)
@given(
    schedule=st.sampled_from(["1f1b", "interleaved-1f1b", "deepspeed-train"]),
    pp=st.integers(2, 6),
    m=st.integers(1, 12),
    vp=st.integers(1, 3),
)
def test_orders_cover_every_instruction_once_and_never_deadlock(schedule, pp, m, vp):
    vp = vp if schedule == "interleaved-1f1b" else 1
    if schedule == "interleaved-1f1b" and (m < pp or m % pp):  # megatron-core refuses these too
        with pytest.raises(InfeasibleConfigError, match="interleaved-1f1b"):
            instruction_order(schedule, pp, m, vp=vp)
        return
    orders = instruction_order(schedule, pp, m, vp=vp)
    want = sorted((k, mb, c) for k in ("forward", "backward") for mb in range(m) for c in range(vp))
    for order in orders:
        assert sorted(order) == want
        for mb in range(m):
            for c in range(vp):
                assert order.index(("forward", mb, c)) < order.index(("backward", mb, c))
    build_dag(orders, 0.001)  # raises on a deadlock


def test_bad_requests_name_the_value():
    with pytest.raises(ConfigError, match="unknown pipeline schedule"):
        instruction_order("gpipe", 2, 4)
    with pytest.raises(ConfigError, match="num_microbatches"):
        instruction_order("1f1b", 2, 0)
    with pytest.raises(InfeasibleConfigError, match="vp=2"):
        instruction_order("1f1b", 2, 4, vp=2)
    with pytest.raises(InfeasibleConfigError, match="pp >= 2"):
        instruction_order("interleaved-1f1b", 1, 4, vp=2)

"""Hopper NVSwitch collectives (cost/collectives.py): ring and NVLS against message size, CTAs and clock."""

from __future__ import annotations

import numpy as np
import pytest

from kareus_megatron.cost.collectives import (
    DEFAULT_CHANNELS,
    HOPPER_NVLS,
    HOPPER_NVLS_GATHER,
    HOPPER_RING,
    algorithm_bandwidth,
    comm_sms_grid,
    default_comm_ctas,
    fastest_algorithm,
    node_algorithms,
    saturating_ctas,
)
from kareus_megatron.cost.kernel import KernelModel
from kareus_megatron.cost.params import KernelParams
from kareus_megatron.hardware.gpus import gpu_spec
from kareus_megatron.search.tables import comm_sms_range
from kareus_megatron.workload.opgraph import Op

H100, A100 = gpu_spec("h100-sxm5-80gb"), gpu_spec("a100-sxm4-40gb")
GB = 1e9


def coll(kind: str, nbytes: float, g: int = 8) -> Op:
    return Op(name="c", kind="collective", collective=f"tp_{kind}", comm_bytes=nbytes, group_size=g, link="nvlink")


def busbw(km: KernelModel, op: Op, ctas=None, f=None) -> np.ndarray:
    """nccl-tests busbw (bytes/s) of op: message bytes × 2(n-1)/n (all-reduce) or (n-1)/n over time."""
    factor = (
        2 * (op.group_size - 1) / op.group_size
        if op.collective.endswith("all_reduce")
        else ((op.group_size - 1) / op.group_size)
    )
    return op.comm_bytes * factor / km.collective_time_s(op, ctas, f)


def test_only_hopper_nvswitch_nodes_get_the_table():
    table = (HOPPER_RING, HOPPER_NVLS, HOPPER_NVLS_GATHER)
    assert node_algorithms(H100) == node_algorithms(gpu_spec("h200-sxm-141gb")) == table
    assert node_algorithms(A100) == () and default_comm_ctas(A100) is None
    assert comm_sms_grid(A100, ("all_reduce",)) is None


def test_large_messages_reach_nvidias_figures():
    """nccl-tests#212: ~480 GB/s NVLS all-reduce, ~370 GB/s ring (other collectives) on 8xH100, large messages."""
    km = KernelModel(H100)
    ar, ag, rs = coll("all_reduce", 8 * 2**30), coll("all_gather", 8 * 2**30), coll("reduce_scatter", 8 * 2**30)
    assert float(busbw(km, ar)) == pytest.approx(480 * GB, rel=0.06)
    for op in (ag, rs):
        assert float(busbw(km, op)) == pytest.approx(370 * GB, rel=0.03)
    # the A100 generic model stays in the 8xA100 range (~200-230 GB/s; default kernel parameters)
    assert 180 * GB < float(busbw(KernelModel(A100), ar)) < 240 * GB


def test_small_all_reduce_stays_on_the_ring_and_large_goes_nvls():
    km = KernelModel(H100)
    small, large = coll("all_reduce", 64 * 2**10), coll("all_reduce", 256 * 2**20)
    ring_small = km.params.nvlink_latency_s + small.comm_bytes * 1.75 / algorithm_bandwidth(HOPPER_RING, 32, 1980)
    assert float(km.collective_time_s(small, None)) == pytest.approx(float(ring_small), rel=1e-6)  # NVLS: 23 µs base
    ring_large = km.params.nvlink_latency_s + large.comm_bytes * 1.75 / algorithm_bandwidth(HOPPER_RING, 32, 1980)
    assert float(km.collective_time_s(large, None)) < 0.85 * float(ring_large)


def test_a_cta_limit_slows_the_ring_more_than_nvls_and_low_clocks_slow_both():
    km = KernelModel(H100)
    op = coll("all_reduce", 512 * 2**20)
    bw = {c: float(busbw(km, op, c)) for c in (4, 8, 16, 32)}
    assert bw[4] < bw[8] < bw[16] <= bw[32] * 1.001
    assert bw[16] / bw[32] > 0.94  # NVLS ~peaks by 16 CTAs ("should not need more than 16 channels")
    ring8 = float(algorithm_bandwidth(HOPPER_RING, 8, 1980)) / HOPPER_RING.bus_bytes_per_s
    nvls8 = float(algorithm_bandwidth(HOPPER_NVLS, 8, 1980)) / HOPPER_NVLS.bus_bytes_per_s
    assert nvls8 > ring8
    # SM-driven below the ceiling: at 8 CTAs a lower SM clock costs bandwidth, at 32 ring CTAs it does not
    assert float(busbw(km, op, 8, 1200)) < 0.92 * float(busbw(km, op, 8, 1980))
    ag = coll("all_gather", 512 * 2**20)
    assert float(busbw(km, ag, 32, 1400)) > 0.97 * float(busbw(km, ag, 32, 1980))


def test_nvls_moves_less_hbm_traffic_and_defaults_to_16_ctas():
    km = KernelModel(H100)
    big = coll("all_reduce", 1 * 2**30)
    hbm_bytes = float(km.collective_hbm_bytes_per_s(big, None) * km.collective_time_s(big, None))
    per_bus = hbm_bytes / (big.comm_bytes * 1.75)
    assert per_bus == pytest.approx(2 / 1.75)
    assert default_comm_ctas(H100) == 16 and km.params.default_comm_sms == 16
    assert KernelModel(A100).params.default_comm_sms == 24  # A100 unchanged: NCCL's 24 ring channels


def nvls_gather_time(km: KernelModel, op: Op, ctas: float) -> float:
    """Time (s) of op on NVLS all-gather/reduce-scatter alone: base latency + bus bytes / its bandwidth."""
    bw = algorithm_bandwidth(HOPPER_NVLS_GATHER, ctas, 1980)
    return HOPPER_NVLS_GATHER.latency_s + op.comm_bytes * 7 / 8 / float(bw)


def test_nvls_all_gather_and_reduce_scatter_follow_nccls_model_and_lose_to_the_ring_unlimited():
    """nccl#1083/#1506: NVLS AG/RS move S one way at the link rate, busbw = R(n-1)/n (~300 measured, ring ~350)."""
    assert HOPPER_NVLS_GATHER.bus_bytes_per_s == pytest.approx(HOPPER_RING.bus_bytes_per_s * 7 / 8, rel=0.1)
    assert HOPPER_NVLS_GATHER.bus_bytes_per_s < HOPPER_RING.bus_bytes_per_s
    km = KernelModel(H100)
    for kind in ("all_gather", "reduce_scatter"):
        op = coll(kind, 1 * 2**30)
        assert fastest_algorithm(H100, kind, 32, 1980) is HOPPER_RING
        assert float(km.collective_time_s(op, None)) < 0.9 * nvls_gather_time(km, op, 16)
        hbm = float(km.collective_hbm_bytes_per_s(op, None) * km.collective_time_s(op, None))
        assert hbm / (op.comm_bytes * 7 / 8) == pytest.approx(2.0 if kind == "all_gather" else 3.0)  # ring's


def test_a_cta_limit_moves_all_gather_and_reduce_scatter_to_nvls():
    """NVLS needs fewer SMs (nccl#1506): under ~10 CTAs it beats the SM-starved ring, as NCCL's per-call choice."""
    km = KernelModel(H100)
    assert saturating_ctas(HOPPER_NVLS_GATHER, 1980) < saturating_ctas(HOPPER_RING, 1980)
    for kind in ("all_gather", "reduce_scatter"):
        op = coll(kind, 512 * 2**20)
        for ctas in (2, 4, 8):
            assert fastest_algorithm(H100, kind, ctas, 1980) is HOPPER_NVLS_GATHER
            assert float(km.collective_time_s(op, ctas)) == pytest.approx(nvls_gather_time(km, op, ctas), rel=1e-9)
            ring_bw = float(algorithm_bandwidth(HOPPER_RING, ctas, 1980))
            ring = km.params.nvlink_latency_s + op.comm_bytes * 7 / 8 / ring_bw
            assert float(km.collective_time_s(op, ctas)) < 0.95 * ring
        assert fastest_algorithm(H100, kind, 12, 1980) is HOPPER_RING
        # NVLS traffic in HBM: S/n + S over (n-1)/n S bus bytes = (n+1)/(n-1)
        hbm = float(km.collective_hbm_bytes_per_s(op, 8) * km.collective_time_s(op, 8))
        assert hbm / (op.comm_bytes * 7 / 8) == pytest.approx(9 / 7)


def test_nvls_gather_ceiling_scales_with_the_group_as_r_times_n_minus_1_over_n():
    bw = {n: float(algorithm_bandwidth(HOPPER_NVLS_GATHER, 256, 1980, group_size=n)) for n in (None, 2, 4, 8)}
    assert bw[8] == bw[None] == pytest.approx(float(algorithm_bandwidth(HOPPER_NVLS_GATHER, 256, 1980)))
    assert bw[2] / bw[8] == pytest.approx((1 / 2) / (7 / 8), rel=0.01) and bw[2] < bw[4] < bw[8]
    ring = {n: float(algorithm_bandwidth(HOPPER_RING, 256, 1980, group_size=n)) for n in (2, 8)}
    assert ring[2] == ring[8]  # the ring's busbw does not depend on the group


def test_default_channels_are_data_the_model_uses():
    assert DEFAULT_CHANNELS["ampere"]["ring"] == KernelParams().default_comm_sms == 24
    assert HOPPER_RING.default_ctas == DEFAULT_CHANNELS["hopper"]["ring"] == 32
    assert HOPPER_NVLS.default_ctas == HOPPER_NVLS_GATHER.default_ctas == DEFAULT_CHANNELS["hopper"]["nvls"] == 16


def test_the_comm_sm_grid_follows_the_algorithms_on_hopper_and_the_kareus_grid_on_a100():
    tp, cp = comm_sms_range(H100, "fwd_attn"), comm_sms_range(H100, "fwd_cp_kv")
    top = max(saturating_ctas(a, 1980) for a in (HOPPER_RING, HOPPER_NVLS, HOPPER_NVLS_GATHER))
    assert tp.tolist() == list(range(2, top + 5, 2)) and cp.tolist() == list(range(1, top + 5))
    assert tp[-1] < 24  # not the A100 grid scaled by SM count (4..37)
    assert comm_sms_range(A100, "fwd_attn").tolist() == list(range(3, 31, 3))


def test_planning_on_h100_searches_the_hopper_grid():
    """What `kareus plan --gpu h100-sxm5-80gb` builds its options from: the Hopper grid plus NCCL's default."""
    from kareus_megatron.search import options as opt
    from kareus_megatron.workload.models import model_spec
    from kareus_megatron.workload.parallel import make_parallel

    model = model_spec("llama3.2-3b")
    par = make_parallel(
        model,
        tp=8,
        pp=2,
        micro_batch_size=8,
        seq_length=4096,
        recompute="full",
        first_stage_layers=15,
        last_stage_layers=13,
    )
    tables = opt.layer_tables(H100, model, par, KernelModel(H100), (1980, 1500))
    sms = tables.phases["forward"].partitions["fwd_attn"].comm_sms
    assert sms.tolist() == sorted(set(comm_sms_range(H100, "fwd_attn").tolist()) | {16})


def test_every_preset_architecture_has_a_collective_model_and_an_unknown_one_is_refused():
    """A generation cost/collectives.py has no NCCL figures for is named and refused, never given the Ampere model."""
    import dataclasses

    from kareus_megatron.errors import ConfigError
    from kareus_megatron.hardware.gpus import gpu_names

    for name in gpu_names():  # every table of gpus.toml, not a hand list
        assert gpu_spec(name).architecture in DEFAULT_CHANNELS, name
        KernelModel(gpu_spec(name))
    blackwell = dataclasses.replace(H100, name="b200-test", architecture="blackwell")
    for build in (
        lambda: KernelModel(blackwell),
        lambda: node_algorithms(blackwell),
        lambda: comm_sms_grid(blackwell, ("all_reduce",)),
    ):
        with pytest.raises(ConfigError, match="b200-test.*'blackwell'.*ampere, hopper"):
            build()
    with pytest.raises(ConfigError, match=r"\(none\)"):
        KernelModel(dataclasses.replace(A100, architecture=""))

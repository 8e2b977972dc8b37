"""The overlapped-power rule and the grid calls of cost/overlap.py, on the real A100 cost model."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kareus_megatron.cost.kernel import KernelModel
from kareus_megatron.cost.overlap import OverlapCost
from kareus_megatron.cost.params import KernelParams
from kareus_megatron.hardware.gpus import gpu_spec
from kareus_megatron.search.partition import layer_schedule
from kareus_megatron.workload.models import model_spec
from kareus_megatron.workload.opgraph import layer_ops
from kareus_megatron.workload.parallel import make_parallel

GPU = gpu_spec("a100-sxm4-40gb")
CLOCKS = np.array([1410.0, 1110.0, 870.0])
SMS = np.array([3.0, 12.0, 24.0, 30.0])


def _instances():
    model = model_spec("llama3.2-3b")
    par = make_parallel(
        model,
        tp=8,
        pp=2,
        micro_batch_size=8,
        seq_length=4096,
        num_microbatches=8,
        recompute="full",
        nodes=2,
        gpus_per_node=8,
    )
    for phase in ("forward", "backward"):
        yield from layer_schedule(phase, layer_ops(model, par, phase, 2), 2).instances


@pytest.fixture(scope="module")
def cost():
    return OverlapCost(KernelModel(GPU))


def test_default_sms_follow_the_kernel_parameters(cost):
    assert cost.default_sms == 24  # cost/params.py default_comm_sms (NCCL's A100 default)
    assert OverlapCost(KernelModel.from_params(GPU, KernelParams(default_comm_sms=20.0))).default_sms == 20
    assert OverlapCost(KernelModel(GPU), default_sms=16).default_sms == 16


def test_an_empty_collective_leaves_the_compute_alone(cost):
    """With nothing to communicate, every slot and SM count costs exactly the compute on all SMs."""
    for inst in _instances():
        empty = dataclasses.replace(inst.collective, comm_bytes=0.0)
        t, e = cost.partition(inst.compute, empty, inst.slot_positions, CLOCKS, SMS)
        t0, e0 = cost.alone(inst.compute, CLOCKS)
        assert np.allclose(t, t0[:, None, None], rtol=1e-12) and np.allclose(e, e0[:, None, None], rtol=1e-12)


def test_overlapped_phases_follow_the_rule(cost):
    for inst in _instances():
        p = cost.phase_arrays(inst.compute, inst.collective, CLOCKS, SMS)
        a, w = np.broadcast_arrays(p.a_s, p.w_s)
        assert np.all(w >= a * (1 - 1e-12)), inst.name  # fewer SMs and shared HBM never make an op faster
        rho = np.broadcast_to(p.rho, w.shape)
        assert np.all((rho > 0) & (rho <= 1)), inst.name  # the collective slows down by the same factor
        po = np.broadcast_to(p.po_w, w.shape)
        assert np.all(po <= GPU.power_limit_w + 1e-9) and np.all(po >= GPU.static_power_w), inst.name


def test_instance_is_partition_of_its_parts(cost):
    inst = next(_instances())
    t1, e1 = cost.instance(inst, CLOCKS, SMS)
    t2, e2 = cost.partition(inst.compute, inst.collective, inst.slot_positions, CLOCKS, SMS)
    assert t1.shape == (CLOCKS.size, len(inst.slot_positions), SMS.size)
    assert np.array_equal(t1, t2) and np.array_equal(e1, e2)

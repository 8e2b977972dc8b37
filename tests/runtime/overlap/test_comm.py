"""Comm-SM groups: NCCL recognised in mixed groups, NCCL's CTA variables refused with a warning, warm-up."""

from __future__ import annotations

import warnings

import pytest
import torch

from kareus_megatron.runtime.overlap import comm


@pytest.mark.parametrize(("backend", "nccl"), [("nccl", True), ("cpu:gloo,cuda:nccl", True), ("cuda:nccl", True),
                                               ("gloo", False), ("cpu:gloo", False), ("mpi", False)])
def test_mixed_backend_groups_count_as_nccl(backend, nccl):
    assert comm.is_nccl_backend(backend) is nccl


def test_cta_overrides_are_found():
    env = {"NCCL_MAX_CTAS": "8", "NCCL_MIN_NCHANNELS": " ", "NCCL_DEBUG": "INFO", "NCCL_MAX_NCHANNELS": "4"}
    assert comm.nccl_cta_overrides(env) == {"NCCL_MAX_CTAS": "8", "NCCL_MAX_NCHANNELS": "4"}
    assert comm.nccl_cta_overrides({}) == {}


class FakeDist:
    """What build_sm_groups needs of torch.distributed, for a world of 2 ranks in one TP group."""

    def __init__(self, backend: str) -> None:
        self.backend, self.created, self.reduced = backend, [], []

    def get_backend(self, group):
        return self.backend

    def get_process_group_ranks(self, group):
        return [0, 1]

    def get_world_size(self, group=None):
        return 2

    def all_gather_object(self, out, obj):
        out[:] = [obj, obj]

    def new_group(self, ranks, backend, pg_options):
        g = ("group", tuple(ranks), pg_options)
        self.created.append((tuple(ranks), backend))
        return g

    def all_reduce(self, tensor, group=None):
        self.reduced.append((group, tensor.numel()))


@pytest.fixture
def fake_dist(monkeypatch):
    fake = FakeDist("cpu:gloo,cuda:nccl")
    monkeypatch.setattr(comm, "dist", fake)
    monkeypatch.setattr(comm, "_nccl_options", lambda sms: sms)
    for k in comm.NCCL_CTA_ENV:
        monkeypatch.delenv(k, raising=False)
    return fake


def test_groups_are_built_for_a_mixed_group_and_warmed_up(fake_dist):
    groups = comm.build_sm_groups([8, 4, 8], tp_group="tp")
    assert sorted(groups) == [4, 8] and [b for _, b in fake_dist.created] == ["nccl", "nccl"]
    # one 1-element all-reduce per group at build time, not inside the layer's first iteration
    assert fake_dist.reduced == [(groups[4], 1), (groups[8], 1)]


def test_nccl_cta_variables_refuse_the_groups_with_one_warning(fake_dist, monkeypatch):
    monkeypatch.setenv("NCCL_MIN_CTAS", "16")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert comm.build_sm_groups([8], tp_group="tp") == {}
    (w,) = caught
    assert "NCCL_MIN_CTAS=16" in str(w.message) and "\n" not in str(w.message)
    assert fake_dist.created == [] and fake_dist.reduced == []
    # the engine then records every request as not applied
    assert comm.Communicator(tp_group=None, sm_groups={}).group_for(8) == (None, False)


def test_warm_up_on_cpu_reports_no_memory(fake_dist):
    assert comm.warm_up("g", 8) is None or torch.cuda.is_available()
    assert fake_dist.reduced == [("g", 1)]

"""Comm-SM groups: NCCL recognised in mixed groups, NCCL's environment (CTA variables drop everything, channel
caps and floors only the counts they rule out), the budget, shared parents, warm-up and costs.

torch.distributed is a stand-in here that records the calls torch would make (a CPU build of torch has no
ProcessGroupNCCL); tests/runtime/overlap/test_comm_probe.py runs the same build path for real (gloo)."""

from __future__ import annotations

import warnings

import pytest
import torch

from kareus_megatron.errors import ConfigError
from kareus_megatron.runtime.overlap import comm, comm_groups
from kareus_megatron.vocab import MAX_COMM_SM_VALUES


@pytest.mark.parametrize(
    ("backend", "nccl"),
    [
        ("nccl", True),
        ("cpu:gloo,cuda:nccl", True),
        ("cuda:nccl", True),
        ("gloo", False),
        ("cpu:gloo", False),
        ("mpi", False),
    ],
)
def test_mixed_backend_groups_count_as_nccl(backend, nccl):
    assert comm.is_nccl_backend(backend) is nccl


def test_cta_overrides_are_found():
    env = {"NCCL_MAX_CTAS": "8", "NCCL_MIN_NCHANNELS": " ", "NCCL_DEBUG": "INFO", "NCCL_MAX_NCHANNELS": "4"}
    assert comm.nccl_cta_overrides(env) == {"NCCL_MAX_CTAS": "8", "NCCL_MAX_NCHANNELS": "4"}
    assert comm.nccl_cta_overrides({}) == {}


@pytest.mark.parametrize(
    ("env", "keep", "dropped"),
    [
        ({}, [4, 8, 12], ""),
        ({"NCCL_MAX_NCHANNELS": "32"}, [4, 8, 12], ""),  # a cap above every planned count overrides nothing
        ({"NCCL_MAX_NCHANNELS": "8"}, [4, 8], "12"),
        ({"NCCL_MIN_NCHANNELS": "6"}, [8, 12], "4"),
        ({"NCCL_MIN_NCHANNELS": "5", "NCCL_MAX_NCHANNELS": "10"}, [8], "4, 12"),
        ({"NCCL_MAX_CTAS": "32"}, [], "override every"),  # replaces the config's max_ctas on every communicator
        ({"NCCL_MIN_CTAS": "1"}, [], "override every"),
        ({"NCCL_MAX_NCHANNELS": "lots"}, [], "override every"),
    ],
)
def test_nccl_environment_drops_only_the_counts_it_rules_out(env, keep, dropped):
    got, why = comm_groups.usable_sm_counts([12, 4, 8, 4], env)
    assert got == keep
    assert (dropped in why and "\n" not in why) if dropped else why == ""


class FakeGroup:
    def __init__(self, ranks, options, via):
        self.ranks, self.options, self.via = tuple(ranks), options, via


class FakeDist:
    """What the builder needs of torch.distributed, for a world of 4 ranks in TP groups [0,1] and [2,3] (this
    process is rank 0); `bound` True: the default group is bound to a device, so torch can split."""

    def __init__(self, backend: str, bound: bool = False) -> None:
        self.backend, self.calls, self.reduced = backend, [], []
        self.group = type("G", (), {"WORLD": type("W", (), {"bound_device_id": "cuda:0" if bound else None})()})
        if bound:
            self.split_group = self._split_group

    def get_backend(self, group):
        return self.backend

    def get_process_group_ranks(self, group):
        return [0, 1]

    def get_world_size(self, group=None):
        return 4

    def all_gather_object(self, out, obj):
        out[:] = [obj, obj, (2, 3), (2, 3)]

    def new_group(self, ranks, backend, pg_options):
        self.calls.append(("new_group", tuple(ranks), backend, pg_options))
        return FakeGroup(ranks, pg_options, "new_group")

    def _split_group(self, parent_pg, split_ranks, pg_options):
        self.calls.append(("split_group", parent_pg.ranks, tuple(map(tuple, split_ranks)), pg_options))
        return FakeGroup(parent_pg.ranks, pg_options, "split")

    def all_reduce(self, tensor, group=None):
        self.reduced.append((group, tensor.numel()))


@pytest.fixture
def fake_dist(monkeypatch):
    for k in comm_groups.NCCL_CTA_ENV:
        monkeypatch.delenv(k, raising=False)

    def make(backend: str = "cpu:gloo,cuda:nccl", bound: bool = False) -> FakeDist:
        fake = FakeDist(backend, bound)
        monkeypatch.setattr(comm_groups, "dist", fake)
        monkeypatch.setattr(
            comm_groups, "nccl_options", lambda sms=None, share=False, max_ctas=None: ("opts", sms or max_ctas, share)
        )
        monkeypatch.setattr(comm_groups, "can_share", lambda: bound)  # torch's own check reads the real module
        return fake

    return make


def test_groups_are_built_for_a_mixed_group_and_warmed_up(fake_dist):
    fake = fake_dist()
    built = comm.build_sm_group_set([8, 4, 8], group="tp")
    assert sorted(built.groups) == [4, 8] and built.parent is None
    # every rank creates every TP group of each count, in the same order; SM-limited options, no sharing
    assert [c[1:] for c in fake.calls] == [
        ((0, 1), "nccl", ("opts", 4, False)),
        ((2, 3), "nccl", ("opts", 4, False)),
        ((0, 1), "nccl", ("opts", 8, False)),
        ((2, 3), "nccl", ("opts", 8, False)),
    ]
    # one 1-element all-reduce per own group at build time, not inside the layer's first iteration
    assert fake.reduced == [(built.groups[4], 1), (built.groups[8], 1)]
    assert [(i.comm_sms, i.kind, i.shared, i.memory_bytes) for i in built.infos] == [
        (4, "tp", False, None),
        (8, "tp", False, None),
    ]
    assert all(i.init_s >= 0 for i in built.infos) and built.infos[0].to_dict()["comm_sms"] == 4


def test_children_split_from_one_shared_parent_where_torch_can_split(fake_dist):
    fake = fake_dist(bound=True)
    built = comm.build_sm_group_set([6, 2], group="tp", kind="cp")
    # one parent per group with split_share (CTAs capped at the largest child's), created by every rank;
    # children split from this rank's parent only
    assert fake.calls[:2] == [
        ("new_group", (0, 1), "nccl", ("opts", 6, True)),
        ("new_group", (2, 3), "nccl", ("opts", 6, True)),
    ]
    assert fake.calls[2:] == [
        ("split_group", (0, 1), ((0, 1),), ("opts", 2, False)),
        ("split_group", (0, 1), ((0, 1),), ("opts", 6, False)),
    ]
    assert built.parent.ranks == (0, 1) and [g.via for g in built.groups.values()] == ["split", "split"]
    assert [(i.comm_sms, i.shared, i.kind) for i in built.infos] == [
        (None, True, "cp"),
        (2, True, "cp"),
        (6, True, "cp"),
    ]
    assert [g for g, _ in fake.reduced] == [built.parent, built.groups[2], built.groups[6]]  # parent created first


def test_over_the_budget_is_refused_before_anything_is_built(fake_dist):
    fake = fake_dist()
    with pytest.raises(ConfigError, match=f"at most {MAX_COMM_SM_VALUES}") as e:
        comm.build_sm_group_set(range(1, MAX_COMM_SM_VALUES + 2), group="tp")
    assert "\n" not in str(e.value) and fake.calls == [] and fake.reduced == []
    assert sorted(comm.build_sm_group_set(range(1, MAX_COMM_SM_VALUES + 1), group="tp").groups) == list(
        range(1, MAX_COMM_SM_VALUES + 1)
    )


def test_nccl_cta_variables_refuse_the_groups_with_one_warning(fake_dist, monkeypatch):
    fake = fake_dist()
    monkeypatch.setenv("NCCL_MIN_CTAS", "16")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert comm.build_sm_groups([8], group="tp") == {}
    (w,) = caught
    assert "NCCL_MIN_CTAS=16" in str(w.message) and "\n" not in str(w.message)
    assert fake.calls == [] and fake.reduced == []
    # the engine then records every request as not SM-limited
    assert comm.Communicator(tp_group=None, sm_groups={}).group_for(8) == (None, False)


def test_a_channel_cap_drops_only_the_counts_above_it(fake_dist, monkeypatch):
    fake = fake_dist()
    monkeypatch.setenv("NCCL_MAX_NCHANNELS", "8")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        groups = comm.build_sm_groups([4, 8, 12], group="tp")
    assert sorted(groups) == [4, 8] and {c[3][1] for c in fake.calls} == {4, 8}
    (w,) = caught
    assert "NCCL_MAX_NCHANNELS=8" in str(w.message) and "12" in str(w.message)
    c = comm.Communicator(tp_group="tp", sm_groups=groups)
    assert c.group_for(8) == (groups[8], True) and c.group_for(12) == ("tp", False)
    monkeypatch.setenv("NCCL_MAX_NCHANNELS", "64")  # above every planned count: nothing to drop, no warning
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert sorted(comm.build_sm_groups([4, 8, 12], group="tp")) == [4, 8, 12]
    assert caught == []


def test_gloo_builds_nothing(fake_dist):
    fake = fake_dist("gloo")
    assert comm.build_sm_group_set([4], group="tp").groups == {} and fake.calls == []


def test_warm_up_reduces_one_element(fake_dist):
    fake = fake_dist()
    comm_groups.warm_up("g")
    assert fake.reduced == [("g", 1)]
    assert comm_groups.scratch_tensor().device.type == ("cuda" if torch.cuda.is_available() else "cpu")

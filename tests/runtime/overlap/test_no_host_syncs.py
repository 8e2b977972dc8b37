"""No host syncs on the training thread in the partitioned layer (issue 23): TP, SP, CP, cross-layer, recompute.

One spawned 2-rank gloo worker (sync_worker.py) runs one forward and one backward of a megatron-core
TransformerBlock of partitioned layers per case, under plan instructions sent through the hooks listener, and
counts every sync-prone operation on the training thread (runtime/selfcheck/sync_count.py: host reads of device
values, device-value-sized outputs, blocking host-device copies, explicit waits), for every attention mask
megatron gives a GPT layer, 1 and 2 nanobatches, recompute off and on. Every case counts zero.
"""

from __future__ import annotations

import pytest
from _dist import MEGATRON_CORE, read_ranks, spawn


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    import sync_worker

    out = tmp_path_factory.mktemp("syncs")
    spawn(sync_worker.worker, 2, str(out), env={"KAREUS_OVERLAP_TRACE": None}, preload=MEGATRON_CORE)
    return read_ranks(out, "rank{rank}.json", 2)


def _cases(rk, prefix):
    return [c for c in rk if c["case"].split(".nb")[0] == prefix]


def test_every_case_ran_for_every_mask_shape(ranks):
    for rk in ranks:
        names = [c["case"] for c in rk]
        assert len(names) == len(set(names)) == 12 + 3 + 12 + 3 + 3 + 3 + 12 + 3
        for layout, n in (("tp", 12), ("tp.llama", 3), ("sp", 12), ("cp", 12), ("cp.llama", 3)):
            cases = _cases(rk, layout)
            assert len(cases) == n, layout
            shapes = {c["case"].split(".mask_")[1].split(".")[0]: c["mask_shape"] for c in cases}
            seq = 16 // (2 if layout.startswith("cp") else 1)  # CP: megatron's slice along the queries
            assert shapes == {"none": None, "1x1": [1, 1, seq, 16], "bx1": [4, 1, seq, 16]}, layout


def test_cross_layer_cases_carried_collectives_between_layers(ranks):
    for rk in ranks:
        cross = [c for c in rk if c["case"].startswith("cross")]
        assert len(cross) == 9
        for c in cross:
            assert c["linked"] == 2 and c["carried"] > 0, c  # 3 layers: 2 links, collectives issued by the next


def test_no_host_syncs_in_forward_and_backward_of_any_case(ranks):
    for rk in ranks:
        bad = [c for c in rk if c["syncs"] or not c["ok"]]
        assert not bad, bad[:3]

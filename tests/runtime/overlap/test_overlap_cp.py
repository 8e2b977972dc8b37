"""The partitioned layer with context parallelism on real megatron-core 0.16.1 (gloo, fp32).

cp_worker.py runs the scenarios: outputs and every gradient equal the same model without CP (megatron's
local spec) on the full sequence, for CP=2 (2 processes) and TP=2 x CP=2 (4; also with sequence parallelism,
against the model without CP and without SP), 1 and 2 nanobatches, every launch slot of the CP partitions
(and of the CP+SP ones), recompute on and off, with and without megatron's CP-sliced mask;
training losses equal through megatron-core's schedule and the runtime patch; each collective issued at its
planned slot (trace.overlap_violations). Single-process checks of the CP attention math and the plan checks
run first.
"""

from __future__ import annotations

import math

import pytest
import torch
from _dist import MEGATRON_CORE, read_ranks, spawn

from kareus_megatron.errors import InfeasibleConfigError, PlanError
from kareus_megatron.runtime.overlap import overlap_violations
from kareus_megatron.runtime.overlap.config import cp_engine_slots, cp_sp_engine_slots, validate_plan_for_layer
from kareus_megatron.runtime.overlap.cp_attention import (
    cp_attend,
    local_chunks,
    sequence_index,
    sequence_order,
    to_sequence_order,
)
from kareus_megatron.runtime.selfcheck.sync_count import SyncCount
from kareus_megatron.vocab import CP_PARTITION_SLOTS


def _attend(q, k, v, mask, is_causal, dropout_p):
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=is_causal, scale=1 / math.sqrt(q.shape[-1])
    )


@pytest.mark.parametrize("cp", [2, 3])
@pytest.mark.parametrize("with_mask", [False, True])
def test_cp_attend_equals_full_causal_attention_rows_and_grads(cp, with_mask):
    torch.manual_seed(0)
    b, nq, ng, s, hn = 2, 4, 2, 4 * cp, 8
    c = s // (2 * cp)
    q = torch.randn(b, nq, s, hn, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, ng, s, hn, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, ng, s, hn, dtype=torch.float64, requires_grad=True)
    ref = _attend(q, k, v, None, True, 0.0)
    w = torch.randn_like(ref)
    gq, gk, gv = torch.autograd.grad((ref * w).sum(), (q, k, v))

    def rows(r):  # megatron's CP layout of rank r (chunk r, chunk 2cp-1-r)
        return torch.cat([torch.arange(g * c, (g + 1) * c) for g in local_chunks(cp, r)])

    gathered = [torch.cat([t[:, :, rows(j)] for j in range(cp)], dim=2) for t in (k, v)]
    dk = torch.zeros_like(k)
    for r in range(cp):
        mask = torch.ones(s, s, dtype=torch.bool).triu(1)[rows(r)] if with_mask else None
        kg, vg = (t.detach().requires_grad_(True) for t in gathered)
        qr = q.detach()[:, :, rows(r)].requires_grad_(True)
        out = cp_attend(_attend, qr, kg, vg, mask, cp, r, 0.0)
        torch.testing.assert_close(out, ref[:, :, rows(r)])
        dq, dkg, _ = torch.autograd.grad((out * w[:, :, rows(r)]).sum(), (qr, kg, vg))
        torch.testing.assert_close(dq, gq[:, :, rows(r)])
        dk += to_sequence_order(dkg, cp, 2)  # the reduce-scatter's sum, in sequence order
    torch.testing.assert_close(dk, gk)
    with pytest.raises(InfeasibleConfigError, match="K/V of all"):
        cp_attend(_attend, q[:, :, : 2 * c], k[:, :, : 2 * c], v[:, :, : 2 * c], None, cp, 0, 0.0)


def test_the_reordering_index_is_built_on_the_device_once_without_host_data():
    sequence_index.cache_clear()
    t = torch.arange(2 * 8 * 3, dtype=torch.float32).view(2, 8, 3).requires_grad_()
    with SyncCount() as sc:  # the first call builds the index: no Python data copied to the device
        out = to_sequence_order(t, 2, 1)
        out.backward(torch.ones_like(out))
        out = to_sequence_order(t, 2, 1)
    assert sc.total == 0, sc.report()
    assert sequence_index.cache_info().misses == 1 and sequence_index(2, t.device) is sequence_index(2, t.device)
    for cp in (1, 2, 3, 4):
        assert sequence_index(cp, torch.device("cpu")).tolist() == sequence_order(cp)
    torch.testing.assert_close(out, t.detach().view(2, 4, 2, 3)[:, [0, 2, 3, 1]].reshape(2, 8, 3))


def test_a_cp_mask_is_checked_not_read():
    q = torch.randn(1, 2, 4, 8)
    k = v = torch.randn(1, 2, 8, 8)
    causal = torch.ones(8, 8, dtype=torch.bool).triu(1)[[0, 1, 6, 7]]  # rank 0 of CP=2, chunks of 2
    with SyncCount() as sc:
        out = cp_attend(_attend, q, k, v, causal.expand(3, 1, 4, 8), 2, 0, 0.0)
    assert sc.total == 0
    torch.testing.assert_close(out, cp_attend(_attend, q, k, v, None, 2, 0, 0.0))
    for bad in (causal.float(), causal[:, :4]):
        with pytest.raises(InfeasibleConfigError, match="boolean attention_mask"):
            cp_attend(_attend, q, k, v, bad, 2, 0, 0.0)


def test_cp_engine_slots_match_the_planners_cut():
    slots = cp_engine_slots()
    assert slots["fwd_cp_kv"] == CP_PARTITION_SLOTS["fwd_cp_kv"] and slots["fwd_attn"] == ("attention", "proj")
    assert slots["bwd_cp_kv"] == CP_PARTITION_SLOTS["bwd_cp_kv"] and slots["bwd_attn"] == ("rope", "qkv")


def _kareus_plan(tmp_path, *flags):
    from kareus_megatron.cli.main import main

    out = tmp_path / "plan"
    assert main(["plan", "--tp", "2", *flags, "--out", str(out)]) == 0
    from kareus_megatron.plan.io import load_plan

    return load_plan(next((out / "plans").glob("kareus*.json")))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    import cp_worker

    out = tmp_path_factory.mktemp("overlap_cp")
    spawn(cp_worker.worker, 2, str(out), preload=MEGATRON_CORE)
    return read_ranks(out, "rank{rank}.json", 2)


@pytest.fixture(scope="module")
def tp_ranks(tmp_path_factory):
    import cp_worker

    out = tmp_path_factory.mktemp("overlap_tp_cp")
    spawn(cp_worker.worker, 4, str(out), 2, preload=MEGATRON_CORE)
    return read_ranks(out, "rank{rank}.json", 4)


def _check_layers(rk, min_grads=10, prefix="layer."):
    names = sorted(k for k in rk if k.startswith(prefix))
    for name in names:
        r = rk[name]
        assert r["out"] <= 1.0, (name, r["out"])
        assert r["grads"] <= 1.0, (name, r["worst_grad"], r["grads"])
        assert r["n_grads"] >= min_grads and r["grad_norm"] > 0
        assert overlap_violations(r["events"]) == [], name
    return names


def _slots_used(rks):
    used: dict[str, set[str]] = {}
    for rk in rks:
        for name in (k for k in rk if k.startswith("layer.")):
            for e in rk[name]["events"]:
                if e["kind"] == "issue" and e.get("partition"):
                    used.setdefault(e["partition"], set()).add(e["slot"])
                if e["kind"] == "issue":  # the K/V collectives are the CP kinds the planner names
                    assert (".cp_kv." in e["coll"]) == (e["collective"] in ("cp_all_gather", "cp_reduce_scatter"))
    return used


def test_cp2_outputs_and_all_grads_equal_the_model_without_cp(ranks):
    for rk in ranks:
        names = _check_layers(rk)
        assert len(names) == 4 * (2 + 2 + 3)  # 4 model cases x (nb1 with/without mask, nb2 s0 both, s1..s3)
        slow = rk["slow_link"]
        assert slow["out"] <= 1.0 and slow["grads"] <= 1.0 and overlap_violations(slow["events"]) == []
        neg = rk["negative.no_cp_reduce_scatter"]
        assert neg["grads"] > 1.0  # the comparison can fail


def test_cp2_every_launch_slot_is_exercised(ranks):
    # TP=1: the TP all-reduces move nothing, so the engine cuts the layer at the K/V collectives only, as the
    # planner does (steps.py); the TP partitions' slots are exercised with TP=2 x CP=2 below
    used = _slots_used(ranks)
    assert used == {name: set(slots) for name, slots in cp_engine_slots().items() if name in CP_PARTITION_SLOTS}


def test_cp2_training_losses_through_megatron_schedule(ranks):
    for rk in ranks:
        for key in ("train.rc0", "train.rc1"):
            r = rk[key]
            assert r["grads"] <= 1.0, (key, r["grads"])
            for a, b in zip(r["losses_ref"], r["losses_part"]):
                assert a == pytest.approx(b, rel=1e-5)
            kinds = {e.get("collective") for e in r["events"] if e["kind"] == "issue"}
            assert kinds == {"cp_all_gather", "cp_reduce_scatter"}  # TP=1: no all-reduce moves anything
            assert r["instructions_seen"] == 8  # 2 iterations x (2 fwd + 2 bwd)


def test_tp2_cp2_outputs_grads_and_losses(tp_ranks):
    used = _slots_used(tp_ranks)
    for name in ("fwd_attn", "bwd_attn"):  # the TP all-reduce partitions after the K/V cut (2 slots each)
        assert used.get(name) == set(cp_engine_slots()[name]), (name, used.get(name))
    for rk in tp_ranks:
        assert len(_check_layers(rk)) == 2 * (2 + 2 + 1)
        r = rk["train.rc1"]
        assert r["grads"] <= 1.0
        for a, b in zip(r["losses_ref"], r["losses_part"]):
            assert a == pytest.approx(b, rel=1e-5)


def test_tp2_cp2_sp_outputs_grads_and_losses_equal_the_model_without_cp_and_sp(tp_ranks):
    for rk in tp_ranks:
        # Llama-like rc0: nb1 with/without mask + 3 slot scenarios; GPT rc1: nb1 with/without mask + slot 0
        assert len(_check_layers(rk, min_grads=14, prefix="layer_sp.")) == 5 + 3
        r = rk["sp.train.rc1"]
        assert r["grads"] <= 1.0, r["grads"]
        for a, b in zip(r["losses_ref"], r["losses_part"]):
            assert a == pytest.approx(b, rel=1e-5)
        assert overlap_violations(r["events"]) == []
        kinds = {e.get("collective") for e in r["events"] if e["kind"] == "issue"}
        assert kinds == {"all_gather", "reduce_scatter", "cp_all_gather", "cp_reduce_scatter"}
        assert r["instructions_seen"] == 8  # 2 iterations x (2 fwd + 2 bwd)


def test_tp2_cp2_sp_every_launch_slot_is_exercised_and_honoured(tp_ranks):
    used: dict[str, set[str]] = {}
    for rk in tp_ranks:
        for name in (k for k in rk if k.startswith("layer_sp.")):
            r = rk[name]
            issues = [e for e in r["events"] if e["kind"] == "issue"]
            if r["nanobatches"] == 1:
                assert not any(e["partition"] for e in issues), name
                continue
            for e in (e for e in issues if e["partition"]):
                knobs = r["knobs"][str(e["instr"])][e["partition"]]
                assert e["slot"] == knobs["launch_slot"] and e["comm_sms"] == knobs["comm_sms"], (name, e)
                used.setdefault(e["partition"], set()).add(e["slot"])
            per_call: dict[tuple, int] = {}
            for e in issues:  # per layer call and nanobatch: forward 4 TP + 1 CP; backward 1 leading + 3 TP + 1 CP
                per_call[(e["phase"], e["call"])] = per_call.get((e["phase"], e["call"]), 0) + 1
                assert (".cp_kv." in e["coll"]) == (e["collective"] in ("cp_all_gather", "cp_reduce_scatter"))
            assert set(per_call.values()) == {10}, (name, per_call)
    assert used == {p: set(s) for p, s in cp_sp_engine_slots().items()}


def test_cp_sp_engine_slots_match_the_planners_cut():
    from kareus_megatron.search.partition import split_segments
    from kareus_megatron.workload.models import model_spec
    from kareus_megatron.workload.opgraph import layer_ops
    from kareus_megatron.workload.parallel import ParallelConfig

    model = model_spec("llama3.2-3b")
    for sp, engine in ((True, cp_sp_engine_slots()), (False, cp_engine_slots())):
        par = ParallelConfig(tp=2, cp=2, sequence_parallel=sp, micro_batch_size=2, seq_length=4096)
        segments = [
            seg for phase in ("forward", "backward") for seg in split_segments(phase, layer_ops(model, par, phase, 2))
        ]
        planned = {
            seg.partition: tuple(seg.compute[k].name for k in seg.slot_positions) for seg in segments if seg.partition
        }
        assert planned == engine, sp


def test_validate_accepts_cp_and_cp_sp_plans_and_refuses_mismatched_layouts(tmp_path):
    import cp_worker

    plan = cp_worker._plan(2, False, 1, 2)
    validate_plan_for_layer(plan)
    with pytest.raises(PlanError, match="'fwd_attn' is not run .*cp=2, with sequence parallelism"):
        validate_plan_for_layer(plan, sequence_parallel=True)
    with pytest.raises(PlanError, match="fwd_cp_kv"):
        validate_plan_for_layer(plan, cp=1)
    cp_sp = cp_worker._plan(2, True, 2, 2, sp=True)
    validate_plan_for_layer(cp_sp)
    with pytest.raises(PlanError, match="'fwd_sp_attn_norm' is not run .* without sequence parallelism"):
        validate_plan_for_layer(cp_sp, sequence_parallel=False)
    with pytest.raises(PlanError, match="'fwd_cp_kv' is not run .*cp=1, with sequence"):
        validate_plan_for_layer(cp_sp, cp=1)
    st = cp_sp.stages[0]
    bad = st.instructions[0].model_copy(
        update={
            "partitions": {
                **st.instructions[0].partitions,
                "fwd_cp_kv": st.instructions[0]
                .partitions["fwd_cp_kv"]
                .model_copy(update={"launch_slot": "input_norm"}),
            }
        }
    )
    wrong_slot = cp_sp.model_copy(update={"stages": (st.model_copy(update={"instructions": (bad,)}),)})
    with pytest.raises(
        PlanError, match="fwd_cp_kv launch_slot 'input_norm' is not an op of its segment; use one of qkv, rope"
    ):
        validate_plan_for_layer(wrong_slot)
    planned = _kareus_plan(tmp_path, "--cp", "2", "--sp", "--pp", "1", "--points", "2", "--methods", "kareus")
    assert any(i.nanobatches == 2 for st in planned.stages for i in st.instructions)
    validate_plan_for_layer(planned)  # the planner's TP x CP + SP plan runs on the engine as planned

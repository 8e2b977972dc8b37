"""The partitioned layer with sequence parallelism on real megatron-core 0.16.1 (gloo, TP=2 + SP, fp32).

sp_worker.py runs every scenario: outputs and all gradients equal the standard (local spec, SP on) layer's
for 1 and 2 nanobatches, every launch slot of every SP partition, recompute on and off; training losses
equal through the real 1F1B schedule and the runtime patch (TP=2 on 2 processes, PP=2 x TP=2 on 4); each
collective issued at its planned slot (trace.overlap_violations).
"""

from __future__ import annotations

import pytest
from _dist import MEGATRON_CORE, read_ranks, spawn

from kareus_megatron.runtime.overlap import overlap_violations
from kareus_megatron.vocab import SP_PARTITION_SLOTS


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    import sp_worker

    out = tmp_path_factory.mktemp("overlap_sp")
    spawn(sp_worker.worker, 2, str(out), preload=MEGATRON_CORE)
    return read_ranks(out, "rank{rank}.json", 2)


@pytest.fixture(scope="module")
def pp_ranks(tmp_path_factory):
    import sp_worker

    out = tmp_path_factory.mktemp("overlap_sp_pp")
    spawn(sp_worker.worker_pp, 4, str(out), preload=MEGATRON_CORE)
    return read_ranks(out, "rank{rank}.json", 4)


def _layer_names(rk):
    return sorted(k for k in rk if k.startswith("layer."))


def test_sp_outputs_and_all_grads_equal_standard_layer(ranks):
    names = _layer_names(ranks[0])
    assert len(names) == 2 * (1 + 4) + 2  # recompute off/on x (1 nanobatch + 4 slot scenarios) + Llama-like
    for rk in ranks:
        for name in names:
            r = rk[name]
            assert r["out"] <= 1.0, (name, r)
            assert r["grads"] <= 1.0, (name, r["worst_grad"], r["grads"])
            assert r["n_grads"] >= 14 and r["grad_norm"] > 0
        slow = rk["slow_link"]
        assert slow["out"] <= 1.0 and slow["grads"] <= 1.0 and overlap_violations(slow["events"]) == []
        neg = rk["negative.no_reduce_scatter"]
        assert neg["out"] > 1.0 or neg["grads"] > 1.0  # the comparison can fail


def test_every_sp_launch_slot_is_exercised_and_honoured(ranks):
    used: dict[str, set[str]] = {}
    for rk in ranks:
        for name in _layer_names(rk):
            r = rk[name]
            assert overlap_violations(r["events"]) == [], name
            if r["nanobatches"] != 2:
                assert not any(e["kind"] == "issue" and e["partition"] for e in r["events"])
                continue
            issues = [e for e in r["events"] if e["kind"] == "issue" and e["partition"]]
            for e in issues:
                knobs = r["knobs"][str(e["instr"])][e["partition"]]
                assert e["slot"] == knobs["launch_slot"], (name, e)
                assert e["comm_sms"] == knobs["comm_sms"] and e["sm_limit_requested"] is False  # gloo
                used.setdefault(e["partition"], set()).add(e["slot"])
            kinds = {e["collective"] for e in r["events"] if e["kind"] == "issue"}
            assert kinds == {"all_gather", "reduce_scatter"}
            # per layer call: every collective of every nanobatch issued once (4 forward, 4 backward each)
            per_call: dict[tuple, int] = {}
            for e in r["events"]:
                if e["kind"] == "issue":
                    per_call[(e["phase"], e["call"])] = per_call.get((e["phase"], e["call"]), 0) + 1
            assert set(per_call.values()) == {8}, per_call
    assert used == {p: set(s) for p, s in SP_PARTITION_SLOTS.items()}


def test_sp_norm_grads_all_reduced_by_finalize(ranks):
    for rk in ranks:
        r = rk["ddp"]
        ref, got = r["losses"]
        assert all(abs(a - b) <= 1e-5 * abs(a) + 1e-6 for a, b in zip(ref, got))
        assert r["grads"] <= 1.0
        sp_ref, sp_part = r["sp_params"]
        assert sp_ref == sp_part and any("layernorm" in k for k in sp_ref)
        assert r["sp_grad_tp_diff"] <= 1.0  # equal on both TP ranks after finalize_model_grads


def _check_training(r, instructions):
    assert r["grad_keys_equal"] and r["grads"] <= 1.0, r["grads"]
    for a, b in zip(sum(r["losses_ref"], []), sum(r["losses_part"], [])):
        assert abs(a - b) <= 1e-5 * abs(a) + 1e-6
    assert overlap_violations(r["events"]) == []
    assert r["instructions_seen"] == 2 * instructions
    assert any(e["kind"] == "issue" and e["partition"].startswith("bwd_sp_") for e in r["events"])


def test_sp_training_through_schedule_and_patch_equal(ranks):
    for rk in ranks:
        for rc in (0, 1):
            _check_training(rk[f"train.pp1.rc{rc}"], instructions=4)
    assert all(rk["train.pp1.rc0"]["losses_ref"][0] for rk in ranks)


def test_sp_pp2_1f1b_training_equal(pp_ranks):
    assert sorted(rk["train.pp2.rc0"]["pp_rank"] for rk in pp_ranks) == [0, 0, 1, 1]
    for rk in pp_ranks:
        for rc in (0, 1):
            _check_training(rk[f"train.pp2.rc{rc}"], instructions=8)
    assert sum(bool(rk["train.pp2.rc0"]["losses_ref"][0]) for rk in pp_ranks) == 2


def test_sp_plans_load_and_mismatched_partitions_are_refused():
    import sp_worker

    from kareus_megatron.errors import PlanError
    from kareus_megatron.runtime.overlap import settings_from_instruction, validate_plan_for_layer

    plan = sp_worker._plan(2, recompute=True)
    validate_plan_for_layer(plan)  # 2-nanobatch SP plans run
    s = settings_from_instruction(plan.stages[0].instructions[-1])
    assert set(s.knobs) == set(SP_PARTITION_SLOTS) and s.knobs_for("bwd_sp_attn").launch_slot in (
        "proj",
        "attention",
        "rope",
        "qkv",
    )
    with pytest.raises(PlanError, match="without sequence parallelism"):
        validate_plan_for_layer(plan, sequence_parallel=False)  # SP partitions on a non-SP layer
    bad = plan.model_copy(
        update={
            "stages": tuple(
                st.model_copy(
                    update={
                        "instructions": tuple(
                            i.model_copy(update={"partitions": {"fwd_attn": next(iter(i.partitions.values()))}})
                            for i in st.instructions
                        )
                    }
                )
                for st in plan.stages
            )
        }
    )
    with pytest.raises(PlanError, match=r"with sequence parallelism\); supported: fwd_sp_attn_norm.*with --sp"):
        validate_plan_for_layer(bad)


def test_sp_collectives_on_one_rank_copy():
    import torch

    from kareus_megatron.runtime.overlap.comm import Communicator

    comm, x = Communicator(), torch.arange(6.0).view(3, 2)
    for fn in (comm.all_gather, comm.reduce_scatter):
        out = torch.empty_like(x)
        pending, applied = fn(out, x, 8)
        pending.wait()
        assert torch.equal(out, x) and applied is False


def _cross_names(rk):
    return sorted(k for k in rk if k.startswith("cross.rc") and not k.endswith(".linked"))


def test_sp_cross_layer_outputs_grads_and_trace(ranks):
    """Cross-layer overlap with SP, 3 layers: outputs and every gradient equal the standard SP layer; forward, layer
    l's last reduce-scatter is issued in layer l+1's call at fwd_sp_attn_norm's slot; backward, layer l's leading
    all-gathers are issued inside layer l+1's backward (nanobatch 0 at once, nanobatch 1 at bwd_sp_mlp's slot)."""
    names = _cross_names(ranks[0])
    assert len(names) == max(len(s) for s in SP_PARTITION_SLOTS.values()) + 1  # every slot, and one with recompute
    for rk in ranks:
        assert rk["cross.rc0.linked"] == rk["cross.rc1.linked"] == 2
        for name in names:
            r = rk[name]
            assert r["out"] <= 1.0 and r["grads"] <= 1.0, (name, r["worst_grad"], r["grads"])
            assert not r["carry_left"] and overlap_violations(r["events"]) == [], name
            assert r["value_checks"] == 0 and r["checks"] == 2, name  # the gradient check took its no-sync path
            ev = r["events"]
            for phase in ("forward", "recompute") if r["recompute"] else ("forward",):
                knobs = r["knobs"]["0" if phase == "forward" else "1"]
                for layer in (1, 2):
                    e = next(
                        e
                        for e in ev
                        if e["kind"] == "issue" and e["phase"] == phase and e["coll"] == f"L{layer}.fwd.mlp.nb1"
                    )
                    assert e["layer"] == layer + 1 and e["partition"] == "fwd_sp_attn_norm", (name, e)
                    assert e["slot"] == knobs["fwd_sp_attn_norm"]["launch_slot"]
            for layer in (1, 2):  # the leading all-gathers of layers 1 and 2, inside the next layer's backward
                upper_wait = next(
                    e
                    for e in ev
                    if e["kind"] == "wait" and e["phase"] == "backward" and e["coll"] == f"L{layer + 1}.bwd.attn.nb1"
                )
                g0, g1 = (
                    next(e for e in ev if e["kind"] == "issue" and e["coll"] == f"L{layer}.bwd.out.nb{k}")
                    for k in (0, 1)
                )
                assert g0["seq"] < upper_wait["seq"] and g0["partition"] == "", (name, g0)
                assert g1["seq"] > upper_wait["seq"] and g1["partition"] == "bwd_sp_mlp", (name, g1)
                assert g1["slot"] == r["knobs"]["1"]["bwd_sp_mlp"]["launch_slot"]
            top = next(e for e in ev if e["kind"] == "issue" and e["coll"] == "L3.bwd.out.nb1")
            assert top["partition"] == ""  # the stack's first backward layer: exposed, as without cross-layer


def test_sp_cross_layer_training_through_schedule_and_patch_equal(ranks):
    for rk in ranks:
        for rc in (0, 1):
            r = rk[f"train.cross.pp1.rc{rc}"]
            _check_training(r, instructions=4)
            assert any(e["kind"] == "issue" and e["coll"] == "L1.fwd.mlp.nb1" and e["layer"] == 2 for e in r["events"])

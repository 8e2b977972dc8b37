"""The partitioned layer on real megatron-core 0.16.1 (2 processes, gloo, TP=2, tiny GPT, fp32).

One spawned worker runs every scenario (overlap_worker.py); these tests assert on what it wrote:
outputs and all gradients equal the standard layer's for 1 and 2 nanobatches, every launch slot,
recompute on and off; training losses equal through the real schedule and runtime patch; the trace
shows each collective overlapping the other nanobatch's compute at the planned slot.
"""

from __future__ import annotations

import json

import pytest
from _dist import MEGATRON_CORE, read_ranks, spawn

from kareus_megatron.runtime.overlap import overlap_violations
from kareus_megatron.vocab import TP_PARTITION_SLOTS


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    import overlap_worker

    out = tmp_path_factory.mktemp("overlap")
    spawn(overlap_worker.worker, 2, str(out), preload=MEGATRON_CORE)
    ranks = read_ranks(out, "rank{rank}.json", 2)
    for r, rk in enumerate(ranks):
        rk["trace_files"] = {p.name: json.loads(p.read_text()) for p in out.glob(f"*.trace.rank{r}.json")}
    return ranks


def _layer_names(rk):
    return sorted(k for k in rk if k.startswith("layer."))


def test_outputs_and_all_grads_equal_standard_layer(ranks):
    names = _layer_names(ranks[0])
    # recompute off/on x (1 nanobatch + 5 slot scenarios), + Llama-like (SwiGLU, RMSNorm, RoPE, GQA, QK-norm)
    assert len(names) == 2 * (1 + 5) + 2
    for rk in ranks:
        for name in names:
            r = rk[name]
            assert r["out"] <= 1.0, (name, r)
            assert r["grads"] <= 1.0, (name, r["worst_grad"], r["grads"])
            assert r["n_grads"] >= 14 and r["grad_norm"] > 0


def test_every_launch_slot_is_exercised_and_honoured(ranks):
    used: dict[tuple[str, str], set[str]] = {}
    for rk in ranks:
        for name in _layer_names(rk):
            r = rk[name]
            if r["nanobatches"] != 2:
                continue
            issues = [e for e in r["events"] if e["kind"] == "issue" and e["partition"]]
            assert issues
            for e in issues:
                knobs = r["knobs"][str(e["instr"])][e["partition"]]
                assert e["slot"] == knobs["launch_slot"], (name, e)
                assert e["comm_sms"] == knobs["comm_sms"] and e["sm_limit_requested"] is False  # gloo
                used.setdefault((e["phase"], e["partition"]), set()).add(e["slot"])
    phases = {"fwd_attn": "forward", "fwd_mlp": "forward", "bwd_mlp": "backward", "bwd_attn": "backward"}
    for part, slots in TP_PARTITION_SLOTS.items():
        assert used[(phases[part], part)] == set(slots), part
    # full recompute: the forward partitions run again inside the backward instruction, with its knobs
    assert used[("recompute", "fwd_attn")] == set(TP_PARTITION_SLOTS["fwd_attn"])


def test_trace_shows_overlap_at_planned_slot(ranks):
    for rk in ranks:
        for name in _layer_names(rk):
            r = rk[name]
            ev = r["events"]
            assert overlap_violations(ev) == [], name
            per_call: dict[tuple[int, str], int] = {}
            for e in ev:
                if e["kind"] == "issue" and e["partition"]:
                    per_call[(e["call"], e["phase"])] = per_call.get((e["call"], e["phase"]), 0) + 1
            want = 3 if r["nanobatches"] == 2 else 0  # per layer call and phase: 3 of the 4 collectives
            assert per_call and set(per_call.values()) == {want} if want else not per_call, name
            phases = {p for _, p in per_call}
            if want:
                assert phases == ({"forward", "recompute", "backward"} if r["recompute"] else {"forward", "backward"})
            # with 1 nanobatch every collective is waited before any other op starts
            if r["nanobatches"] == 1:
                for i, e in enumerate(ev):
                    if e["kind"] == "issue":
                        assert ev[i + 1]["kind"] == "wait" and ev[i + 1]["coll"] == e["coll"], name


def test_violation_checker_catches_a_wrong_slot(ranks):
    ev = [dict(e) for e in ranks[0]["layer.rc0.nb2.s0"]["events"]]
    issue = next(e for e in ev if e["kind"] == "issue" and e["partition"] == "fwd_mlp")
    issue["slot"] = "fc2" if issue["slot"] != "fc2" else "fc1"
    assert overlap_violations(ev)


def test_mixed_nanobatches_and_negative_control(ranks):
    for rk in ranks:
        r = rk["mixed.fwd2.bwd1"]
        assert r["out"] <= 1.0 and r["grads"] <= 1.0
        bwd_issues = [e for e in r["events"] if e["kind"] == "issue" and e["phase"] == "backward"]
        # Megatron's 1-nanobatch order: each all-reduce once, over the whole microbatch (2 per layer, 2 layers)
        assert len(bwd_issues) == 4 and all(e["partition"] == "" and e["whole"] for e in bwd_issues)
        assert rk["leak.live_runs"] == 0  # forward without backward frees its graph (no reference cycle)
        neg = rk["negative.no_allreduce"]
        assert neg["out"] > 1.0 and neg["grads"] > 1.0  # the comparison does detect missing collectives


def _check_training(r, recompute: bool, instructions: int) -> None:
    ref, got = r["losses_ref"], r["losses_part"]
    assert len(ref) == len(got) == 2
    if ref[0]:  # the last pipeline stage reports the losses
        assert ref[0] != ref[1]  # the SGD step changed the model
        for a, b in zip(sum(ref, []), sum(got, [])):
            assert abs(a - b) <= 1e-5 * abs(a) + 1e-6, (ref, got)
    assert r["grad_keys_equal"] and r["n_grads"] >= 8 and r["grads"] <= 1.0, r["grads"]
    assert r["standard_model_refused"] and r["partitioned_layers"] >= 1
    # switched per instruction by the real runtime patch: every issue used its own instruction's knobs
    assert r["instructions_seen"] == 2 * instructions
    issues = [e for e in r["events"] if e["kind"] == "issue" and e["partition"]]
    assert issues and overlap_violations(r["events"]) == []
    for e in issues:
        assert e["slot"] == r["plan_knobs"][e["instr"]][e["partition"]]["launch_slot"]
        assert e["comm_sms"] == r["plan_knobs"][e["instr"]][e["partition"]]["comm_sms"]
    assert {e["phase"] for e in issues} == (
        {"forward", "recompute", "backward"} if recompute else {"forward", "backward"}
    )


@pytest.mark.parametrize("recompute", [False, True])
def test_training_step_losses_equal(ranks, recompute):
    for rk in ranks:
        _check_training(rk[f"train.pp1.rc{int(recompute)}"], recompute, instructions=4)


def test_public_install_sets_up_the_overlap_engine(ranks):
    for rk in ranks:
        r = rk["runtime_install"]
        assert r["listening"] and r["released"]
        assert r["instructions_seen"] == 2 * 4  # 2 iterations x (2 forward + 2 backward)
        if r["losses_ref"][0]:
            for a, b in zip(sum(r["losses_ref"], []), sum(r["losses_part"], [])):
                assert abs(a - b) <= 1e-5 * abs(a) + 1e-6
        assert "no partitioned layers" in r["refused"]


def test_unsupported_configs_refused_at_build(ranks):
    sel = ranks[0]["refuse.selective"]  # selective recompute of the MLP: the planner models core attention only
    assert sel and "selective recompute of mlp" in sel and "get_gpt_layer_local_spec" in sel and "\n" not in sel
    assert ranks[0]["refuse.selective_core_attn"] is None  # megatron's default selective recompute runs


@pytest.mark.parametrize("recompute", [0, 1])
def test_megatron_ddp_with_overlapped_grad_reduce(ranks, recompute):
    # DDP's hooks assert one gradient per parameter per microbatch: the engine hands in the nanobatch sum
    for rk in ranks:
        r = rk[f"ddp.rc{recompute}"]
        ref, got = r["losses"]
        assert len(ref) == 3 and all(abs(a - b) <= 1e-5 * abs(a) + 1e-6 for a, b in zip(ref, got))
        assert r["grads"] <= 1.0 and r["grad_norm"] > 0


def test_trace_files_are_per_rank_json(ranks):
    for r, rk in enumerate(ranks):
        doc = rk["trace_files"][f"train.pp1.rc1.trace.rank{r}.json"]
        assert doc["format"] == "kareus-overlap-trace/1" and doc["rank"] == r and not doc["truncated"]
        assert doc["scenario"] == "train.pp1.rc1" and overlap_violations(doc["events"]) == []
        kinds = {e["kind"] for e in doc["events"]}
        assert kinds == {"op", "issue", "wait"}
        assert all({"phase", "layer", "nb", "mb", "instr"} <= set(e) for e in doc["events"])


@pytest.fixture(scope="module")
def pp_ranks(tmp_path_factory):
    import overlap_worker

    out = tmp_path_factory.mktemp("overlap_pp")
    spawn(overlap_worker.worker_pp, 4, str(out), preload=MEGATRON_CORE)
    return read_ranks(out, "rank{rank}.json", 4)


def test_tp2_pp2_1f1b_training_equal(pp_ranks):
    stages = sorted(rk["train.pp2.rc0"]["pp_rank"] for rk in pp_ranks)
    assert stages == [0, 0, 1, 1]
    for rk in pp_ranks:
        _check_training(rk["train.pp2.rc0"], recompute=False, instructions=8)
    assert any(rk["train.pp2.rc0"]["losses_ref"][0] for rk in pp_ranks)


def test_tp2_pp2_vp2_interleaved_equal(pp_ranks):
    for rk in pp_ranks:
        r = rk["train.vp2"]
        ref, got = r["losses"]
        assert len(ref) == len(got) and all(abs(a - b) <= 1e-5 * abs(a) + 1e-6 for a, b in zip(ref, got))
        assert r["n_grads"] >= 8 and r["grads"] <= 1.0
        assert overlap_violations(r["events"]) == []
        assert len({e["layer"] for e in r["events"]}) == 2  # both chunks' layers ran partitioned
    assert sum(len(rk["train.vp2"]["losses"][0]) == 4 for rk in pp_ranks) == 2  # the last stage's two TP ranks


def _coll_layer(event) -> int:
    """The layer that produced a trace event's collective (named L<layer>.<phase>.<segment>.nb<k>)."""
    return int(event["coll"][1:].split(".", 1)[0])


def _cross_names(rk):
    return sorted(k for k in rk if k.startswith("cross.rc") and not k.endswith(".linked"))


def test_cross_layer_outputs_and_all_grads_equal_standard_layer(ranks):
    names = _cross_names(ranks[0])
    assert len(names) == 5 + 2 + 2  # no recompute x 5 slots; recompute in groups of 3 and of 1 x 2 slots
    for rk in ranks:
        assert rk["cross.rc0.g3.linked"] == rk["cross.rc1.g3.linked"] == 2  # layers 1, 2 feed the next
        assert rk["cross.rc1.g1.linked"] == 0  # megatron's default recompute group: one layer per call
        for name in names:
            r = rk[name]
            assert r["out"] <= 1.0 and r["grads"] <= 1.0, (name, r["worst_grad"], r["grads"])
            assert r["n_grads"] >= 20 and r["grad_norm"] > 0 and not r["carry_left"], name
            # each linked layer got the very tensor the next one returned: checked without a host sync
            assert r["value_checks"] == 0 and r["checks"] == (2 if r["group"] == 3 else 0), name
            assert overlap_violations(r["events"]) == [], name
        neg = rk["cross.negative"]  # the carried half never written into the output: the comparison sees it
        assert not neg["out"] <= 1.0 and not neg["grads"] <= 1.0  # unwritten memory may hold NaN: also "differs"


def _issues(ev, phase):
    return [e for e in ev if e["kind"] == "issue" and e["phase"] == phase]


def test_cross_layer_forward_carries_the_last_allreduce_into_the_next_layer(ranks):
    for rk in ranks:
        for name in _cross_names(rk):
            r = rk[name]
            linked = r["group"] == 3
            for phase in ("forward", "recompute") if r["recompute"] else ("forward",):
                issues = _issues(r["events"], phase)
                for layer in (1, 2, 3):
                    last = next(e for e in issues if e["coll"] == f"L{layer}.fwd.mlp.nb1")
                    if linked and layer < 3:  # issued in the next layer's call, beside its nanobatch-0 attn unit
                        knobs = r["knobs"]["0" if phase == "forward" else "1"]["fwd_attn"]
                        assert last["layer"] == layer + 1 and last["nb"] == 1, (name, last)
                        assert last["partition"] == "fwd_attn" and last["slot"] == knobs["launch_slot"]
                        assert last["comm_sms"] == knobs["comm_sms"]
                        nxt = next(e for e in r["events"] if e["seq"] > last["seq"] and e["kind"] == "op")
                        assert (nxt["layer"], nxt["nb"], nxt["op"]) == (layer + 1, 0, knobs["launch_slot"])
                    else:  # the block's last layer, or no link: issued at once, exposed
                        assert last["layer"] == layer and last["partition"] == "", (name, last)


def test_cross_layer_backward_runs_the_next_layers_first_unit_beside_the_last_allreduce(ranks):
    for rk in ranks:
        for name in _cross_names(rk):
            r = rk[name]
            ev = r["events"]
            for layer in (3, 2):
                issue = next(e for e in _issues(ev, "backward") if e["coll"] == f"L{layer}.bwd.attn.nb1")
                wait = next(
                    e for e in ev if e["kind"] == "wait" and e["coll"] == issue["coll"] and e["phase"] == "backward"
                )
                beside = [
                    (e["op"], e["nb"])
                    for e in ev
                    if issue["seq"] < e["seq"] < wait["seq"] and e["kind"] == "op" and e["layer"] == layer - 1
                ]
                if r["group"] == 3:  # the lower layer's nanobatch-0 mlp unit runs before this layer's last wait
                    assert beside == [("fc2", 0), ("activation", 0), ("fc1", 0)], (name, layer, beside)
                else:
                    assert beside == [], (name, layer)


def test_cross_layer_backward_refuses_an_output_gradient_it_did_not_assume():
    import torch

    from kareus_megatron.errors import KareusError
    from kareus_megatron.runtime.overlap.cross_layer import Prefetched

    returned = torch.ones(4, 2, 3)
    pre = Prefetched(grads=None, coll=None, used=[torch.ones(4, 1, 3)], returned=returned)
    pre.check(returned, list(returned.chunk(2, dim=1)), 5)  # the tensor the next layer returned
    same = torch.ones(4, 2, 3)
    pre.check(same, list(same.chunk(2, dim=1)), 5)  # another tensor, equal values: accepted
    other = torch.ones(4, 2, 3) * 2  # a second consumer added to the gradient
    with pytest.raises(KareusError, match="^cross-layer overlap: layer 5's output feeds more than the next layer"):
        pre.check(other, [d.contiguous() for d in other.chunk(2, dim=1)], 5)


@pytest.mark.parametrize("recompute", [False, True])
def test_cross_layer_training_losses_equal_through_the_schedule_and_patch(ranks, recompute):
    for rk in ranks:
        r = rk[f"train.cross.pp1.rc{int(recompute)}"]
        _check_training(r, recompute, instructions=4)
        assert r["linked"] == 2  # check_model_for_plan linked the 3 layers for the cross-layer plan
        carried = [
            e
            for e in r["events"]
            if e["kind"] == "issue" and e["coll"].endswith("fwd.mlp.nb1") and e["layer"] == _coll_layer(e) + 1
        ]
        assert carried and {e["partition"] for e in carried} == {"fwd_attn"}


def test_cross_layer_tp2_pp2_1f1b_training_equal(pp_ranks):
    """2 layers per stage: each stage links its own pair; the stage boundary (a pipeline send) is never carried."""
    for rk in pp_ranks:
        r = rk["train.cross.pp2.rc0"]
        _check_training(r, recompute=False, instructions=8)
        assert r["linked"] == 1
        first = 1 + 2 * r["pp_rank"]  # megatron's global layer numbers of this stage: first, first + 1
        carried = [
            e
            for e in r["events"]
            if e["kind"] == "issue" and e["coll"].endswith("fwd.mlp.nb1") and e["layer"] != _coll_layer(e)
        ]
        assert carried and {(_coll_layer(e), e["layer"]) for e in carried} == {(first, first + 1)}

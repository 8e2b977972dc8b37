"""Plan checks at load: overlap knobs that do not fit the partitioned layer give one-line PlanErrors."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kareus_megatron.errors import PlanError
from kareus_megatron.plan.io import plan_from_dict
from kareus_megatron.runtime.overlap import (
    LayerSettings,
    comm_sms_values,
    settings_from_instruction,
    setup_overlap,
    validate_plan_for_layer,
)
from kareus_megatron.runtime.overlap.config import OverlapState
from kareus_megatron.vocab import CP_PARTITION_SLOTS, TP_PARTITION_SLOTS


def plan_dict(partitions: dict, *, mbs: int = 2, nanobatches: int = 2, cp: int = 1) -> dict:
    instrs = [
        {"kind": "forward", "microbatch": 0, "sm_clock_mhz": 1410, "nanobatches": 1},
        {
            "kind": "backward",
            "microbatch": 0,
            "sm_clock_mhz": 1200,
            "nanobatches": nanobatches,
            "partitions": partitions if nanobatches > 1 else {},
        },
    ]
    return {
        "format": "kareus-plan/1",
        "method": "kareus",
        "gpu": "a100-sxm4-40gb",
        "parallel": {
            "tp": 2,
            "cp": cp,
            "pp": 1,
            "vp": 1,
            "dp": 1,
            "micro_batch_size": mbs,
            "seq_length": 16,
            "num_microbatches": 1,
            "layers_per_stage": [2],
            "nodes": 1,
            "gpus_per_node": 2 * cp,
        },
        "predicted": {"iteration_time_s": 1.0, "iteration_energy_j": 1.0},
        "stages": [{"pp_rank": 0, "instructions": instrs}],
    }


GOOD = {"bwd_mlp": {"comm_sms": 12, "launch_slot": "fc1"}, "fwd_attn": {"comm_sms": 6, "launch_slot": "rope"}}


def test_good_plan_passes_and_lists_sm_counts():
    plan = plan_from_dict(plan_dict(GOOD))
    validate_plan_for_layer(plan, gpu_sm_count=108)
    assert comm_sms_values(plan) == [6, 12]


@pytest.mark.parametrize(
    "kwargs, sm_count, needle",
    [
        (dict(partitions={"bwd_mlp": {"comm_sms": 108, "launch_slot": "fc1"}}), 108, "comm_sms=108"),
        (dict(partitions={"bwd_mlp": {"comm_sms": 200, "launch_slot": "fc1"}}), 132, "1..131"),
        (dict(partitions=GOOD, mbs=3), 108, "does not divide micro-batch size 3"),
        (
            dict(partitions={"bwd_cp_kv": {"comm_sms": 4, "launch_slot": CP_PARTITION_SLOTS["bwd_cp_kv"][0]}}),
            108,
            "bwd_cp_kv",
        ),
        (dict(partitions=GOOD, cp=2), 108, "use one of attention, proj"),  # CP cuts the attn segment
    ],
)
def test_misfits_are_rejected_in_one_line(kwargs, sm_count, needle):
    plan = plan_from_dict(plan_dict(**kwargs))
    with pytest.raises(PlanError, match=needle) as e:
        validate_plan_for_layer(plan, gpu_sm_count=sm_count)
    assert "\n" not in str(e.value) and "use" in str(e.value)


def test_slot_outside_partition_rejected_at_load():
    with pytest.raises(PlanError, match="launch_slot 'qkv'"):
        plan_from_dict(plan_dict({"bwd_mlp": {"comm_sms": 12, "launch_slot": "qkv"}}))
    # a plan object that skipped the schema (model_construct) is still caught by the layer check
    plan = plan_from_dict(plan_dict(GOOD))
    ins = plan.stages[0].instructions[1]
    bad_knobs = ins.partitions["bwd_mlp"].model_construct(comm_sms=12, launch_slot="qkv")
    bad_ins = ins.model_construct(**{**dict(ins), "partitions": {"bwd_mlp": bad_knobs}})
    stage = plan.stages[0].model_construct(pp_rank=0, instructions=(plan.stages[0].instructions[0], bad_ins))
    bad = plan.model_construct(**{**dict(plan), "stages": (stage,)})
    with pytest.raises(PlanError, match="not an op of its segment; use one of fc2, activation, fc1"):
        validate_plan_for_layer(bad)


def test_setup_rejects_before_touching_distributed():
    # no process group exists here: the plan check (with the a100 preset's 108 SMs on a CPU) runs first
    plan = plan_from_dict(plan_dict({"fwd_mlp": {"comm_sms": 120, "launch_slot": "fc2"}}))
    with pytest.raises(PlanError, match="108 SMs"):
        setup_overlap(plan)


def test_listener_switches_settings_per_instruction():
    from kareus_megatron.runtime.hooks import InstructionEvent

    plan = plan_from_dict(plan_dict(GOOD))
    state = OverlapState()
    assert state.settings == LayerSettings() and state.forward_phase() == "forward"
    fwd, bwd = plan.stages[0].instructions
    state.on_instruction(InstructionEvent(0, 1, 0, bwd))
    s = state.settings
    assert s.nanobatches == 2 and s.kind == "backward" and state.forward_phase() == "recompute"
    assert s.knobs_for("bwd_mlp").launch_slot == "fc1" and s.knobs_for("bwd_mlp").comm_sms == 12
    assert s.knobs_for("bwd_attn").launch_slot == "pre_mlp_norm" and s.knobs_for("bwd_attn").comm_sms is None
    state.on_instruction(InstructionEvent(0, 0, 1, fwd))
    assert state.settings == settings_from_instruction(fwd, 0) and state.settings.nanobatches == 1


_PARTS = sorted(TP_PARTITION_SLOTS) + sorted(CP_PARTITION_SLOTS)
_ALL_OPS = sorted({o for s in TP_PARTITION_SLOTS.values() for o in s} | {"rope", "bogus"})


@settings(max_examples=60, deadline=None)
@given(
    part=st.sampled_from(_PARTS),
    slot=st.sampled_from(_ALL_OPS),
    sms=st.integers(1, 200),
    mbs=st.integers(1, 9),
    sm_count=st.sampled_from([84, 108, 132]),
)
def test_validation_matches_an_independent_oracle(part, slot, sms, mbs, sm_count):
    ok = part in TP_PARTITION_SLOTS and slot in TP_PARTITION_SLOTS[part] and sms < sm_count and mbs % 2 == 0
    try:
        plan = plan_from_dict(plan_dict({part: {"comm_sms": sms, "launch_slot": slot}}, mbs=mbs))
        validate_plan_for_layer(plan, gpu_sm_count=sm_count)
    except PlanError as e:
        assert not ok and "\n" not in str(e)
    else:
        assert ok

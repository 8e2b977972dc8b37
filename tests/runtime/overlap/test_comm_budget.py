"""The comm-SM budget at plan load: a plan with more distinct comm SM counts per group (TP, CP) than the runtime
builds communicators for is refused in one line before anything is built; one at the budget passes."""

from __future__ import annotations

import pytest
from test_overlap_plan import plan_dict

from kareus_megatron.errors import PlanError
from kareus_megatron.plan.io import plan_from_dict
from kareus_megatron.runtime.overlap import comm_sms_values, validate_plan_for_layer
from kareus_megatron.vocab import CP_PARTITION_SLOTS, MAX_COMM_SM_VALUES, TP_PARTITION_SLOTS


def _plan(n_tp: int, n_cp: int = 0):
    """A plan whose instructions use n_tp distinct TP comm SM counts and n_cp CP ones (CP=2 when n_cp)."""
    d = plan_dict({}, cp=2 if n_cp else 1)
    instrs, tp_left, cp_left, mb = [], list(range(1, n_tp + 1)), list(range(1, n_cp + 1)), 0
    while tp_left or cp_left or mb == 0:
        parts = {}
        if tp_left:
            parts["bwd_mlp"] = {"comm_sms": tp_left.pop(), "launch_slot": TP_PARTITION_SLOTS["bwd_mlp"][0]}
        if cp_left:
            parts["bwd_cp_kv"] = {"comm_sms": cp_left.pop(), "launch_slot": CP_PARTITION_SLOTS["bwd_cp_kv"][0]}
        instrs += [
            {"kind": "forward", "microbatch": mb, "sm_clock_mhz": 1410, "nanobatches": 1},
            {"kind": "backward", "microbatch": mb, "sm_clock_mhz": 1200, "nanobatches": 2, "partitions": parts},
        ]
        mb += 1
    d["stages"][0]["instructions"] = instrs
    d["parallel"]["num_microbatches"] = mb
    return plan_from_dict(d)


@pytest.mark.parametrize(
    ("n_tp", "n_cp", "kind"), [(MAX_COMM_SM_VALUES + 1, 0, "TP"), (2, MAX_COMM_SM_VALUES + 1, "CP")]
)
def test_a_plan_over_the_budget_is_refused_in_one_line(n_tp, n_cp, kind):
    plan = _plan(n_tp, n_cp)
    assert len(comm_sms_values(plan, cp=kind == "CP")) == MAX_COMM_SM_VALUES + 1
    with pytest.raises(PlanError, match=f"for the {kind} group") as e:
        validate_plan_for_layer(plan, gpu_sm_count=132)
    assert f"at most {MAX_COMM_SM_VALUES}" in str(e.value) and "\n" not in str(e.value)


def test_a_plan_at_the_budget_passes():
    plan = _plan(MAX_COMM_SM_VALUES, MAX_COMM_SM_VALUES)
    validate_plan_for_layer(plan, gpu_sm_count=132)
    assert len(comm_sms_values(plan)) == len(comm_sms_values(plan, cp=True)) == MAX_COMM_SM_VALUES

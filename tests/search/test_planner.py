"""The planner glue: plan files, the frontier document, point choice, and the methods' frontiers.

One planning run of the documented default (llama3.2-3b, 2 × 8 A100-SXM4-40GB, TP=8, PP=2) is shared by
the tests of this module; small layouts cover the interleaved and DeepSpeed schedules.
"""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kareus_megatron.cost import KernelModel
from kareus_megatron.cost.waveform import METRIC_NAMES
from kareus_megatron.errors import ConfigError, PlanError
from kareus_megatron.hardware.gpus import gpu_spec
from kareus_megatron.plan.build import build_outputs
from kareus_megatron.plan.frontier import reductions
from kareus_megatron.plan.io import SCHEMA_PATH, plan_from_dict, plan_json_schema
from kareus_megatron.search.planner import plan_methods, reduction_indices, select_points
from kareus_megatron.search.schedules import instruction_order
from kareus_megatron.vocab import METHODS
from kareus_megatron.workload.models import model_spec
from kareus_megatron.workload.parallel import make_parallel

POINTS = 6


def default_job():
    gpu, model = gpu_spec("a100-sxm4-40gb"), model_spec("llama3.2-3b")
    par = make_parallel(
        model,
        tp=8,
        pp=2,
        micro_batch_size=8,
        seq_length=4096,
        num_microbatches=8,
        recompute="full",
        first_stage_layers=15,
        last_stage_layers=13,
        nodes=2,
        gpus_per_node=8,
    )
    return gpu, model, par


@pytest.fixture(scope="module")
def planned():
    gpu, model, par = default_job()
    result = plan_methods(gpu, model, par, KernelModel(gpu), points=POINTS)
    doc, built = build_outputs(result)
    return result, doc, built


def test_shipped_schema_is_current():
    shipped = json.loads(SCHEMA_PATH.read_text())
    shipped.pop("$schema")
    assert shipped == plan_json_schema(), (
        "kareus_megatron/plan/plan.schema.json is stale; regenerate it from plan.io.plan_json_schema()"
    )


def test_plans_validate_against_the_shipped_schema(planned):
    _, _, built = planned
    validator = jsonschema.Draft202012Validator(json.loads(SCHEMA_PATH.read_text()))
    for b in built:
        data = b.plan.model_dump(mode="json", exclude_none=True)
        validator.validate(data)
        assert plan_from_dict(json.loads(json.dumps(data))) == b.plan


def test_frontier_document_layout(planned):
    result, doc, built = planned
    assert set(doc) == {"format", "config", "methods", "reductions"}
    assert doc["format"] == "kareus-frontier/1"
    assert list(doc["methods"]) == list(METHODS)
    assert set(doc["reductions"]) == set(METHODS)
    names = {b.relpath for b in built}
    for name, entry in doc["methods"].items():
        assert set(entry) == {"points"}
        pts = entry["points"]
        assert 1 <= len(pts) <= POINTS
        for nn, p in enumerate(pts):
            assert set(p) == {"time_s", "energy_j", "plan", *METRIC_NAMES}  # issue 26: the power metrics
            # the waveform's mean over the iteration is the predicted energy, and swing = peak - min
            assert p["mean_power_w"] * p["time_s"] == pytest.approx(p["energy_j"], rel=1e-9)
            assert p["swing_w"] == pytest.approx(p["peak_power_w"] - p["min_power_w"])
            assert 0 < p["min_power_w"] < p["mean_power_w"] < p["peak_power_w"]
            assert p["plan"] == f"plans/{name}-{nn:02d}.json" and p["plan"] in names
        t = [p["time_s"] for p in pts]
        e = [p["energy_j"] for p in pts]
        assert t == sorted(t) and all(a > b for a, b in zip(e, e[1:])), "fastest first, energy falling"
        mf = result.methods[name]
        assert t[0] == pytest.approx(mf.time_s[0]) and e[-1] == pytest.approx(mf.energy_j.min())
        assert set(doc["reductions"][name]) == {
            "iso_time_energy",
            "iso_energy_time",
            "max_throughput_time_vs_megatron",
            "max_throughput_energy_vs_megatron",
        }
    cfg = doc["config"]
    assert (cfg["model"], cfg["gpu"], cfg["tp"], cfg["pp"], cfg["layers_per_stage"]) == (
        "llama3.2-3b",
        "a100-sxm4-40gb",
        8,
        2,
        [15, 13],
    )
    # The chosen points include the plans that decide the reductions: the file's points reproduce them.
    pts = {n: [(p["time_s"], p["energy_j"]) for p in m["points"]] for n, m in doc["methods"].items()}
    from_points = reductions(pts)
    for name in METHODS:
        for key, v in doc["reductions"][name].items():
            assert (v is None and from_points[name][key] is None) or v == pytest.approx(from_points[name][key])


def test_kareus_dominates_the_baselines_on_the_default(planned):
    result, doc, _ = planned
    k = result.methods["kareus"]
    for base in ("perseus", "nanobatch_perseus", "megatron"):
        b = result.methods[base]
        for t, e in zip(b.time_s, b.energy_j):
            ok = (k.time_s <= t * (1 + 1e-9)) & (k.energy_j <= e * (1 + 1e-9))
            assert ok.any(), f"{base} point ({t:.4f} s, {e:.1f} J) is not dominated by kareus"
    red = doc["reductions"]["kareus"]
    assert all(v is not None and v > 0 for v in red.values()), red
    assert red["iso_time_energy"] > doc["reductions"]["nanobatch_perseus"]["iso_time_energy"]


def test_instruction_order_and_predictions_match_the_schedule(planned):
    result, _, built = planned
    orders = instruction_order("1f1b", 2, 8)
    grid = set(result.gpu.clock_grid_mhz())
    for b in built:
        plan = b.plan
        assert plan.parallel.schedule == "1f1b" and plan.framework == "megatron"
        assert plan.parallel.layers_per_stage == (15, 13)
        for r, stage in enumerate(plan.stages):
            assert [(i.kind, i.microbatch, i.chunk) for i in stage.instructions] == orders[r]
            for i in stage.instructions:
                assert (i.nanobatches == 2) == bool(i.partitions)
                assert i.sm_clock_mhz in grid
        if b.method in ("megatron", "perseus"):
            assert all(i.nanobatches == 1 for s in plan.stages for i in s.instructions)
        if b.method == "megatron":
            assert {i.sm_clock_mhz for s in plan.stages for i in s.instructions} == {1410}
        # Whole-job energy: every GPU's instructions plus blocked power while not computing.
        busy = [sum(i.predicted_time_s for i in s.instructions) for s in plan.stages]
        inst_e = sum(i.predicted_energy_j for s in plan.stages for i in s.instructions)
        t = plan.predicted.iteration_time_s
        assert t >= max(busy)
        want = result.gpus_per_stage * (inst_e + result.p_blocked_w * sum(t - x for x in busy))
        assert plan.predicted.iteration_energy_j == pytest.approx(want, rel=1e-9)


def test_kareus_overlap_knobs_are_valid_and_vary(planned):
    _, _, built = planned
    kareus = [b.plan for b in built if b.method == "kareus"]
    knobs = {
        (n, k.comm_sms, k.launch_slot)
        for p in kareus
        for s in p.stages
        for i in s.instructions
        for n, k in i.partitions.items()
    }
    assert knobs, "the kareus plans overlap nothing"
    assert len({k[1] for k in knobs}) > 1 or len({k[2] for k in knobs}) > 1


@pytest.mark.parametrize("schedule, pp, vp, m", [("interleaved-1f1b", 2, 2, 4), ("deepspeed-train", 4, 1, 4)])
def test_other_schedules(schedule, pp, vp, m):
    gpu, model = gpu_spec("a100-sxm4-40gb"), model_spec("qwen3-1.7b")
    par = make_parallel(
        model,
        tp=4,
        pp=pp,
        vp=vp,
        micro_batch_size=2,
        seq_length=1024,
        num_microbatches=m,
        recompute="full",
        gpus_per_node=8,
    )
    result = plan_methods(gpu, model, par, KernelModel(gpu), methods=["perseus"], points=3, schedule=schedule)
    assert list(result.methods) == ["megatron", "perseus"]
    _, built = build_outputs(result)
    orders = instruction_order(schedule, pp, m, vp)
    for b in built:
        assert b.plan.parallel.schedule == schedule and b.plan.parallel.vp == vp
        assert b.plan.framework == ("deepspeed" if schedule == "deepspeed-train" else "megatron")
        for r, stage in enumerate(b.plan.stages):
            assert [(i.kind, i.microbatch, i.chunk) for i in stage.instructions] == orders[r]


def test_max_time_limits_the_chosen_points_and_rejects_the_impossible():
    gpu, model, par = default_job()
    kernel = KernelModel(gpu)
    with pytest.raises(PlanError, match="--max-time"):
        plan_methods(gpu, model, par, kernel, methods=["perseus"], points=4, max_time_s=0.01)
    full = plan_methods(gpu, model, par, kernel, methods=["perseus"], points=4)
    p = full.methods["perseus"]
    limit = float(p.time_s[len(p.time_s) // 2])
    cut = plan_methods(gpu, model, par, kernel, methods=["perseus"], points=4, max_time_s=limit)
    assert all(cut.methods["perseus"].time_s[i] <= limit for i in cut.methods["perseus"].chosen)
    with pytest.raises(ConfigError, match="--points"):
        plan_methods(gpu, model, par, kernel, points=1)
    with pytest.raises(ConfigError, match="unknown method"):
        plan_methods(gpu, model, par, kernel, methods=["zeus"])


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.floats(0.1, 100, allow_nan=False), min_size=1, max_size=40, unique=True),
    st.integers(2, 12),
    st.lists(st.integers(-3, 45), max_size=4),
    st.one_of(st.none(), st.integers(0, 45)),
)
def test_select_points_properties(times, n, must, allowed):
    t = np.sort(np.array(times))
    idx = select_points(t, n, must=must, allowed=allowed)
    count = t.size if allowed is None else max(1, min(allowed, t.size))
    assert idx == sorted(set(idx))
    assert len(idx) == min(n, count)
    assert idx[0] == 0 and idx[-1] == count - 1
    kept_must = [i for i in dict.fromkeys(must) if 0 <= i < count and i not in (0, count - 1)]
    assert set(kept_must[: max(0, n - len({0, count - 1}))]) <= set(idx)


def test_reduction_indices():
    t = np.array([1.0, 2.0, 3.0, 4.0])
    e = np.array([10.0, 8.0, 6.0, 5.0])
    assert reduction_indices(t, e, ref_time_s=2.5, ref_energy_j=6.5) == [1, 2]
    assert reduction_indices(t, e, ref_time_s=0.5, ref_energy_j=4.0) == []

"""The plan file: validation names the bad field, versions are checked, writes are atomic."""

from __future__ import annotations

import copy
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kareus_megatron.errors import PlanError, PlanVersionError
from kareus_megatron.plan.io import load_plan, plan_from_dict, plan_sha256, save_plan
from kareus_megatron.plan.schema import MODEL_RECORD_FIELDS, Plan


def sample_plan_dict(pp: int = 2, m: int = 2) -> dict:
    stages = []
    for r in range(pp):
        instrs = []
        for mb in range(m):
            instrs.append({"kind": "forward", "microbatch": mb, "sm_clock_mhz": 1410, "nanobatches": 1})
        for mb in range(m):
            instrs.append(
                {
                    "kind": "backward",
                    "microbatch": mb,
                    "sm_clock_mhz": 1200,
                    "nanobatches": 2,
                    "partitions": {"bwd_mlp": {"comm_sms": 12, "launch_slot": "fc1"}},
                }
            )
        stages.append({"pp_rank": r, "instructions": instrs})
    return {
        "format": "kareus-plan/1",
        "method": "kareus",
        "gpu": "a100-sxm4-40gb",
        "parallel": {
            "tp": 2,
            "cp": 1,
            "pp": pp,
            "vp": 1,
            "dp": 1,
            "micro_batch_size": 2,
            "seq_length": 16,
            "num_microbatches": m,
            "recompute": "none",
            "layers_per_stage": [1] * pp,
            "nodes": 1,
            "gpus_per_node": 2 * pp,
        },
        "predicted": {"iteration_time_s": 1.0, "iteration_energy_j": 100.0},
        "stages": stages,
    }


TINY_MODEL = dict(
    name="tiny",
    num_layers=2,
    hidden_size=8,
    num_attention_heads=1,
    num_query_groups=1,
    ffn_hidden_size=8,
    vocab_size=16,
)


def test_plans_without_the_model_architecture_load_and_hash_as_before():
    d = sample_plan_dict()
    d["model"] = dict(TINY_MODEL)  # a plan written before the architecture fields existed
    plan = plan_from_dict(d)
    assert plan.model.unknown_fields() == list(MODEL_RECORD_FIELDS)
    # the hash the build before the architecture fields gave this plan (run logs record it)
    assert plan_sha256(plan) == "bc08a6f952787f971332b4e815bcf7d08d434326a9d3b1b01beae9ff58858986"
    full = plan_from_dict({**d, "model": dict(TINY_MODEL, activation="gelu", precision="fp32")})
    assert plan_sha256(full) != plan_sha256(plan)


def test_kareus_plan_records_the_model_and_precision():
    from kareus_megatron.plan.build import model_shape
    from kareus_megatron.workload.models import model_spec

    rec = model_shape(model_spec("qwen3-1.7b"), "fp16")
    assert rec.unknown_fields() == []
    assert (
        rec.activation,
        rec.normalization,
        rec.position_embedding,
        rec.kv_channels,
        rec.qk_norm,
        rec.bias_linear,
        rec.qkv_bias,
        rec.tied_embeddings,
        rec.precision,
    ) == ("swiglu", "rmsnorm", "rope", 128, True, False, False, True, "fp16")


def test_roundtrip(tmp_path):
    plan = plan_from_dict(sample_plan_dict())
    save_plan(plan, tmp_path / "p.json")
    again = load_plan(tmp_path / "p.json")
    assert again == plan
    assert plan_sha256(again) == plan_sha256(plan)
    assert plan.clock_sequence(0) == [1410, 1410, 1200, 1200]
    assert not list(tmp_path.glob(".*tmp"))


@pytest.mark.parametrize(
    "mutate, needle",
    [
        (
            lambda d: d["stages"][0]["instructions"][2]["partitions"].update(
                bogus={"comm_sms": 3, "launch_slot": "fc1"}
            ),
            "bogus",
        ),
        (lambda d: d["stages"][0]["instructions"][2]["partitions"]["bwd_mlp"].update(launch_slot="qkv"), "launch_slot"),
        (lambda d: d["stages"][0]["instructions"][0].update(nanobatches=3), "nanobatches"),
        (lambda d: d["stages"][1]["instructions"].pop(), "backward"),
        (lambda d: d["parallel"].update(pp=3), "layers_per_stage"),
        (lambda d: d["parallel"].update(gpus_per_node=3), "nodes"),
        (lambda d: d["stages"][0]["instructions"][0].update(sm_clock_mhz=-5), "sm_clock_mhz"),
        (lambda d: d.update(extra_key=1), "extra_key"),
        (lambda d: d.update(model=dict(TINY_MODEL, activation="relu")), "activation 'relu' is not one of swiglu, gelu"),
        (lambda d: d.update(model=dict(TINY_MODEL, precision="int4")), "precision 'int4'"),
        (lambda d: d.update(model=dict(TINY_MODEL, bias_linear=True, qkv_bias=False)), "qkv_bias is false"),
    ],
)
def test_bad_fields_are_named(mutate, needle):
    d = sample_plan_dict()
    mutate(d)
    with pytest.raises(PlanError, match=needle):
        plan_from_dict(d)


def test_version_and_json_errors(tmp_path):
    d = sample_plan_dict()
    d["format"] = "kareus-plan/2"
    with pytest.raises(PlanVersionError, match="kareus-plan/2"):
        plan_from_dict(d)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(PlanError, match="not valid JSON"):
        load_plan(tmp_path / "bad.json")
    with pytest.raises(PlanError, match="cannot read"):
        load_plan(tmp_path / "missing.json")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5000) | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3),
    max_leaves=10,
)


@settings(max_examples=200, deadline=None)
@given(
    path=st.lists(
        st.sampled_from(["stages", 0, "instructions", 1, "parallel", "tp", "kind", "partitions", "predicted"]),
        min_size=1,
        max_size=4,
    ),
    value=json_values,
)
def test_fuzzed_plans_either_load_or_raise_plan_error(path, value):
    d = copy.deepcopy(sample_plan_dict())
    node = d
    for key in path[:-1]:
        try:
            node = node[key]
        except (KeyError, IndexError, TypeError):
            return
    try:
        node[path[-1]] = value
    except (TypeError, IndexError):
        return
    try:
        plan = plan_from_dict(json.loads(json.dumps(d, allow_nan=True)))
    except PlanError:
        return
    assert isinstance(plan, Plan)


def test_replace_directory_swaps_whole_or_leaves_out_untouched(tmp_path):
    import os
    import stat

    from kareus_megatron.plan.io import replace_directory, write_json_atomic

    out = tmp_path / "out"
    with replace_directory(out) as tmp:
        write_json_atomic(tmp / "frontier.json", {"v": 1})
        (tmp / "plans").mkdir()
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~umask  # not mkdtemp's private 0700
    assert stat.S_IMODE((out / "frontier.json").stat().st_mode) == 0o666 & ~umask
    with pytest.raises(RuntimeError):
        with replace_directory(out) as tmp:
            write_json_atomic(tmp / "frontier.json", {"v": 2})
            raise RuntimeError("half-way")
    assert json.loads((out / "frontier.json").read_text()) == {"v": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary left behind


def test_check_output_dir_refuses_what_a_swap_would_damage(tmp_path, monkeypatch):
    from kareus_megatron.errors import ConfigError
    from kareus_megatron.plan.io import check_output_dir

    monkeypatch.chdir(tmp_path)
    (tmp_path / "file").write_text("x")
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("mine")
    for bad, needle in (
        (tmp_path / "file", "not a directory"),
        (tmp_path, "current directory"),
        (tmp_path.parent, "current directory"),
        (tmp_path / "foreign", "no frontier.json"),
    ):
        with pytest.raises(ConfigError, match=needle):
            check_output_dir(bad)
    check_output_dir(tmp_path / "new")

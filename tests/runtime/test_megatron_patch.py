"""The megatron-core patch on real schedules: 2 processes, gloo, tiny GPT, simulated GPUs.

Run against the pinned megatron-core 0.16.1; test_framework_versions.py reruns it on 0.15 and 0.19."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import plans
import pytest
from _dist import MEGATRON_CORE, read_ranks, spawn

from kareus_megatron.errors import PlanMismatchError, UnsupportedVersionError
from kareus_megatron.plan.megatron_model import live_architecture
from kareus_megatron.plan.schema import MODEL_RECORD_FIELDS
from kareus_megatron.runtime.frameworks import megatron_patch
from kareus_megatron.runtime.frameworks.megatron_patch import LiveRun, plan_mismatches, validate_plan


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    import patch_worker

    out = tmp_path_factory.mktemp("patch")
    spawn(
        patch_worker.worker,
        2,
        str(out),
        env={"KAREUS_GPU_BACKEND": "simulated", "KAREUS_SIMULATED_LATENCY_MS": "15", "KAREUS_GPU": None},
        preload=MEGATRON_CORE,
    )
    ranks = read_ranks(out, "rank{rank}.json", 2)
    return out, ranks


def _clock_decisions(path, gpu: int) -> list[tuple[str, int]]:
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    return [(r["event"], r["mhz"]) for r in recs if r["gpu"] == gpu and r["event"] in ("set", "skip")]


@pytest.mark.parametrize("tag,vp,seed", [("1f1b", 1, 0), ("vp", 2, 5)])
def test_clock_log_follows_plan(spawned, tag, vp, seed):
    out, ranks = spawned
    plan = plans.tiny_plan(pp=2, vp=vp, m=4, seed=seed)
    for r in range(2):
        decisions = _clock_decisions(out / f"{tag}.clocks.jsonl", r)
        assert [mhz for _, mhz in decisions] == plan.clock_sequence(r) * 2  # 2 iterations, applied+skipped
        assert any(ev == "set" for ev, _ in decisions)
        recs = [json.loads(line) for line in (out / f"{tag}.clocks.jsonl").read_text().splitlines()]
        mine = [x for x in recs if x["gpu"] == r]
        assert mine[-2]["event"] == "reset" and mine[-1]["event"] == "close"  # clocks restored at the end


@pytest.mark.parametrize("tag", ["1f1b", "vp"])
def test_losses_and_grads_bit_identical(spawned, tag):
    _, ranks = spawned
    for r in range(2):
        res = ranks[r][tag]
        assert res["grads_equal"] and res["n_grads"] > 0
        assert res["losses_equal"], res["losses"]
    last = ranks[1][tag]["losses"][0]
    assert all(3.0 < x < 6.0 for x in last)  # ~ln(128) for the untrained tiny GPT


@pytest.mark.parametrize("tag,vp,seed", [("1f1b", 1, 0), ("vp", 2, 5)])
def test_hooks_see_every_planned_instruction_in_order(spawned, tag, vp, seed):
    _, ranks = spawned
    plan = plans.tiny_plan(pp=2, vp=vp, m=4, seed=seed)
    for r in range(2):
        res = ranks[r][tag]
        planned = [[i.kind, i.chunk, i.microbatch, i.sm_clock_mhz] for i in plan.stages[r].instructions]
        want = [[it, k, r, *p] for it in range(2) for k, p in enumerate(planned)]
        assert res["events"] == want  # forward-only evaluation passes announce nothing
        assert res["order_deviations"] == 0


def test_measurement_log(spawned):
    out, _ = spawned
    from kareus_megatron.report.runlog import read_run_log  # the log is a directory of rank files

    log = read_run_log(out / "1f1b.run.jsonl")
    assert log.header["world"] == 2 and log.header["backend"] == "simulated" and log.partial == {}
    its = log.iterations
    assert [r["iteration"] for r in its] == [0, 1]
    for r in its:
        assert [s["pp_rank"] for s in r["stages"]] == [0, 1]
        assert r["time_s"] == max(s["time_s"] for s in r["stages"]) > 0
        assert r["energy_j"] == pytest.approx(sum(s["energy_j"] for s in r["stages"]))
        assert r["energy_j"] > 0


def test_wrong_plans_rejected_before_step_one(spawned):
    _, ranks = spawned
    for r in range(2):
        wrong_m = ranks[r]["wrong_m"]
        assert wrong_m["forward_calls"] == 0
        assert "microbatches per iteration: plan 8, run 4" in wrong_m["raised"]
        both = ranks[r]["wrong_pp_and_m"]
        assert both["forward_calls"] == 0
        msg = both["raised"]
        assert "pipeline parallel size (pp): plan 4, run 2" in msg and "plan 5, run 4" in msg
        assert msg.count("does not match") == 1  # one error listing every mismatch


def test_live_model_is_read_in_full(spawned):
    _, ranks = spawned
    for r in range(2):
        live = ranks[r]["live_model"]
        assert {k: live[k] for k in MODEL_RECORD_FIELDS} == plans.TINY_GPT_ARCH  # every field read, and right
        assert live["hidden_size"] == plans.HIDDEN


def test_a_plan_for_another_architecture_is_rejected_before_step_one(spawned):
    _, ranks = spawned
    for r in range(2):
        wrong = ranks[r]["wrong_arch"]
        assert wrong["forward_calls"] == 0
        for part in (
            "model activation: plan swiglu, run gelu",
            "model normalization: plan rmsnorm, run layernorm",
            "model position_embedding: plan rope, run learned",
            "model precision: plan bf16, run fp32",
            "model bias_linear: plan false, run true",
            "model tied_embeddings: plan true, run false",
        ):
            assert part in wrong["raised"]
        assert wrong["raised"].count("does not match") == 1


# ---- validation without processes ----------------------------------------------------------


def _live(**kw):
    base = dict(
        pp=2,
        pp_rank=0,
        vp=1,
        num_microbatches=4,
        seq_length=16,
        micro_batch_size=2,
        tp=1,
        cp=1,
        dp=1,
        sequence_parallel=False,
        layers_on_rank=1,
        model=dict(
            num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=4, ffn_hidden_size=128, vocab_size=128
        ),
    )
    base.update(kw)
    return LiveRun(**base)


def test_matching_plan_has_no_mismatch():
    assert (
        plan_mismatches(plans.tiny_plan(), _live(), (1410, 1305, 1200, 1155, 1095, 1005, 990), "a100-sxm4-40gb") == []
    )


def test_every_mismatch_is_listed():
    live = _live(tp=2, seq_length=32, layers_on_rank=3, model={"hidden_size": 64}, vp=2)
    with pytest.raises(PlanMismatchError) as e:
        validate_plan(plans.tiny_plan(), live, (1410, 1200), "h100-sxm5-80gb", source="p.json")
    msg = str(e.value)
    bad = sorted(set(plans.tiny_plan().clock_sequence(0)) - {1410, 1200})
    assert bad
    for part in (
        "p.json does not match",
        "tensor parallel size (tp): plan 1, run 2",
        "sequence length: plan 16, run 32",
        "virtual pipeline chunks (vp): plan 1, run 2",
        "schedule: plan 1f1b, run interleaved-1f1b",
        "model hidden_size: plan 32, run 64",
        "layers on pipeline rank 0: plan 1, run 3",
        "GPU: plan made for a100-sxm4-40gb, this GPU is h100-sxm5-80gb",
        f"SM clocks {', '.join(map(str, bad))} MHz are not lockable",
    ):
        assert part in msg
    assert "\n" not in msg


def test_architecture_mismatches_are_listed_and_unknown_fields_skipped():
    arch = dict(plans.TINY_GPT_ARCH, activation="swiglu", kv_channels=16, qk_norm=True, precision="tf32")
    live = _live(
        model={**plans.TINY_GPT_ARCH, **{k: v for k, v in arch.items() if k != "precision"}, "precision": "bf16"}
    )
    assert plan_mismatches(plans.tiny_plan(), live) == [
        "model activation: plan gelu, run swiglu",
        "model kv_channels: plan 8, run 16",
        "model qk_norm: plan false, run true",
        "model precision: plan fp32, run bf16",
    ]
    old = plans.tiny_plan()
    old = old.model_copy(update={"model": old.model.model_copy(update=dict.fromkeys(MODEL_RECORD_FIELDS))})
    assert plan_mismatches(old, live) == []  # a plan from before the record: unknown, not checked


def test_live_architecture_names_what_megatron_runs():
    import torch
    import torch.nn.functional as F

    from kareus_megatron.runtime.frameworks.cpu_shim import stub_missing_triton

    stub_missing_triton()  # megatron-core 0.19 imports Triton (test_framework_versions.py runs this file on it)
    from megatron.core.activations import squared_relu
    from megatron.core.transformer import TransformerConfig

    cfg = TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        kv_channels=32,
        gated_linear_unit=True,
        activation_func=F.silu,
        normalization="RMSNorm",
        add_bias_linear=False,
        add_qkv_bias=True,
        qk_layernorm=True,
        bf16=True,
        params_dtype=torch.bfloat16,
    )
    gpt = SimpleNamespace(position_embedding_type="rope", share_embeddings_and_output_weights=False)
    assert live_architecture(cfg, gpt, "highest") == dict(
        activation="swiglu",
        normalization="rmsnorm",
        kv_channels=32,
        bias_linear=False,
        qkv_bias=True,
        qk_norm=True,
        precision="bf16",
        position_embedding="rope",
        tied_embeddings=False,
    )
    plain = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, activation_func=squared_relu)
    got = live_architecture(plain, SimpleNamespace(position_embedding_type="none"), "high")
    assert (got["activation"], got["position_embedding"], got["precision"]) == ("squared_relu", "none", "tf32")
    assert got["kv_channels"] == 16 and got["bias_linear"] and got["qkv_bias"] and "tied_embeddings" not in got


def test_padded_vocabulary_is_the_same_model():
    plan = plans.tiny_plan()
    live = _live(model=dict(vocab_size=128 + 64))
    assert plan_mismatches(plan, live) == []
    assert plan_mismatches(plan, _live(model=dict(vocab_size=100))) == ["model vocab_size: plan 128, run 100"]


def test_unsupported_megatron_version(monkeypatch):
    for v in ("0.17.0", "0.14.0", "0.18.2rc0"):
        monkeypatch.setattr(megatron_patch, "megatron_core_version", lambda v=v: v)
        with pytest.raises(
            UnsupportedVersionError, match=rf"megatron-core {v} is not supported.*supported: 0.15.x, 0.16.x, 0.19.x"
        ):
            megatron_patch.check_megatron_core_version()
    for v in ("0.15.3", "0.16.0", "0.19.1"):
        monkeypatch.setattr(megatron_patch, "megatron_core_version", lambda v=v: v)
        assert megatron_patch.check_megatron_core_version() == v


def test_version_read_without_importing_megatron():
    from kareus_megatron.runtime.frameworks.megatron_patch import _version_from_package_info

    assert _version_from_package_info("MAJOR = 0\nMINOR = 16\nPATCH = 1\nPRE_RELEASE = ''\n") == "0.16.1"
    assert _version_from_package_info("MAJOR = 0\nMINOR = 13\nPATCH = 0\nPRE_RELEASE = 'rc2'\n") == "0.13.0rc2"
    assert _version_from_package_info("MAJOR = 0\n") is None
    # test_framework_versions.py reruns this file against each other supported series and names it here
    assert megatron_patch.megatron_core_version() == os.environ.get("KAREUS_TEST_MEGATRON_CORE", "0.16.1")

"""The model flags of the generated Megatron-LM command come from the plan's model record alone.

The round trip: plan record -> jobs/commands.py model_args -> Megatron-LM core_v0.16.1's own argument
parsing (vendored snapshot, ../shared/vendor/) -> TransformerConfig -> the runtime's reading of it
(plan/megatron_model.py live_architecture) gives back the record. core_v0.19.0's training code needs
Python >= 3.12 (typing.override), so only its megatron-core attribute names are checked (by the runtime tests).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from kareus_megatron.errors import InfeasibleConfigError, PlanError
from kareus_megatron.jobs.commands import model_args
from kareus_megatron.plan.build import model_shape
from kareus_megatron.plan.schema import MODEL_RECORD_FIELDS, ModelShape
from kareus_megatron.workload.models import model_from_dict, model_spec

ROOT = Path(__file__).resolve().parents[2]
SNAPSHOT = ROOT.parent / "shared" / "vendor" / "Megatron-LM-core_v0.16.1.tar.gz"
GPT2ISH = dict(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    ffn_hidden_size=256,
    vocab_size=128,
    activation="gelu",
    norm="layernorm",
    position="learned",
    bias_linear=True,
    tied_embeddings=True,
)
# The CPU needs Megatron-LM's fused kernels off; the rest makes a parseable pretrain_gpt.py command line.
RUN_FLAGS = (
    "--seq-length 64 --max-position-embeddings 64 --micro-batch-size 1 --train-iters 1 --lr 1e-4 "
    "--mock-data --tokenizer-type NullTokenizer --vocab-size 127 --transformer-impl local "
    "--no-gradient-accumulation-fusion --no-masked-softmax-fusion --no-bias-gelu-fusion "
    "--no-bias-swiglu-fusion --no-bias-dropout-fusion --no-rope-fusion --no-persist-layer-norm"
).split()


def record(name_or_dict: str | dict, precision: str = "bf16") -> ModelShape:
    spec = model_spec(name_or_dict) if isinstance(name_or_dict, str) else model_from_dict(name_or_dict)
    return model_shape(spec, precision)


def test_a_gelu_layernorm_learned_fp32_model_gets_its_own_flags():
    flags = model_args(record(GPT2ISH, "fp32"))
    assert flags == [
        "--num-layers",
        "2",
        "--hidden-size",
        "64",
        "--num-attention-heads",
        "4",
        "--ffn-hidden-size",
        "256",
        "--kv-channels",
        "16",
        "--normalization",
        "LayerNorm",
        "--position-embedding-type",
        "learned_absolute",
    ]  # gelu, biases, tied, fp32: the defaults


@pytest.mark.parametrize(
    "change, present, absent",
    [
        (dict(activation="swiglu"), ["--swiglu"], []),
        (dict(bias_linear=False), ["--disable-bias-linear"], ["--add-qkv-bias"]),
        (dict(bias_linear=False, qkv_bias=True), ["--disable-bias-linear", "--add-qkv-bias"], []),
        (dict(tied_embeddings=False), ["--untie-embeddings-and-output-weights"], []),
        (dict(qk_norm=True, head_dim=32), ["--qk-layernorm", "--kv-channels 32"], ["--kv-channels 16"]),
        (
            dict(norm="rmsnorm", position="rope"),
            ["--normalization RMSNorm", "--position-embedding-type rope"],
            ["LayerNorm", "learned_absolute"],
        ),
    ],
)
def test_each_recorded_field_sets_its_flag(change, present, absent):
    line = " ".join(model_args(record({**GPT2ISH, **change}, "fp32")))
    for flag in present:
        assert flag in line
    for flag in absent:
        assert flag not in line


@pytest.mark.parametrize(
    "precision, flags",
    [("bf16", ["--bf16"]), ("fp16", ["--fp16"]), ("fp32", []), ("fp8", ["--bf16", "--fp8-format", "hybrid"])],
)
def test_precision_flags(precision, flags):
    got = model_args(record(GPT2ISH, precision))
    assert got[got.index("learned_absolute") + 1 :] == flags


def test_models_megatron_lm_cannot_build_are_refused_with_one_line():
    with pytest.raises(InfeasibleConfigError, match="no alibi position embedding; use one of learned, rope"):
        model_args(record("bloom-176b"))
    with pytest.raises(InfeasibleConfigError, match="precision tf32: Megatron-LM has no switch"):
        model_args(record(GPT2ISH, "tf32"))
    old = record(GPT2ISH).model_copy(update=dict.fromkeys(("activation", "precision")))
    with pytest.raises(PlanError, match="does not record the model's activation, precision .*regenerate"):
        model_args(old)
    assert set(MODEL_RECORD_FIELDS) <= set(ModelShape.model_fields)


def test_preset_names_do_not_override_the_record():
    # a plan that calls itself llama3.2-3b but records a GPT-2 style model gets the GPT-2 flags
    rec = record(GPT2ISH, "fp32").model_copy(update={"name": "llama3.2-3b"})
    assert "--swiglu" not in model_args(rec) and "RMSNorm" not in model_args(rec)


@pytest.fixture(scope="module")
def megatron_lm_0161(tmp_path_factory) -> Path:
    if not SNAPSHOT.is_file():
        pytest.fail(f"{SNAPSHOT} is missing (the vendored Megatron-LM snapshots, see its README.md)", pytrace=False)
    base = tmp_path_factory.mktemp("mlm")
    with tarfile.open(SNAPSHOT) as tf:
        tf.extractall(
            base, members=[m for m in tf.getmembers() if m.name.split("/")[1:2] == ["megatron"]], filter="data"
        )
    (tree,) = base.iterdir()
    return tree


def test_megatron_lm_builds_the_recorded_model_from_the_flags(megatron_lm_0161):
    records = [
        record("llama3.2-3b"),
        record("llama3.3-70b"),
        record("qwen3-1.7b", "fp16"),
        record("gpt3-175b", "fp32"),
        record({**GPT2ISH, "bias_linear": False, "qkv_bias": True, "tied_embeddings": False}, "bf16"),
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(megatron_lm_0161), str(ROOT)])}
    r = subprocess.run(
        [sys.executable, "-W", "ignore", str(Path(__file__).with_name("mlm_args_worker.py"))],
        input=json.dumps([model_args(m) + RUN_FLAGS for m in records]),
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    for rec, built in zip(records, json.loads(r.stdout)):
        assert built == {k: getattr(rec, k) for k in MODEL_RECORD_FIELDS}, rec.name

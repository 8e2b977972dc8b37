"""Which layer Megatron-LM builds for a plan (runtime/frameworks/layer_choice.py), and the shipped spec objects
(kareus_megatron/megatron_spec.py) that Megatron-LM's ``--spec MODULE NAME`` reads.

End to end through Megatron-LM's pretrain_gpt.py: tests/megatron_lm/test_mlm_overlap.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _dist import MEGATRON_CORE, spawn

from kareus_megatron.errors import ConfigError
from kareus_megatron.plan.points import load_point_plan
from kareus_megatron.runtime.frameworks import layer_choice
from kareus_megatron.runtime.frameworks.layer_choice import choose_layer, megatron_layer_flags

ROOT = Path(__file__).resolve().parents[2]
MLM = ROOT / "tests" / "megatron_lm"


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """(2-nanobatch kareus plan, 1-nanobatch perseus plan) of the tiny GPT at TP=2 (slow-links calibration)."""
    from kareus_megatron.cli.main import main

    out = tmp_path_factory.mktemp("plan") / "p"
    assert (
        main(
            [
                "plan",
                "--model",
                str(MLM / "tiny-mlm.yaml"),
                "--gpu",
                "a100-sxm4-40gb",
                "--tp",
                "2",
                "--pp",
                "1",
                "--mbs",
                "2",
                "--seq",
                "32",
                "--microbatches",
                "4",
                "--nodes",
                "1",
                "--gpus-per-node",
                "2",
                "--precision",
                "fp32",
                "--calibration",
                str(MLM / "slow-links.calib.json"),
                "--methods",
                "kareus",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    two, _ = load_point_plan(str(out), "kareus-00")
    one, _ = load_point_plan(str(out), "perseus-00")
    assert layer_choice.two_nanobatch_count(two) > 0 and layer_choice.two_nanobatch_count(one) == 0
    return two, one


def _flags(line: str):
    return megatron_layer_flags(line.split())


def test_the_plan_decides_the_layer(plans):
    two, one = plans
    own = choose_layer(one, _flags("--transformer-impl local"))
    assert own.spec is None and not own.partitioned and "Megatron-LM's own layer" in own.line
    part = choose_layer(two, _flags("--transformer-impl local --tensor-model-parallel-size 2"))
    assert part.spec == ("kareus_megatron.megatron_spec", "partitioned_layer_spec") and part.partitioned
    assert part.line.startswith("kareus: model built with kareus's partitioned layer") and "\n" not in part.line
    assert "2 nanobatches" in part.line and "transformer_engine" not in part.line
    # --kareus-plan auto: a TP=2 workload may switch to 2-nanobatch plans, so its layer is built from the start
    assert choose_layer(one, _flags(""), auto=True).partitioned


def test_transformer_engine_default_builds_local_modules_and_says_what_it_gives_up(plans):
    two, _ = plans
    choice = choose_layer(two, _flags(""))  # Megatron-LM's default --transformer-impl transformer_engine
    assert choice.partitioned
    assert "--transformer-impl transformer_engine: built on megatron-core's local modules, giving up" in choice.line
    assert all(f in choice.line for f in layer_choice.TE_GIVEN_UP)
    for flag in ("--fp8-format hybrid", "--tp-comm-overlap"):
        with pytest.raises(ConfigError, match=f"^{flag.split()[0]}: .*--transformer-impl transformer_engine"):
            choose_layer(two, _flags(flag))


@pytest.mark.parametrize(
    "line,flag",
    [
        ("--num-experts 8", "--num-experts"),
        ("--multi-latent-attention", "--multi-latent-attention"),
        ("--reset-attention-mask --context-parallel-size 2", "--reset-attention-mask"),
        ("--use-legacy-models", "--use-legacy-models"),
    ],
)
def test_flags_the_partitioned_layer_cannot_honour_are_refused_in_one_line(plans, line, flag):
    two, one = plans
    with pytest.raises(ConfigError) as e:
        choose_layer(two, _flags(f"--transformer-impl local {line}"))
    assert str(e.value).startswith(f"{flag}") and "\n" not in str(e.value) and "perseus-fastest" in str(e.value)
    assert choose_layer(one, _flags(line)).spec is None  # a 1-nanobatch plan leaves Megatron-LM's layer alone


def test_reset_attention_mask_gets_megatrons_attention_and_a_given_spec_is_kept(plans):
    two, _ = plans
    masked = choose_layer(two, _flags("--transformer-impl local --reset-attention-mask"))
    assert masked.spec == ("kareus_megatron.megatron_spec", "partitioned_layer_spec_local_attention")
    given = choose_layer(two, _flags("--spec my.mod my_spec --num-experts 8"))
    assert given.spec == ("my.mod", "my_spec") and given.given and "as given" in given.line
    with pytest.raises(ConfigError, match="^--spec a: give MODULE NAME"):
        choose_layer(two, _flags("--spec a"))


def test_sequence_parallel_without_apex_or_te_gets_the_block_spec(plans, monkeypatch):
    two, _ = plans
    monkeypatch.setattr(layer_choice, "torch_norm_fallback", lambda: True)
    choice = choose_layer(two, _flags("--transformer-impl local --sequence-parallel"))
    assert choice.spec == ("kareus_megatron.megatron_spec", "partitioned_block_spec")
    assert "final norm: SP-capable torch norm" in choice.line
    monkeypatch.setattr(layer_choice, "torch_norm_fallback", lambda: False)  # Apex/TE's norms run SP themselves
    assert choose_layer(two, _flags("--sequence-parallel")).spec[1] == "partitioned_layer_spec"


def test_drop_in_refuses_before_megatron_starts(plans, tmp_path, capsys):
    """launch/pretrain_gpt.py: a refused flag is one line on stderr, exit status 2, and Megatron-LM never runs."""
    import runpy

    tree = tmp_path / "mlm"
    tree.mkdir()
    (tree / "pretrain_gpt.py").write_text("raise SystemExit('Megatron-LM ran')\n")
    plan_file = tmp_path / "two.json"
    plan_file.write_text(plans[0].model_dump_json())
    drop_in = runpy.run_path(str(ROOT / "launch" / "pretrain_gpt.py"))
    code = drop_in["main"](
        [
            "--kareus-plan",
            str(plan_file),
            "--megatron-lm-dir",
            str(tree),
            "--num-experts",
            "8",
            "--transformer-impl",
            "local",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--num-experts" in err[0], err


def _spec_probe_worker(rank: int, world: int, port: int, out_dir: str, two: str, one: str) -> None:
    """What Megatron-LM's --spec builds, and the Python API's choice; what it prints goes to rank0.txt."""
    import contextlib
    import io
    import os

    import torch.distributed as dist

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        from kareus_megatron.runtime.frameworks import cpu_shim

        cpu_shim.apply()
        from megatron.core import parallel_state as ps

        ps.initialize_model_parallel()
        from megatron.core.transformer import TransformerConfig
        from megatron.core.transformer.spec_utils import import_module
        from megatron.core.transformer.transformer_block import TransformerBlock

        import kareus_megatron.megatron as kareus
        from kareus_megatron.plan.io import load_plan
        from kareus_megatron.runtime.overlap.layer import PartitionedTransformerLayer

        spec = import_module(("kareus_megatron.megatron_spec", "partitioned_layer_spec"))  # what --spec does
        cfg = TransformerConfig(
            num_layers=2,
            hidden_size=32,
            num_attention_heads=4,
            num_query_groups=2,
            normalization="RMSNorm",
            qk_layernorm=True,
            gated_linear_unit=True,
            add_bias_linear=False,
            use_cpu_initialization=True,
            hidden_dropout=0.0,
            attention_dropout=0.0,
        )
        block = TransformerBlock(cfg, spec, post_layer_norm=False)
        layer = block.layers[0]
        attn = layer.self_attention
        print(
            len(block.layers),
            isinstance(layer, PartitionedTransformerLayer),
            type(layer.input_layernorm).__name__,
            type(attn.q_layernorm).__name__,
            type(attn.core_attention).__name__,
            attn.linear_qkv.weight.shape[0],
            layer.mlp.linear_fc1.weight.shape[0],
            layer.mlp.linear_fc1.bias is None,
        )
        for path in (two, one):  # the Python API's choice for code that builds GPTModel itself
            print(kareus.transformer_layer_spec(cfg, plan=load_plan(Path(path))).module.__name__)
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.txt").write_text(printed.getvalue())


def test_the_spec_object_builds_the_partitioned_layer_from_the_config(plans, tmp_path):
    """Megatron's import_module reads the object; its layer follows the config: RMSNorm, QK-norm, GQA, SwiGLU,
    no biases; the Python API chooses by the plan (a process of its own: it joins a 1-rank gloo group)."""
    for name, plan in zip(("two", "one"), plans):
        (tmp_path / f"{name}.json").write_text(plan.model_dump_json())
    spawn(
        _spec_probe_worker,
        1,
        str(tmp_path),
        str(tmp_path / "two.json"),
        str(tmp_path / "one.json"),
        preload=MEGATRON_CORE,
    )
    # 2 layers; q: 4 heads x 8 + k, v: 2 groups x 8 each = 64 rows; fc1: 2 x 128 (SwiGLU)
    out = (tmp_path / "rank0.txt").read_text().splitlines()
    assert out[0].split() == ["2", "True", "RMSNorm", "RMSNorm", "SDPAttention", "64", "256", "True"], out
    assert out[1].startswith("kareus: model built with kareus's partitioned layer") and "2 nanobatches" in out[1]
    assert out[2] == "PartitionedTransformerLayer", out
    assert out[3].startswith("kareus: model built with megatron-core's local layer") and out[4] == "TransformerLayer"

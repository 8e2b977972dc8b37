"""CUDA graphs are refused in one line naming the setting: megatron-core's own TransformerConfig with every CUDA
graph setting this release has (test_framework_versions.py reruns this file on 0.15 and 0.19, whose settings
differ), the megatron-core patch's plan check, Megatron-LM's checked arguments (the native patch's hook) and
its command line (the drop-in and the generic launcher). The refusal through a real training run is in
test_cuda_graphs_entry.py."""

from __future__ import annotations

import dataclasses
import sys
import warnings
from argparse import Namespace
from pathlib import Path

import plans
import pytest

from kareus_megatron import launch
from kareus_megatron.errors import ConfigError
from kareus_megatron.plan.io import save_plan
from kareus_megatron.runtime.frameworks.cuda_graphs import cuda_graph_flag_in_argv, cuda_graph_problem
from kareus_megatron.runtime.frameworks.megatron_lm_hook import megatron_lm_hook
from kareus_megatron.runtime.frameworks.megatron_patch import LiveRun, validate_plan

ROOT = Path(__file__).resolve().parents[2]
# (TransformerConfig keywords, what the one line must name); a release without the field or value is left out
CANDIDATES = [
    (dict(cuda_graph_impl="local"), "--cuda-graph-impl local"),
    (dict(cuda_graph_impl="transformer_engine"), "--cuda-graph-impl transformer_engine"),
    (dict(cuda_graph_impl="full_iteration"), "--cuda-graph-impl full_iteration"),  # 0.19
    (dict(enable_cuda_graph=True), "--enable-cuda-graph"),
    (dict(external_cuda_graph=True), "--external-cuda-graph"),
    (dict(cuda_graph_impl="local", cuda_graph_scope="full_iteration"), "full_iteration"),
]


def _config(**kw):
    from kareus_megatron.runtime.frameworks.cpu_shim import stub_missing_triton

    stub_missing_triton()  # megatron-core 0.19 imports Triton (test_framework_versions.py runs this file on it)
    from megatron.core.transformer import TransformerConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True, **kw)


def _settings_of_this_release():
    _config()  # imports megatron-core's TransformerConfig (Triton stand-in first)
    from megatron.core.transformer import TransformerConfig

    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    out = []
    for kw, needle in CANDIDATES:
        if not set(kw) <= fields:
            continue
        try:
            out.append((_config(**kw), kw, needle))
        except (AssertionError, ValueError, TypeError, KeyError):  # a value this release does not accept
            continue
    return out


def test_every_cuda_graph_setting_of_this_release_is_named():
    settings = _settings_of_this_release()
    assert len(settings) >= 3  # 0.15, 0.16 and 0.19 each have at least impl local/TE and one deprecated flag
    for cfg, kw, needle in settings:
        problem = cuda_graph_problem(cfg)
        assert problem and needle in problem and "\n" not in problem, (kw, problem)
    assert cuda_graph_problem(_config()) is None  # the default: graphs off
    assert cuda_graph_problem(_config(cuda_graph_impl="none")) is None


def test_the_patch_plan_check_refuses_before_any_mismatch():
    plan = plans.tiny_plan(pp=2, m=4)
    cfg, _, needle = _settings_of_this_release()[0]
    live = LiveRun(pp=3, pp_rank=0, vp=1, num_microbatches=9, cuda_graphs=cuda_graph_problem(cfg))
    with pytest.raises(ConfigError, match="CUDA graphs are on") as e:
        validate_plan(plan, live, source="plan.json")
    assert needle in str(e.value) and "plan.json" in str(e.value) and "\n" not in str(e.value)


def test_the_native_patch_hook_refuses_megatron_lm_arguments(capsys):
    from megatron.core.transformer import enums

    scope = [enums.CudaGraphScope.full_iteration] if hasattr(enums, "CudaGraphScope") else []
    args = Namespace(kareus_plan="never-read.json", kareus_debug=False, cuda_graph_impl="local", cuda_graph_scope=scope)
    with pytest.raises(SystemExit) as e:
        megatron_lm_hook(args)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--cuda-graph-impl local" in err[0] and "never-read" not in err[0], err


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--cuda-graph-impl", "local"], "--cuda-graph-impl local"),
        (["--cuda-graph-impl=transformer_engine"], "--cuda-graph-impl transformer_engine"),
        (["--seq-length", "8", "--enable-cuda-graph"], "--enable-cuda-graph"),
        (["--external-cuda-graph"], "--external-cuda-graph"),
        (["--cuda-graph-impl", "none"], None),
        (["--cuda-graph-warmup-steps", "3"], None),
    ],
)
def test_flags_in_a_megatron_lm_command_line(argv, needle):
    problem = cuda_graph_flag_in_argv(argv)
    assert (needle in problem) if needle else problem is None


def _one_line(capsys, code: int, needle: str) -> None:
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and needle in err[0] and "Traceback" not in err[0], err


def test_the_launchers_refuse_the_flags_before_training(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    save_plan(plans.tiny_plan(), tmp_path / "plan.json")
    (tmp_path / "train.py").write_text("raise SystemExit(0)\n")  # never reached
    _one_line(
        capsys,
        launch.main(["--kareus-plan", "plan.json", "--", "train.py", "--cuda-graph-impl", "local"]),
        "--cuda-graph-impl local",
    )
    sys.path.insert(0, str(ROOT / "launch"))
    try:
        import pretrain_gpt
    finally:
        sys.path.remove(str(ROOT / "launch"))
    monkeypatch.delenv("MEGATRON_LM_DIR", raising=False)  # refused before Megatron-LM is even looked for
    _one_line(capsys, pretrain_gpt.main(["--kareus-plan", "plan.json", "--enable-cuda-graph"]), "--enable-cuda-graph")

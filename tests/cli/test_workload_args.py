"""The shared workload flags (cli/workload_args.py): the default job and its 15 + 13 layer split."""

from __future__ import annotations

import argparse

import pytest

from kareus_megatron.cli.workload_args import DEFAULT_JOB, add_workload_arguments, workload_from_args


def _resolve(*argv: str):
    p = argparse.ArgumentParser()
    add_workload_arguments(p)
    return workload_from_args(p.parse_args(list(argv)))


def test_no_flags_is_the_default_job():
    gpu, model, par = _resolve()
    assert (gpu.name, model.name) == ("a100-sxm4-40gb", "llama3.2-3b")
    assert (par.tp, par.cp, par.pp, par.vp, par.dp, par.micro_batch_size, par.seq_length) == (8, 1, 2, 1, 1, 8, 4096)
    assert (par.num_microbatches, par.recompute, par.layers_per_stage) == (8, "full", (15, 13))
    assert (par.nodes, par.gpus_per_node) == (2, 8)
    assert par.layers_per_stage == (DEFAULT_JOB["first_stage_layers"], DEFAULT_JOB["last_stage_layers"])


@pytest.mark.parametrize("argv", [(), ("--mbs", "16"), ("--tp", "4", "--cp", "2"), ("--seq", "8192")])
def test_the_default_pipeline_keeps_the_uneven_split(argv):
    """Flags that leave the model and the pipeline alone keep the default job's 15 + 13 layers."""
    assert _resolve(*argv)[2].layers_per_stage == (15, 13)


@pytest.mark.parametrize(
    "argv, layers",
    [
        (("--model", "llama3.2-3b", "--pp", "2"), (14, 14)),  # the same job, named: the even split
        (("--pp", "2"), (14, 14)),
        (("--model", "llama3.2-3b"), (14, 14)),
        (("--vp", "2"), (14, 14)),
        (("--model", "qwen3-1.7b"), (14, 14)),
        (("--pp", "4"), (7, 7, 7, 7)),
        (("--model", "llama3.2-3b", "--pp", "2", "--first-stage-layers", "15", "--last-stage-layers", "13"), (15, 13)),
        (("--first-stage-layers", "16"), (16, 12)),
    ],
)
def test_a_named_model_or_pipeline_gets_the_even_split_unless_told(argv, layers):
    assert _resolve(*argv)[2].layers_per_stage == layers


def test_a_named_model_sizes_the_job():
    _, _, par = _resolve("--model", "gpt3-175b", "--tp", "8", "--pp", "8")
    assert par.nodes == 8 and par.layers_per_stage == (12,) * 8

"""The workload a plan was made for, rebuilt from the plan's own record (model shape and parallel layout).

``plan_workload(plan)`` returns the GPU preset, the model and the parallel layout as the planner's cost
model takes them, so code that holds only a plan file (``kareus calibrate --from-log``, the simulated GPU's
truth) costs exactly the instructions the plan was made for. ``plan_cli_args(plan, model_file)`` gives the
``kareus plan`` flags that plan the same job again (the closed loop re-plans in a side process with them).
Plans whose model record predates the architecture fields (activation .. precision None) get the ModelSpec
defaults for them; PlanError when a plan has no model record at all.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from kareus_megatron.errors import PlanError
from kareus_megatron.hardware.gpus import GPUSpec, gpu_spec
from kareus_megatron.plan.schema import Plan
from kareus_megatron.workload.models import ModelSpec
from kareus_megatron.workload.parallel import ParallelConfig


def plan_model(plan: Plan) -> ModelSpec:
    """The plan's model as a workload ModelSpec (PlanError when the plan records none)."""
    m = plan.model
    if m is None:
        raise PlanError(
            "the plan records no model shape (written by `kareus solve` from a profile?); "
            "plan with `kareus plan` to get one that records its workload."
        )
    extra: dict[str, Any] = {}
    for field, key in (
        ("activation", "activation"),
        ("normalization", "norm"),
        ("position_embedding", "position"),
        ("bias_linear", "bias_linear"),
        ("qkv_bias", "qkv_bias"),
        ("tied_embeddings", "tied_embeddings"),
        ("qk_norm", "qk_norm"),
    ):
        value = getattr(m, field)
        if value is not None:
            extra[key] = value
    if m.kv_channels is not None and m.kv_channels != m.hidden_size // m.num_attention_heads:
        extra["head_dim"] = m.kv_channels
    return ModelSpec(
        name=m.name,
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        ffn_hidden_size=m.ffn_hidden_size,
        vocab_size=m.vocab_size,
        **extra,
    )


def plan_parallel(plan: Plan) -> ParallelConfig:
    """The plan's parallel layout as a workload ParallelConfig (precision from the model record, else bf16)."""
    p = plan.parallel
    precision = (plan.model.precision if plan.model is not None else None) or "bf16"
    return ParallelConfig(
        tp=p.tp,
        cp=p.cp,
        pp=p.pp,
        vp=p.vp,
        dp=p.dp,
        sequence_parallel=p.sequence_parallel,
        micro_batch_size=p.micro_batch_size,
        seq_length=p.seq_length,
        num_microbatches=p.num_microbatches,
        recompute=p.recompute,
        layers_per_stage=tuple(p.layers_per_stage),
        nodes=p.nodes,
        gpus_per_node=p.gpus_per_node,
        precision=precision,
    )


def plan_workload(plan: Plan) -> tuple[GPUSpec, ModelSpec, ParallelConfig]:
    """(GPU preset, model, parallel layout) of the job `plan` was made for."""
    return gpu_spec(plan.gpu), plan_model(plan), plan_parallel(plan)


def write_model_file(plan: Plan, path: str | Path) -> Path:
    """Write the plan's model as a JSON model file (workload/models.py keys) that ``kareus plan --model`` reads."""
    out = Path(path)
    out.write_text(json.dumps(dataclasses.asdict(plan_model(plan)), indent=1) + "\n")
    return out


def plan_cli_args(plan: Plan, model_file: str | Path) -> list[str]:
    """``kareus plan`` flags for the job `plan` was made for; `model_file` is write_model_file's output."""
    p = plan.parallel
    par = plan_parallel(plan)
    args = [
        "--model",
        str(model_file),
        "--gpu",
        plan.gpu,
        "--framework",
        plan.framework,
        "--tp",
        str(p.tp),
        "--cp",
        str(p.cp),
        "--pp",
        str(p.pp),
        "--vp",
        str(p.vp),
        "--dp",
        str(p.dp),
        "--mbs",
        str(p.micro_batch_size),
        "--seq",
        str(p.seq_length),
        "--microbatches",
        str(p.num_microbatches),
        "--recompute",
        p.recompute,
        "--nodes",
        str(p.nodes),
        "--gpus-per-node",
        str(p.gpus_per_node),
        "--precision",
        par.precision,
    ]
    if p.sequence_parallel:
        args.append("--sp")
    if p.pp > 1:
        args += ["--first-stage-layers", str(p.layers_per_stage[0]), "--last-stage-layers", str(p.layers_per_stage[-1])]
    return args

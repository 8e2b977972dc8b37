"""The workload flags every `kareus` subcommand shares (--gpu, --model, the parallel layout, --calibration).

The *default job* is what the commands describe when given no workload flags (``kareus plan`` plans it,
``make demo`` runs that): configuration 1 of the Kareus evaluation (docs/sources.md#kareus-evaluation),
Llama 3.2 3B on 2 nodes × 8 A100-SXM4-40GB, TP=8, PP=2, MBS 8, seq 4096, 8 microbatches, full recompute,
bf16, with the evaluation's uneven 15 + 13 layer split (stage 0 also runs the embedding, stage 1 the
output layer and the loss).

That split is a property of the default job's pipeline only: it applies while none of --model, --pp and
--vp is given. A model or pipeline named on the command line gets make_parallel's even split unless
--first-stage-layers/--last-stage-layers set the end stages.
"""

from __future__ import annotations

import argparse
from typing import Any

from kareus_megatron.hardware.gpus import GPUSpec, gpu_names, gpu_spec
from kareus_megatron.workload.models import ModelSpec, model_names, model_spec
from kareus_megatron.workload.parallel import PRECISION_BYTES, RECOMPUTE, ParallelConfig, make_parallel

DEFAULT_JOB: dict[str, Any] = {
    "gpu": "a100-sxm4-40gb",
    "model": "llama3.2-3b",
    "tp": 8,
    "cp": 1,
    "pp": 2,
    "vp": 1,
    "mbs": 8,
    "seq": 4096,
    "microbatches": 8,
    "recompute": "full",
    "gpus_per_node": 8,
    "precision": "bf16",
    "first_stage_layers": 15,
    "last_stage_layers": 13,  # nodes: derived, 16 GPUs = 2 nodes of 8
}


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """Add --gpu, --model, the parallel flags and --calibration (defaults: the default job)."""
    d = DEFAULT_JOB
    split = f"{d['first_stage_layers']} + {d['last_stage_layers']}"
    g = parser.add_argument_group("workload")
    g.add_argument(
        "--gpu",
        default=d["gpu"],
        metavar="PRESET",
        help=f"GPU preset, one of {', '.join(gpu_names())} (default {d['gpu']})",
    )
    g.add_argument(
        "--model",
        default=None,
        metavar="PRESET|FILE",
        help=f"model preset, one of {', '.join(model_names())}, or a .yaml/.json file (default {d['model']})",
    )
    g.add_argument("--tp", type=int, default=d["tp"], help=f"tensor parallel size (default {d['tp']})")
    g.add_argument("--cp", type=int, default=d["cp"], help="context parallel size (default 1)")
    g.add_argument("--pp", type=int, default=None, help=f"pipeline stages (default {d['pp']})")
    g.add_argument("--vp", type=int, default=None, help="virtual pipeline chunks per stage (default 1)")
    g.add_argument("--dp", type=int, default=None, help="data parallel size (default: GPUs / (TP×CP×PP))")
    g.add_argument(
        "--sp",
        "--sequence-parallel",
        dest="sequence_parallel",
        action="store_true",
        help="sequence parallelism (default off)",
    )
    g.add_argument("--mbs", type=int, default=d["mbs"], help=f"microbatch size (default {d['mbs']})")
    g.add_argument("--seq", type=int, default=d["seq"], help=f"sequence length (default {d['seq']})")
    g.add_argument(
        "--microbatches",
        type=int,
        default=d["microbatches"],
        help=f"microbatches per iteration (default {d['microbatches']})",
    )
    g.add_argument(
        "--recompute",
        choices=RECOMPUTE,
        default=d["recompute"],
        help=f"activation recompute (default {d['recompute']})",
    )
    g.add_argument(
        "--first-stage-layers",
        type=int,
        default=None,
        help=f"layers on the first stage (default: even split; the default job, with none of --model, "
        f"--pp, --vp given, splits {split})",
    )
    g.add_argument(
        "--last-stage-layers",
        type=int,
        default=None,
        help=f"layers on the last stage (default: even split; {d['last_stage_layers']} in the default job)",
    )
    g.add_argument(
        "--nodes", type=int, default=None, help="nodes (default: as many as TP×CP×PP×DP needs; 2 for the default job)"
    )
    g.add_argument(
        "--gpus-per-node", type=int, default=d["gpus_per_node"], help=f"GPUs per node (default {d['gpus_per_node']})"
    )
    g.add_argument(
        "--precision", choices=tuple(PRECISION_BYTES), default=d["precision"], help="training precision (default bf16)"
    )
    g.add_argument("--calibration", default=None, help="calibration JSON from `kareus calibrate`")


def default_pipeline(args: argparse.Namespace) -> bool:
    """True when the command line names no model and no pipeline layout (the default job's pipeline)."""
    return args.model is None and args.pp is None and args.vp is None


def workload_from_args(args: argparse.Namespace) -> tuple[GPUSpec, ModelSpec, ParallelConfig]:
    """Resolve the workload flags into (GPU preset, model, validated parallel layout)."""
    d = DEFAULT_JOB
    gpu = gpu_spec(args.gpu)
    model = model_spec(args.model if args.model is not None else d["model"])
    precision = getattr(args, "precision", d["precision"])
    gpu.peak_flops(precision)  # raises ConfigError if the GPU lacks that precision
    first, last = args.first_stage_layers, args.last_stage_layers
    if default_pipeline(args) and first is None and last is None:
        first, last = d["first_stage_layers"], d["last_stage_layers"]
    par = make_parallel(
        model,
        tp=args.tp,
        cp=args.cp,
        pp=args.pp if args.pp is not None else d["pp"],
        vp=args.vp if args.vp is not None else d["vp"],
        dp=args.dp,
        sequence_parallel=args.sequence_parallel,
        micro_batch_size=args.mbs,
        seq_length=args.seq,
        num_microbatches=args.microbatches,
        recompute=args.recompute,
        first_stage_layers=first,
        last_stage_layers=last,
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        precision=precision,
    )
    return gpu, model, par

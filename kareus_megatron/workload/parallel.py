"""Parallel layout of a training run: sizes, layer split over pipeline stages, and their validation.

Terms (Megatron's): TP tensor, CP context, PP pipeline (stages), VP virtual pipeline chunks per stage
(1 = no interleaving), DP data parallel size; SP sequence parallelism (norms/elementwise split over
TP); *microbatch* = micro_batch_size samples of seq_length tokens; an iteration runs num_microbatches
of them per pipeline. Ranks are ordered TP innermost, then CP, DP, PP (Megatron's default order).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kareus_megatron.errors import ConfigError, InfeasibleConfigError
from kareus_megatron.workload.models import ModelSpec

RECOMPUTE = ("none", "full", "selective")
PRECISION_BYTES = {"bf16": 2, "fp16": 2, "fp8": 1, "tf32": 4, "fp32": 4}
# Upper bounds of the sizes (far above any real run; beyond them the cost model's numbers overflow).
MAX_SIZE = {
    "--seq": 2**20,
    "--mbs": 2**14,
    "--microbatches": 2**14,
    "--tp": 2**12,
    "--cp": 2**12,
    "--pp": 2**12,
    "--vp": 2**12,
    "--dp": 2**20,
    "--nodes": 2**20,
    "--gpus-per-node": 2**12,
}


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelConfig:
    """A validated parallel layout (build it with make_parallel)."""

    tp: int = 1
    cp: int = 1
    pp: int = 1
    vp: int = 1
    dp: int = 1
    sequence_parallel: bool = False
    micro_batch_size: int = 1
    seq_length: int = 2048
    num_microbatches: int = 1
    recompute: str = "none"
    layers_per_stage: tuple[int, ...] = ()  # transformer layers on each pipeline stage (all chunks)
    nodes: int = 1
    gpus_per_node: int = 1
    precision: str = "bf16"

    @property
    def world_size(self) -> int:
        """GPUs in the job."""
        return self.nodes * self.gpus_per_node

    @property
    def bytes_per_element(self) -> int:
        """Bytes of one activation/weight element in the training precision."""
        return PRECISION_BYTES[self.precision]

    @property
    def global_batch_size(self) -> int:
        """Samples per iteration over all DP replicas."""
        return self.micro_batch_size * self.num_microbatches * self.dp

    def chunk_layers(self, stage: int, chunk: int = 0) -> int:
        """Transformer layers in virtual chunk `chunk` of pipeline stage `stage`."""
        return self.layers_per_stage[stage] // self.vp

    def is_first_chunk(self, stage: int, chunk: int = 0) -> bool:
        """True for the model chunk that holds the embedding."""
        return stage == 0 and chunk == 0

    def is_last_chunk(self, stage: int, chunk: int = 0) -> bool:
        """True for the model chunk that holds the output layer and the loss."""
        return stage == self.pp - 1 and chunk == self.vp - 1


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} = {value!r} must be a positive integer.")
    if value > MAX_SIZE.get(name, value):
        raise ConfigError(f"{name} = {value!r} is too large; the most this planner models is {MAX_SIZE[name]}.")
    return value


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _split_layers(model: ModelSpec, pp: int, vp: int, first: int | None, last: int | None) -> tuple[int, ...]:
    n = model.num_layers
    if pp == 1:
        if first is not None or last is not None:
            raise InfeasibleConfigError("--first-stage-layers/--last-stage-layers need --pp > 1.")
        return (n,)
    if n < pp * vp:
        raise InfeasibleConfigError(
            f"{model.name} has {n} layers, fewer than {pp} stages × {vp} chunks; use --pp (× --vp) ≤ {n}."
        )
    fixed = [x for x in (first, last) if x is not None]
    for name, x in (("--first-stage-layers", first), ("--last-stage-layers", last)):
        if x is not None and (isinstance(x, bool) or not isinstance(x, int) or x < 1):
            raise ConfigError(f"{name} {x!r} must be a positive integer.")
    middle_stages = pp - len(fixed)
    rest = n - sum(fixed)
    if middle_stages == 0:
        if rest != 0:
            raise InfeasibleConfigError(
                f"--first-stage-layers {first} + --last-stage-layers {last} = {sum(fixed)} but {model.name} has "
                f"{n} layers; they must add up to {n} when --pp 2."
            )
        split = list(fixed)  # pp == 2 and both counts given: [first, last]
    else:
        if rest < middle_stages or rest % middle_stages:
            what = f"{n} layers" if not fixed else f"the {rest} layers left after the first/last stage counts"
            raise InfeasibleConfigError(
                f"--pp {pp} does not split {what} evenly over {middle_stages} stages; "
                + (f"use --pp one of {_divisors(n)}" if not fixed else "change the first/last stage counts")
                + " or set --first-stage-layers/--last-stage-layers."
            )
        per = rest // middle_stages
        split = [per] * pp
        if first is not None:
            split[0] = first
        if last is not None:
            split[-1] = last
    if vp > 1:
        for s, k in enumerate(split):
            if k % vp:
                raise InfeasibleConfigError(
                    f"stage {s} has {k} layers, not divisible into --vp {vp} chunks; use a --vp dividing {k}."
                )
    return tuple(int(k) for k in split)


def make_parallel(
    model: ModelSpec,
    *,
    tp: int = 1,
    cp: int = 1,
    pp: int = 1,
    vp: int = 1,
    dp: int | None = None,
    sequence_parallel: bool = False,
    micro_batch_size: int = 1,
    seq_length: int = 2048,
    num_microbatches: int = 1,
    recompute: str = "none",
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
    nodes: int | None = None,
    gpus_per_node: int = 8,
    precision: str = "bf16",
) -> ParallelConfig:
    """Validate a parallel layout for `model`; InfeasibleConfigError (with the fix) if it cannot run.

    dp=None derives DP from nodes × gpus_per_node; nodes=None derives the node count from the world size
    (one node of tp·cp·pp·dp GPUs when that is at most gpus_per_node).
    """
    for name, v in (
        ("--tp", tp),
        ("--cp", cp),
        ("--pp", pp),
        ("--vp", vp),
        ("--mbs", micro_batch_size),
        ("--seq", seq_length),
        ("--microbatches", num_microbatches),
        ("--gpus-per-node", gpus_per_node),
    ):
        _positive(name, v)
    if nodes is not None:
        _positive("--nodes", nodes)
    if dp is not None:
        _positive("--dp", dp)
    if recompute not in RECOMPUTE:
        raise ConfigError(f"--recompute {recompute!r}; allowed: {', '.join(RECOMPUTE)}.")
    if precision not in PRECISION_BYTES:
        raise ConfigError(f"--precision {precision!r}; allowed: {', '.join(PRECISION_BYTES)}.")
    valid_tp = _divisors(math.gcd(model.num_attention_heads, model.num_query_groups))  # both checks pass
    if model.num_attention_heads % tp:
        raise InfeasibleConfigError(
            f"--tp {tp} does not divide {model.name}'s {model.num_attention_heads} attention heads; "
            f"use --tp one of {valid_tp}."
        )
    if model.num_query_groups % tp:
        raise InfeasibleConfigError(
            f"--tp {tp} does not divide {model.name}'s {model.num_query_groups} KV heads (query groups); "
            f"use --tp one of {valid_tp}."
        )
    if sequence_parallel and tp == 1:
        raise InfeasibleConfigError("--sequence-parallel needs --tp > 1; drop --sp or raise --tp.")
    if cp > 1 and seq_length % (2 * cp):
        raise InfeasibleConfigError(
            f"--seq {seq_length} is not divisible by 2 × --cp {cp} (load-balanced causal context parallelism); "
            f"use a --seq that is a multiple of {2 * cp}."
        )
    if sequence_parallel and (seq_length // cp) % tp:
        raise InfeasibleConfigError(
            f"--seq {seq_length} / --cp {cp} is not divisible by --tp {tp} as sequence parallelism needs; "
            f"use a --seq that is a multiple of {tp * cp}."
        )
    if vp > 1 and pp == 1:
        raise InfeasibleConfigError("--vp > 1 (interleaved pipeline) needs --pp > 1; set --vp 1.")
    if vp > 1 and num_microbatches % pp:
        raise InfeasibleConfigError(
            f"the interleaved schedule needs --microbatches ({num_microbatches}) to be a multiple of --pp {pp}."
        )
    layers = _split_layers(model, pp, vp, first_stage_layers, last_stage_layers)
    model_gpus = tp * cp * pp
    if dp is None:
        if nodes is None:
            dp = 1
        else:
            world = nodes * gpus_per_node
            if world % model_gpus:
                raise InfeasibleConfigError(
                    f"{nodes} nodes × {gpus_per_node} GPUs = {world} GPUs is not a multiple of "
                    f"TP×CP×PP = {model_gpus}; change the node count or the parallel sizes."
                )
            dp = world // model_gpus
    world = model_gpus * dp
    if nodes is None:
        if world <= gpus_per_node:
            nodes, gpus_per_node = 1, world
        elif world % gpus_per_node:
            raise InfeasibleConfigError(
                f"TP×CP×PP×DP = {world} GPUs do not fill whole nodes of {gpus_per_node} GPUs; "
                "set --nodes and --gpus-per-node to match."
            )
        else:
            nodes = world // gpus_per_node
    if nodes * gpus_per_node != world:
        raise InfeasibleConfigError(
            f"TP×CP×PP×DP = {tp}×{cp}×{pp}×{dp} = {world} GPUs but {nodes} nodes × {gpus_per_node} GPUs = "
            f"{nodes * gpus_per_node}; make the product match "
            f"(e.g. --dp {max(1, nodes * gpus_per_node // model_gpus)})."
        )
    return ParallelConfig(
        tp=tp,
        cp=cp,
        pp=pp,
        vp=vp,
        dp=dp,
        sequence_parallel=bool(sequence_parallel),
        micro_batch_size=micro_batch_size,
        seq_length=seq_length,
        num_microbatches=num_microbatches,
        recompute=recompute,
        layers_per_stage=layers,
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        precision=precision,
    )

"""GPU memory (bytes) of one GPU of each pipeline stage: weights, gradients, optimizer state, activations.

Model state per parameter held by the GPU (TP-sharded; stage 0 adds the embedding, the last stage the
output layer and final norm; embeddings are counted untied, as Megatron holds a copy on each end
stage when PP > 1), mixed-precision Adam as Megatron-LM runs it
(docs/sources.md#memory-model): weights in the training dtype (2 bytes; 4 for fp32/tf32), gradients in
fp32 (Megatron accumulates bf16 gradients in fp32; fp16 keeps them in fp16), optimizer state 12 bytes
(fp32 master copy + 2 moments; 8 for fp32 training, which needs no master copy). The distributed
optimizer shards the optimizer state over the DP × CP group. With bf16 this is Megatron's
``theoretical_memory_usage.py``: 18 bytes per parameter, or 6 + 12 / DP with the distributed optimizer.

Activations of one transformer layer for one microbatch, following Korthikanti et al. (MLSys 2023,
section 4; 34sbh + 5as²b bytes per layer for GPT with bf16 and dropout), generalised to GQA (K and V of
``num_query_groups`` heads), SwiGLU (the gate and up outputs both kept), QK-norm and the cost model's
flash attention (no s² term; the softmax statistics, fp32 per head and token, instead):

- norms' inputs, the QKV and fc1 inputs, dropout masks (1 byte; only with ``dropout``): split over TP
  only with sequence parallelism (the ``10 sbh`` of the paper), the rest (Q, K, V, attention output,
  the MLP's inner activations) always split over TP;
- CP splits the sequence: the GPU's tokens are ``micro_batch_size × seq_length / CP``;
- selective recompute (Megatron's ``core_attn``) drops the attention core's own tensors (the s² terms
  or the softmax statistics); full recompute keeps each layer's input only, plus one layer's full
  activations while its backward runs (uniform method, one layer per checkpoint).

Microbatches in flight on stage s: 1F1B holds min(PP - s, m); the interleaved schedule runs
2 (PP - s - 1) + (VP - 1) PP warm-up forwards of a chunk each, so it holds that + 1 chunks (at most
m × VP) of L_s / VP layers: stage 0 holds PP (1 + (PP - 1) / (PP VP)) microbatches' worth, Megatron's
interleaving penalty. Stage 0 adds the token ids (int64) and embedding dropout mask per microbatch in
flight; the last stage the final norm and output-layer inputs and the fp32 softmax of the
cross-entropy (4 bytes × tokens × vocab / TP) per microbatch of its last chunk in flight.

Not counted: the CUDA context, allocator fragmentation, communication buffers and temporary
workspaces (Megatron's formula adds 5% for these in one variant); the estimate is a lower bound that
refuses only jobs that cannot fit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kareus_megatron.errors import InfeasibleConfigError
from kareus_megatron.hardware.gpus import GPUSpec
from kareus_megatron.workload.models import ModelSpec
from kareus_megatron.workload.opgraph import FP32_BYTES, stage_params
from kareus_megatron.workload.parallel import ParallelConfig

GB = 1e9  # bytes per GB in messages (the presets' memory_gb are decimal GB too)
TOKEN_ID_BYTES = 8  # int64 token ids


@dataclass(frozen=True, kw_only=True, slots=True)
class StageMemory:
    """Memory (bytes) of one GPU of pipeline stage `stage`."""

    stage: int
    weights_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activations_bytes: float
    microbatches_in_flight: float  # microbatches' worth of the stage's layers held at the peak

    @property
    def total_bytes(self) -> float:
        """Everything this GPU holds at the peak (bytes)."""
        return self.weights_bytes + self.grads_bytes + self.optimizer_bytes + self.activations_bytes

    def as_dict(self) -> dict[str, float | int]:
        """JSON form (bytes)."""
        return {
            "stage": self.stage,
            "weights_bytes": self.weights_bytes,
            "grads_bytes": self.grads_bytes,
            "optimizer_bytes": self.optimizer_bytes,
            "activations_bytes": self.activations_bytes,
            "total_bytes": self.total_bytes,
            "microbatches_in_flight": self.microbatches_in_flight,
        }


def state_bytes_per_param(par: ParallelConfig, distributed_optimizer: bool = False) -> tuple[float, float, float]:
    """(weight, gradient, optimizer-state) bytes per parameter held by one GPU (Adam, Megatron's dtypes)."""
    full = par.precision in ("fp32", "tf32")
    weight = 4.0 if full else 2.0  # fp8 training keeps bf16 parameters
    grad = 2.0 if par.precision == "fp16" else 4.0
    optim = 8.0 if full else 12.0  # (fp32 master +) first and second moment
    if distributed_optimizer:
        optim /= par.dp * par.cp
    return weight, grad, optim


def layer_activation_bytes(
    model: ModelSpec,
    par: ParallelConfig,
    recompute: str | None = None,
    *,
    flash_attention: bool = True,
    dropout: bool = False,
) -> float:
    """Bytes one transformer layer keeps for its backward, for one microbatch on one GPU.

    `recompute` none / selective / full (default: the layout's); for full, only the layer's input.
    """
    recompute = par.recompute if recompute is None else recompute
    e = par.bytes_per_element
    tokens = par.micro_batch_size * par.seq_length / par.cp
    h, f, d, tp = model.hidden_size, model.ffn_hidden_size, model.kv_channels, par.tp
    sp = tp if par.sequence_parallel else 1
    if recompute == "full":
        return e * tokens * h / sp
    heads, groups = model.num_attention_heads / tp, model.num_query_groups / tp
    mask = 1.0 if dropout else 0.0
    # 2 norm inputs, QKV input, fc1 input (e bytes each); attention-output and MLP dropout masks
    replicated = tokens * h * (4 * e + 2 * mask) / sp
    qkv = e * tokens * d * (heads + 2 * groups)
    qk_norm = e * tokens * d * (heads + groups) if model.qk_norm else 0.0
    attn_out = e * tokens * heads * d  # input of the output projection
    inner = 2 * f if model.activation == "swiglu" else f
    mlp = e * tokens * (inner + f) / tp  # activation-function input, fc2 input
    if recompute == "selective":
        core = 0.0
    elif flash_attention:
        core = FP32_BYTES * tokens * heads  # softmax log-sum-exp per head and token
    else:  # softmax output, its dropout mask and the dropout output: the paper's 5as²b (bf16)
        core = heads * tokens * par.seq_length * (2 * e + mask if dropout else e)
    return replicated + qkv + qk_norm + attn_out + mlp + core


def chunk_microbatches_in_flight(par: ParallelConfig, stage: int) -> int:
    """Model chunks' microbatches whose activations stage `stage` holds at its peak."""
    if par.vp == 1:
        return min(par.pp - stage, par.num_microbatches)
    warmup = 2 * (par.pp - stage - 1) + (par.vp - 1) * par.pp
    return min(warmup + 1, par.num_microbatches * par.vp)


def stage_memory(
    model: ModelSpec,
    par: ParallelConfig,
    stage: int,
    *,
    distributed_optimizer: bool = False,
    flash_attention: bool = True,
    dropout: bool = False,
) -> StageMemory:
    """Memory of one GPU of `stage` at its peak (bytes)."""
    params = stage_params(model, par, stage)
    w, g, o = state_bytes_per_param(par, distributed_optimizer)
    chunks = chunk_microbatches_in_flight(par, stage)
    layer_mb = chunks * par.layers_per_stage[stage] / par.vp  # (layer, microbatch) pairs held
    act = layer_mb * layer_activation_bytes(model, par, flash_attention=flash_attention, dropout=dropout)
    if par.recompute == "full":  # one layer rematerialised during its backward
        act += layer_activation_bytes(model, par, "none", flash_attention=flash_attention, dropout=dropout)
    e = par.bytes_per_element
    tokens = par.micro_batch_size * par.seq_length / par.cp
    sp = par.tp if par.sequence_parallel else 1
    if stage == 0:
        first_mb = math.ceil(chunks / par.vp)
        act += first_mb * tokens * (TOKEN_ID_BYTES + (model.hidden_size / sp if dropout else 0.0))
    if stage == par.pp - 1:
        last_mb = math.ceil(chunks / par.vp)
        act += last_mb * tokens * (2 * e * model.hidden_size / sp + FP32_BYTES * model.vocab_size / par.tp)
    return StageMemory(
        stage=stage,
        weights_bytes=params * w,
        grads_bytes=params * g,
        optimizer_bytes=params * o,
        activations_bytes=act,
        microbatches_in_flight=layer_mb / par.layers_per_stage[stage],
    )


def job_memory(model: ModelSpec, par: ParallelConfig, *, distributed_optimizer: bool = False) -> list[StageMemory]:
    """Memory of one GPU of every pipeline stage (bytes)."""
    return [stage_memory(model, par, s, distributed_optimizer=distributed_optimizer) for s in range(par.pp)]


def _gb(x: float) -> str:
    return f"{x / GB:.1f}"


def check_fits(
    gpu: GPUSpec, model: ModelSpec, par: ParallelConfig, *, distributed_optimizer: bool = False, refuse: bool = True
) -> list[StageMemory]:
    """Every stage's memory; with `refuse`, InfeasibleConfigError (one line, the numbers and the fixes) if one
    exceeds the GPU's."""
    stages = job_memory(model, par, distributed_optimizer=distributed_optimizer)
    worst = max(stages, key=lambda m: m.total_bytes)
    if refuse and worst.total_bytes > gpu.memory_bytes:
        fixes = ["more --tp/--pp", "--recompute full" if par.recompute != "full" else "a smaller --mbs/--seq"]
        if not par.sequence_parallel and par.tp > 1:
            fixes.append("--sp")
        if not distributed_optimizer and par.dp * par.cp > 1:
            fixes.append("--distributed-optimizer")
        elif par.dp * par.cp == 1:
            fixes.append("more GPUs (DP with --distributed-optimizer)")
        raise InfeasibleConfigError(
            f"{model.name} needs {_gb(worst.total_bytes)} GB per GPU on stage {worst.stage} (weights "
            f"{_gb(worst.weights_bytes)}, grads {_gb(worst.grads_bytes)}, optimizer {_gb(worst.optimizer_bytes)}, "
            f"activations {_gb(worst.activations_bytes)}), {gpu.name} has {_gb(gpu.memory_bytes)} GB; use "
            + ", ".join(fixes)
            + "."
        )
    return stages


def memory_summary(gpu: GPUSpec, stages: list[StageMemory], distributed_optimizer: bool) -> dict[str, object]:
    """The estimate as frontier.json's ``config.memory`` and ``kareus predict --format json``'s ``memory``."""
    return {
        "gpu_memory_bytes": gpu.memory_bytes,
        "distributed_optimizer": distributed_optimizer,
        "peak_bytes": max(m.total_bytes for m in stages),
        "stages": [m.as_dict() for m in stages],
    }


def memory_line(gpu: GPUSpec, stages: list[StageMemory]) -> str:
    """One line: each stage's estimate against the GPU's memory (GB)."""
    per = ", ".join(f"stage {m.stage} {_gb(m.total_bytes)}" for m in stages)
    return f"memory per GPU (estimate, GB): {per}; {gpu.name} has {_gb(gpu.memory_bytes)}"

"""Per-layer op graph: the kernels one GPU runs for one nanobatch of one transformer layer.

Terms: a *nanobatch* is micro_batch_size / nanobatches samples of the microbatch; *T* is the tokens one
GPU processes in the GEMMs (nanobatch samples × seq_length / CP). Each Op carries its work in FLOP and
HBM bytes (bf16 unless the precision says otherwise), a GEMM's (M, N, K), and for collectives the
nccl-tests message size ``comm_bytes`` (all-reduce: the buffer; all-gather: the gathered output;
reduce-scatter: the input; send/recv: the tensor), the group size and the link it crosses.

Op order follows kareus_megatron/vocab.py: forward segments ``attn`` then ``mlp``, each ending in its TP
collective; backward segments ``mlp``, ``attn`` and the ``tail`` (input_norm). The norms include the
fused residual add of the previous sublayer. With sequence parallelism each segment starts with a TP
all-gather and ends in a reduce-scatter; with CP the KV all-gather sits just before ``attention`` in
forward and the KV-gradient reduce-scatter just after it in backward. Models without RoPE keep a
``rope`` op with no work so that launch slots have the same names for every model.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kareus_megatron.errors import InfeasibleConfigError
from kareus_megatron.workload.models import ModelSpec
from kareus_megatron.workload.parallel import ParallelConfig

PHASES = ("forward", "backward", "recompute")
KINDS = ("gemm", "attention", "memory", "collective", "p2p")
FP32_BYTES = 4
ATTENTION_BWD_FLOP_FACTOR = 2.5  # flash attention backward: 5 matmuls against forward's 2 (Dao 2023)


@dataclass(frozen=True, kw_only=True, slots=True)
class Op:
    """One kernel (or fused group) of work: FLOP, HBM bytes, and for collectives the message bytes."""

    name: str
    kind: str
    flops: float = 0.0
    hbm_bytes: float = 0.0
    gemm_mnk: tuple[int, int, int] | None = None
    segment: str | None = None
    collective: str | None = None
    comm_bytes: float = 0.0
    group_size: int = 1
    link: str | None = None  # "nvlink" | "network"
    phase: str = "forward"
    kernels: int = 1  # kernel launches the op costs


def _rank_grid(par: ParallelConfig) -> np.ndarray:
    """Node index of every rank, shaped (pp, dp, cp, tp): Megatron's order, TP innermost."""
    ranks = np.arange(par.pp * par.dp * par.cp * par.tp).reshape(par.pp, par.dp, par.cp, par.tp)
    return ranks // par.gpus_per_node


def _crosses(nodes: np.ndarray, axes: tuple[int, ...]) -> bool:
    return bool(np.any(nodes.max(axis=axes) != nodes.min(axis=axes)))


def group_link(par: ParallelConfig, group: str) -> str:
    """Link ("nvlink"/"network") a collective over group "tp", "cp", "dp" (DP×CP) or "pp" crosses."""
    axes = {"tp": (3,), "cp": (2,), "dp": (1, 2), "pp": (0,)}[group]
    return "network" if _crosses(_rank_grid(par), axes) else "nvlink"


def pp_boundary_link(par: ParallelConfig, stage: int) -> str:
    """Link between pipeline stage `stage` and `stage + 1` (wrapping for interleaving)."""
    nodes = _rank_grid(par)
    nxt = (stage + 1) % par.pp
    return "network" if bool(np.any(nodes[stage] != nodes[nxt])) else "nvlink"


def _tokens(model: ModelSpec, par: ParallelConfig, nanobatches: int) -> float:
    if nanobatches < 1 or par.micro_batch_size % nanobatches:
        raise InfeasibleConfigError(
            f"--mbs {par.micro_batch_size} cannot be split into {nanobatches} nanobatches; "
            f"use an MBS divisible by {nanobatches}."
        )
    return par.micro_batch_size // nanobatches * (par.seq_length // par.cp)


def _gemm(name: str, m: float, n: float, k: float, e: int, segment: str | None, phase: str) -> Op:
    bwd = phase == "backward"
    mul = 2 if bwd else 1  # backward = input-gradient GEMM + weight-gradient GEMM
    return Op(
        name=name,
        kind="gemm",
        flops=2.0 * m * n * k * mul,
        hbm_bytes=e * (m * k + k * n + m * n) * mul,
        gemm_mnk=(int(m), int(n), int(k)),
        segment=segment,
        phase=phase,
        kernels=mul,
    )


def _mem(name: str, bytes_: float, flops: float, segment: str | None, phase: str) -> Op:
    return Op(
        name=name,
        kind="memory",
        flops=flops,
        hbm_bytes=bytes_,
        segment=segment,
        phase=phase,
        kernels=1 if bytes_ > 0 else 0,
    )


def _coll(
    par: ParallelConfig,
    collective: str,
    bytes_: float,
    segment: str | None,
    phase: str,
    name: str | None = None,
    kernels: int = 1,
) -> Op:
    group = collective.split("_", 1)[0]
    size = {"tp": par.tp, "cp": par.cp, "dp": par.dp * par.cp}[group]
    return Op(
        name=name or f"{segment}_{collective}",
        kind="collective",
        collective=collective,
        comm_bytes=bytes_,
        group_size=size,
        link=group_link(par, group),
        segment=segment,
        phase=phase,
        kernels=kernels,
    )


def _tp_in(par: ParallelConfig, t: float, h: int, e: int, seg: str, phase: str) -> list[Op]:
    """Sequence parallelism: all-gather the sequence-split activation before a TP GEMM block."""
    if par.sequence_parallel and par.tp > 1:
        return [_coll(par, "tp_all_gather", t * h * e, seg, phase, name=f"{seg}_tp_all_gather")]
    return []


def _tp_out(par: ParallelConfig, t: float, h: int, e: int, seg: str, phase: str) -> list[Op]:
    """The TP collective that ends a segment: all-reduce, or reduce-scatter with sequence parallelism."""
    if par.tp == 1:
        return []
    kind = "tp_reduce_scatter" if par.sequence_parallel else "tp_all_reduce"
    return [_coll(par, kind, t * h * e, seg, phase)]


def layer_ops(model: ModelSpec, par: ParallelConfig, phase: str, nanobatches: int = 1) -> tuple[Op, ...]:
    """Ops of one transformer layer for one nanobatch in `phase`, in execution order (see module doc)."""
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, not {phase!r}")
    if phase == "recompute":
        if par.recompute == "none":
            return ()
        fwd = layer_ops(model, par, "forward", nanobatches)
        if par.recompute == "selective":  # core attention only (Megatron's selective recompute)
            return tuple(_retag(op, "recompute") for op in fwd if op.name == "attention")
        return tuple(_retag(op, "recompute") for op in fwd)
    e = par.bytes_per_element
    t = _tokens(model, par, nanobatches)
    b = par.micro_batch_size // nanobatches
    h, d, tp = model.hidden_size, model.kv_channels, par.tp
    q_w = model.num_attention_heads * d / tp
    kv_w = model.num_query_groups * d / tp
    ffn = model.ffn_hidden_size / tp
    fc1_n = ffn * (2 if model.activation == "swiglu" else 1)
    t_sp = t / tp if par.sequence_parallel else t
    kv_gather = b * par.seq_length * 2 * kv_w * e  # gathered K and V of the whole sequence
    attn_flops = 4.0 * t * par.seq_length * d * (model.num_attention_heads / tp) * 0.5  # causal
    rope_bytes = (2 * t * (q_w + kv_w) * e if model.position == "rope" else 0.0) + (
        2 * t * (q_w + kv_w) * e if model.qk_norm else 0.0
    )
    norm_bytes = 4 * t_sp * h * e  # read input and residual branch, write sum and normalised output
    norm_flops = 8.0 * t_sp * h
    cp_kv = par.cp > 1
    ops: list[Op] = []
    if phase == "forward":
        ops += [_mem("input_norm", norm_bytes, norm_flops, "attn", phase), *_tp_in(par, t, h, e, "attn", phase)]
        ops += [
            _gemm("qkv", t, q_w + 2 * kv_w, h, e, "attn", phase),
            _mem("rope", rope_bytes, 0.5 * rope_bytes, "attn", phase),
        ]
        if cp_kv:
            ops.append(_coll(par, "cp_all_gather", kv_gather, "attn", phase))
        ops.append(
            Op(
                name="attention",
                kind="attention",
                flops=attn_flops,
                segment="attn",
                phase=phase,
                hbm_bytes=e * (2 * t * q_w) + (kv_gather if cp_kv else 2 * t * kv_w * e),
            )
        )
        ops += [_gemm("proj", t, h, q_w, e, "attn", phase), *_tp_out(par, t, h, e, "attn", phase)]
        ops += [_mem("pre_mlp_norm", norm_bytes, norm_flops, "mlp", phase), *_tp_in(par, t, h, e, "mlp", phase)]
        act_bytes = t * ffn * e * (3 if model.activation == "swiglu" else 2)
        ops += [
            _gemm("fc1", t, fc1_n, h, e, "mlp", phase),
            _mem("activation", act_bytes, 8.0 * t * ffn, "mlp", phase),
            _gemm("fc2", t, h, ffn, e, "mlp", phase),
            *_tp_out(par, t, h, e, "mlp", phase),
        ]
        return tuple(ops)
    # backward: mlp segment, attn segment, tail
    act_bytes = t * ffn * e * (5 if model.activation == "swiglu" else 3)
    ops += [
        *_tp_in(par, t, h, e, "mlp", phase),
        _gemm("fc2", t, h, ffn, e, "mlp", phase),
        _mem("activation", act_bytes, 12.0 * t * ffn, "mlp", phase),
        _gemm("fc1", t, fc1_n, h, e, "mlp", phase),
        *_tp_out(par, t, h, e, "mlp", phase),
    ]
    ops += [
        _mem("pre_mlp_norm", norm_bytes, 2 * norm_flops, "attn", phase),
        *_tp_in(par, t, h, e, "attn", phase),
        _gemm("proj", t, h, q_w, e, "attn", phase),
    ]
    ops.append(
        Op(
            name="attention",
            kind="attention",
            flops=ATTENTION_BWD_FLOP_FACTOR * attn_flops,
            segment="attn",
            phase=phase,
            hbm_bytes=e * (5 * t * q_w) + 2 * (kv_gather if cp_kv else 2 * t * kv_w * e),
        )
    )
    if cp_kv:
        ops.append(_coll(par, "cp_reduce_scatter", kv_gather, "attn", phase))
    ops += [
        _mem("rope", rope_bytes, 0.5 * rope_bytes, "attn", phase),
        _gemm("qkv", t, q_w + 2 * kv_w, h, e, "attn", phase),
        *_tp_out(par, t, h, e, "attn", phase),
    ]
    ops.append(_mem("input_norm", norm_bytes, 2 * norm_flops, "tail", phase))
    return tuple(ops)


def _retag(op: Op, phase: str) -> Op:
    from dataclasses import replace

    return replace(op, phase=phase)


def stage_extra_ops(
    model: ModelSpec, par: ParallelConfig, stage: int, phase: str, nanobatches: int = 1, chunk: int | None = None
) -> tuple[Op, ...]:
    """Non-layer ops of `stage` (chunk None: any chunk): embedding first; final norm, output, loss last."""
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, not {phase!r}")
    if phase == "recompute":
        return ()  # Megatron recomputes transformer layers only
    e = par.bytes_per_element
    t = _tokens(model, par, nanobatches)
    h, tp = model.hidden_size, par.tp
    t_sp = t / tp if par.sequence_parallel else t
    first = stage == 0 and (chunk is None or chunk == 0)
    last = stage == par.pp - 1 and (chunk is None or chunk == par.vp - 1)
    ops: list[Op] = []
    bwd = phase == "backward"
    if first:
        pos = 1 if model.position == "learned" else 0
        ops.append(_mem("embedding", (2 + pos + bwd) * t * h * e, t * h * pos, None, phase))
        if tp > 1 and not bwd:  # vocab-parallel embedding: sum the partial lookups
            kind = "tp_reduce_scatter" if par.sequence_parallel else "tp_all_reduce"
            ops.append(_coll(par, kind, t * h * e, None, phase, name=f"embedding_{kind}"))
    if last:
        vocab = model.vocab_size / tp
        logits = t * vocab
        norm = _mem("final_norm", 3 * t_sp * h * e, 8.0 * t_sp * h * (1 + bwd), None, phase)
        out = _gemm("output", t, vocab, h, e, None, phase)
        # vocab-parallel cross-entropy in fp32: max, sum-exp and target logit all-reduced over TP
        loss_bytes = logits * (e + 2 * FP32_BYTES) if not bwd else logits * (FP32_BYTES + e)
        loss = _mem("loss", loss_bytes, 6.0 * logits, None, phase)
        sp_in = _tp_in(par, t, h, e, "output", phase)
        if not bwd:
            ops += [norm, *sp_in, out, loss]
            if tp > 1:
                ops.append(
                    _coll(par, "tp_all_reduce", 3 * t * FP32_BYTES, None, phase, name="loss_tp_all_reduce", kernels=3)
                )
        else:
            ops += [loss, out]
            if tp > 1:  # input gradient of the column-parallel output layer
                kind = "tp_reduce_scatter" if par.sequence_parallel else "tp_all_reduce"
                ops.append(_coll(par, kind, t * h * e, None, phase, name=f"output_{kind}"))
            ops.append(norm)
    return tuple(ops)


def p2p_op(model: ModelSpec, par: ParallelConfig, stage: int | None = None) -> Op:
    """Activation (or gradient) send/recv of one microbatch between stages (stage → stage + 1)."""
    e = par.bytes_per_element
    t = par.micro_batch_size * (par.seq_length // par.cp)
    bytes_ = t * model.hidden_size * e / (par.tp if par.sequence_parallel else 1)
    if stage is None:
        link = "network" if par.pp > 1 and group_link(par, "pp") == "network" else "nvlink"
    else:
        link = pp_boundary_link(par, stage)
    return Op(
        name="pp_send_recv",
        kind="p2p",
        collective="pp_send_recv",
        comm_bytes=bytes_,
        group_size=2,
        link=link,
        phase="forward",
    )


def stage_params(model: ModelSpec, par: ParallelConfig, stage: int) -> float:
    """Parameters held by one GPU of `stage` (TP-sharded).

    The first stage holds the input embedding, the last the final norm and the output layer; tied
    embeddings share one matrix when both are on the same stage (PP=1), while with PP > 1 the last stage
    keeps its own copy (megatron-core's word embeddings there). Learned position embeddings are left out,
    as in Megatron-LM's theoretical_memory_usage.py (seq_length x hidden, small beside the vocabulary).
    """
    h = model.hidden_size
    n = par.layers_per_stage[stage] * model.layer_params
    if stage == 0:
        n += model.embedding_params
    if stage == par.pp - 1:
        n += 0 if model.tied_embeddings and par.pp == 1 else model.embedding_params
        n += h * (2 if model.norm == "layernorm" else 1)
    return n / par.tp


def dp_grad_ops(model: ModelSpec, par: ParallelConfig, stage: int) -> tuple[Op, ...]:
    """Gradient reduce-scatter over DP×CP (distributed optimizer, fp32 grads) once per iteration."""
    if par.dp * par.cp == 1:
        return ()
    return (
        _coll(
            par,
            "dp_reduce_scatter",
            stage_params(model, par, stage) * FP32_BYTES,
            None,
            "backward",
            name="dp_grad_reduce_scatter",
        ),
    )

"""Spawned worker (gloo, fp32) for test_planned_is_run.py: every instruction kind the planner writes, run by the
overlap engine on real megatron-core with the runtime's plan listener, its collectives traced.

A *layout* is one of ``tp`` (TP=2), ``sp`` (TP=2 + SP), ``cross`` / ``cross_sp`` (the same, 3 layers, plans made
with ``--cross-layer``), ``cp`` (CP=2, TP=1), ``tpcp`` (TP=2 x CP=2) and ``tpcpsp`` (with SP). For each layout,
recompute none / full (one recompute group: cross-layer overlap runs inside it) / selective, and every
(forward, backward) nanobatch pair: one microbatch's forward and backward instructions of a real ``Plan`` (knobs
from the planner's own partitions and launch slots, search/partition.py ``layout_slots``), sent through
``runtime.hooks`` to the engine ``setup_overlap(plan)`` built. Each rank writes per scenario the engine's
collective list (trace.traced_collectives), the trace's launch-slot violations, and the largest differences of the
outputs and every gradient against the standard megatron-core model (for CP: without CP, on the whole sequence).
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.distributed as dist
from cp_worker import _batch, _compare, _fwd_bwd, _setup
from overlap_worker import HEADS, HIDDEN, MBS, SEQ, VOCAB

RECOMPUTES = ("none", "full", "selective")
PAIRS = ((1, 1), (2, 2), (2, 1), (1, 2))  # (forward, backward) nanobatches of the microbatch


def layout_of(name: str) -> dict[str, Any]:
    """tp, cp, sp, layers and cross_layer of a layout name (module docstring)."""
    cp = 2 if "cp" in name else 1
    tp = 1 if name == "cp" else 2
    cross = name.startswith("cross")
    return {"tp": tp, "cp": cp, "sp": name.endswith("sp"), "layers": 3 if cross else 2, "cross_layer": cross}


def planner_model() -> Any:
    """The workload ModelSpec of the tiny GPT the workers build (megatron-core defaults: GELU, LayerNorm)."""
    from kareus_megatron.workload.models import ModelSpec

    return ModelSpec(
        name="tiny-gpt",
        num_layers=2,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_query_groups=HEADS,
        ffn_hidden_size=4 * HIDDEN,
        vocab_size=VOCAB,
        activation="gelu",
        norm="layernorm",
        position="learned",
        bias_linear=True,
    )


def planner_layout(name: str, recompute: str) -> Any:
    """The planner's ParallelConfig of a layout (fp32: the workers' precision)."""
    from kareus_megatron.workload.parallel import make_parallel

    lay = layout_of(name)
    return make_parallel(
        planner_model(),
        tp=lay["tp"],
        cp=lay["cp"],
        sequence_parallel=lay["sp"],
        micro_batch_size=MBS,
        seq_length=SEQ,
        recompute=recompute,
        precision="fp32",
    )


def _knobs(name: str, recompute: str, kind: str, i: int) -> dict[str, dict[str, Any]]:
    """The layout's partitions an instruction of `kind` carries (the planner's names and launch slots), every one at
    slot i (mod its count) and a distinct comm SM count within the
    per-group budget (vocab.MAX_COMM_SM_VALUES)."""
    from kareus_megatron.search.partition import layout_slots
    from kareus_megatron.vocab import MAX_COMM_SM_VALUES

    slots = layout_slots(planner_model(), planner_layout(name, recompute))
    names = [p for p in slots if p.startswith("bwd_" if kind == "backward" else "fwd_")]
    if kind == "backward" and recompute == "full":  # the recompute pass runs the forward partitions
        names = [p for p in slots if p.startswith("fwd_")] + names
    assert len(names) <= MAX_COMM_SM_VALUES  # distinct counts within the instruction, within the budget per group
    return {
        p: {"comm_sms": 2 + (k + i) % MAX_COMM_SM_VALUES, "launch_slot": slots[p][i % len(slots[p])]}
        for k, p in enumerate(names)
    }


def _plan(name: str, recompute: str, order: list[tuple[str, int, int]], i: int) -> Any:
    """A plan of one stage running `order`: (kind, microbatch, nanobatches) instructions."""
    from kareus_megatron.plan.schema import Instruction, ModelShape, ParallelLayout, Plan, Predicted, StagePlan

    lay = layout_of(name)
    instrs = tuple(
        Instruction(
            kind=kind,
            microbatch=mb,
            sm_clock_mhz=1410,
            nanobatches=nb,
            partitions=_knobs(name, recompute, kind, i + k) if nb > 1 else {},
        )
        for k, (kind, mb, nb) in enumerate(order)
    )
    return Plan(
        format="kareus-plan/1",
        method="kareus",
        gpu="a100-sxm4-40gb",
        cross_layer=lay["cross_layer"],
        model=ModelShape(
            name="tiny",
            num_layers=lay["layers"],
            hidden_size=HIDDEN,
            num_attention_heads=HEADS,
            num_query_groups=HEADS,
            ffn_hidden_size=4 * HIDDEN,
            vocab_size=VOCAB,
        ),
        parallel=ParallelLayout(
            tp=lay["tp"],
            cp=lay["cp"],
            pp=1,
            vp=1,
            dp=1,
            micro_batch_size=MBS,
            seq_length=SEQ,
            num_microbatches=len(order) // 2,
            recompute=recompute,
            layers_per_stage=(lay["layers"],),
            nodes=1,
            gpus_per_node=lay["tp"] * lay["cp"],
            sequence_parallel=lay["sp"],
        ),
        predicted=Predicted(iteration_time_s=0.1, iteration_energy_j=10.0),
        stages=(StagePlan(pp_rank=0, instructions=instrs),),
    )


def _models(name: str, recompute: str, solo: Any):
    """(standard model, partitioned model) of a layout; for CP the standard one runs without CP (and SP)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.transformer_config import TransformerConfig

    from kareus_megatron.runtime.overlap import get_partitioned_gpt_layer_spec

    lay = layout_of(name)
    extra: dict[str, Any] = {}
    if recompute == "full":  # one recompute group: the layers run back to back (cross-layer overlap links them)
        extra = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=lay["layers"])
    elif recompute == "selective":
        extra = dict(recompute_granularity="selective")
    common = dict(
        num_layers=lay["layers"],
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=lay["tp"],
        pipeline_dtype=torch.float32,
        **extra,
    )
    ref_kw: dict[str, Any] = {}
    if lay["cp"] > 1:
        pgc = ProcessGroupCollection.use_mpu_process_groups()
        pgc.cp = solo  # the reference runs the whole sequence on every rank
        ref_cfg, ref_kw = TransformerConfig(**common), {"pg_collection": pgc}
    else:
        ref_cfg = TransformerConfig(sequence_parallel=lay["sp"], **common)
    torch.manual_seed(1234)
    ref = GPTModel(ref_cfg, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=SEQ, **ref_kw)
    part = GPTModel(
        TransformerConfig(context_parallel_size=lay["cp"], sequence_parallel=lay["sp"], **common),
        get_partitioned_gpt_layer_spec(),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
    )
    part.load_state_dict(ref.state_dict())
    if lay["cross_layer"]:
        from kareus_megatron.runtime.overlap.layer import link_layers

        link_layers(part)
    return ref, part


def _case(name: str, recompute: str, pair: tuple[int, int], i: int, ref: Any, part: Any) -> dict[str, Any]:
    from kareus_megatron.runtime import hooks
    from kareus_megatron.runtime.overlap import overlap_violations, set_engine, setup_overlap
    from kareus_megatron.runtime.overlap.trace import traced_collectives

    plan = _plan(name, recompute, [("forward", 0, pair[0]), ("backward", 0, pair[1])], i)
    engine = setup_overlap(plan, trace=True)
    fwd, bwd = plan.stages[0].instructions
    batch = _batch(40 + i)
    base = _fwd_bwd(ref, batch, cp_layout=False)
    try:
        got = _fwd_bwd(
            part,
            batch,
            cp_layout=layout_of(name)["cp"] > 1,
            before_fwd=lambda: hooks.notify_instruction(hooks.InstructionEvent(0, 0, 0, fwd)),
            before_bwd=lambda: hooks.notify_instruction(hooks.InstructionEvent(0, 1, 0, bwd)),
        )
    finally:
        set_engine(None)
    events = engine.tracer.events
    return {
        **_compare(base, got),
        "collectives": traced_collectives(events),
        "violations": overlap_violations(events),
        "carry_left": engine.carry is not None,
    }


TRAIN_PAIRS = ((2, 1), (1, 2))  # microbatch 0 runs a 2-nanobatch forward and a 1-nanobatch backward, 1 the reverse


def _training(name: str, recompute: str, solo: Any) -> dict[str, Any]:
    """2 SGD iterations of 2 microbatches (TRAIN_PAIRS) through megatron-core's schedule and the runtime patch,
    against the standard model's; the traced collectives with their plan instruction."""
    from cp_worker import _train
    from overlap_worker import _order, _Session

    from kareus_megatron.runtime.frameworks import megatron_patch
    from kareus_megatron.runtime.overlap import overlap_violations, set_engine, setup_overlap
    from kareus_megatron.runtime.overlap.trace import traced_collectives

    ref, part = _models(name, recompute, solo)
    base, base_grads = _train(ref, len(TRAIN_PAIRS), 2, cp_layout=False)
    order = [(kind, mb, TRAIN_PAIRS[mb][kind == "backward"]) for kind, mb in _order(1, 0, len(TRAIN_PAIRS))]
    plan = _plan(name, recompute, order, 0)
    engine = setup_overlap(plan, trace=True)
    megatron_patch.install(plan, _Session())
    try:
        got, got_grads = _train(part, len(TRAIN_PAIRS), 2, cp_layout=False)
    finally:
        megatron_patch.uninstall()
        set_engine(None)
    from overlap_worker import _rel_diff

    events = engine.tracer.events
    return {
        "losses_ref": base,
        "losses_part": got,
        "order": order,
        "grads": max(_rel_diff(got_grads[k], base_grads[k]) for k in base_grads),
        "collectives": traced_collectives(events),
        "violations": overlap_violations(events),
        "instructions_seen": engine.state.instructions_seen,
    }


def worker(
    rank: int, world: int, port: int, outdir: str, runs: tuple[tuple[int, tuple[str, ...], tuple[str, ...]], ...]
) -> None:
    """Each (tp, layouts, train) of `runs` in turn, CP = world / tp (megatron's groups rebuilt between): every
    scenario of `layouts` (module docstring), and training steps for the layouts `train`; ``tp{tp}.rank{rank}.json``
    each."""
    solo = _setup(rank, world, port, runs[0][0])
    for k, (tp, layouts, train) in enumerate(runs):
        if k:
            from megatron.core import parallel_state as ps

            ps.destroy_model_parallel()
            ps.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=world // tp)
        res = _run(rank, tp, layouts, train, solo)
        with open(os.path.join(outdir, f"tp{tp}.rank{rank}.json"), "w") as f:
            json.dump(res, f)
    dist.destroy_process_group()


def _run(rank: int, tp: int, layouts: tuple[str, ...], train: tuple[str, ...], solo: Any) -> dict[str, Any]:
    """Every scenario of `layouts` on this rank, as a spawn of its own would run them: TP=1 without torch's
    private coalescing manager (the engine's fallback, steps.py), megatron's norm patched for SP only where a layout
    runs SP, scenario numbers (knob slots, batch seeds) from 0."""
    from megatron.core.transformer import torch_norm

    coalescing, norm_new = getattr(dist, "_coalescing_manager", None), torch_norm.WrappedTorchNorm.__new__
    if tp == 1:
        del dist._coalescing_manager
    if any(layout_of(n)["sp"] for n in layouts):
        from sp_worker import sp_capable_torch_norm

        sp_capable_torch_norm()  # the GPT block's final norm is megatron's torch-norm fallback
    try:
        res: dict[str, Any] = {"rank": rank}
        i = 0
        for name in layouts:
            for recompute in RECOMPUTES:
                ref, part = _models(name, recompute, solo)
                for pair in PAIRS:
                    res[f"{name}.{recompute}.f{pair[0]}b{pair[1]}"] = _case(name, recompute, pair, i, ref, part)
                    i += 1
        for name in train:  # through megatron's schedule and the runtime patch
            for recompute in RECOMPUTES:
                res[f"train:{name}.{recompute}"] = _training(name, recompute, solo)
    finally:
        if coalescing is not None:
            dist._coalescing_manager = coalescing
        torch_norm.WrappedTorchNorm.__new__ = norm_new
    return res

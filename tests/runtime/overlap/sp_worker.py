"""Spawned worker (gloo, TP=2 + sequence parallelism) for the SP overlap-engine tests.

Each rank writes ``rank{r}.json``: per scenario the largest differences against the standard
megatron-core layer (local spec, ``sequence_parallel=True``) and the overlap trace events; test_overlap_sp.py
asserts. Helpers (set-up, batches, comparisons, the 1F1B order, the runtime-patch session) are
overlap_worker.py's.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.distributed as dist
from overlap_worker import (
    HEADS,
    HIDDEN,
    MBS,
    SEQ,
    VOCAB,
    _batch,
    _compare,
    _fwd_bwd,
    _order,
    _rel_diff,
    _Session,
    _train,
    planned_step,
)
from overlap_worker import _setup as _setup_tp2

from kareus_megatron.vocab import MAX_COMM_SM_VALUES, SP_BACKWARD_PARTITIONS, SP_FORWARD_PARTITIONS, SP_PARTITION_SLOTS

SLOT_SCENARIOS = max(len(s) for s in SP_PARTITION_SLOTS.values())  # scenario i: slot i mod len of every partition


def knobs_for(i: int, names: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """Plan knobs with every SP partition at slot i (mod its slot count) and a distinct comm SM count."""
    return {
        p: {
            "comm_sms": 2 + (k + i) % MAX_COMM_SM_VALUES,  # within the comm-SM budget across a plan
            "launch_slot": SP_PARTITION_SLOTS[p][i % len(SP_PARTITION_SLOTS[p])],
        }
        for k, p in enumerate(names)
    }


def sp_capable_torch_norm() -> None:
    """Let megatron's torch-norm fallback run with ``sequence_parallel=True`` (test only).

    Without Apex or Transformer Engine (this CPU machine) the local spec's norms are
    ``WrappedTorchNorm``, which asserts ``not config.sequence_parallel`` (megatron/core/transformer/
    torch_norm.py, 0.16.1) only because it does not mark its parameters for the SP grad all-reduce. Apex's
    FusedLayerNorm, which the local spec uses where Apex is installed, does nothing else for SP than set
    ``sequence_parallel`` on its weight and bias (fused_layer_norm.py). This stand-in does the same on
    torch's LayerNorm / RMSNorm, for the standard and the partitioned model alike.
    """
    from megatron.core.transformer import torch_norm

    def new(cls, config, hidden_size, eps=1e-5):
        norm_cls = torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm
        norm = norm_cls(hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = config.sequence_parallel
        return norm

    torch_norm.WrappedTorchNorm.__new__ = new


def _models(recompute: bool, num_layers: int = 2, pp: int = 1, llama: bool = False, recompute_num_layers: int = 1):
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from kareus_megatron.runtime.overlap import get_partitioned_gpt_layer_spec

    extra: dict[str, Any] = (
        dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=recompute_num_layers)
        if recompute
        else {}
    )
    spec_kw: dict[str, Any] = {}
    model_kw: dict[str, Any] = {}
    if llama:  # SwiGLU, RMSNorm, RoPE, GQA, no biases
        import torch.nn.functional as F

        extra.update(
            gated_linear_unit=True,
            activation_func=F.silu,
            normalization="RMSNorm",
            num_query_groups=2,
            add_bias_linear=False,
            bias_activation_fusion=False,
        )
        spec_kw = dict(normalization="RMSNorm")
        model_kw = dict(position_embedding_type="rope")
    cfg = TransformerConfig(
        num_layers=num_layers,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=2,
        sequence_parallel=True,
        pipeline_dtype=torch.float32,
        pipeline_model_parallel_size=pp,
        deallocate_pipeline_outputs=pp > 1,
        **extra,
    )
    stage = dict(pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())
    torch.manual_seed(1234)
    ref = GPTModel(
        cfg, get_gpt_layer_local_spec(**spec_kw), vocab_size=VOCAB, max_sequence_length=SEQ, **stage, **model_kw
    )
    part = GPTModel(
        cfg, get_partitioned_gpt_layer_spec(**spec_kw), vocab_size=VOCAB, max_sequence_length=SEQ, **stage, **model_kw
    )
    part.load_state_dict(ref.state_dict())
    return ref, part


def _layer_scenarios(res: dict[str, Any]) -> None:
    from kareus_megatron.runtime.overlap import setup_overlap

    fwd_names = SP_FORWARD_PARTITIONS
    bwd_names = (*SP_FORWARD_PARTITIONS, *SP_BACKWARD_PARTITIONS)
    for recompute, llama in ((False, False), (True, False), (False, True)):
        ref, part = _models(recompute, llama=llama)
        for n in (1, 2):
            for i in range(SLOT_SCENARIOS if n == 2 and not llama else 1):
                name = f"layer.{'llama.' if llama else ''}rc{int(recompute)}.nb{n}.s{i}"
                fk = knobs_for(i, fwd_names) if n == 2 else {}
                bk = knobs_for(i + 1, bwd_names) if n == 2 else {}  # recompute gets other slots than forward
                cmp, engine = planned_step(ref, part, _batch(i), i, fk, bk, n)
                res[name] = {
                    **cmp,
                    "events": engine.tracer.events,
                    "knobs": {"0": fk, "1": bk},
                    "nanobatches": n,
                    "recompute": recompute,
                }
    # negative control: an engine whose reduce-scatter does nothing must not match
    from kareus_megatron.runtime.overlap import LayerSettings

    ref, part = _models(False)
    batch = _batch(7)
    base = _fwd_bwd(ref, batch)
    # the slow-link emulation (benchmarks/overlap_cpu.py) runs all-gathers and reduce-scatters on its thread
    engine = setup_overlap(trace=True, settings=LayerSettings(nanobatches=2), delay_s=1e-3, delay_s_per_byte=1e-9)
    res["slow_link"] = {**_compare(base, _fwd_bwd(part, batch)), "events": engine.tracer.events}
    engine.comm.close()
    engine = setup_overlap(settings=LayerSettings(nanobatches=2))

    def no_sum(out, t, sms, group=None):  # this rank's slice, not summed over the TP group
        out.copy_(t[: out.shape[0]])
        return type("Done", (), {"wait": lambda self: None})(), False

    engine.comm.reduce_scatter = no_sum
    res["negative.no_reduce_scatter"] = _compare(base, _fwd_bwd(part, batch))


def _cross_layer_scenarios(res: dict[str, Any]) -> None:
    """Cross-layer overlap with SP (cross_layer.py): 3 layers, every launch slot, recompute off and in one group
    of 3, outputs and every gradient against the standard SP layer; the trace."""
    from kareus_megatron.runtime.overlap.layer import link_layers

    fwd_names = SP_FORWARD_PARTITIONS
    bwd_names = (*SP_FORWARD_PARTITIONS, *SP_BACKWARD_PARTITIONS)
    for recompute in (False, True):
        ref, part = _models(recompute, num_layers=3, recompute_num_layers=3)
        res[f"cross.rc{int(recompute)}.linked"] = link_layers(part)
        for i in range(SLOT_SCENARIOS if not recompute else 1):
            fk, bk = knobs_for(i, fwd_names), knobs_for(i + 1, bwd_names)
            cmp, engine = planned_step(ref, part, _batch(30 + i), i, fk, bk, 2, cross_layer=True)
            res[f"cross.rc{int(recompute)}.s{i}"] = {
                **cmp,
                "events": engine.tracer.events,
                "knobs": {"0": fk, "1": bk},
                "recompute": recompute,
                "carry_left": engine.carry is not None,
            }


def _plan(m: int, recompute: bool, pp: int = 1, num_layers: int = 2, cross_layer: bool = False):
    from kareus_megatron.plan.schema import Instruction, ModelShape, ParallelLayout, Plan, Predicted, StagePlan

    stages = []
    for r in range(pp):
        instrs = []
        for kind, mb in _order(pp, r, m):
            names = SP_FORWARD_PARTITIONS if kind == "forward" else (*SP_FORWARD_PARTITIONS, *SP_BACKWARD_PARTITIONS)
            instrs.append(
                Instruction(
                    kind=kind,
                    microbatch=mb,
                    sm_clock_mhz=1410,
                    nanobatches=2,
                    partitions=knobs_for(mb + r + (2 if kind == "backward" else 0), names),
                )
            )
        stages.append(StagePlan(pp_rank=r, instructions=tuple(instrs)))
    return Plan(
        format="kareus-plan/1",
        method="kareus",
        gpu="a100-sxm4-40gb",
        model=ModelShape(
            name="tiny",
            num_layers=num_layers,
            hidden_size=HIDDEN,
            num_attention_heads=HEADS,
            num_query_groups=HEADS,
            ffn_hidden_size=4 * HIDDEN,
            vocab_size=VOCAB,
        ),
        parallel=ParallelLayout(
            tp=2,
            cp=1,
            pp=pp,
            vp=1,
            dp=1,
            micro_batch_size=MBS,
            seq_length=SEQ,
            num_microbatches=m,
            recompute="full" if recompute else "none",
            layers_per_stage=(num_layers // pp,) * pp,
            nodes=1,
            gpus_per_node=2 * pp,
            sequence_parallel=True,
        ),
        predicted=Predicted(iteration_time_s=0.1, iteration_energy_j=10.0),
        stages=tuple(stages),
        cross_layer=True if cross_layer else None,
    )


def _training_steps(
    res: dict[str, Any], pp: int = 1, m: int = 2, recomputes=(False, True), cross_layer: bool = False
) -> None:
    """Real megatron-core schedule + runtime patch + SP plan: losses and grads vs the standard SP layer
    (`cross_layer`: a cross-layer plan on 3 layers, recompute in one group of 3)."""
    from megatron.core import parallel_state as ps

    from kareus_megatron.runtime.frameworks import megatron_patch
    from kareus_megatron.runtime.overlap import set_engine, setup_overlap

    for recompute in recomputes:
        layers = 3 if cross_layer else 2
        ref, part = _models(recompute, pp=pp, num_layers=layers, recompute_num_layers=3 if cross_layer else 1)
        base, base_grads = _train(ref, m, 2)
        plan = _plan(m, recompute, pp, num_layers=layers, cross_layer=cross_layer)
        engine = setup_overlap(plan, trace=True)
        from kareus_megatron.runtime.overlap import check_model_for_plan

        check_model_for_plan(part, plan)  # as the session does before step 1 (links the layers for cross-layer)
        megatron_patch.install(plan, _Session())
        try:
            got, got_grads = _train(part, m, 2)
        finally:
            megatron_patch.uninstall()
            set_engine(None)
        diffs = {k: _rel_diff(got_grads[k], base_grads[k]) for k in base_grads}
        res[f"train.{'cross.' if cross_layer else ''}pp{pp}.rc{int(recompute)}"] = {
            "losses_ref": base,
            "losses_part": got,
            "events": engine.tracer.events,
            "pp_rank": ps.get_pipeline_model_parallel_rank(),
            "grads": max(diffs.values()),
            "n_grads": len(diffs),
            "grad_keys_equal": sorted(base_grads) == sorted(got_grads),
            "instructions_seen": engine.state.instructions_seen,
        }


def _ddp(res: dict[str, Any]) -> None:
    """megatron DDP + finalize_model_grads: the SP norms' grads (params marked sequence_parallel) all-reduced."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from kareus_megatron.runtime.overlap import LayerSettings, set_engine, setup_overlap

    setup_overlap(settings=LayerSettings(nanobatches=2, knobs={}))
    m, out = 2, []
    for model in _models(False):
        cfg = model.config
        ddp = DistributedDataParallel(
            cfg, DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=10_000), model
        )
        cfg.no_sync_func, cfg.finalize_model_grads_func = ddp.no_sync, finalize_model_grads
        ddp.zero_grad_buffer()
        batches = iter([_batch(50 + k) for k in range(m)])

        def step(data_iter, mdl):
            tokens, pos, mask = next(data_iter)
            o = mdl(tokens, pos, mask, labels=tokens)
            return o, lambda o: (o.float().mean(), {"loss": o.float().mean().detach()})

        losses = get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=batches,
            model=ddp,
            num_microbatches=m,
            seq_length=SEQ,
            micro_batch_size=MBS,
        )
        grads = {k: p.main_grad.clone() for k, p in model.named_parameters()}
        sp_names = sorted(k for k, p in model.named_parameters() if getattr(p, "sequence_parallel", False))
        # the SP params' grads are equal on both TP ranks once finalize_model_grads has all-reduced them
        other = [torch.zeros_like(grads[sp_names[0]]) for _ in range(2)]
        dist.all_gather(other, grads[sp_names[0]].contiguous(), group=model.decoder.layers[0].tp_group)
        out.append((grads, [float(d["loss"]) for d in losses], sp_names, _rel_diff(other[1], other[0])))
        cfg.no_sync_func = cfg.finalize_model_grads_func = None
    (g0, l0, sp0, _), (g1, l1, sp1, tp_diff) = out
    res["ddp"] = {
        "losses": [l0, l1],
        "grads": max(_rel_diff(g1[k], g0[k]) for k in g0),
        "sp_params": [sp0, sp1],
        "sp_grad_tp_diff": tp_diff,
    }
    set_engine(None)


def worker(rank: int, world: int, port: int, outdir: str) -> None:
    """TP=2 + SP (2 ranks): every layer scenario, DDP, then training steps without pipelining."""
    _setup_tp2(rank, world, port)
    sp_capable_torch_norm()
    res: dict[str, Any] = {}
    _layer_scenarios(res)
    _cross_layer_scenarios(res)
    _ddp(res)
    _training_steps(res)
    _training_steps(res, cross_layer=True)
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


def worker_pp(rank: int, world: int, port: int, outdir: str) -> None:
    """TP=2 + SP x PP=2 (4 ranks): 1F1B training steps with the runtime patch."""
    _setup_tp2(rank, world, port, pp=2)
    sp_capable_torch_norm()
    res: dict[str, Any] = {}
    _training_steps(res, pp=2, m=4, recomputes=(False, True))
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()

"""Spawned worker (gloo, fp32) for the context-parallel overlap-engine tests: CP=2 (2 ranks), TP=2 x CP=2 (4),
the latter also with sequence parallelism (``layer_sp.*`` and ``sp.train.*`` scenarios, schedule_cpsp.py).

The reference is the same model without CP and without SP (local spec, megatron's DotProductAttention, a CP
group of one rank) on the full sequence; the partitioned CP model gets megatron's CP batch layout
(``get_batch_on_this_cp_rank``). Per-rank logits are gathered back into sequence order, parameter gradients
of SP-marked parameters summed over the TP group (megatron's finalize_model_grads does it), all summed over
the CP group (what megatron's DP x CP grad all-reduce does), then compared. Each rank writes
``rank{r}.json``; test_overlap_cp.py asserts.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.distributed as dist
from overlap_worker import HEADS, HIDDEN, MBS, VOCAB, _order, _rel_diff, _Session

SEQ = 16  # 2·cp chunks of 4 tokens
CP_FWD = ("fwd_cp_kv", "fwd_attn", "fwd_mlp")
CP_BWD = (*CP_FWD, "bwd_mlp", "bwd_cp_kv", "bwd_attn")
CPSP_FWD = ("fwd_sp_attn_norm", "fwd_cp_kv", "fwd_sp_attn", "fwd_sp_mlp_norm", "fwd_sp_mlp")
CPSP_BWD = (*CPSP_FWD, "bwd_sp_mlp", "bwd_sp_attn_norm", "bwd_cp_kv", "bwd_sp_attn")


def knobs_for(i: int, names: tuple[str, ...], sp: bool = False) -> dict[str, dict[str, Any]]:
    """Plan knobs with every partition at its engine slot i (mod count) and a distinct comm SM count (`sp`: the
    slots with sequence parallelism too)."""
    from kareus_megatron.runtime.overlap.config import cp_engine_slots, cp_sp_engine_slots
    from kareus_megatron.vocab import MAX_COMM_SM_VALUES

    slots = cp_sp_engine_slots() if sp else cp_engine_slots()
    return {
        p: {
            "comm_sms": 2 + (k + i) % MAX_COMM_SM_VALUES,  # within the comm-SM budget across a plan
            "launch_slot": slots[p][i % len(slots[p])],
        }
        for k, p in enumerate(names)
    }


def _setup(rank: int, world: int, port: int, tp: int) -> Any:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mrandom

    from kareus_megatron.runtime.frameworks import cpu_shim

    cpu_shim.apply()
    mrandom._get_cuda_rng_state = lambda *a, **k: None
    mrandom._set_cuda_rng_state = lambda *a, **k: None
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=world // tp)
    _cpu_rope_cp_slice()
    solo = None
    for r in range(world):  # every rank creates every group
        g = dist.new_group([r])
        if r == rank:
            solo = g
    return solo


def _cpu_rope_cp_slice() -> None:
    """megatron's ``get_pos_emb_on_this_cp_rank`` builds its index with ``pin_memory=True`` (rope_utils.py,
    0.16.1), which fails without an accelerator: a CPU stand-in taking the same chunks (test only)."""
    from megatron.core.models.common.embeddings import rotary_pos_embedding

    from kareus_megatron.runtime.overlap.cp_attention import local_chunks

    def on_this_rank(emb, seq_dim, cp_group):
        cp, r = cp_group.size(), cp_group.rank()
        chunks = emb.chunk(2 * cp, dim=seq_dim)
        return torch.cat([chunks[g] for g in local_chunks(cp, r)], dim=seq_dim)

    rotary_pos_embedding.get_pos_emb_on_this_cp_rank = on_this_rank


def _models(recompute: bool, tp: int, solo: Any, llama: bool = False, sp: bool = False):
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.transformer_config import TransformerConfig

    from kareus_megatron.runtime.overlap import get_partitioned_gpt_layer_spec

    extra: dict[str, Any] = (
        dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) if recompute else {}
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
    common = dict(
        num_layers=2,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_dtype=torch.float32,
        **extra,
    )
    cp = ps.get_context_parallel_world_size()
    pgc = ProcessGroupCollection.use_mpu_process_groups()
    pgc.cp = solo  # the reference runs the whole sequence on every rank
    torch.manual_seed(1234)
    ref = GPTModel(
        TransformerConfig(**common),
        get_gpt_layer_local_spec(**spec_kw),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        pg_collection=pgc,
        **model_kw,
    )
    part = GPTModel(
        TransformerConfig(context_parallel_size=cp, sequence_parallel=sp, **common),
        get_partitioned_gpt_layer_spec(**spec_kw),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        **model_kw,
    )
    part.load_state_dict(ref.state_dict())
    return ref, part


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (MBS, SEQ), generator=g)
    pos = torch.arange(SEQ).expand(MBS, SEQ).contiguous()
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1).view(1, 1, SEQ, SEQ)
    return tokens, pos, mask


def _cp_batch(batch, with_mask: bool = True):
    """megatron's CP layout of a batch (its own get_batch_on_this_cp_rank)."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    tokens, pos, mask = batch
    out = get_batch_on_this_cp_rank(
        {"tokens": tokens, "position_ids": pos, "attention_mask": mask if with_mask else None}
    )
    return out["tokens"], out["position_ids"], out["attention_mask"]


def _to_sequence(local: torch.Tensor) -> torch.Tensor:
    """Gather per-rank [b, 2c, ...] tensors over the CP group into sequence order [b, s, ...]."""
    from megatron.core import parallel_state as ps

    from kareus_megatron.runtime.overlap.cp_attention import to_sequence_order

    cp = ps.get_context_parallel_world_size()
    parts = [torch.empty_like(local) for _ in range(cp)]
    dist.all_gather(parts, local.contiguous(), group=ps.get_context_parallel_group())
    return to_sequence_order(torch.cat(parts, dim=1), cp, 1)


def _weights(shape) -> torch.Tensor:
    return torch.linspace(-1.0, 1.0, int(torch.tensor(shape).prod())).view(shape)


def _sum_cp(grads: dict[str, torch.Tensor], scale: float = 1.0, model: Any = None) -> dict[str, torch.Tensor]:
    """Sum `grads` over the CP group, times `scale`; first those of `model`'s SP-marked parameters (sequence
    parallelism's partial norm and row-bias grads) over the TP group."""
    from megatron.core import parallel_state as ps

    for k, p in model.named_parameters() if model is not None else ():
        if getattr(p, "sequence_parallel", False) and k in grads:
            dist.all_reduce(grads[k], group=ps.get_tensor_model_parallel_group())
    for g in grads.values():
        dist.all_reduce(g, group=ps.get_context_parallel_group())
        g.mul_(scale)
    return grads


def _fwd_bwd(model, batch, cp_layout: bool, with_mask: bool = True, before_fwd=None, before_bwd=None):
    tokens, pos, mask = _cp_batch(batch, with_mask) if cp_layout else batch
    model.zero_grad(set_to_none=True)
    if before_fwd:
        before_fwd()
    logits = model(tokens, pos, mask)
    full_shape = (MBS, SEQ, logits.shape[-1])
    w = _weights(full_shape)
    if cp_layout:
        from megatron.core.utils import get_batch_on_this_cp_rank

        w = get_batch_on_this_cp_rank({"w": w})["w"]
    if before_bwd:
        before_bwd()
    (logits * w).sum().backward()
    grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
    if cp_layout:
        return _to_sequence(logits.detach()), _sum_cp(grads, model=model)
    return logits.detach(), grads


def _compare(ref_out, part_out) -> dict[str, Any]:
    (l0, g0), (l1, g1) = ref_out, part_out
    grads = {k: _rel_diff(g1[k], g0[k]) for k in g0}
    return {
        "out": _rel_diff(l1, l0),
        "grads": max(grads.values()),
        "n_grads": len(grads),
        "grad_norm": float(sum(float(g.norm()) for g in g0.values())),
        "worst_grad": max(grads, key=grads.get),
    }


def _layer_case(
    ref, part, n: int, i: int, with_mask: bool, names: tuple[tuple[str, ...], tuple[str, ...]], sp: bool = False
) -> dict[str, Any]:
    """One layer scenario: `n` nanobatches, forward knobs at slot i and backward ones at slot i + 1 of the
    partitions `names` (forward, backward); the comparison, the trace and the knobs."""
    from kareus_megatron.plan.schema import Instruction
    from kareus_megatron.runtime import hooks
    from kareus_megatron.runtime.overlap import setup_overlap

    fk = knobs_for(i, names[0], sp) if n == 2 else {}
    bk = knobs_for(i + 1, names[1], sp) if n == 2 else {}
    fwd = Instruction(kind="forward", microbatch=i, sm_clock_mhz=1410, nanobatches=n, partitions=fk)
    bwd = Instruction(kind="backward", microbatch=i, sm_clock_mhz=1200, nanobatches=n, partitions=bk)
    engine = setup_overlap(trace=True, plan=None)
    engine.install_listener()
    batch = _batch(i)
    base = _fwd_bwd(ref, batch, cp_layout=False)
    got = _fwd_bwd(
        part,
        batch,
        cp_layout=True,
        with_mask=with_mask,
        before_fwd=lambda: hooks.notify_instruction(hooks.InstructionEvent(0, 0, 0, fwd)),
        before_bwd=lambda: hooks.notify_instruction(hooks.InstructionEvent(0, 1, 0, bwd)),
    )
    engine.uninstall_listener()
    return {**_compare(base, got), "events": engine.tracer.events, "knobs": {"0": fk, "1": bk}, "nanobatches": n}


def _layer_scenarios(res: dict[str, Any], tp: int, solo: Any, short: bool) -> None:
    from kareus_megatron.runtime.overlap import setup_overlap
    from kareus_megatron.runtime.overlap.config import cp_engine_slots

    n_slots = max(len(s) for s in cp_engine_slots().values())
    cases = ((False, True), (True, True)) if short else ((False, False), (True, False), (False, True), (True, True))
    for recompute, llama in cases:
        ref, part = _models(recompute, tp, solo, llama=llama)
        for n in (1, 2):
            for i in range(1 if n == 1 else (2 if short else n_slots)):
                for with_mask in (True,) if i else (True, False):
                    name = f"layer.{'llama.' if llama else ''}rc{int(recompute)}.nb{n}.s{i}.m{int(with_mask)}"
                    res[name] = _layer_case(ref, part, n, i, with_mask, (CP_FWD, CP_BWD))
    if short:
        return
    from kareus_megatron.runtime.overlap import LayerSettings

    ref, part = _models(False, tp, solo)
    batch = _batch(7)
    base = _fwd_bwd(ref, batch, cp_layout=False)
    engine = setup_overlap(trace=True, settings=LayerSettings(nanobatches=2), delay_s=1e-3, delay_s_per_byte=1e-9)
    res["slow_link"] = {**_compare(base, _fwd_bwd(part, batch, cp_layout=True)), "events": engine.tracer.events}
    engine.comm.close()
    engine = setup_overlap(settings=LayerSettings(nanobatches=2))

    def no_sum(out, t, sms, group=None):  # this rank's slice, not summed over the CP group
        out.copy_(t[: out.shape[0]])
        return type("Done", (), {"wait": lambda self: None})(), False

    engine.comm.cp_reduce_scatter = no_sum
    res["negative.no_cp_reduce_scatter"] = _compare(base, _fwd_bwd(part, batch, cp_layout=True))


def _sp_scenarios(res: dict[str, Any], tp: int, solo: Any) -> None:
    """TP x CP with sequence parallelism (schedule_cpsp.py): Llama-like without recompute at every slot of the
    cp_sp_engine_slots partitions, GPT with recompute at the first ones; 1 nanobatch with and without the mask."""
    from sp_worker import sp_capable_torch_norm

    from kareus_megatron.runtime.overlap.config import cp_sp_engine_slots

    sp_capable_torch_norm()  # the GPT block's final norm is megatron's torch-norm fallback
    n_slots = max(len(s) for s in cp_sp_engine_slots().values())
    for recompute, llama in ((False, True), (True, False)):
        ref, part = _models(recompute, tp, solo, llama=llama, sp=True)
        for n in (1, 2):
            for i in range(1 if n == 1 else (n_slots if llama else 1)):
                for with_mask in (True,) if i or n == 2 else (True, False):
                    name = f"layer_sp.{'llama.' if llama else ''}rc{int(recompute)}.nb{n}.s{i}.m{int(with_mask)}"
                    res[name] = _layer_case(ref, part, n, i, with_mask, (CPSP_FWD, CPSP_BWD), sp=True)


def _plan(m: int, recompute: bool, tp: int, cp: int, sp: bool = False):
    from kareus_megatron.plan.schema import Instruction, ModelShape, ParallelLayout, Plan, Predicted, StagePlan

    instrs = []
    for kind, mb in _order(1, 0, m):
        names = (CPSP_FWD if sp else CP_FWD) if kind == "forward" else (CPSP_BWD if sp else CP_BWD)
        instrs.append(
            Instruction(
                kind=kind,
                microbatch=mb,
                sm_clock_mhz=1410,
                nanobatches=2,
                partitions=knobs_for(mb + (2 if kind == "backward" else 0), names, sp),
            )
        )
    return Plan(
        format="kareus-plan/1",
        method="kareus",
        gpu="a100-sxm4-40gb",
        model=ModelShape(
            name="tiny",
            num_layers=2,
            hidden_size=HIDDEN,
            num_attention_heads=HEADS,
            num_query_groups=HEADS,
            ffn_hidden_size=4 * HIDDEN,
            vocab_size=VOCAB,
        ),
        parallel=ParallelLayout(
            tp=tp,
            cp=cp,
            pp=1,
            vp=1,
            dp=1,
            micro_batch_size=MBS,
            seq_length=SEQ,
            num_microbatches=m,
            recompute="full" if recompute else "none",
            layers_per_stage=(2,),
            nodes=1,
            gpus_per_node=tp * cp,
            sequence_parallel=sp,
        ),
        predicted=Predicted(iteration_time_s=0.1, iteration_energy_j=10.0),
        stages=(StagePlan(pp_rank=0, instructions=tuple(instrs)),),
    )


def _train(model, m: int, iters: int, cp_layout: bool):
    """Losses of `iters` SGD steps through megatron-core's schedule (PP=1); CP: grads averaged over CP."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    cp = ps.get_context_parallel_world_size()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses, grads = [], {}
    for it in range(iters):
        batches = iter([_batch(100 * it + k) for k in range(m)])

        def step(data_iter, mdl):
            b = next(data_iter)
            tokens, pos, mask = _cp_batch(b) if cp_layout else b
            out = mdl(tokens, pos, mask, labels=tokens)
            div = cp  # megatron's 2-output loss path multiplies the loss by the CP size (the reference's too)
            return out, lambda o: (o.float().mean() / div, {"loss": o.float().mean().detach()})

        opt.zero_grad(set_to_none=True)
        out = get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=batches,
            model=model,
            num_microbatches=m,
            seq_length=SEQ,  # megatron divides by CP itself
            micro_batch_size=MBS,
        )
        grads = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
        step_losses = torch.tensor([float(d["loss"]) for d in out])
        if cp_layout:  # equal token counts per rank: the mean over CP ranks is the whole sequence's mean
            _sum_cp(grads, 1.0 / cp, model=model)
            dist.all_reduce(step_losses, group=ps.get_context_parallel_group())
            step_losses /= cp
        grads = {k: g.detach().clone() for k, g in grads.items()}
        opt.step()
        losses.append(step_losses.tolist())
    return losses, grads


def _training_steps(
    res: dict[str, Any], tp: int, solo: Any, m: int = 2, recomputes=(False, True), sp: bool = False
) -> None:
    from megatron.core import parallel_state as ps

    from kareus_megatron.runtime.frameworks import megatron_patch
    from kareus_megatron.runtime.overlap import set_engine, setup_overlap, validate_plan_for_layer

    cp = ps.get_context_parallel_world_size()
    for recompute in recomputes:
        ref, part = _models(recompute, tp, solo, sp=sp)
        base, base_grads = _train(ref, m, 2, cp_layout=False)
        plan = _plan(m, recompute, tp, cp, sp)
        validate_plan_for_layer(plan)
        engine = setup_overlap(plan, trace=True)
        megatron_patch.install(plan, _Session())
        try:
            got, got_grads = _train(part, m, 2, cp_layout=True)
        finally:
            megatron_patch.uninstall()
            set_engine(None)
        diffs = {k: _rel_diff(got_grads[k], base_grads[k]) for k in base_grads}
        res[f"{'sp.' if sp else ''}train.rc{int(recompute)}"] = {
            "losses_ref": base,
            "losses_part": got,
            "events": engine.tracer.events,
            "grads": max(diffs.values()),
            "n_grads": len(diffs),
            "instructions_seen": engine.state.instructions_seen,
        }


def worker(rank: int, world: int, port: int, outdir: str, tp: int = 1) -> None:
    """CP = world / tp: layer scenarios, then training steps (the 4-rank TP x CP run: a short set, then the same
    with sequence parallelism)."""
    solo = _setup(rank, world, port, tp)
    res: dict[str, Any] = {}
    short = tp > 1
    _layer_scenarios(res, tp, solo, short)
    _training_steps(res, tp, solo, recomputes=(True,) if short else (False, True))
    if short:
        _sp_scenarios(res, tp, solo)
        _training_steps(res, tp, solo, recomputes=(True,), sp=True)
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()

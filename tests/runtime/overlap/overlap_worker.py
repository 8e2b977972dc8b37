"""Spawned 2-process worker (gloo, TP=2) for the overlap-engine tests: many scenarios per process start.

Each rank writes ``rank{r}.json``: per scenario the largest differences against the standard
megatron-core layer (outputs, every gradient, losses) and the overlap trace events; the tests assert.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.distributed as dist

from kareus_megatron.vocab import MAX_COMM_SM_VALUES, TP_PARTITION_SLOTS

HIDDEN, HEADS, VOCAB, SEQ, MBS = 32, 4, 128, 16, 4
SLOT_SCENARIOS = 5  # max slots per partition: scenario i uses slot i mod len(slots) of every partition


def knobs_for(i: int, names: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """Plan knobs with every partition at slot i (mod its slot count) and a distinct comm SM count."""
    return {
        p: {
            "comm_sms": 2 + (k + i) % MAX_COMM_SM_VALUES,  # within the comm-SM budget across a plan
            "launch_slot": TP_PARTITION_SLOTS[p][i % len(TP_PARTITION_SLOTS[p])],
        }
        for k, p in enumerate(names)
    }


def _setup(rank: int, world: int, port: int, pp: int = 1) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mrandom

    from kareus_megatron.runtime.frameworks import cpu_shim

    cpu_shim.apply()
    # Full recompute saves/restores the CUDA RNG state (torch.cuda.get_rng_state): none on CPU.
    mrandom._get_cuda_rng_state = lambda *a, **k: None
    mrandom._set_cuda_rng_state = lambda *a, **k: None
    ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=pp)


def _models(recompute: bool, num_layers: int = 2, pp: int = 1, llama: bool = False, recompute_num_layers: int = 1):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from kareus_megatron.runtime.overlap import get_partitioned_gpt_layer_spec

    extra = (
        dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=recompute_num_layers)
        if recompute
        else {}
    )
    spec_kw: dict[str, Any] = {}
    model_kw: dict[str, Any] = {}
    if llama:  # SwiGLU, RMSNorm, RoPE, GQA, QK-norm, no biases (Llama/Qwen3-like)
        import torch.nn.functional as F

        extra.update(
            gated_linear_unit=True,
            activation_func=F.silu,
            normalization="RMSNorm",
            num_query_groups=2,
            qk_layernorm=True,
            add_bias_linear=False,
            bias_activation_fusion=False,
        )
        spec_kw = dict(normalization="RMSNorm", qk_layernorm=True)
        model_kw = dict(position_embedding_type="rope")
    cfg = TransformerConfig(
        num_layers=num_layers,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=2,
        pipeline_dtype=torch.float32,
        pipeline_model_parallel_size=pp,
        deallocate_pipeline_outputs=pp > 1,
        **extra,
    )
    from megatron.core import parallel_state as ps

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


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (MBS, SEQ), generator=g)
    pos = torch.arange(SEQ).expand(MBS, SEQ)
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1).view(1, 1, SEQ, SEQ)
    return tokens, pos, mask


def _fwd_bwd(model, batch, before_fwd=None, before_bwd=None):
    """Logits and every parameter gradient of one forward+backward (loss = weighted logits sum)."""
    tokens, pos, mask = batch
    model.zero_grad(set_to_none=True)
    if before_fwd:
        before_fwd()
    logits = model(tokens, pos, mask)
    w = torch.linspace(-1.0, 1.0, logits.numel()).view_as(logits)
    if before_bwd:
        before_bwd()
    (logits * w).sum().backward()
    return logits.detach(), {k: p.grad.detach().clone() for k, p in model.named_parameters()}


def _rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a-b| / (1e-5 |b| + atol): <= 1 means allclose(a, b, rtol=1e-5, atol).

    atol = 1e-5 x the largest |b| of the tensor: fp32 sums taken in a different order (per nanobatch,
    then added) differ by a few ulps of the summands, which matters only for near-cancelling entries
    (bias gradients summed over tokens with weights of both signs).
    """
    atol = 1e-5 * float(b.abs().max()) + 1e-12
    return float(((a - b).abs() / (1e-5 * b.abs() + atol)).max())


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


def planned_step(ref, part, batch, mb: int, fk: dict, bk: dict, nanobatches: int, cross_layer: bool = False):
    """One forward+backward of `ref` and of `part` under a forward and a backward plan instruction (knobs `fk`,
    `bk`) sent through the hooks listener; return (the comparison, with cross-layer overlap's backward gradient
    ``checks`` and how many of them compared values, ``value_checks``: 0 when autograd hands each layer the very
    tensor the next one returned; the engine with its trace)."""
    from kareus_megatron.plan.schema import Instruction
    from kareus_megatron.runtime import hooks
    from kareus_megatron.runtime.overlap import setup_overlap

    fwd = Instruction(kind="forward", microbatch=mb, sm_clock_mhz=1410, nanobatches=nanobatches, partitions=fk)
    bwd = Instruction(kind="backward", microbatch=mb, sm_clock_mhz=1200, nanobatches=nanobatches, partitions=bk)
    engine = setup_overlap(trace=True, plan=None)
    engine.state.cross_layer = cross_layer
    engine.install_listener()
    base = _fwd_bwd(ref, batch)
    from kareus_megatron.runtime.overlap.cross_layer import Prefetched

    same, check = [], Prefetched.check

    def recorded(self, *args):
        same.append(check(self, *args))
        return same[-1]

    Prefetched.check = recorded
    try:
        got = _fwd_bwd(
            part,
            batch,
            before_fwd=lambda: hooks.notify_instruction(hooks.InstructionEvent(0, 0, 0, fwd)),
            before_bwd=lambda: hooks.notify_instruction(hooks.InstructionEvent(0, 1, 0, bwd)),
        )
    finally:
        Prefetched.check = check
    engine.uninstall_listener()
    return {**_compare(base, got), "value_checks": same.count(False), "checks": len(same)}, engine


def _layer_scenarios(res: dict[str, Any]) -> None:

    fwd_names = ("fwd_attn", "fwd_mlp")
    bwd_names = ("fwd_attn", "fwd_mlp", "bwd_mlp", "bwd_attn")
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


def _cross_layer_scenarios(res: dict[str, Any]) -> None:
    """Cross-layer overlap (cross_layer.py): 3 layers, every launch slot, recompute off and on (groups of 3
    layers, and megatron's default of 1: nothing to link), outputs and every gradient against the standard
    layer; the trace; and a carried collective dropped (the comparison must see it)."""
    from kareus_megatron.runtime.overlap.layer import link_layers

    fwd_names = ("fwd_attn", "fwd_mlp")
    bwd_names = ("fwd_attn", "fwd_mlp", "bwd_mlp", "bwd_attn")
    for recompute, group in ((False, 3), (True, 3), (True, 1)):
        ref, part = _models(recompute, num_layers=3, recompute_num_layers=group)
        res[f"cross.rc{int(recompute)}.g{group}.linked"] = link_layers(part)
        for i in range(SLOT_SCENARIOS if (recompute, group) == (False, 3) else 2):
            name = f"cross.rc{int(recompute)}.g{group}.s{i}"
            fk, bk = knobs_for(i, fwd_names), knobs_for(i + 1, bwd_names)
            batch = _batch(20 + i)
            cmp, engine = planned_step(ref, part, batch, i, fk, bk, 2, cross_layer=True)
            res[name] = {
                **cmp,
                "events": engine.tracer.events,
                "knobs": {"0": fk, "1": bk},
                "nanobatches": 2,
                "recompute": recompute,
                "group": group,
                "carry_left": engine.carry is not None,
            }
        if (recompute, group) == (False, 3):  # negative control: the carried half never written into the output
            from kareus_megatron.runtime.overlap import cross_layer

            def unwritten(carry, by=None):
                (by or carry.run)._wait(carry.coll)
                carry.run.finish_nb(carry.nb)

            saved, cross_layer.ForwardCarry.complete = cross_layer.ForwardCarry.complete, unwritten
            try:
                res["cross.negative"] = _compare(_fwd_bwd(ref, batch), _fwd_bwd(part, batch))
            finally:
                cross_layer.ForwardCarry.complete = saved
        link_layers(part, enabled=False)


def _mixed_and_negative(res: dict[str, Any]) -> None:
    """2-nanobatch forward with a 1-nanobatch backward; and a broken communicator (must differ)."""
    from kareus_megatron.runtime.overlap import LayerSettings, setup_overlap

    ref, part = _models(False)
    batch = _batch(7)
    base = _fwd_bwd(ref, batch)
    engine = setup_overlap(trace=True, settings=LayerSettings(nanobatches=2))
    got = _fwd_bwd(part, batch, before_bwd=lambda: engine.state.set(LayerSettings(nanobatches=1, kind="backward")))
    res["mixed.fwd2.bwd1"] = {**_compare(base, got), "events": engine.tracer.events}

    # no leak when no backward runs (forward under grad, output dropped): every LayerRun is freed by
    # reference counting alone (a cycle through autograd nodes would survive until never)
    import gc

    from kareus_megatron.runtime.overlap.schedule import LayerRun

    gc.collect()
    gc.disable()
    try:
        for _ in range(3):
            logits = part(*batch)
            del logits
        res["leak.live_runs"] = sum(isinstance(o, LayerRun) for o in gc.get_objects())
    finally:
        gc.enable()

    engine = setup_overlap(settings=LayerSettings(nanobatches=2))
    engine.comm.all_reduce = lambda t, sms, group=None: (type("Done", (), {"wait": lambda self: None})(), False)
    res["negative.no_allreduce"] = _compare(base, _fwd_bwd(part, batch))


def _refusals(res: dict[str, Any]) -> None:
    """Configurations the engine does not run are refused when the layer is built, in one line."""
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from kareus_megatron.errors import InfeasibleConfigError
    from kareus_megatron.runtime.overlap import get_partitioned_gpt_layer_spec

    base = dict(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        use_cpu_initialization=True,
        tensor_model_parallel_size=2,
    )
    for tag, extra in (
        ("selective", dict(recompute_granularity="selective", recompute_modules=["core_attn", "mlp"])),
        ("selective_core_attn", dict(recompute_granularity="selective")),
    ):  # SP runs: test_overlap_sp.py
        try:
            build_module(get_partitioned_gpt_layer_spec(), config=TransformerConfig(**base, **extra), layer_number=1)
            res[f"refuse.{tag}"] = None
        except InfeasibleConfigError as e:
            res[f"refuse.{tag}"] = str(e)


def _ddp_scenarios(res: dict[str, Any]) -> None:
    """megatron DDP (overlap_grad_reduce=True: its hooks assert one gradient per parameter) + schedule."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from kareus_megatron.runtime.overlap import LayerSettings, set_engine, setup_overlap

    setup_overlap(settings=LayerSettings(nanobatches=2, knobs={}))
    m = 3
    for recompute in (False, True):
        out = []
        for model in _models(recompute):
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
            out.append(
                ({k: p.main_grad.clone() for k, p in model.named_parameters()}, [float(d["loss"]) for d in losses])
            )
            cfg.no_sync_func = cfg.finalize_model_grads_func = None
        (g0, l0), (g1, l1) = out
        res[f"ddp.rc{int(recompute)}"] = {
            "losses": [l0, l1],
            "grads": max(_rel_diff(g1[k], g0[k]) for k in g0),
            "grad_norm": float(sum(float(g.norm()) for g in g0.values())),
        }
    set_engine(None)


class _Session:
    """Minimal session for the runtime patch: validates the plan against the live run, nothing else."""

    def validate(self, plan, live, source):
        from kareus_megatron.runtime.frameworks.megatron_patch import validate_plan

        validate_plan(plan, live, source=source)

    def iteration_begins(self, it): ...
    def iteration_ends(self, it): ...
    def instruction_ends(self): ...
    def training_failed(self): ...

    def instruction_callables(self):
        return None, self.instruction_ends

    def iteration_callables(self):
        return self.iteration_begins, self.iteration_ends


def _order(pp: int, rank: int, m: int) -> list[tuple[str, int]]:
    """megatron-core's 1F1B order on pipeline rank `rank` (no pipelining when pp == 1: F0 B0 F1 B1 ...)."""
    warm = min(pp - rank - 1, m)
    out = [("forward", i) for i in range(warm)]
    for i in range(m - warm):
        out += [("forward", warm + i), ("backward", i)]
    return out + [("backward", i) for i in range(m - warm, m)]


def _plan(m: int, recompute: bool, pp: int = 1, num_layers: int = 2, cross_layer: bool = False):
    from kareus_megatron.plan.schema import Instruction, ModelShape, ParallelLayout, Plan, Predicted, StagePlan

    stages = []
    for r in range(pp):
        instrs = []
        for kind, mb in _order(pp, r, m):
            names = ("fwd_attn", "fwd_mlp") if kind == "forward" else ("fwd_attn", "fwd_mlp", "bwd_mlp", "bwd_attn")
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
        ),
        predicted=Predicted(iteration_time_s=0.1, iteration_energy_j=10.0),
        stages=tuple(stages),
        cross_layer=True if cross_layer else None,
    )


def _train(model, m: int, iters: int) -> tuple[list[list[float]], dict[str, torch.Tensor]]:
    """Losses (last stage; [] elsewhere) of `iters` SGD steps, and the last step's gradients."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses, grads = [], {}
    for it in range(iters):
        batches = iter([_batch(100 * it + k) for k in range(m)])

        def step(data_iter, mdl):
            tokens, pos, mask = next(data_iter)
            out = mdl(tokens, pos, mask, labels=tokens)
            return out, lambda o: (o.float().mean(), {"loss": o.float().mean().detach()})

        opt.zero_grad(set_to_none=True)
        out = get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=batches,
            model=model,
            num_microbatches=m,
            seq_length=SEQ,
            micro_batch_size=MBS,
        )
        grads = {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}
        opt.step()
        losses.append([float(d["loss"]) for d in out])
    return losses, grads


def _training_steps(
    res: dict[str, Any], outdir: str, pp: int = 1, m: int = 2, recomputes=(False, True), cross_layer: bool = False
) -> None:
    """Real megatron-core schedule + runtime patch + plan: losses and grads vs the standard layer (`cross_layer`:
    a cross-layer plan on 3 layers, 2 per stage with PP, recompute in one group of 3)."""
    from megatron.core import parallel_state as ps

    from kareus_megatron.runtime.frameworks import megatron_patch
    from kareus_megatron.runtime.overlap import set_engine, setup_overlap

    for recompute in recomputes:
        layers = (3 if pp == 1 else 2 * pp) if cross_layer else 2
        ref, part = _models(recompute, pp=pp, num_layers=layers, recompute_num_layers=3 if cross_layer else 1)
        base, base_grads = _train(ref, m, 2)
        plan = _plan(m, recompute, pp, num_layers=layers, cross_layer=cross_layer)
        from kareus_megatron.errors import PlanMismatchError
        from kareus_megatron.runtime.overlap import check_model_for_plan

        try:
            check_model_for_plan(ref, plan)
            refused = False
        except PlanMismatchError:
            refused = True
        engine = setup_overlap(plan, trace=True)
        partitioned = check_model_for_plan(part, plan)  # as the session does before step 1 (links cross-layer)
        megatron_patch.install(plan, _Session())
        try:
            got, got_grads = _train(part, m, 2)
        finally:
            megatron_patch.uninstall()
            set_engine(None)
        diffs = {k: _rel_diff(got_grads[k], base_grads[k]) for k in base_grads}
        rank = ps.get_pipeline_model_parallel_rank()
        tag = f"train.{'cross.' if cross_layer else ''}pp{pp}.rc{int(recompute)}"
        engine.dump_trace(os.path.join(outdir, f"{tag}.trace.rank{dist.get_rank()}.json"), scenario=tag)
        res[tag] = {
            "losses_ref": base,
            "losses_part": got,
            "events": engine.tracer.events,
            "pp_rank": rank,
            "grads": max(diffs.values()),
            "n_grads": len(diffs),
            "grad_keys_equal": sorted(base_grads) == sorted(got_grads),
            "plan_knobs": [
                {k: v.model_dump() for k, v in i.partitions.items()} for i in plan.stages[rank].instructions
            ],
            "instructions_seen": engine.state.instructions_seen,
            "standard_model_refused": refused,
            "partitioned_layers": partitioned,
            "linked": sum(bool(getattr(mod, "feeds_next", False)) for mod in part.modules()),
        }


def _runtime_install(res: dict[str, Any]) -> None:
    """The public API alone (kareus_megatron.megatron.install) sets the overlap engine up from the plan."""
    import kareus_megatron.megatron as kareus
    from kareus_megatron.errors import PlanMismatchError
    from kareus_megatron.runtime import hooks
    from kareus_megatron.runtime.overlap import get_engine

    m = 2
    ref, part = _models(False)
    base, _ = _train(ref, m, 2)
    plan = _plan(m, False)
    kareus.install(plan, backend="simulated", controller="thread")
    try:
        got, _ = _train(part, m, 2)
        engine = get_engine()
        seen = engine.state.instructions_seen
        listening = hooks.is_registered(engine.state.on_instruction)
    finally:
        kareus.uninstall()
    released = not hooks.is_registered(engine.state.on_instruction)
    kareus.install(plan, backend="simulated", controller="thread")
    try:
        _train(ref, m, 1)
        refused = ""
    except PlanMismatchError as e:
        refused = str(e)
    finally:
        kareus.uninstall()
    res["runtime_install"] = {
        "losses_ref": base,
        "losses_part": got,
        "instructions_seen": seen,
        "listening": listening,
        "released": released,
        "refused": refused,
    }


def worker(rank: int, world: int, port: int, outdir: str) -> None:
    """TP=2 (2 ranks): every layer scenario, then training steps without pipelining."""
    _setup(rank, world, port)
    res: dict[str, Any] = {}
    _layer_scenarios(res)
    _cross_layer_scenarios(res)
    _mixed_and_negative(res)
    _refusals(res)
    _ddp_scenarios(res)
    _training_steps(res, outdir)
    _training_steps(res, outdir, cross_layer=True)
    _runtime_install(res)
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


def _interleaved(res: dict[str, Any]) -> None:
    """TP=2 x PP=2 x VP=2 interleaved 1F1B (batch_p2p_comm=False, see the CPU notes): 2 nanobatches."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.transformer_config import TransformerConfig

    from kareus_megatron.runtime.overlap import (
        Knobs,
        LayerSettings,
        get_partitioned_gpt_layer_spec,
        set_engine,
        setup_overlap,
    )

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=2, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2
    )
    cfg = TransformerConfig(
        num_layers=4,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        virtual_pipeline_model_parallel_size=2,
        pipeline_dtype=torch.float32,
        batch_p2p_comm=False,
    )

    def chunks(spec):
        torch.manual_seed(99)
        return [
            GPTModel(
                cfg,
                spec,
                vocab_size=VOCAB,
                max_sequence_length=SEQ,
                vp_stage=c,
                pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=c),
                post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=c),
            )
            for c in range(2)
        ]

    m, out = 4, []
    knobs = {p: Knobs(4, TP_PARTITION_SLOTS[p][-1]) for p in TP_PARTITION_SLOTS}
    engine = setup_overlap(trace=True, settings=LayerSettings(nanobatches=2, knobs=knobs))
    for model in (chunks(get_gpt_layer_local_spec()), chunks(get_partitioned_gpt_layer_spec())):

        def step(data_iter, mdl):
            tokens, pos, mask = next(data_iter)
            o = mdl(tokens, pos, mask, labels=tokens)
            return o, lambda o: (o.float().mean(), {"loss": o.float().mean().detach()})

        losses = get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=[iter([_batch(200 + k) for k in range(m)]) for _ in range(2)],
            model=model,
            num_microbatches=m,
            seq_length=SEQ,
            micro_batch_size=MBS,
        )
        out.append(
            (
                [float(d["loss"]) for d in losses],
                {f"{c}.{k}": p.grad.clone() for c, ch in enumerate(model) for k, p in ch.named_parameters()},
            )
        )
    (l0, g0), (l1, g1) = out
    res["train.vp2"] = {
        "losses": [l0, l1],
        "grads": max(_rel_diff(g1[k], g0[k]) for k in g0),
        "n_grads": len(g0),
        "events": engine.tracer.events,
    }
    set_engine(None)


def worker_pp(rank: int, world: int, port: int, outdir: str) -> None:
    """TP=2 x PP=2 (4 ranks): 1F1B training steps with the runtime patch; interleaved VP=2."""
    _setup(rank, world, port, pp=2)
    res: dict[str, Any] = {}
    _training_steps(res, outdir, pp=2, m=4, recomputes=(False,))
    _training_steps(res, outdir, pp=2, m=4, recomputes=(False,), cross_layer=True)  # 2 layers per stage
    _interleaved(res)
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()

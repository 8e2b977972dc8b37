"""CPU benchmark: with a slow TP link, 2 nanobatches make a layer's forward+backward faster than 1.

Two processes (gloo, TP=2) run one megatron-core partitioned transformer layer, forward and backward,
with every TP all-reduce slowed by a fixed delay (``--delay-ms``, emulating a slow link: the
collective runs in issue order on a helper thread that sleeps, then reduces). With 1 nanobatch each
collective is exposed; with 2 the engine issues it while the other nanobatch computes, so the wall
time drops if the overlap is real (a mere reordering would not change it). A second delay model
scales the delay with the bytes reduced (a bandwidth-bound link: a nanobatch's collective is half as
long), as on real links; with a fixed delay 2 nanobatches pay it twice as often. Printed: median wall
time (ms) per forward+backward for 1 and 2 nanobatches, for no delay and each delay model, and the
savings. Figures are noisy on a shared 2-core machine; run it alone.

With ``--sp`` the layer runs sequence parallelism (input and output split along the sequence; the TP
collectives are all-gathers and reduce-scatters, each slowed the same way; 8 per forward+backward with 1
nanobatch instead of 4 all-reduces).

The layer's core attention is ``--core-attention sdpa`` (default: torch's scaled_dot_product_attention,
its math path on a CPU) or ``local`` (megatron's unfused DotProductAttention); a last line times the core
attention op alone (forward+backward, one rank's heads) with each.

With ``--cp`` the layer runs context parallelism instead (CP=2, TP=1; each rank holds 2 of the 4
load-balanced sequence chunks, megatron's ``get_batch_on_this_cp_rank`` layout, and the CP-sliced causal
mask). Its collectives are the K/V all-gather (forward) and the dK/dV reduce-scatter (backward) over the CP
group, 2 per forward+backward with 1 nanobatch, each slowed the same way (per-byte model: the whole
microbatch's K and V, twice the activation bytes); the TP all-reduces are no-ops on one rank. CP needs
``--core-attention sdpa``, and the attention-op line is left out. A traced run (2 nanobatches, fixed delay)
then checks that each CP collective was issued at its planned slot (``trace.overlap_violations``).

With ``--cross-layer`` (with or without ``--sp``) a stack of ``--layers`` layers (megatron's TransformerBlock,
default 4) runs instead, and a third column adds cross-layer overlap (runtime/overlap/cross_layer.py: each
layer's last collective beside the next layer's first unit, forward and backward), so that only the stack's last
collective stays exposed. A traced run (fixed delay) then checks each collective's planned slot, carried
ones included.

    python benchmarks/overlap_cpu.py [--delay-ms 15] [--hidden 512] [--seq 256] [--mbs 8] [--reps 7] [--sp | --cp]
                                     [--core-attention sdpa|local] [--cross-layer [--layers 4]]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _layer(args: argparse.Namespace):
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from kareus_megatron.runtime.overlap import get_partitioned_gpt_layer_spec

    cfg = TransformerConfig(
        num_layers=args.layers if args.cross_layer else 1,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=1 if args.cp else 2,
        sequence_parallel=args.sp,
        context_parallel_size=2 if args.cp else 1,
    )
    if args.sp:
        _sp_capable_torch_norm()
    torch.manual_seed(0)
    spec = get_partitioned_gpt_layer_spec(core_attention=args.core_attention)
    if args.cross_layer:  # a block of layers, linked for cross-layer overlap; called as block(x, mask) -> y
        from megatron.core.transformer.transformer_block import TransformerBlock

        from kareus_megatron.runtime.overlap.layer import link_layers

        block = TransformerBlock(cfg, spec, post_layer_norm=False)
        link_layers(block)
        return lambda x, attention_mask: (block(x, attention_mask), None), block
    layer = build_module(spec, config=cfg, layer_number=1)
    return layer, layer


def _sp_capable_torch_norm() -> None:
    """Let megatron's torch-norm fallback (no Apex/TE on CPU) run with sequence parallelism: it asserts
    ``not sequence_parallel`` (torch_norm.py, 0.16.1) only because it does not mark its parameters for the
    SP grad all-reduce, as Apex's FusedLayerNorm does; this stand-in marks them (benchmark only)."""
    from megatron.core.transformer import torch_norm

    def new(cls, config, hidden_size, eps=1e-5):
        norm_cls = torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm
        norm = norm_cls(hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = config.sequence_parallel
        return norm

    torch_norm.WrappedTorchNorm.__new__ = new


def _worker(rank: int, store: str, args: argparse.Namespace, out: dict) -> None:
    """One of the 2 ranks; `store`: the rendezvous file (no TCP port to race for on a busy machine)."""
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mrandom

    # CPU: attention forks megatron's CUDA RNG tracker (the inference tracker's fork is a no-op) and
    # takes a scratch buffer on torch.cuda.current_device().
    mrandom.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    if not torch.cuda.is_available():
        torch.cuda.current_device = lambda: torch.device("cpu")
    ps.initialize_model_parallel(
        tensor_model_parallel_size=1 if args.cp else 2, context_parallel_size=2 if args.cp else 1
    )
    from kareus_megatron.runtime.overlap import LayerSettings, set_engine, setup_overlap

    layer, module = _layer(args)
    g = torch.Generator().manual_seed(1)
    s_local = args.seq // 2 if args.sp or args.cp else args.seq  # SP, CP: this rank's half of the sequence
    x = torch.randn(s_local, args.mbs, args.hidden, generator=g).requires_grad_()
    dy = torch.randn(s_local, args.mbs, args.hidden, generator=g)
    mask = torch.triu(torch.ones(args.seq, args.seq, dtype=torch.bool), 1).view(1, 1, args.seq, args.seq)
    # one all-reduce of the whole microbatch's activations (SP: the gathered output / scattered input)
    full_bytes = args.seq * args.mbs * args.hidden * x.element_size()
    if args.cp:  # this rank's query rows of the mask; the K/V collective moves K and V (num_query_groups = heads)
        from megatron.core.utils import get_batch_on_this_cp_rank

        mask = get_batch_on_this_cp_rank({"attention_mask": mask})["attention_mask"]
        full_bytes *= 2
    delays = {
        "none": (0.0, 0.0),
        "fixed": (args.delay_ms / 1e3, 0.0),
        "per-byte": (0.0, args.delay_ms / 1e3 / full_bytes),
    }
    configs = [(d, n) for d in delays for n in ((1, 2, "2x") if args.cross_layer else (1, 2))]  # 2x: cross-layer
    engines = {
        c: setup_overlap(
            settings=LayerSettings(nanobatches=2 if c[1] == "2x" else c[1], cross_layer=c[1] == "2x"),
            delay_s=delays[c[0]][0],
            delay_s_per_byte=delays[c[0]][1],
        )
        for c in configs
    }
    times: dict[tuple[str, int], list[float]] = {c: [] for c in configs}
    for rep in range(args.reps + 1):  # configurations interleaved, so load drift hits all alike
        for c in configs:
            set_engine(engines[c])
            dist.barrier()
            t0 = time.perf_counter()
            y, _ = layer(x, attention_mask=mask)
            y.backward(dy)
            if rep:  # the first round is warm-up
                times[c].append(time.perf_counter() - t0)
            x.grad = None
            module.zero_grad(set_to_none=True)
    set_engine(None)
    results = {c: statistics.median(t) * 1e3 for c, t in times.items()}
    if args.cp or args.cross_layer:
        out.update(_trace_check(rank, layer, x, dy, mask, delays["fixed"][0], args.cross_layer))
        attn = {}
    else:
        from overlap_gpu import attention_op_times  # benchmarks/ is on sys.path (this script's folder)

        attn = attention_op_times(layer.config, args.seq, args.mbs, torch.device("cpu"), torch.float32, args.reps)
    if rank == 0:
        out.update({f"{d}|{n}": v for (d, n), v in results.items()})
        out.update({f"attn|{k}": v * 1e3 for k, v in attn.items()})
    dist.barrier()
    dist.destroy_process_group()


def _trace_check(rank: int, layer, x, dy, mask, delay_s: float, cross_layer: bool) -> dict[str, object]:
    """One traced forward+backward (2 nanobatches, fixed delay): this rank's CP collectives issued (with
    `cross_layer`: the last all-reduces carried into the next layer's call), and the overlap violations of the
    whole trace (a collective not issued before its planned slot's op of the other nanobatch, or with no op of
    it before its wait)."""
    from kareus_megatron.runtime.overlap import LayerSettings, overlap_violations, set_engine, setup_overlap

    engine = setup_overlap(settings=LayerSettings(nanobatches=2, cross_layer=cross_layer), trace=True, delay_s=delay_s)
    y, _ = layer(x, attention_mask=mask)
    y.backward(dy)
    set_engine(None)
    engine.comm.close()
    events = engine.tracer.events
    if cross_layer:  # issued in a later layer's call than the one that produced it
        issued = [
            e
            for e in events  # a collective is named L<layer>.<phase>.<segment>.nb<k>
            if e["kind"] == "issue" and int(e["coll"][1:].split(".", 1)[0]) != e["layer"]
        ]
    else:
        issued = [
            e for e in events if e["kind"] == "issue" and e["collective"] in ("cp_all_gather", "cp_reduce_scatter")
        ]
    return {
        f"trace|{rank}|issued": len(issued),
        f"trace|{rank}|slots": ", ".join(sorted({f"{e['partition']}@{e['slot']}" for e in issued})),
        f"trace|{rank}|violations": "; ".join(overlap_violations(events)),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--delay-ms",
        type=float,
        default=15.0,
        help="delay of an all-reduce (ms): fixed, or of a whole-microbatch one in the per-byte model",
    )
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--mbs", type=int, default=8, help="micro-batch size (split into 2 nanobatches)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument(
        "--core-attention",
        default="sdpa",
        choices=("sdpa", "local"),
        help="core attention of the layer: torch SDPA (default) or megatron's unfused one",
    )
    ap.add_argument("--sp", action="store_true", help="sequence parallelism (all-gather / reduce-scatter)")
    ap.add_argument(
        "--cp", action="store_true", help="context parallelism CP=2, TP=1 (K/V all-gather, dK/dV reduce-scatter)"
    )
    ap.add_argument(
        "--cross-layer",
        action="store_true",
        help="a stack of --layers layers, with a third column: 2 nanobatches with cross-layer overlap",
    )
    ap.add_argument("--layers", type=int, default=4, help="layers of the --cross-layer stack")
    args = ap.parse_args(argv)
    if args.cross_layer and args.cp:
        ap.error("--cross-layer runs without context parallelism only (not with --cp)")
    if args.cross_layer and args.layers < 2:
        ap.error("--layers must be at least 2 with --cross-layer")
    if args.cp and args.sp:
        ap.error("--cp and --sp: the partitioned layer does not run CP with sequence parallelism")
    if args.cp and args.core_attention != "sdpa":
        ap.error("--cp needs --core-attention sdpa (the CP attention runs on SDPA)")
    with mp.Manager() as mgr, tempfile.TemporaryDirectory() as tmp:
        out = mgr.dict()
        mp.spawn(_worker, args=(os.path.join(tmp, "store"), args, out), nprocs=2, join=True)
        res = {tuple(k.split("|")): v for k, v in out.items()}
    if args.cp:
        return _print_cp(args, res)
    if args.cross_layer:
        return _print_cross(args, res)
    print(
        f"partitioned layer fwd+bwd, gloo TP=2{'+SP' if args.sp else ''}, hidden {args.hidden}, seq {args.seq}, "
        f"mbs {args.mbs}, "
        f"{args.threads} thread(s)/rank, {args.core_attention} core attention, median of {args.reps} "
        "(noisy on a shared machine)"
    )
    print(f"{'all-reduce delay':>26} {'1 nanobatch (ms)':>17} {'2 nanobatches (ms)':>19} {'saved (ms)':>11}")
    labels = _delay_labels(args)
    for d in ("none", "fixed", "per-byte"):
        t1, t2 = res[(d, "1")], res[(d, "2")]
        print(f"{labels[d]:>26} {t1:>17.1f} {t2:>19.1f} {t1 - t2:>11.1f}")
    la, sa = res[("attn", "local")], res[("attn", "sdpa")]
    print(
        f"core attention op alone (fwd+bwd, {args.heads // 2} heads/rank): local (unfused) {la:.1f} ms, "
        f"sdpa {sa:.1f} ms ({la / sa:.2f}x)"
    )
    t1, t2 = res[("fixed", "1")], res[("fixed", "2")]
    n_colls = 8 if args.sp else 4
    print(
        f"fixed delay: 1 nanobatch exposes {n_colls} delays ({n_colls * args.delay_ms:g} ms); 2 nanobatches save "
        f"{t1 - t2:.1f} ms ({(t1 - t2) / t1:.0%})"
    )
    print("OVERLAP REAL" if t2 < t1 else "NO GAIN (2 nanobatches not faster with the fixed delay)")
    return 0


def _delay_labels(args: argparse.Namespace) -> dict[str, str]:
    return {"none": "none", "fixed": f"fixed {args.delay_ms:g} ms", "per-byte": f"{args.delay_ms:g} ms per microbatch"}


def _print_traces(res: dict, what: str) -> list[str]:
    """Print each rank's traced collectives (`what`: how they are counted); return the overlap violations found."""
    bad = []
    for r in (0, 1):
        v = res[("trace", str(r), "violations")]
        print(
            f"trace rank {r}: {res[('trace', str(r), 'issued')]} {what} "
            f"(partition@slot: {res[('trace', str(r), 'slots')]}), overlap violations: {v or 'none'}"
        )
        bad += [v] if v else []
    return bad


def _print_cp(args: argparse.Namespace, res: dict) -> int:
    print(
        f"partitioned layer fwd+bwd, gloo CP=2 (TP=1), hidden {args.hidden}, seq {args.seq} ({args.seq // 2} "
        f"per rank), mbs {args.mbs}, {args.threads} thread(s)/rank, sdpa core attention, median of {args.reps} "
        "(noisy on a shared machine)"
    )
    print(f"{'K/V collective delay':>26} {'1 nanobatch (ms)':>17} {'2 nanobatches (ms)':>19} {'saved (ms)':>11}")
    labels = _delay_labels(args)
    for d in ("none", "fixed", "per-byte"):
        t1, t2 = res[(d, "1")], res[(d, "2")]
        print(f"{labels[d]:>26} {t1:>17.1f} {t2:>19.1f} {t1 - t2:>11.1f} ({(t1 - t2) / t1:.0%})")
    bad = _print_traces(res, "CP collectives issued")
    t1, t2 = res[("per-byte", "1")], res[("per-byte", "2")]
    print(
        "OVERLAP REAL"
        if t2 < t1 and not bad
        else "NO GAIN (2 nanobatches not faster with the per-byte delay, or the trace breaks the plan)"
    )
    return 0


def _print_cross(args: argparse.Namespace, res: dict) -> int:
    print(
        f"{args.layers} partitioned layers (TransformerBlock) fwd+bwd, gloo TP=2{'+SP' if args.sp else ''}, "
        f"hidden {args.hidden}, seq "
        f"{args.seq}, mbs {args.mbs}, {args.threads} thread(s)/rank, {args.core_attention} core attention, "
        f"median of {args.reps} (noisy on a shared machine)"
    )
    print(
        f"{'collective delay':>26} {'1 nb (ms)':>10} {'2 nb (ms)':>10} {'2 nb + cross-layer (ms)':>24} "
        f"{'cross-layer saved (ms)':>23}"
    )
    labels = _delay_labels(args)
    for d in ("none", "fixed", "per-byte"):
        t1, t2, tx = res[(d, "1")], res[(d, "2")], res[(d, "2x")]
        print(f"{labels[d]:>26} {t1:>10.1f} {t2:>10.1f} {tx:>24.1f} {t2 - tx:>16.1f} ({(t2 - tx) / t2:.0%})")
    bad = _print_traces(res, "collectives issued in the next layer's call")
    t2, tx = res[("fixed", "2")], res[("fixed", "2x")]
    print(
        f"fixed delay: cross-layer overlap hides up to {2 * (args.layers - 1)} more delays per forward+backward "
        f"({2 * (args.layers - 1) * args.delay_ms:g} ms); saved {t2 - tx:.1f} ms"
    )
    print(
        "CROSS-LAYER REAL"
        if tx < t2 and not bad
        else "NO GAIN (cross-layer not faster with the fixed delay, or the trace breaks the plan)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

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

    python benchmarks/overlap_cpu.py [--delay-ms 15] [--hidden 512] [--seq 256] [--mbs 8] [--reps 7]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _layer(args: argparse.Namespace):
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from kareus_megatron.runtime.overlap import get_partitioned_gpt_layer_spec

    cfg = TransformerConfig(
        num_layers=1, hidden_size=args.hidden, num_attention_heads=args.heads, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=2,
    )
    torch.manual_seed(0)
    return build_module(get_partitioned_gpt_layer_spec(), config=cfg, layer_number=1)


def _worker(rank: int, port: int, args: argparse.Namespace, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mrandom

    # CPU: attention forks megatron's CUDA RNG tracker (the inference tracker's fork is a no-op) and
    # takes a scratch buffer on torch.cuda.current_device().
    mrandom.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    if not torch.cuda.is_available():
        torch.cuda.current_device = lambda: torch.device("cpu")
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    from kareus_megatron.runtime.overlap import LayerSettings, set_engine, setup_overlap

    layer = _layer(args)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.seq, args.mbs, args.hidden, generator=g).requires_grad_()
    dy = torch.randn(args.seq, args.mbs, args.hidden, generator=g)
    mask = torch.triu(torch.ones(args.seq, args.seq, dtype=torch.bool), 1).view(1, 1, args.seq, args.seq)
    full_bytes = x.numel() * x.element_size()  # one all-reduce of the whole microbatch's activations
    delays = {"none": (0.0, 0.0), "fixed": (args.delay_ms / 1e3, 0.0),
              "per-byte": (0.0, args.delay_ms / 1e3 / full_bytes)}
    configs = [(d, n) for d in delays for n in (1, 2)]
    engines = {c: setup_overlap(settings=LayerSettings(nanobatches=c[1]), delay_s=delays[c[0]][0],
                                delay_s_per_byte=delays[c[0]][1]) for c in configs}
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
            layer.zero_grad(set_to_none=True)
    set_engine(None)
    results = {c: statistics.median(t) * 1e3 for c, t in times.items()}
    if rank == 0:
        out.update({f"{d}|{n}": v for (d, n), v in results.items()})
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--delay-ms", type=float, default=15.0,
                    help="delay of an all-reduce (ms): fixed, or of a whole-microbatch one in the per-byte model")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--mbs", type=int, default=8, help="micro-batch size (split into 2 nanobatches)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = ap.parse_args(argv)
    with mp.Manager() as mgr:
        out = mgr.dict()
        mp.spawn(_worker, args=(_free_port(), args, out), nprocs=2, join=True)
        res = {tuple(k.split("|")): v for k, v in out.items()}
    print(f"partitioned layer fwd+bwd, gloo TP=2, hidden {args.hidden}, seq {args.seq}, mbs {args.mbs}, "
          f"{args.threads} thread(s)/rank, median of {args.reps} (noisy on a shared machine)")
    print(f"{'all-reduce delay':>26} {'1 nanobatch (ms)':>17} {'2 nanobatches (ms)':>19} {'saved (ms)':>11}")
    labels = {"none": "none", "fixed": f"fixed {args.delay_ms:g} ms",
              "per-byte": f"{args.delay_ms:g} ms per microbatch"}
    for d in ("none", "fixed", "per-byte"):
        t1, t2 = res[(d, "1")], res[(d, "2")]
        print(f"{labels[d]:>26} {t1:>17.1f} {t2:>19.1f} {t1 - t2:>11.1f}")
    t1, t2 = res[("fixed", "1")], res[("fixed", "2")]
    print(f"fixed delay: 1 nanobatch exposes 4 delays ({4 * args.delay_ms:g} ms); 2 nanobatches save "
          f"{t1 - t2:.1f} ms ({(t1 - t2) / t1:.0%})")
    print("OVERLAP REAL" if t2 < t1 else "NO GAIN (2 nanobatches not faster with the fixed delay)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Benchmark: every per-instruction option of the reference configuration, all clocks and partitions.

llama3.2-3b on a100-sxm4-40gb, TP=8, PP=2 (15 + 13 layers), MBS=8, seq 4096, full recompute,
2 nodes × 8 GPUs; default clock grid (1410 → 870 MHz every 30 MHz, 19 clocks); every partition's comm
SMs (3–30 step 3, plus NCCL's default 24) × launch slot. Prints the wall time of building the options
of all four methods from a cold start (the knob tables are shared between methods, as in `kareus plan`)
and of the joint method alone, and the peak memory (tracemalloc: Python/numpy allocations of the
computation; ru_maxrss: the whole process). Target: ≤ 1 s and ≤ 500 MB on a 2-core machine.

Run: python benchmarks/search_options.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
import tracemalloc

from kareus_megatron.cost.kernel import KernelModel
from kareus_megatron.hardware.gpus import gpu_spec
from kareus_megatron.search import options as opt
from kareus_megatron.workload.models import model_spec
from kareus_megatron.workload.parallel import make_parallel


def _config():
    gpu, model = gpu_spec("a100-sxm4-40gb"), model_spec("llama3.2-3b")
    par = make_parallel(
        model,
        tp=8,
        pp=2,
        micro_batch_size=8,
        seq_length=4096,
        num_microbatches=8,
        recompute="full",
        nodes=2,
        gpus_per_node=8,
        first_stage_layers=15,
        last_stage_layers=13,
    )
    return gpu, model, par


def _build(methods):
    gpu, model, par = _config()
    opt._CACHE.clear()  # cold: knob tables recomputed
    kernel = KernelModel(gpu)
    return {m: opt.build_options(gpu, model, par, kernel, m) for m in methods}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    _build(opt.OPTION_METHODS)  # warm imports and caches of numpy itself
    runs = {}
    for label, methods in (("all four methods", opt.OPTION_METHODS), ("kareus only", ("kareus",))):
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            result = _build(methods)
            times.append(time.perf_counter() - t0)
        runs[label] = (times, result)
    tracemalloc.start()
    result = _build(opt.OPTION_METHODS)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    gpu, _, _ = _config()
    print(
        "search_options: llama3.2-3b, a100-sxm4-40gb, TP=8 PP=2 MBS=8 seq=4096, 2x8 GPUs, "
        f"{len(gpu.clock_grid_mhz())} clocks"
    )
    for label, (times, _) in runs.items():
        print(
            f"  {label:17s} wall time: median {statistics.median(times):.3f} s, min {min(times):.3f} s "
            f"({args.repeat} runs)"
        )
    print(f"  peak memory: {peak / 2**20:.1f} MiB traced (computation), {rss_mb:.0f} MiB max RSS (process)")
    for m, opts in result.items():
        sizes = ", ".join(f"{k[0]}/{k[2][0]}:{len(o)}" for k, o in opts.items())
        print(f"  {m:17s} options per instruction (stage/kind:count): {sizes}")
    print("  (timings on a shared 2-core machine are noisy)")


if __name__ == "__main__":
    main()

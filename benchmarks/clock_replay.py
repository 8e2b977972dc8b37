"""Clock replay (issue 23 item 9): can the clock controller apply a plan's clock changes at the GPU's latency?

Each plan's clock sequence, as its predicted timeline begins the instructions of every pipeline rank, goes through
the controller's own decision logic: runtime/clock/controller.py on a simulated GPU of the plan's preset whose
clock call takes the preset's clock_latency_ms, deciding on the simulated time line (timeline.py: a call issued
at the begin if the device is free, else when it becomes free; a begin still waiting when the next one begins is
skipped as stale; a call made more than half a latency after its begin counts late). ITERATIONS iterations per
rank, back to back (the wrap from the last instruction to the next iteration's first counts), after one
warm-up iteration that is not counted (its first call locks a clock from none).

*Applied in time* = (applied - late) / (applied + stale): of the clock changes the plan asks for, those the
controller makes within half a latency of their instruction's begin. Jobs:

- the default job (`kareus plan` defaults: llama3.2-3b, 2 × 8 A100-SXM4-40GB, TP=8 PP=2, MBS 8, seq 4096);
- Qwen3-1.7B, TP=8 PP=2, MBS 1, seq 2048, 8 microbatches on 2 × 8 H100 SXM (instructions of ~3-8 ms).

Each is planned twice: latency-aware (the preset's latency: segments >= 2 latencies, lag in the prediction) and as
before this change (--clock-latency-ms 0: the clock may change at every instruction). Rows: every chosen plan of
perseus and kareus (and nanobatch_perseus where it applies); columns: plans, clock changes per rank-iteration,
applied in time (worst plan and mean), stale and late counts, the share of busy time in clock segments < 10 ms
(worst stage of any plan), and the kareus iso-time energy reduction against Perseus.

Run: .venv/bin/python benchmarks/clock_replay.py [--quick] [--json FILE]   (--quick: the Qwen3 job only)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from kareus_megatron.cost import KernelModel
from kareus_megatron.hardware.device import simulation_of
from kareus_megatron.hardware.device.sim import SimulatedGPU
from kareus_megatron.hardware.gpus import gpu_spec
from kareus_megatron.plan.frontier import reductions
from kareus_megatron.runtime.clock.controller import ClockController
from kareus_megatron.runtime.clock.wire import begin_record, encode_records
from kareus_megatron.search.planner import plan_methods, simulate_plan
from kareus_megatron.search.segments import ClockLatency, short_segment_share
from kareus_megatron.vocab import KAREUS, NANOBATCH_PERSEUS, PERSEUS
from kareus_megatron.workload.models import model_spec
from kareus_megatron.workload.parallel import make_parallel

ITERATIONS = 3
SHORT_S = 0.010
CLOCK_METHODS = (PERSEUS, NANOBATCH_PERSEUS, KAREUS)


def jobs(quick: bool) -> list[tuple[str, Any, Any, Any]]:
    """(name, GPU, model, layout) of each job replayed."""
    out = []
    if not quick:
        m = model_spec("llama3.2-3b")
        out.append(
            (
                "default job (llama3.2-3b, A100-40GB)",
                gpu_spec("a100-sxm4-40gb"),
                m,
                make_parallel(
                    m,
                    tp=8,
                    pp=2,
                    micro_batch_size=8,
                    seq_length=4096,
                    num_microbatches=8,
                    recompute="full",
                    first_stage_layers=15,
                    last_stage_layers=13,
                    nodes=2,
                    gpus_per_node=8,
                ),
            )
        )
    q = model_spec("qwen3-1.7b")
    out.append(
        (
            "Qwen3-1.7B TP=8 PP=2 MBS 1 (H100)",
            gpu_spec("h100-sxm5-80gb"),
            q,
            make_parallel(
                q,
                tp=8,
                pp=2,
                micro_batch_size=1,
                seq_length=2048,
                num_microbatches=8,
                recompute="full",
                nodes=2,
                gpus_per_node=8,
            ),
        )
    )
    return out


def replay(result: Any, method: str, index: int, latency_s: float) -> dict[str, Any]:
    """One plan's clock sequence through one controller per rank (simulated GPU, `latency_s` per call)."""
    sim, timed = simulate_plan(result, method, index)
    opts = result.methods[method].options
    counts = {"applied": 0, "late": 0, "stale": 0, "unchanged": 0, "errors": 0}
    short = 0.0
    t0 = time.monotonic() - 3600.0  # records "long after the fact": the time line decides at their own times
    for rank in range(result.par.pp):
        mine = [t for t in timed if t.rank == rank]
        clocks = [int(opts[(rank, t.key[2], t.key[0])].clock_mhz[t.option]) for t in mine]
        short = max(short, short_segment_share(clocks, [t.end_s - t.start_s for t in mine], SHORT_S))
        dev = SimulatedGPU(result.gpu, rank, log_path=None, latency_s=latency_s)
        ctl = ClockController(dev, lambda m: None, simulation=simulation_of(dev))
        if ctl.probe()["op"] != "ready":
            raise RuntimeError("the simulated GPU refused clock control")

        def records(its: range, mine: list[Any] = mine, clocks: list[int] = clocks) -> bytes:
            return encode_records(
                [
                    x
                    for it in its
                    for k, (t, mhz) in enumerate(zip(mine, clocks))
                    for x in begin_record(t0 + it * sim.time_s + t.start_s, it, k, mhz, t.key[0])
                ]
            )

        ctl.feed(records(range(1)))  # warm-up: the first clock is locked from none (the report skips warm-up too)
        before = dict(ctl.counts)
        ctl.feed(records(range(1, 1 + ITERATIONS)))
        for key in counts:
            counts[key] += ctl.counts[key] - before[key]
    asked = counts["applied"] + counts["stale"]
    return {
        **counts,
        "requested": asked,
        "in_time": 1.0 if not asked else (counts["applied"] - counts["late"]) / asked,
        "changes_per_rank_iteration": asked / (ITERATIONS * result.par.pp),
        "short_share": short,
    }


def run_job(name: str, gpu: Any, model: Any, par: Any, aware: bool) -> list[dict[str, Any]]:
    """The table rows of one job planned latency-aware (`aware`) or as before (changes at once)."""
    lat = None if aware else ClockLatency(0.0)
    t = time.perf_counter()
    result = plan_methods(
        gpu,
        model,
        par,
        KernelModel(gpu),
        points=10,
        clock_latency=lat,
        methods=[m for m in CLOCK_METHODS if m != NANOBATCH_PERSEUS or par.micro_batch_size % 2 == 0],
    )
    plan_s = time.perf_counter() - t
    red = reductions({m: list(zip(mf.time_s.tolist(), mf.energy_j.tolist())) for m, mf in result.methods.items()})
    rows = []
    for method in CLOCK_METHODS:
        if method not in result.methods:
            continue
        reps = [replay(result, method, i, gpu.clock_latency_s) for i in result.methods[method].chosen]
        rows.append(
            {
                "job": name,
                "planning": "latency-aware" if aware else "instant (before)",
                "method": method,
                "plans": len(reps),
                "plan_s": plan_s,
                "changes": sum(r["changes_per_rank_iteration"] for r in reps) / len(reps),
                "in_time_min": min(r["in_time"] for r in reps),
                "in_time_mean": sum(r["in_time"] for r in reps) / len(reps),
                "stale": sum(r["stale"] for r in reps),
                "late": sum(r["late"] for r in reps),
                "short_share_max": max(r["short_share"] for r in reps),
                "iso_time_energy": red[method]["iso_time_energy"],
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="the Qwen3-1.7B job only")
    p.add_argument("--json", type=Path, default=None, help="write the rows to this file")
    args = p.parse_args(argv)
    rows = []
    for name, gpu, model, par in jobs(args.quick):
        for aware in (False, True):
            rows.extend(run_job(name, gpu, model, par, aware))
    lat = {name: gpu.clock_latency_s for name, gpu, _m, _p in jobs(args.quick)}
    print(f"clock replay: {ITERATIONS} iterations per rank through the controller's decisions at the preset latency")
    head = (
        f"{'job':36s} {'planning':17s} {'method':18s} {'plans':>5s} {'chg/it':>7s} {'in time':>15s} "
        f"{'stale':>6s} {'late':>5s} {'<10ms':>6s} {'iso-T E':>8s}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        iso = "n/a" if r["iso_time_energy"] is None else f"{r['iso_time_energy'] * 100:.1f}%"
        print(
            f"{r['job']:36.36s} {r['planning']:17s} {r['method']:18s} {r['plans']:5d} {r['changes']:7.2f} "
            f"{r['in_time_min'] * 100:6.1f}% / {r['in_time_mean'] * 100:5.1f}% {r['stale']:6d} {r['late']:5d} "
            f"{r['short_share_max'] * 100:5.1f}% {iso:>8s}"
        )
    print(
        "in time: worst plan / mean over the chosen plans; <10ms: worst stage's busy share in clock segments "
        "< 10 ms; latency per job: " + ", ".join(f"{k.split(' (')[0]} {v * 1e3:g} ms" for k, v in lat.items())
    )
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Our pipeline frontier solver against lowtime 0.3.0 (Phillips–Dessouky, the Perseus reference solver).

Same input for both: the measured GPT-3 175B A100 stage profile (Perseus SOSP '24 artifact), S = 8 stages,
M microbatches, synchronous 1F1B (DeepSpeed TrainSchedule order, which is lowtime's), blocked power
83.64 W, lowtime time unit 1 ms. lowtime is driven the way the Perseus example drives it (facts from
ml-energy/lowtime examples/perseus.py: options' cost = energy, Pareto filter and time quantisation by
CandidateExecutionOptions, cost minus blocked power x quantised time, exponential fit, one solver
iteration per unit of time). Every iteration's discrete plan (the frequency each instruction was
assigned) and every plan of our frontier are scored by OUR event simulator, so both are judged alike.

Prints wall times and their ratio, then our and lowtime's best energy with T <= t at 20 evenly spaced
iteration times t over lowtime's range. Timings are wall-clock on a shared machine: expect noise.

    python benchmarks/solver_vs_lowtime.py            # M = 8, 16, 32 (the M = 32 lowtime run takes minutes)
    python benchmarks/solver_vs_lowtime.py --m 8      # quick
"""

from __future__ import annotations

import argparse
import csv
import logging
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from kareus_megatron.search.pipeline import build_dag
from kareus_megatron.search.schedules import instruction_order
from kareus_megatron.search.simulate import simulate_choice
from kareus_megatron.search.solver import solve_frontier

PROFILE = Path(__file__).resolve().parent / "data/perseus_sosp24/gpt3-175b+a100_sxm_bf16.csv"
P_BLOCKED_W = 83.64  # A100, measured by the Perseus authors (docs/sources.md#blocked-power)
UNIT_S = 0.001
STAGES = 8


def read_profile(path: Path) -> dict[tuple[int, str], list[tuple[int, float, float]]]:
    """(stage, instruction) -> [(frequency MHz, time s, energy J)] sorted by time."""
    out: dict[tuple[int, str], list[tuple[int, float, float]]] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            key = (int(row["stage"]), row["instruction"])
            out.setdefault(key, []).append((int(row["frequency"]), float(row["time"]), float(row["energy"])))
    return {k: sorted(v, key=lambda x: (x[1], -x[0])) for k, v in out.items()}


def our_options(prof, dag):
    opts, freq_index = [], []
    for s, kind, _, _ in dag.keys:
        rows = prof[(s, kind)]
        opts.append(SimpleNamespace(time_s=np.array([r[1] for r in rows]), energy_j=np.array([r[2] for r in rows])))
        freq_index.append({r[0]: i for i, r in enumerate(rows)})
    return opts, freq_index


def run_lowtime(prof, m: int, progress: bool) -> tuple[float, list[dict[tuple[int, str, int], int]]]:
    """Run lowtime to completion; return its wall time (s) and the frequency plan of every iteration."""
    import networkx as nx
    from lowtime.cost_model import ExponentialModel
    from lowtime.graph_utils import add_sink_node, add_source_node
    from lowtime.operation import CandidateExecutionOptions, ExecutionOption, OperationSpec
    from lowtime.perseus.instruction import Backward, Forward
    from lowtime.perseus.schedule import Synchronous1F1B
    from lowtime.solver import PhillipsDessouky

    t0 = time.perf_counter()
    specs: dict[int, dict[type, OperationSpec]] = {}
    for s in range(STAGES):
        specs[s] = {}
        for cls, kind in ((Forward, "forward"), (Backward, "backward")):
            opts = [ExecutionOption[int](real_time=t, unit_time=UNIT_S, cost=e, knob=f) for f, t, e in prof[(s, kind)]]
            cand = CandidateExecutionOptions[int](options=opts)
            for o in cand.options:  # effective energy: minus blocked power over the quantised time
                o.cost -= P_BLOCKED_W * o.quant_time * o.unit_time
            specs[s][cls] = OperationSpec[int](options=cand, cost_model=ExponentialModel(cand))
    dag = nx.DiGraph()
    node = 2
    by_key: dict[tuple[int, str, int], int] = {}
    for s in range(STAGES):
        prev = None
        for inst in Synchronous1F1B(num_stages=STAGES, num_micro_batches=m, stage_id=s, operation_spec_map=specs[s]):
            dag.add_node(node, op=inst)
            kind = "forward" if isinstance(inst, Forward) else "backward"
            by_key[(s, kind, inst.micro_batch_id)] = node
            if prev is not None:
                dag.add_edge(prev, node)
            prev, node = node, node + 1
    for (s, kind, mb), u in by_key.items():  # forward s -> s+1, backward s+1 -> s
        if kind == "forward" and s + 1 < STAGES:
            dag.add_edge(u, by_key[(s + 1, "forward", mb)])
        if kind == "backward" and s > 0:
            dag.add_edge(u, by_key[(s - 1, "backward", mb)])
    add_source_node(dag, 0)
    add_sink_node(dag, 1)
    dag.graph["source_node"], dag.graph["sink_node"] = 0, 1
    plans = []
    for it, _ in enumerate(PhillipsDessouky(dag).run()):
        plans.append({k: dag.nodes[n]["op"].assigned_knob for k, n in by_key.items()})
        if progress and it % 100 == 0:
            print(f"  lowtime M={m}: iteration {it}, {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return time.perf_counter() - t0, plans


def best_at(t_s: np.ndarray, e_j: np.ndarray, t: float) -> float:
    ok = t_s <= t * (1 + 1e-12)
    return float(e_j[ok].min()) if ok.any() else float("nan")


def compare(m: int, progress: bool) -> tuple[bool, dict[str, float]]:
    prof = read_profile(PROFILE)
    orders = instruction_order("deepspeed-train", STAGES, m)
    dag = build_dag(orders, 0.0)
    opts, freq_index = our_options(prof, dag)

    t0 = time.perf_counter()
    ours = solve_frontier(dag, opts, P_BLOCKED_W, gpus_per_stage=1)
    ours_s = time.perf_counter() - t0
    print(f"M={m}: ours {ours_s:.2f} s, {len(ours)} frontier plans", flush=True)

    lt_s, lt_plans = run_lowtime(prof, m, progress)
    lt_t, lt_e = [], []
    for plan in lt_plans:
        choice = np.array([freq_index[i][plan[(s, kind, mb)]] for i, (s, kind, mb, _) in enumerate(dag.keys)])
        sim = simulate_choice(dag, opts, choice, P_BLOCKED_W, 1)
        lt_t.append(sim.time_s)
        lt_e.append(sim.energy_j)
    lt_t, lt_e = np.array(lt_t), np.array(lt_e)
    o_t = np.array([p.time_s for p in ours])
    o_e = np.array([p.energy_j for p in ours])
    print(
        f"M={m}: lowtime {lt_s:.1f} s, {len(lt_plans)} iterations; wall-time ratio lowtime/ours = {lt_s / ours_s:.1f}x"
    )
    print(f"{'t (s)':>9} {'ours (J)':>10} {'lowtime (J)':>12} {'ours vs lowtime':>16}")
    ok = True
    worst = -np.inf
    for t in np.linspace(lt_t.min(), lt_t.max(), 20):
        eo, el = best_at(o_t, o_e, t), best_at(lt_t, lt_e, t)
        rel = (eo - el) / el
        ok &= bool(eo <= el * 1.005)
        worst = max(worst, rel)
        print(f"{t:9.4f} {eo:10.1f} {el:12.1f} {100 * rel:+15.3f}%")
    print(
        f"M={m}: fastest ours {o_t[0]:.4f} s vs lowtime {lt_t.min():.4f} s; "
        f"min energy ours {o_e.min():.1f} J vs lowtime {lt_e.min():.1f} J; within +0.5% everywhere: {ok}"
    )
    return ok, {"m": m, "ours_s": ours_s, "lowtime_s": lt_s, "worst": worst}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, action="append", help="microbatches (repeatable; default 8 16 32)")
    parser.add_argument("--quiet", action="store_true", help="no lowtime progress lines")
    args = parser.parse_args()
    logging.getLogger("lowtime").setLevel(logging.WARNING)
    ok = True
    rows = []
    for m in args.m or [8, 16, 32]:
        good, row = compare(m, not args.quiet)
        ok &= good
        rows.append(row)
    print("\nsummary (S=8, GPT-3 175B A100 profile, 83.64 W blocked power; wall times are noisy)")
    print(f"{'M':>3} {'ours (s)':>9} {'lowtime (s)':>12} {'speed-up':>9} {'worst energy vs lowtime':>24}")
    for r in rows:
        print(
            f"{r['m']:>3} {r['ours_s']:9.2f} {r['lowtime_s']:12.1f} {r['lowtime_s'] / r['ours_s']:8.0f}x "
            f"{100 * r['worst']:+23.2f}%"
        )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

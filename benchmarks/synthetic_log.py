"""Synthetic run logs for the --from-log fit: a plan run under a hidden "truth" calibration.

Each iteration runs every instruction at one SM clock (the closed loop's profiling phase); instruction times are
the truth's instruction_cost times with multiplicative noise, the iteration follows the pipeline DAG (search/
simulate.py), and each rank's energy is its instructions' truth energy plus the truth's p_blocked_w over its idle
time, with multiplicative noise. Written as the runtime's rank files (header + iteration lines with the
``instructions`` columns).

Options that make a log look more like a real closed-loop run: ``tags`` adds the runtime's ``phase`` and
``profile_mhz`` tags (closed_loop/auto.py), so the energy windows leave out the first iteration at every clock as they
do on a real run; ``energy_quantum_s`` makes each rank's energy an NVML-like counter that updates every
`energy_quantum_s` seconds (about 0.1 s on NVIDIA GPUs; each rank's updates at its own random phase), read at
iteration boundaries: an iteration's energy is the difference of two stale readings.

Used by tests/cost/test_calibrate_log.py, tests/cli/test_calibrate_from_log.py and benchmarks/closed_loop.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from kareus_megatron.cli.main import main
from kareus_megatron.cost.calibration import FORMAT, Calibration
from kareus_megatron.cost.kernel import KernelModel
from kareus_megatron.cost.params import KernelParams
from kareus_megatron.hardware.gpus import gpu_spec
from kareus_megatron.plan.io import load_plan, plan_sha256
from kareus_megatron.plan.workload import plan_workload
from kareus_megatron.search.pipeline import build_dag
from kareus_megatron.search.planner import pipeline_comm_times_s
from kareus_megatron.search.simulate import simulate

GPU = "a100-sxm4-40gb"
TINY = [
    "--model",
    str(Path(__file__).resolve().parents[1] / "examples" / "tiny-gpt.yaml"),
    "--gpu",
    GPU,
    "--tp",
    "1",
    "--pp",
    "2",
    "--mbs",
    "2",
    "--seq",
    "16",
    "--microbatches",
    "4",
    "--nodes",
    "1",
    "--gpus-per-node",
    "2",
    "--precision",
    "fp32",
    "--recompute",
    "none",
]
# A bigger preset: llama3.2-3b, PP=4, 8 microbatches, one GPU per stage.
BIG = [
    "--model",
    "llama3.2-3b",
    "--gpu",
    GPU,
    "--tp",
    "1",
    "--pp",
    "4",
    "--mbs",
    "1",
    "--seq",
    "2048",
    "--microbatches",
    "8",
    "--nodes",
    "1",
    "--gpus-per-node",
    "4",
    "--recompute",
    "full",
]
CLOCKS = (1410, 1230, 1050, 870, 690, 510)

# Truth: 15-30% off the preset in every power parameter and the time parameters a clock sweep reveals.
_PRESET = gpu_spec(GPU)
_KP = KernelParams()
TRUTH_PARAMS = {
    "launch_overhead_s": _KP.launch_overhead_s * 1.25,
    "time_scale": 1.2,
    "static_power_w": _PRESET.static_power_w * 1.25,
    "idle_dynamic_w": _PRESET.idle_dynamic_w * 0.80,
    "compute_dynamic_w": _PRESET.compute_dynamic_w * 1.20,
    "memory_dynamic_w": _PRESET.memory_dynamic_w * 0.78,
    "voltage_floor": _PRESET.voltage_floor * 1.15,
    "voltage_knee_mhz": _PRESET.voltage_knee_mhz * 0.85,
    "p_blocked_w": _PRESET.p_blocked_w * 1.20,
}


def truth_calibration(params: dict[str, float] | None = None) -> Calibration:
    """The truth as a calibration file's content."""
    return Calibration(format=FORMAT, gpu=GPU, params=dict(params or TRUTH_PARAMS), source="synthetic truth")


def make_plan(out: Path, flags: list[str], method: str = "megatron") -> Path:
    """Plan `flags` into `out` with `kareus plan` and return the path of `method`'s fastest plan file."""
    assert main(["plan", *flags, "--methods", "megatron,perseus", "--points", "2", "--out", str(out)]) == 0
    return out / "plans" / f"{method}-00.json"


def write_log(
    out: Path,
    plan_path: Path,
    truth: Calibration,
    clocks=CLOCKS,
    iters_per_clock: int = 4,
    warmup: int = 2,
    noise: float = 0.01,
    seed: int = 0,
    instructions: bool = True,
    tags: bool = False,
    energy_quantum_s: float = 0.0,
) -> Path:
    """Write the rank files of a run of `plan_path` under `truth` into directory `out`; return `out`.

    `clocks` (MHz) in profile order, `iters_per_clock` iterations each after `warmup` at clocks[0]; `tags` and
    `energy_quantum_s` (s; 0: exact energy) as in the module doc.
    """
    rng = np.random.default_rng(seed)
    plan = load_plan(plan_path)
    gpu, model, par = plan_workload(plan)
    km = KernelModel(gpu, truth)
    orders = [[(i.kind, i.microbatch, i.chunk) for i in st.instructions] for st in plan.stages]
    p2p, dp = pipeline_comm_times_s(model, par, km)
    dag = build_dag(orders, p2p, dp)
    fs = np.array(sorted(set(clocks)), dtype=float)
    cost = {}
    for s in range(par.pp):
        for c in range(par.vp):
            for kind in ("forward", "backward"):
                t, e = km.instruction_cost(model, par, s, kind, fs, c)
                cost[(s, c, kind)] = {int(f): (t[j], e[j] / t[j]) for j, f in enumerate(fs)}
    out.mkdir(parents=True, exist_ok=True)
    sha = plan_sha256(plan)
    files = {
        s: [
            json.dumps(
                {
                    "kind": "header",
                    "format": "kareus-rank-log/1",
                    "rank": s,
                    "world": par.pp,
                    "pp_rank": s,
                    "pp": par.pp,
                    "tp": 1,
                    "cp": 1,
                    "dp": 1,
                    "plan": str(plan_path),
                    "plan_sha256": sha,
                    "gpu": gpu.name,
                    "backend": "simulated",
                    "clock_control": True,
                }
            )
        ]
        for s in range(par.pp)
    }
    schedule = [int(clocks[0])] * warmup + [int(f) for f in clocks for _ in range(iters_per_clock)]
    records: dict[int, list[dict]] = {s: [] for s in range(par.pp)}
    t_now = 0.0
    for it, f in enumerate(schedule):
        dur = np.empty(dag.n)
        en = np.empty(dag.n)
        for n, (s, kind, _mb, c) in enumerate(dag.keys):
            t, p = cost[(s, c, kind)][f]
            dur[n] = t * (1.0 + noise * rng.standard_normal())
            en[n] = p * dur[n]
        sim = simulate(dag, dur, en, km.p_blocked_w)
        for s, order in enumerate(dag.rank_orders):
            busy = float(dur[list(order)].sum())
            energy = float(en[list(order)].sum()) + km.p_blocked_w * (sim.time_s - busy)
            rec = {
                "kind": "iteration",
                "iteration": it,
                "t_start": t_now,
                "t_end": t_now + sim.time_s,
                "time_s": sim.time_s,
                "energy_j": energy * (1.0 + noise * rng.standard_normal()),
                "temperature_c": 55.0,
                "sm_clock_mhz": f,
                "clock_stale": 0,
                "clock_errors": 0,
            }
            if instructions:
                rec["instructions"] = {
                    "index": list(range(len(order))),
                    "chunk": [dag.keys[n][3] for n in order],
                    "microbatch": [dag.keys[n][2] for n in order],
                    "kind": "".join("F" if dag.keys[n][1] == "forward" else "B" for n in order),
                    "sm_clock_mhz": [f] * len(order),
                    "t_start_s": [float(sim.start_s[n]) for n in order],
                    "time_s": [float(dur[n]) for n in order],
                }
            if tags:
                rec.update(phase="warmup" if it < warmup else "profile", profile_mhz=f)
            records[s].append(rec)
        t_now += sim.time_s
    if energy_quantum_s > 0:
        for s in records:
            _quantise(records[s], energy_quantum_s, float(rng.uniform(0.0, energy_quantum_s)))
    for s in records:
        files[s].extend(json.dumps(rec) for rec in records[s])
    for s, lines in files.items():
        (out / f"rank-{s:05d}.jsonl").write_text("\n".join(lines) + "\n")
    return out


def _quantise(recs: list[dict], quantum_s: float, phase_s: float) -> None:
    """Replace each record's energy_j by the difference of an energy counter's readings at its start and end, the
    counter updating every `quantum_s` s (at times phase_s + k·quantum_s) to the energy used so far (J)."""
    ends = np.array([recs[0]["t_start"]] + [r["t_end"] for r in recs])
    cum = np.concatenate([[0.0], np.cumsum([r["energy_j"] for r in recs])])  # power constant within an iteration
    updated = np.floor((ends - phase_s) / quantum_s) * quantum_s + phase_s  # the counter's last update (s)
    reading = np.interp(np.maximum(updated, ends[0]), ends, cum)
    for k, r in enumerate(recs):
        r["energy_j"] = float(reading[k + 1] - reading[k])


def plan_prediction(plan_path: Path, cal: Calibration) -> tuple[float, float]:
    """(iteration time s, energy J over all GPUs) of the plan file under calibration `cal` (event simulation)."""
    plan = load_plan(plan_path)
    gpu, model, par = plan_workload(plan)
    km = KernelModel(gpu, cal)
    orders = [[(i.kind, i.microbatch, i.chunk) for i in st.instructions] for st in plan.stages]
    p2p, dp = pipeline_comm_times_s(model, par, km)
    dag = build_dag(orders, p2p, dp)
    clock = {
        (s, i.kind, i.microbatch, i.chunk): i.sm_clock_mhz for s, st in enumerate(plan.stages) for i in st.instructions
    }
    dur, en = np.empty(dag.n), np.empty(dag.n)
    for n, key in enumerate(dag.keys):
        s, kind, _mb, c = key
        t, e = km.instruction_cost(model, par, s, kind, float(clock[key]), c)
        dur[n], en[n] = float(t), float(e)
    sim = simulate(dag, dur, en, km.p_blocked_w, par.tp * par.cp * par.dp)
    return sim.time_s, sim.energy_j

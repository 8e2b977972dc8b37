"""What the methods do to the grid: predicted power swing, ramp and band fraction, and the cost of a bound.

For the default job of ``kareus plan`` (configuration 1 below is that job) and the published evaluation's
configurations (benchmarks/paper_configs.py), every method's plan at three points of its frontier:
its fastest plan, its iso-time plan (least energy no slower than Perseus's fastest plan) and its
least-energy plan. Per plan, from the job's predicted power waveform (cost/waveform.py; all GPUs):

- swing: (peak − min) / peak, %;
- ramp: the largest rise or fall over 100 ms, kW/s;
- band: RMS of the 0.1–20 Hz components over the mean, %;

and what ``--max-swing 0.3`` costs: the energy of the method's fastest and least-energy plan under the
bound against without it (%; a costed power floor where the clocks alone do not meet it,
search/plan_power.py). These are PREDICTIONS of the uncalibrated model (GPU presets only), not measurements.

Run: .venv/bin/python benchmarks/power_waveform.py [--markdown] [--only 1,5,70b] [--max-swing 0.3]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from paper_configs import CONFIGS, LABEL, PaperConfig, _render, workload

from kareus_megatron.plan.build import build_plan
from kareus_megatron.search.plan_power import PowerBound
from kareus_megatron.search.planner import PlanningResult, plan_methods, reduction_indices
from kareus_megatron.vocab import ISO_REL_TOL, KAREUS, MEGATRON, METHODS, PERSEUS

POINTS = ("fastest", "iso-time", "least-energy")


def _points(result: PlanningResult, method: str) -> dict[str, int]:
    """Frontier index of the method's fastest, iso-time (vs Perseus's fastest) and least-energy plan."""
    mf, ref = result.methods[method], result.methods[PERSEUS]
    iso = reduction_indices(mf.time_s, mf.energy_j, float(ref.time_s[0]), float(ref.energy_j.min()))
    first = iso[0] if iso and mf.time_s[iso[0]] <= ref.time_s[0] * (1 + ISO_REL_TOL) else 0
    return {"fastest": 0, "iso-time": first, "least-energy": int(mf.energy_j.argmin())}


def _metrics(result: PlanningResult, method: str, index: int) -> dict[str, float]:
    plan, _ = build_plan(result, method, index)
    p = plan.predicted.power
    assert p is not None
    return {
        "swing": p.swing_w / p.peak_power_w,
        "ramp_w_per_s": p.ramp_w_per_s,
        "band": p.band_fraction,
        "energy_j": plan.predicted.iteration_energy_j,
        "time_s": plan.predicted.iteration_time_s,
    }


def evaluate(cfg: PaperConfig, max_swing: float) -> dict[str, Any]:
    """Every method's metrics at its three points, and its energy under the swing bound (fastest, least)."""
    gpu, model, par, kernel = workload(cfg)
    t0 = time.perf_counter()
    free = plan_methods(gpu, model, par, kernel, methods=METHODS, points=2)
    bounded = plan_methods(gpu, model, par, kernel, methods=METHODS, points=2, bound=PowerBound(max_swing=max_swing))
    out: dict[str, Any] = {}
    for m in METHODS:
        pts = {name: _metrics(free, m, i) for name, i in _points(free, m).items()}
        fb, lb = bounded.methods[m], free.methods[m]
        out[m] = {
            **pts,
            "bound_fastest": float(fb.energy_j[0]) / float(lb.energy_j[0]) - 1,
            "bound_least": float(fb.energy_j.min()) / float(lb.energy_j.min()) - 1,
        }
    out["seconds"] = time.perf_counter() - t0
    return out


def table(rows: list[tuple[PaperConfig, dict[str, Any]]], markdown: bool, max_swing: float) -> str:
    """One row per configuration and method."""
    head = [
        "#",
        "method",
        "swing % (fast · iso · least)",
        "ramp kW/s (fast · iso · least)",
        "band % (fast · iso · least)",
        f"energy +% under {max_swing:g}×peak (fast · least)",
    ]
    body = []
    for c, r in rows:
        for m in METHODS:
            d = r[m]
            body.append(
                [
                    c.tag if m == METHODS[0] else "",
                    LABEL[m],
                    " · ".join(f"{100 * d[p]['swing']:.0f}" for p in POINTS),
                    " · ".join(f"{d[p]['ramp_w_per_s'] / 1e3:.0f}" for p in POINTS),
                    " · ".join(f"{100 * d[p]['band']:.1f}" for p in POINTS),
                    f"{100 * d['bound_fastest']:.1f} · {100 * d['bound_least']:.1f}",
                ]
            )
    return _render(head, body, markdown)


def verdicts(rows: list[tuple[PaperConfig, dict[str, Any]]]) -> str:
    """Per configuration: Kareus's iso-time swing against Megatron's (better = smaller)."""
    lines = []
    for c, r in rows:
        k, mg = r[KAREUS]["iso-time"]["swing"], r[MEGATRON]["fastest"]["swing"]
        word = "smaller" if k < mg - 5e-3 else "larger" if k > mg + 5e-3 else "about the same"
        lines.append(
            f"config {c.tag} ({c.model}, {c.layout}, MBS {c.mbs}, seq {c.seq}): Kareus iso-time swing "
            f"{100 * k:.0f}% vs Megatron {100 * mg:.0f}% of peak: {word}; planned in {r['seconds']:.1f} s"
        )
    return "\n".join(lines)


def main() -> None:
    """Plan every configuration with and without the bound and print the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--markdown", action="store_true", help="print a markdown table (for the docs)")
    ap.add_argument("--only", default=None, help="comma-separated configuration tags (1..10, 70b; 1 = default job)")
    ap.add_argument("--max-swing", type=float, default=0.3, help="the swing bound, a fraction of peak (default 0.3)")
    args = ap.parse_args()
    want = set(args.only.split(",")) if args.only else None
    rows = [(c, evaluate(c, args.max_swing)) for c in CONFIGS if want is None or c.tag in want]
    print(table(rows, args.markdown, args.max_swing))
    print()
    print(verdicts(rows))


if __name__ == "__main__":
    main()

"""Simulated reproduction of the published comparison on a CPU: plan every evaluation configuration.

For each configuration of benchmarks/paper_configs.py (the ten of the Kareus evaluation,
docs/sources.md#kareus-evaluation, and Llama 3.3 70B) this runs `kareus plan` into OUT/config-TAG/
(frontier.json, plans/, frontier.png, timeline.png; its terminal table in OUT/logs/config-TAG.txt),
then writes OUT/comparison.md (the tables), OUT/comparison.json, OUT/frontiers.png (one frontier panel
per configuration) and OUT/reductions.png (the four reductions per configuration and method).
Everything is a MODEL PREDICTION: it shows what to expect before booking GPUs; `launch/` runs the
same comparison on a real cluster and `kareus compare` renders the measured one with the same formulas.

Run: make repro, or .venv/bin/python benchmarks/reproduce.py [--out DIR] [--points N] [--only 1,5,70b]
[--band-samples N]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from paper_configs import CONFIGS, GPU, LABEL, PaperConfig, tables  # noqa: E402

from kareus_megatron.cli.main import main as kareus  # noqa: E402
from kareus_megatron.plan.io import write_json_atomic  # noqa: E402
from kareus_megatron.plotting.frontier import plot_frontier, plot_reductions, save_grid_png  # noqa: E402
from kareus_megatron.vocab import METHODS  # noqa: E402

REDUCTIONS = {
    "iso_time_energy": "energy at Perseus's fastest time",
    "iso_energy_time": "time at Perseus's lowest energy",
    "max_throughput_time_vs_megatron": "fastest plan: time vs Megatron",
    "max_throughput_energy_vs_megatron": "fastest plan: energy vs Megatron",
}


def plan_one(
    cfg: PaperConfig, out: Path, points: int, calibration: str | None, band_samples: int | None = None
) -> dict:
    """Run `kareus plan` for one configuration; return its frontier document."""
    argv = ["plan", *cfg.argv(), "--out", str(out), "--points", str(points)]
    argv += ["--no-memory-check"] if cfg.tag == "70b" else []  # emulated in the paper: needs > 40 GB per GPU
    if calibration:
        argv += ["--calibration", calibration]
    if band_samples is not None:
        argv += ["--band-samples", str(band_samples)]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = kareus(argv)
    if rc != 0:
        raise SystemExit(f"kareus plan failed for configuration {cfg.tag} (exit {rc}): {' '.join(argv)}")
    (out.parent / "logs").mkdir(exist_ok=True)
    (out.parent / "logs" / f"config-{cfg.tag}.txt").write_text(buf.getvalue())
    return json.loads((out / "frontier.json").read_text())


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def main() -> None:
    """Plan every configuration, then write the comparison table and plots."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="repro-out", help="output directory (default ./repro-out)")
    ap.add_argument("--points", type=int, default=6, help="plans written per method and configuration (default 6)")
    ap.add_argument("--only", default=None, help="comma-separated configuration tags (1..10, 70b)")
    ap.add_argument("--calibration", default=None, help="calibration JSON (default: GPU preset only)")
    ap.add_argument(
        "--band-samples",
        type=int,
        default=None,
        metavar="N",
        help="kareus plan's --band-samples (default: its own; 0: no prediction bands, a faster run)",
    )
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    want = set(args.only.split(",")) if args.only else None
    chosen = [c for c in CONFIGS if want is None or c.tag in want]
    if not chosen:
        raise SystemExit(f"--only {args.only!r} matches no configuration; tags: {', '.join(c.tag for c in CONFIGS)}")
    t0 = time.perf_counter()
    docs: list[tuple[PaperConfig, dict]] = []
    for cfg in chosen:
        t = time.perf_counter()
        doc = plan_one(cfg, out / f"config-{cfg.tag}", args.points, args.calibration, args.band_samples)
        docs.append((cfg, doc))
        print(
            f"  #{cfg.tag:<3} {cfg.model:<13} {cfg.layout:<11} MBS {cfg.mbs:<2} seq {cfg.seq:<5} "
            f"-> {out}/config-{cfg.tag}/  ({time.perf_counter() - t:.1f} s)",
            flush=True,
        )

    rows = [
        (
            cfg,
            {
                "fastest": {
                    m: (d["methods"][m]["points"][0]["time_s"], d["methods"][m]["points"][0]["energy_j"])
                    for m in METHODS
                },
                "reductions": d["reductions"],
            },
        )
        for cfg, d in docs
    ]
    cal = f"calibration {args.calibration}" if args.calibration else "GPU preset, uncalibrated"
    header = (
        f"# Simulated reproduction (MODEL PREDICTIONS, not measurements)\n\n{GPU}, 2 nodes × 8 GPUs, {cal}. "
        "Energy = GPU energy of all 16 GPUs per iteration; reductions use Perseus's frontier as the "
        "reference (+ = better). Per-configuration outputs: config-TAG/ (`kareus plan` output) and "
        "logs/config-TAG.txt (its table).\n\n"
    )
    _write_text(out / "comparison.md", header + tables(rows, markdown=True, dominance=False) + "\n")
    write_json_atomic(
        out / "comparison.json",
        [
            {
                "tag": c.tag,
                "model": c.model,
                "tp": c.tp,
                "cp": c.cp,
                "mbs": c.mbs,
                "seq": c.seq,
                "fastest": {m: {"time_s": r["fastest"][m][0], "energy_j": r["fastest"][m][1]} for m in METHODS},
                "reductions": r["reductions"],
            }
            for c, r in rows
        ],
    )
    tags = [f"#{c.tag}" for c, _ in docs]
    save_grid_png(
        out / "frontiers.png",
        [
            (
                lambda ax, c=c, d=d, k=k: plot_frontier(
                    d, ax, title=f"#{c.tag} {c.model} {c.layout} MBS {c.mbs} seq {c.seq}", legend=k == 0
                )
            )
            for k, (c, d) in enumerate(docs)
        ],
        ncols=3,
    )
    save_grid_png(
        out / "reductions.png",
        [
            (
                lambda ax, key=key, what=what: plot_reductions(
                    tags, {m: [d["reductions"][m][key] for _, d in docs] for m in METHODS[1:]}, ax, title=what
                )
            )
            for key, what in REDUCTIONS.items()
        ],
        ncols=2,
        panel=(7.0, 3.4),
    )
    print()
    print(tables(rows, markdown=False, dominance=False))
    print(
        f"\nwrote {out}/comparison.md, comparison.json, frontiers.png, reductions.png and {len(docs)} "
        f"config-TAG/ directories in {time.perf_counter() - t0:.1f} s (model predictions; "
        f"{', '.join(LABEL[m] for m in METHODS)})"
    )


if __name__ == "__main__":
    main()

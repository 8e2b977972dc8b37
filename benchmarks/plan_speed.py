"""Wall time (s) of `kareus plan` as a user runs it: a fresh process, imports, planning, files and plots.

Cases (issue 4 acceptance, targets on a 2-core machine):
- the documented default (llama3.2-3b, 2 × 8 A100-SXM4-40GB, TP=8, PP=2, MBS 8, seq 4096,
  8 microbatches): <= 10 s;
- llama3.3-70b, TP=8, PP=8, 64 microbatches, 64 A100-SXM4-80GB (8 nodes × 8; MBS 8, seq 4096): <= 60 s.
  (On the 40 GB A100 its first stage needs 67.6 GB, which the planner's memory check refuses.)
Prints wall time, CPU time (user + sys of the child) and the load average: on a shared machine the
wall time is noisy, the CPU time much less so. Each case runs `--repeat` times (default 1); the best
wall time counts.

Run: .venv/bin/python benchmarks/plan_speed.py [--repeat N]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CASES = (
    ("default (llama3.2-3b, 16 GPUs, PP=2, M=8)", [], 10.0),
    (
        "llama3.3-70b, TP=8 PP=8, M=64, 64 A100-80GB",
        [
            "--model",
            "llama3.3-70b",
            "--tp",
            "8",
            "--pp",
            "8",
            "--microbatches",
            "64",
            "--nodes",
            "8",
            "--gpu",
            "a100-sxm4-80gb",
        ],
        60.0,
    ),
)


def run_case(argv: list[str], out: Path) -> tuple[float, float, dict]:
    """(wall s, child CPU s, frontier document) of one `kareus plan` run in a fresh process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "kareus_megatron.cli.main", "plan", *argv, "--out", str(out)],
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"kareus plan {' '.join(argv)} failed ({proc.returncode}):\n{proc.stderr}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, json.loads((out / "frontier.json").read_text())


def main() -> None:
    """Run every case and print its figures against the target."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=1, help="runs per case; the best wall time counts")
    args = ap.parse_args()
    print(
        f"kareus plan speed; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start "
        "(shared machine: wall times are noisy)"
    )
    print(f"{'case':<44} {'wall s':>8} {'CPU s':>8} {'target s':>9} {'plans':>6} {'kareus pts':>11}  verdict")
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        for k, (name, argv, target) in enumerate(CASES):
            best_wall, best_cpu, doc = float("inf"), float("inf"), {}
            for r in range(args.repeat):
                wall, cpu, doc = run_case(argv, Path(tmp) / f"case{k}-{r}")
                best_wall, best_cpu = min(best_wall, wall), min(best_cpu, cpu)
            plans = sum(len(m["points"]) for m in doc["methods"].values())
            ok = best_wall <= target
            failed |= not ok
            print(
                f"{name:<44} {best_wall:>8.1f} {best_cpu:>8.1f} {target:>9.0f} {plans:>6} "
                f"{len(doc['methods']['kareus']['points']):>11}  {'ok' if ok else 'SLOWER THAN TARGET'}"
            )
    print(f"load average at end {os.getloadavg()[0]:.1f}")
    if failed:
        print("note: a wall time above its target on a loaded machine may be contention; compare the CPU time")


if __name__ == "__main__":
    main()

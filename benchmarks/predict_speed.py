"""Time `kareus predict` for the default job (issue 2 target: under 1 s).

The default job (no workload flags: Llama 3.2 3B on 2 x 8 a100-sxm4-40gb, TP=8, PP=2 with 15 + 13 layers,
MBS 8, seq 4096) at every clock of the default grid, as a subprocess (interpreter start-up and imports
included) and in process (the model alone).

Run: .venv/bin/python benchmarks/predict_speed.py
"""

from __future__ import annotations

import io
import subprocess
import sys
import time
from contextlib import redirect_stdout

ARGS = ["predict", "--format", "csv"]  # the default job


def main() -> None:
    from kareus_megatron.cli.main import main as kareus

    runs = []
    for _ in range(3):
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, "-m", "kareus_megatron.cli.main", *ARGS], capture_output=True, text=True)
        runs.append(time.perf_counter() - t0)
        if out.returncode != 0:
            raise SystemExit(f"kareus predict failed: {out.stderr.strip()}")
    rows = len(out.stdout.splitlines()) - 1
    print(
        f"kareus predict (subprocess, imports included): best {min(runs):.3f} s, worst {max(runs):.3f} s, {rows} rows"
    )
    inproc = []
    for _ in range(5):
        t0 = time.perf_counter()
        with redirect_stdout(io.StringIO()):
            kareus(ARGS)
        inproc.append(time.perf_counter() - t0)
    print(f"kareus predict (in process): best {min(inproc) * 1e3:.1f} ms, worst {max(inproc) * 1e3:.1f} ms")
    print("target: < 1 s (timings on 2 shared cores are noisy)")


if __name__ == "__main__":
    main()

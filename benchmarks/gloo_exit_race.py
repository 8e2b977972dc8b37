"""How often a 2-rank gloo job aborts at exit right after a collective, with and without kareus's fix.

    python benchmarks/gloo_exit_race.py [--runs 25] [--load 2]

Each run is `torchrun --nproc-per-node 2` of this file in worker mode: three small all_gathers of CPU
tensors over gloo, then the script returns. ``plain`` calls ``dist.all_gather``; ``kareus`` calls the
measurement log's exchange (``runtime/measurement._all_gather_rows``), which keeps the last gloo work
referenced from Python. In ``plain``, a gloo worker thread may free the work after the interpreter
has begun to finalise; freeing it decrefs tensors' Python objects, the thread cannot take the GIL and
the process aborts ("terminate called without an active exception"). `--load N` runs N busy loops
meanwhile (the race needs a starved worker thread; a loaded CI machine is where it shows).
Prints aborted runs per mode; exit status 1 when a ``kareus`` run aborted.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time


def _worker(mode: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if mode == "kareus":
        from kareus_megatron.runtime.measurement import _all_gather_rows

        for i in range(3):
            _all_gather_rows([[float(i), float(rank), 0.01, 1.0]])
    else:
        for i in range(3):
            local = torch.tensor([[float(i), float(rank), 0.01, 1.0]], dtype=torch.float64)
            out = [torch.empty_like(local) for _ in range(dist.get_world_size())]
            dist.all_gather(out, local)
            [o.tolist() for o in out]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_once(mode: str) -> bool:
    """True when the 2-rank job exited cleanly."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, "--nnodes", "1", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), os.path.abspath(__file__), "--worker", mode]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": ""}
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    return r.returncode == 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=25, help="runs per mode")
    p.add_argument("--load", type=int, default=2, help="busy-loop processes running meanwhile")
    p.add_argument("--worker", choices=("plain", "kareus"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker(args.worker)
        return 0
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    aborted = {"plain": 0, "kareus": 0}
    t0 = time.monotonic()
    try:
        for _ in range(args.runs):  # interleaved, so both modes see the same load
            for mode in aborted:
                aborted[mode] += not _run_once(mode)
    finally:
        for b in busy:
            b.kill()
    print(f"{args.runs} runs per mode, {args.load} busy loops, {time.monotonic() - t0:.0f} s")
    for mode, n in aborted.items():
        print(f"  {mode:7s} aborted at exit: {n}/{args.runs}")
    return 1 if aborted["kareus"] else 0


if __name__ == "__main__":
    sys.exit(main())

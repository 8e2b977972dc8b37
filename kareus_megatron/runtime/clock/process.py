"""The clock controller's side process: ``python -m kareus_megatron.runtime.clock.process``.

One per local GPU, started by ``ClockClient.start_process`` (``spawn``). stdin carries the client's
byte stream (wire.py), stdout the replies, one JSON object per line (the marks of one batch in one
write). It opens the GPU, passes the simulated backend's ``SimulationHooks`` to the controller
explicitly, and resets clocks on every way out: ``close``, SIGTERM/SIGINT, stdin EOF (the trainer closed
the pipe or died) and a changed parent PID. Scheduling (sched.py): SCHED_BATCH, nice +5 with NVML (its
changes are due, but it never preempts a trainer); SCHED_IDLE with a simulated GPU (on a CPU host the
trainers are the device, and nothing there is due sooner).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import Any

from kareus_megatron.errors import KareusError
from kareus_megatron.runtime.clock import sched
from kareus_megatron.runtime.clock.wire import Reply


def spawn(
    index: int,
    backend: str | None,
    gpu: str | None,
    log_path: str | None,
    uuid: str | None = None,
    power_limit_w: float | None = None,
) -> subprocess.Popen[bytes]:
    """Start the side process for local GPU `index` (NVML's index; `uuid`, when given, picks the GPU
    instead: hardware/device/cuda_map.py); stdin and stdout are pipes. KAREUS_GPU_READ_ONLY is inherited."""
    # This module's own name: on the training side it is imported, never run.
    cmd = [
        sys.executable,
        "-m",
        __name__,
        "--index",
        str(index),
        "--backend",
        backend or "",
        "--gpu",
        gpu or "",
        "--log",
        log_path or "",
        "--uuid",
        uuid or "",
        "--power-limit-w",
        "" if power_limit_w is None else repr(float(power_limit_w)),
    ]
    # One thread per library pool: a BLAS pool would spin on the trainers' cores for nothing.
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True, env=env)


def serve(args: argparse.Namespace) -> int:
    """Body of the side process: stdin carries requests, stdout replies."""
    from kareus_megatron.hardware.device import open_gpu, power_reader_of, simulation_of
    from kareus_megatron.runtime.clock.controller import ClockController

    parent = os.getppid()
    sched.yield_to_training()  # each message from a trainer wakes this process: do not preempt it
    out_lock = threading.Lock()
    out = sys.stdout.buffer

    def reply(msg: Reply) -> None:
        reply_many([msg])

    def reply_many(msgs: Sequence[Reply]) -> None:
        data = "".join(json.dumps(m, separators=(",", ":")) + "\n" for m in msgs).encode()
        with out_lock:
            try:
                out.write(data)
                out.flush()
            except (BrokenPipeError, ValueError):
                pass

    try:
        device = open_gpu(args.index, backend=args.backend or None, gpu=args.gpu or None, uuid=args.uuid or None)
    except KareusError as e:
        reply({"op": "error", "type": type(e).__name__, "message": str(e)})
        return 2
    simulation = simulation_of(device)
    if simulation is not None:  # a simulated GPU: the trainers are the device, take only idle time
        sched.idle_time_only()
    controller = ClockController(
        device,
        reply,
        simulation=simulation,
        log_path=args.log or None,
        reply_many=reply_many,
        power=power_reader_of(device),
        power_limit_w=float(args.power_limit_w) if args.power_limit_w else None,
    )

    def on_signal(signum: int, frame: Any) -> None:
        controller.stop()

    for signum in (signal.SIGTERM, signal.SIGINT):
        if signal.getsignal(signum) != signal.SIG_IGN:  # inherited from a trainer started ignoring it: so does this
            signal.signal(signum, on_signal)
    reply(controller.probe())

    def read_stdin() -> None:
        fd = sys.stdin.fileno()
        while True:  # everything that has arrived, in one read per wake-up
            data = os.read(fd, 1 << 16)
            if not data:
                break
            controller.feed(data)
        controller.submit({"op": "parent_gone"})  # EOF: the trainer closed the pipe or died

    threading.Thread(target=read_stdin, name="kareus-clock-stdin", daemon=True).start()
    controller.run(parent_alive=lambda: os.getppid() == parent)
    sys.stdout.flush()
    os._exit(0)  # the stdin reader thread may be blocked in read(); do not wait for it


def main(argv: list[str] | None = None) -> int:
    """Entry point of the side process (started by ``spawn``)."""
    p = argparse.ArgumentParser(prog="kareus-clock-controller")
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--backend", default="")
    p.add_argument("--gpu", default="")
    p.add_argument("--log", default="")
    p.add_argument("--uuid", default="")
    p.add_argument("--power-limit-w", default="")  # a powercap plan's board power limit (W)
    return serve(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())

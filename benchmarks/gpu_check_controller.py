"""Step 7 of benchmarks/gpu_check.py: the clock controller in its side process, on a read-only device.

As a training rank runs it: ``ClockClient.start_process`` (the side process opens the GPU read-only, since
KAREUS_GPU_READ_ONLY is inherited), the client's CUDA-event transport (a forwarder thread waits for each
instruction's event, then hands the message over). The GPU is kept busy between instructions
(``torch.cuda._sleep``) while instruction begins alternate between two clocks, so the controller decides a
change at every one: recorded, never applied. Marks date the path: the time between a marked event completing
on the GPU (the GPU's event timer, referenced to an event recorded on an idle stream) and the time the
controller was handed for it. Then ``close``: the side process must exit 0 within its time.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

MARKS = 40
INSTRUCTIONS = 200
SLEEP_CYCLES = 2_000_000  # GPU busy time before each marked event (~1 ms at 2 GHz)


def run_controller(device: str, backend: str) -> dict[str, Any]:
    """The side-process controller's figures on `device` ("cuda:N" or "cpu") with `backend` (nvml/simulated)."""
    import torch

    from kareus_megatron.hardware.device import open_gpu
    from kareus_megatron.runtime.clock.client import ClockClient
    from kareus_megatron.runtime.process_env import gpu_target

    cuda = device.startswith("cuda")
    index = int(device.split(":")[1]) if cuda else 0
    nvml_index, uuid = gpu_target(index, backend)
    probe = open_gpu(nvml_index, backend=backend, uuid=uuid)
    clocks = list(probe.supported_sm_clocks_mhz())[:2]
    read_only = probe.read_only
    probe.close()
    events: list[Any] = []
    if cuda:
        torch.cuda.set_device(index)

        def factory() -> Any:
            ev = torch.cuda.Event(enable_timing=True, blocking=True)
            ev.record()
            events.append(ev)
            return ev

        client = ClockClient(event_factory=factory, coalesce_s=0.0, bind_thread=lambda: torch.cuda.set_device(index))
    else:
        client = ClockClient(coalesce_s=0.005)
    t0 = time.monotonic()
    ready = client.start_process(nvml_index, backend=backend, uuid=uuid, timeout_s=30.0)
    start_s = time.monotonic() - t0
    pid = client.controller_pid
    lat: list[float] = []
    per_instruction_s: list[float] = []
    try:
        for i in range(INSTRUCTIONS):
            if cuda:
                torch.cuda._sleep(SLEEP_CYCLES // 10)
            c0 = time.thread_time()
            client.instruction_begins(0, i, clocks[i % len(clocks)], "forward")
            per_instruction_s.append(time.thread_time() - c0)
        for _ in range(MARKS):
            if not cuda:
                h0 = time.monotonic()
                ticket = client.mark()
                if ticket.wait(5.0):
                    lat.append(time.monotonic() - h0)
                continue
            e0 = torch.cuda.Event(enable_timing=True, blocking=True)
            h0 = time.monotonic()
            e0.record()
            e0.synchronize()
            h1 = time.monotonic()
            torch.cuda._sleep(SLEEP_CYCLES)
            ticket = client.mark()
            if not ticket.wait(5.0) or ticket.t is None:
                continue
            done = (h0 + h1) / 2 + e0.elapsed_time(events[-1]) / 1e3
            lat.append(float(ticket.t) - done)
    finally:
        t1 = time.monotonic()
        client.close(timeout_s=10.0)
        close_s = time.monotonic() - t1
    proc = client._proc
    exit_status = proc.returncode if proc is not None else None
    key = "event_to_controller" if cuda else "cpu_mark_round_trip"
    counts = client.counts
    ok = (
        exit_status == 0
        and len(lat) >= MARKS // 2
        and bool(ready.get("read_only"))
        and counts is not None
        and counts.get("errors", 0) == 0
    )
    return {
        "status": "ok" if ok else "failed",
        "read_only": bool(ready.get("read_only")),
        "device_read_only": read_only,
        "ready": {k: v for k, v in ready.items() if k != "op"},
        "start_s": start_s,
        "close_s": close_s,
        "pid": pid,
        "exit_status": exit_status,
        "counts": counts,
        "instructions": INSTRUCTIONS,
        "clocks_mhz": clocks,
        "training_thread_cpu_s_per_instruction_median": statistics.median(per_instruction_s),
        "marks": len(lat),
        f"{key}_s_median": statistics.median(lat) if lat else None,
        f"{key}_s_p95": sorted(lat)[int(0.95 * (len(lat) - 1))] if lat else None,
    }

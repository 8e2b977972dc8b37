"""The validation kit's runtime checks, in a process of their own: ``python -m kareus_megatron.runtime.selfcheck``.

``--out FILE.json [--dry-run] [--device N]``. ``kareus validate`` runs this as a subprocess (the CLI never
imports the runtime) and merges the JSON under ``"runtime"``. Every check reports ``status``
(ok / failed / not_applicable) with its figures; none changes a GPU setting (the device is opened
read-only: KAREUS_GPU_READ_ONLY=1, so the clock controller records the planned clocks and applies none).

1. ``megatron_patch``: a one-process megatron-core run (tiny GPT, PP=1, ``forward_backward_no_pipelining``)
   trained N iterations without and with the kareus patch: losses bit-identical, median iteration time (s)
   both ways, and the device synchronisations inside the schedule calls, explicit (torch.cuda.synchronize)
   and implicit (CUDA's sync debug mode), each way: the patch may add none (on the CPU: not applicable).
2. ``event_alignment``: the clock controller's CUDA-event path (``ClockClient`` with a ``GpuTransport``, a
   controller thread on the read-only device): the time (s) between a marked CUDA event completing on the
   GPU and the time the controller was handed for it, median and p95. On the CPU dry run: the CPU
   transport's mark round trip instead (``measure: cpu_mark_latency_s``).
3. ``partitioned_layer``: selfcheck_layer.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

from kareus_megatron.runtime.selfcheck.model import Sizes, build_gpt, gpt_plan, train

FORMAT = "kareus-selfcheck/1"
CHECKS = ("megatron_patch", "event_alignment", "partitioned_layer")
MARKS = 50  # event-alignment samples
SLEEP_CYCLES = 2_000_000  # GPU busy time before each marked event (~1 ms on a 2 GHz SM clock)


def _p95(xs: list[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(0.95 * (len(s) - 1))))]


def check_megatron_patch(torch: Any, sizes: Sizes, device: str, work: str) -> dict[str, Any]:
    """Train without, then with, the patch (read-only device, thread controller); compare."""
    from kareus_megatron.runtime.selfcheck.sync_count import CudaSyncCounter
    from kareus_megatron.runtime.session_slot import MEGATRON_SESSIONS

    cuda = device.startswith("cuda")
    counters = [CudaSyncCounter(torch) if cuda else None for _ in range(2)]
    times_a: list[float] = []
    losses_a = train(build_gpt(torch, sizes, device), sizes, device, times_a, around_schedule=counters[0])
    gpu_name, clocks = _device_preset()
    plan = gpt_plan(sizes, gpu_name, clocks)
    session = MEGATRON_SESSIONS.install(
        plan, source="the selfcheck plan", log_path=os.path.join(work, "run"), controller="thread"
    )  # what kareus_megatron.megatron.install does
    times_b: list[float] = []
    try:
        losses_b = train(build_gpt(torch, sizes, device), sizes, device, times_b, around_schedule=counters[1])
        ready = dict(session.ready or {})
    finally:
        MEGATRON_SESSIONS.uninstall()
    counts = session.client.counts if session.client else None
    same = losses_a == losses_b
    syncs: Any = "not applicable (CPU)"
    added = 0
    if cuda:
        a, b = counters
        assert a is not None and b is not None
        syncs = {
            "explicit_without": a.explicit,
            "explicit_with": b.explicit,
            "implicit_without": a.implicit,
            "implicit_with": b.implicit,
        }
        added = (b.explicit - a.explicit) + (b.implicit - a.implicit)  # the patch's own: must be 0
    med_a, med_b = statistics.median(times_a[1:]), statistics.median(times_b[1:])  # first: warm-up
    ok = same and added == 0 and bool(ready.get("read_only"))
    return {
        "status": "ok" if ok else "failed",
        "iterations": sizes.iterations,
        "microbatches": sizes.microbatches,
        "losses_without": losses_a,
        "losses_with": losses_b,
        "losses_identical": same,
        "iteration_s_median_without": med_a,
        "iteration_s_median_with": med_b,
        "overhead_pct": 100.0 * (med_b / med_a - 1.0),
        "device_syncs_in_schedule": syncs,
        "device_syncs_added_by_patch": added if cuda else "not applicable (CPU)",
        "read_only": bool(ready.get("read_only")),
        "gpu": ready.get("gpu"),
        "controller_counts": counts,
    }


def _device_preset() -> tuple[str, tuple[int, ...]]:
    """(preset name, lockable SM clocks in MHz) of the device the session will open (read-only)."""
    from kareus_megatron.hardware.device import backend_from_env, open_gpu
    from kareus_megatron.runtime.process_env import gpu_target, local_rank_from_env

    index, uuid = gpu_target(local_rank_from_env(), backend_from_env(None))
    dev = open_gpu(index, uuid=uuid, read_only=True)
    try:
        return dev.spec.name, tuple(dev.supported_sm_clocks_mhz()) or tuple(dev.spec.sm_clocks_mhz)
    finally:
        dev.close()


def check_event_alignment(torch: Any, cuda_index: int | None) -> dict[str, Any]:
    """Marked CUDA events through the controller's event path: completion on the GPU to controller time."""
    from kareus_megatron.hardware.device import backend_from_env, open_gpu, simulation_of
    from kareus_megatron.runtime.clock.client import ClockClient
    from kareus_megatron.runtime.process_env import gpu_target, local_rank_from_env

    index, uuid = gpu_target(local_rank_from_env(), backend_from_env(None))
    device = open_gpu(index, uuid=uuid, read_only=True)
    events: list[Any] = []
    if cuda_index is None:
        client = ClockClient(coalesce_s=0.005)
    else:

        def factory() -> Any:  # as CudaEvents, with timing so the GPU's own clock dates the event
            ev = torch.cuda.Event(enable_timing=True, blocking=True)
            ev.record()
            events.append(ev)
            return ev

        client = ClockClient(
            event_factory=factory,
            coalesce_s=0.0,  # the forwarder on this device (CudaEvents)
            bind_thread=lambda: torch.cuda.set_device(cuda_index),
        )
    client.start_thread(device, simulation=simulation_of(device))
    lat: list[float] = []
    try:
        for _ in range(MARKS):
            if cuda_index is None:
                t0 = time.monotonic()
                ticket = client.mark()
                ticket.wait(5.0)
                lat.append(time.monotonic() - t0)
                continue
            e0 = torch.cuda.Event(enable_timing=True, blocking=True)
            h0 = time.monotonic()
            e0.record()
            e0.synchronize()
            h1 = time.monotonic()  # the GPU passed e0 between h0 and h1 (idle stream: close to h1)
            torch.cuda._sleep(SLEEP_CYCLES)
            ticket = client.mark()
            if not ticket.wait(5.0) or ticket.t is None:
                continue
            done = (h0 + h1) / 2 + e0.elapsed_time(events[-1]) / 1e3
            lat.append(float(ticket.t) - done)
    finally:
        client.close()
        device.close()
    if len(lat) < MARKS // 2:
        return {"status": "failed", "samples": len(lat), "message": "marks were not answered"}
    key = "cpu_mark_latency" if cuda_index is None else "event_to_controller"
    out = {
        "status": "ok",
        "measure": f"{key}_s",
        "samples": len(lat),
        f"{key}_s_median": statistics.median(lat),
        f"{key}_s_p95": _p95(lat),
    }
    if cuda_index is None:
        out["note"] = "CPU dry run: no CUDA events; the CPU transport's mark round trip (mark to answer) instead"
    else:
        out["note"] = "reference: the GPU's event timer from an event recorded on an idle stream (+- launch latency)"
    return out


def _guarded(name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    t0 = time.monotonic()
    try:
        res = fn()
    except Exception as e:  # a failed check is a report line, not a crash of the kit
        res = {"status": "failed", "message": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=6)}
    res["elapsed_s"] = time.monotonic() - t0
    print(f"selfcheck {name}: {res['status']} ({res['elapsed_s']:.1f} s)", file=sys.stderr)
    return res


def _init(dry_run: bool, device: int, work: str) -> tuple[Any, str]:
    """torch, one-process torch.distributed (gloo / nccl), megatron parallel state; return (torch, device)."""
    os.environ["KAREUS_GPU_READ_ONLY"] = "1"
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS: bit-identical losses
    os.environ["LOCAL_RANK"] = str(device if not dry_run else 0)
    if dry_run:
        os.environ["KAREUS_GPU_BACKEND"] = "simulated"
    import torch
    import torch.distributed as dist

    if not dry_run:
        torch.cuda.set_device(device)
    torch.use_deterministic_algorithms(True, warn_only=True)
    dist.init_process_group("gloo" if dry_run else "nccl", init_method=f"file://{work}/store", rank=0, world_size=1)
    from kareus_megatron.runtime.frameworks import cpu_shim

    if dry_run:
        torch.set_num_threads(min(2, torch.get_num_threads()))
        cpu_shim.apply()
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    if not dry_run:
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(1234)
    return torch, "cpu" if dry_run else f"cuda:{device}"


def run_checks(dry_run: bool, device: int) -> dict[str, Any]:
    """Run the three checks; the report dict (``kareus-selfcheck/1``)."""
    import warnings

    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kareus-selfcheck-") as work:
        torch, dev = _init(dry_run, device, work)
        sizes = Sizes.tiny() if dry_run else Sizes.gpu()
        report: dict[str, Any] = {
            "format": FORMAT,
            "dry_run": dry_run,
            "device": dev,
            "torch": torch.__version__,
            "sizes": sizes.as_dict(),
        }
        report["megatron_patch"] = _guarded("megatron_patch", lambda: check_megatron_patch(torch, sizes, dev, work))
        report["event_alignment"] = _guarded(
            "event_alignment", lambda: check_event_alignment(torch, None if dry_run else device)
        )

        def layer() -> dict[str, Any]:
            from kareus_megatron.runtime.selfcheck.layer import check_partitioned_layer

            return check_partitioned_layer(torch, sizes, dev)

        report["partitioned_layer"] = _guarded("partitioned_layer", layer)
        import torch.distributed as dist

        dist.destroy_process_group()
    report["elapsed_s"] = time.monotonic() - t0
    return report


def main(argv: list[str] | None = None) -> int:
    """Entry point: run the checks, write --out; exit 0 when every check ran (ok or not applicable)."""
    p = argparse.ArgumentParser(prog="python -m kareus_megatron.runtime.selfcheck", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="report file (JSON)")
    p.add_argument("--dry-run", action="store_true", help="CPU and the simulated GPU, tiny sizes")
    p.add_argument("--device", type=int, default=0, help="CUDA device index (default 0)")
    ns = p.parse_args(argv)
    report = run_checks(ns.dry_run, ns.device)
    with open(ns.out, "w") as f:
        json.dump(report, f, indent=2, sort_keys=True, default=str)
    return 0 if all(report[c]["status"] != "failed" for c in CHECKS) else 1


if __name__ == "__main__":
    sys.exit(main())

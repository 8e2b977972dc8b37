"""No host syncs on the training thread in the patched schedule's instruction hooks (issue 23).

A real megatron-core 1F1B schedule (2 gloo ranks, PP=2, 4 microbatches, the tiny GPT) runs with the kareus
patch installed (a session with a clock controller in a side process, simulated GPUs, the run log with its
per-instruction columns, and the overlap engine's settings switch as a hooks listener). Sync-prone operations
(runtime/selfcheck/sync_count.py) are counted only in the patch's own code: its schedule and step wrappers
(validation, iteration marks, ``announce`` -> the clock client's ``instruction_begins`` -> the transport, the
meter's stamps, the listeners, ``instruction_ends``), not in megatron-core's schedule and steps they wrap.

Two paths: the CPU transport and CPU stamps (what a CPU run takes), and the GPU path (``CudaEvents`` ->
``GpuTransport``, ``TimingEvents`` stamps) driven by stand-in CUDA events whose ``synchronize`` reports to the
counter: the forwarder thread waits on each event (its job), the training thread must not. A negative control
per path adds a listener that reads a device value (``.item()``) at every instruction: the count must see
each one, and only those.
"""

from __future__ import annotations

import json
import os
import time

import plans
import pytest
from _dist import MEGATRON_CORE, read_ranks, spawn

M, ITERATIONS = 4, 3


class _StandInCuda:
    """torch.cuda as the GPU path uses it: events (recorded, waited, timed), the current device."""

    def __init__(self, counter):
        outer = self

        class Event:
            def __init__(self, enable_timing=False, blocking=False):
                self.t = None
                outer.made += bool(blocking)

            def record(self):
                self.t = time.monotonic()

            def synchronize(self):  # a host wait: counted when the training thread does it
                counter.note("Event.synchronize")
                outer.waits += 1

            def query(self):
                return self.t is not None

            def elapsed_time(self, other):
                return (other.t - self.t) * 1e3

        self.Event = Event
        self.waits = 0  # by any thread (the forwarder's)
        self.made = 0  # the transport's (blocking) events constructed: its pool refills itself

    @staticmethod
    def current_device():
        return 0

    @staticmethod
    def set_device(index):
        pass

    @staticmethod
    def device(index):
        import contextlib

        return contextlib.nullcontext()


def _worker(rank: int, world: int, port: int, out_dir: str, gpu_path: bool) -> None:
    import tiny_gpt
    import torch
    from megatron.core.pipeline_parallel import schedules

    import kareus_megatron.megatron as kareus
    from kareus_megatron.runtime import hooks
    from kareus_megatron.runtime.clock.transport_gpu import CudaEvents
    from kareus_megatron.runtime.frameworks.megatron_patch import SCHEDULE_FUNCTIONS
    from kareus_megatron.runtime.measure.instruction_times import TimingEvents
    from kareus_megatron.runtime.overlap import setup_overlap
    from kareus_megatron.runtime.selfcheck.sync_count import SyncCount

    tiny_gpt.setup(rank, world, port)
    tiny_gpt.init_parallel(2, None)
    chunks = tiny_gpt.build_chunks(2, None)
    counter = SyncCount(active=False)
    cuda = _StandInCuda(counter)
    if gpu_path:
        stand_in = type("torch", (), {"cuda": cuda})
        CudaEvents.available = classmethod(lambda cls, fallback_device=None: cls(stand_in, fallback_device))
        TimingEvents.available = classmethod(lambda cls: cls(stand_in))
    names = ("forward_step", "backward_step", *SCHEDULE_FUNCTIONS)
    for name in names:  # megatron-core's own schedules and steps: not counted (the patch wraps these)
        setattr(schedules, name, counter.paused_call(getattr(schedules, name)))
    session = kareus.install(plans.tiny_plan(pp=2, m=M), log_path=os.path.join(out_dir, f"log{int(gpu_path)}"))
    for name in names:  # the patch's wrappers: counted
        setattr(schedules, name, counter.counting_call(getattr(schedules, name)))
    engine = setup_overlap()
    engine.install_listener()
    res = {"transport": type(session.client.transport).__name__}
    try:
        with counter:
            tiny_gpt.train(chunks, M, ITERATIONS)
            res.update(syncs=counter.total, sites=counter.report()["sites"], switches=engine.state.instructions_seen)

            def reads_a_device_value(event):  # the negative control
                torch.ones(2).sum().item()

            hooks.add_instruction_listener(reads_a_device_value)
            tiny_gpt.train(chunks, M, 1)
            hooks.remove_instruction_listener(reads_a_device_value)
            res.update(control_syncs=counter.total - res["syncs"], control_counts=dict(counter.counts))
    finally:
        engine.uninstall_listener()
        kareus.uninstall()
    res.update(
        event_waits=cuda.waits, events_made=cuda.made, logged=len(session.meter.records) if session.meter else None
    )
    with open(os.path.join(out_dir, f"rank{rank}.{int(gpu_path)}.json"), "w") as f:
        json.dump(res, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module", params=[False, True], ids=["cpu_path", "gpu_path"])
def ranks(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("hooks")
    spawn(
        _worker,
        2,
        str(out),
        request.param,
        env={
            "KAREUS_GPU_BACKEND": "simulated",
            "KAREUS_SIMULATED_LATENCY_MS": "1",
            "KAREUS_GPU": None,
            "KAREUS_LOG_INSTRUCTIONS": None,
        },
        preload=MEGATRON_CORE,
    )
    return request.param, read_ranks(out, "rank{rank}." + f"{int(request.param)}.json", 2)


def test_the_patched_instruction_path_has_no_host_syncs(ranks):
    gpu_path, rks = ranks
    per_rank = 2 * M  # forward and backward of every microbatch
    for rk in rks:
        assert rk["transport"] == ("GpuTransport" if gpu_path else "CpuTransport")
        assert rk["switches"] == ITERATIONS * per_rank  # the listeners ran at every instruction
        assert rk["syncs"] == 0, rk["sites"]
        if gpu_path:  # the forwarder waited on the events (off the training thread), which came back to the pools
            assert rk["event_waits"] >= ITERATIONS * per_rank
            assert rk["events_made"] < ITERATIONS * per_rank, rk  # a message per begin, end and mark: 3x more
        assert rk["logged"] == ITERATIONS + 1


def test_the_count_sees_a_host_read_in_the_path_and_only_there(ranks):
    _, rks = ranks
    for rk in rks:
        assert rk["control_syncs"] == 2 * M and rk["control_counts"] == {"Tensor.item": 2 * M}, rk

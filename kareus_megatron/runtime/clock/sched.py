"""CPU scheduling of the clock controller's side process (Linux; elsewhere a no-op), called before it starts threads.

Never for a thread of the trainer's own process: it shares the trainer's GIL, and a deprioritised thread preempted
while holding the GIL stalls the training thread when the cores are busy (priority inversion; measured in
docs/guides/megatron-core.md, "Without an NVIDIA GPU").
"""

from __future__ import annotations

import os


def yield_to_training() -> None:
    """SCHED_BATCH, nice +5 for the calling thread (best effort): a woken controller does not preempt the trainer that
    woke it, but gets a fair share soon after (the NVML controller: its changes are due)."""
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except (AttributeError, OSError):  # not Linux, or not allowed: keep the default
        pass
    try:
        os.nice(5)
    except (AttributeError, OSError):
        pass


def idle_time_only() -> None:
    """SCHED_IDLE for the calling thread (best effort; falls back to ``yield_to_training``): it runs in the time the
    trainers leave (the simulated GPU's controller: on a CPU host the trainers are the "GPU", nothing there is due
    sooner)."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        yield_to_training()

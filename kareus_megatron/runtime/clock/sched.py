"""CPU scheduling of the clock path's helper threads and side process (Linux; elsewhere a no-op).

The trainers own the CPU. Helpers say how much they may take from them, for the calling thread (Linux
scheduling attributes are per thread; threads started afterwards inherit them):

- ``yield_to_training()``: SCHED_BATCH and nice +5. A woken helper does not preempt the trainer that
  woke it, but still gets a fair share soon after (the NVML clock controller: its changes are due).
- ``idle_time_only()``: SCHED_IDLE. The helper runs in the time the trainers leave (pipeline bubbles,
  waits on communication) and only gets a sliver otherwise (the CPU side channel and the simulated
  GPU's controller: on a CPU host the trainers are the "GPU", and nothing there is due sooner).
"""

from __future__ import annotations

import os


def yield_to_training() -> None:
    """SCHED_BATCH, nice +5 for the calling thread (best effort)."""
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except (AttributeError, OSError):  # not Linux, or not allowed: keep the default
        pass
    try:
        os.nice(5)
    except (AttributeError, OSError):
        pass


def idle_time_only() -> None:
    """SCHED_IDLE for the calling thread (best effort; falls back to ``yield_to_training``)."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        yield_to_training()

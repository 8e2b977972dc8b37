"""SIGTERM and SIGHUP as an exception in a process that locks a GPU's clocks outside a training session.

An NVML clock lock outlives its process, and Python's default action for either signal ends the process without
running its `finally`: `timeout 600 kareus calibrate --run`, a job's time limit or a closed terminal left the GPU locked
(at down to its lowest clock) for whoever came next. Inside ``stops_cleanly()`` either signal raises Terminated, so the
code that locked resets in its `finally` (`kareus validate`, `calibrate --run`, benchmarks/overlap_gpu.py; the CLI
then prints one line and exits 143). A training session has its own handlers (runtime/session_signals.py). A signal
the process was started to ignore (nohup) stays ignored.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kareus_megatron.errors import Terminated

SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _raise_terminated(signum: int, frame: Any) -> None:
    for s in SIGNALS:  # the cleanup the exception starts is not cut short by a second signal
        signal.signal(s, signal.SIG_IGN)
    raise Terminated


@contextmanager
def stops_cleanly() -> Iterator[None]:
    """Within: SIGTERM or SIGHUP raises Terminated (main thread only; an ignored signal stays ignored)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in SIGNALS}
    for s, was in previous.items():
        if was != signal.SIG_IGN:
            signal.signal(s, _raise_terminated)
    try:
        yield
    finally:
        for s, was in previous.items():
            signal.signal(s, was)

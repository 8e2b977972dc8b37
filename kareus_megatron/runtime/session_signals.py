"""SIGTERM/SIGINT in a training process with a session: reset clocks, write what is measured, then chain.

``SignalHandling`` is the part of ``RuntimeSession`` (session.py) that owns the signal handlers: installed on the
main thread once the meter runs, restored when the meter closes.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any


class SignalHandling:
    """Signal handlers of a session; the session provides ``meter``, ``client`` and ``controller``."""

    meter: Any
    client: Any
    controller: str
    _old_handlers: dict[int, Any]

    def _install_signal_handlers(self) -> None:
        if self.meter is None or threading.current_thread() is not threading.main_thread():
            return
        for signum in (signal.SIGTERM, signal.SIGINT):
            self._old_handlers[signum] = signal.signal(signum, self._on_signal)

    def _restore_signal_handlers(self) -> None:
        old, self._old_handlers = self._old_handlers, {}
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, handler in old.items():
            if signal.getsignal(signum) == self._on_signal:
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)

    def _on_signal(self, signum: int, frame: Any) -> None:
        """SIGTERM/SIGINT: reset clocks, write the resolved iterations (up to 0.5 s for the newest), then
        chain to what was installed before (SIGINT: KeyboardInterrupt; SIGTERM: the process ends)."""
        if self.client is not None:
            self.client.reset(timeout_s=0.2)  # first: the GPU must not stay locked however the rest goes
        if self.meter is not None:
            self.meter.drain(wait_s=0.5, to_sink=False)  # never into a writer the signal may have interrupted
        previous = self._old_handlers.get(signum, signal.SIG_DFL)
        if callable(previous):
            previous(signum, frame)  # SIGINT's default raises KeyboardInterrupt
            return
        if previous == signal.SIG_IGN:
            return
        signal.signal(signum, signal.SIG_DFL)  # the default action: end the process as the signal does
        if self.client is not None and self.controller == "thread":  # no side process outlives this one:
            self.client.close(timeout_s=1.0)  # its final reset restores a powercap plan's limit (W) now
        os.kill(os.getpid(), signum)

"""SIGTERM/SIGINT in a training process with a session: reset clocks, write what is measured, then chain.

``SignalHandling`` is the part of ``RuntimeSession`` (session.py) that owns the signal handlers: installed on the
main thread once the meter runs, restored when the meter closes. A signal the process was started to ignore (SIG_IGN
inherited, as a background job of a script gets SIGINT) gets no handler: it stays ignored and the clocks stay as
planned.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

# How long (s) the handler waits for its work thread: the reset's 0.2, the drain's 0.5 and the thread
# controller's close's 1.0, with room to spare. Past it the signal is chained anyway.
SETTLE_WAIT_S = 2.5


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
            if signal.getsignal(signum) == signal.SIG_IGN:
                continue  # started to ignore it (`nohup`, `cmd &` in a script): it stays ignored, clocks untouched
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
        chain to what was installed before (SIGINT: KeyboardInterrupt; SIGTERM: the process ends).

        The work runs on its own thread, waited for at most ``SETTLE_WAIT_S``: the signal interrupts the main
        thread at any point, possibly holding a lock the reset or the drain needs (the transport's send lock,
        the marks' condition), which a handler on that thread would wait for forever. Chained past that wait,
        the interrupted code unwinds, releases the lock and the work thread finishes (SIGINT), or the process
        ends and the side controller resets the clocks when its pipe closes (SIGTERM)."""
        previous = self._old_handlers.get(signum, signal.SIG_DFL)
        ends = not callable(previous)
        work = threading.Thread(target=self._settle, args=(ends,), name="kareus-signal", daemon=True)
        work.start()
        work.join(SETTLE_WAIT_S)
        if callable(previous):
            previous(signum, frame)  # SIGINT's default raises KeyboardInterrupt
            return
        signal.signal(signum, signal.SIG_DFL)  # the default action: end the process as the signal does
        os.kill(os.getpid(), signum)

    def _settle(self, ends: bool) -> None:
        """The signal's work (its own thread): reset clocks, write the resolved iterations; when the signal
        ends the process and the controller is a thread of it, close the controller too (its final reset
        restores a powercap plan's limit, W) since nothing outlives the process to do it."""
        if self.client is not None:
            self.client.reset(timeout_s=0.2)  # first: the GPU must not stay locked however the rest goes
        if self.meter is not None:
            self.meter.drain(wait_s=0.5, to_sink=False)  # never into a writer the signal may have interrupted
        if ends and self.client is not None and self.controller == "thread":
            self.client.close(timeout_s=1.0)

"""The command a `kareus` process runs and waits for (torchrun, srun, a kareus subcommand), and SIGTERM passed on to it.

`kill PID` on `kareus launch` or `kareus torchrun`, or a scheduler that stops a task by signalling only the process it
started, sends SIGTERM to kareus alone. Inside ``sigterm_passed_on()`` (the CLI's, main thread) a SIGTERM reaches the
running command, whose own handler stops its workers (torchrun sends them SIGTERM and kills those still running 30 s
later), and ``run`` raises Terminated once it has ended: nothing more starts, and the CLI prints one line and exits 143.
Without it kareus ended at once and the job it started went on training on the GPUs. A command still running
KILL_AFTER_S after the SIGTERM is killed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kareus_megatron.errors import Terminated

# torchrun's agent gives its workers 30 s after passing SIGTERM on (torch/distributed/elastic/agent/server/
# local_elastic_agent.py, _shutdown(timeout=30)), then kills them; this leaves it the time to do so
KILL_AFTER_S = 60.0


class _State:
    running: subprocess.Popen[bytes] | None = None
    terminated = False


def run(argv: list[str], env: dict[str, str] | None = None) -> int:
    """Run `argv` (with `env` added to this process's environment) and wait for it; its exit status.

    Terminated when a SIGTERM came (sigterm_passed_on) before it started or while it ran. Any other exception while
    waiting (KeyboardInterrupt: after the 0.25 s that Popen.wait leaves the command for its own SIGINT) kills it, as
    subprocess.run does."""
    if _State.terminated:
        raise Terminated
    with subprocess.Popen(argv, env={**os.environ, **(env or {})}) as p:
        try:
            _State.running = p
            rc = p.wait()
        except BaseException:
            p.kill()
            raise
        finally:
            _State.running = None
    if _State.terminated:
        raise Terminated
    return rc


def _on_sigterm(signum: int, frame: Any) -> None:
    _State.terminated = True
    p = _State.running
    if p is None:  # between commands: nothing to wait for
        raise Terminated
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # passed on once; a repeat changes nothing
    p.send_signal(signal.SIGTERM)  # run()'s wait goes on until the command has stopped its workers
    timer = threading.Timer(KILL_AFTER_S, p.send_signal, (signal.SIGKILL,))  # send_signal: a no-op once it has ended
    timer.daemon = True
    timer.start()


@contextmanager
def sigterm_passed_on() -> Iterator[None]:
    """Within: a SIGTERM goes on to the command ``run`` is waiting for, then Terminated (see the module docstring).

    Signal handlers live on the main thread only; an ignored SIGTERM stays ignored."""
    if threading.current_thread() is not threading.main_thread() or (
        signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    ):
        yield
        return
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        _State.terminated = False

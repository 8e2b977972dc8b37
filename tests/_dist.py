"""Helpers for tests that spawn torch.distributed ranks on this machine (gloo, 127.0.0.1).

A *worker* is a module-level function ``worker(rank, world, port, *args)``; ``spawn`` starts `world` of
them on a free TCP port and waits for all; each writes its results as JSON that ``read_ranks`` loads.
A worker that returns ends its process with ``exit_process`` (no interpreter finalisation).
"""

from __future__ import annotations

import json
import os
import socket
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def exit_process(code: int = 0) -> None:
    """End this rank without interpreter finalisation (os._exit after flushing stdout and stderr).

    A gloo worker thread may still hold a finished collective when the script returns (DeepSpeed's
    loss broadcast over the pipe group, say). Destroying it decrefs the tensors' Python objects,
    which takes the GIL; if the interpreter is finalising by then, the thread is unwound through a
    noexcept frame and the process aborts with "terminate called without an active exception"
    (backtrace: ProcessGroupGloo::runLoop -> ~AsyncBroadcastWork -> TensorImpl::decref_pyobject ->
    take_gil -> PyThread_exit_thread). Seen about once in 70 runs of tests/runtime/deepspeed/ds_train.py on a
    loaded 2-core machine, with or without kareus (plain all_gather shows the
    same race). Callers write their results and call kareus uninstall() first.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _run_and_exit(rank: int, worker: Callable[..., Any], *args: Any) -> None:
    worker(rank, *args)
    exit_process(0)


def spawn(worker: Callable[..., Any], world: int, *args: Any, env: Mapping[str, str | None] | None = None) -> None:
    """Run ``worker(rank, world, port, *args)`` in `world` spawned processes; raise if any fails.

    `env` is set for the spawn (None: unset) and os.environ is restored afterwards.
    """
    import torch.multiprocessing as mp

    saved = dict(os.environ)
    try:
        for k, v in (env or {}).items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        mp.spawn(_run_and_exit, args=(worker, world, free_port(), *args), nprocs=world, join=True)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def read_ranks(directory: str | os.PathLike[str], pattern: str, world: int) -> list[Any]:
    """The JSON each rank wrote: ``pattern.format(rank=r)`` in `directory`, for r in 0..world-1."""
    return [json.loads((Path(directory) / pattern.format(rank=r)).read_text()) for r in range(world)]

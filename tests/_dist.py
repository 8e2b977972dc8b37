"""Helpers for tests that spawn torch.distributed ranks on this machine (gloo, 127.0.0.1).

A *worker* is a module-level function ``worker(rank, world, port, *args)``; ``spawn`` starts `world` of
them on a free TCP port and waits for all; each writes its results as JSON that ``read_ranks`` loads.
A worker that returns ends its process with ``exit_process`` (no interpreter finalisation).

Starting a rank is most of what a small run costs: a fresh interpreter imports torch and megatron-core, about
4 s of CPU per rank. ``spawn(..., preload=MEGATRON_CORE)`` (and ``start_ranks``, torch.multiprocessing.spawn's
call) instead forks each rank from a fork server that imported those modules once per test process. Every spawn
of the suite uses it (the megatron-core workers, the overlap benchmarks, DeepSpeed's, which import DeepSpeed
themselves), all with MEGATRON_CORE: the server keeps the first call's `preload`. The preloaded modules read
their import-time environment once, in the server (torch's TORCHDYNAMO_DISABLE, say): a test that needs another
one for them, or a process that has not imported them (what an import loads), starts a fresh interpreter instead.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import random
import socket
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

EPHEMERAL_LOW = 32768  # Linux's default first ephemeral port, where /proc does not say


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for MASTER_PORT), drawn below the kernel's ephemeral range.

    Rank 0 binds it seconds later (after importing torch). A port from ``bind(("127.0.0.1", 0))`` lies in the
    ephemeral range, where any outbound connection made meanwhile on the machine (the other worker's gloo ranks, say)
    may be given it: a 2-rank run then failed with EADDRINUSE (a full suite run, 2026-12-07). Below that range only
    another explicit bind can take it, and the draw makes two tests' picks coincide about once in 10,000."""
    low = EPHEMERAL_LOW
    with contextlib.suppress(OSError, ValueError):
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    draw = random.SystemRandom()
    for _ in range(100):
        port = draw.randrange(max(1024, low - 10_000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    with socket.socket() as s:  # all drawn ports taken: the kernel's choice
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


# What the megatron-core workers import (tests/runtime/overlap/*_worker.py, patch_worker.py, ...): torch, and
# megatron-core's GPT model, schedules and DDP. Third-party modules only: the package and the workers are imported by
# each rank.
MEGATRON_CORE = (
    "torch",
    "torch.distributed",
    "megatron.core.parallel_state",
    "megatron.core.tensor_parallel",
    "megatron.core.transformer.transformer_config",
    "megatron.core.models.gpt",
    "megatron.core.pipeline_parallel",
    "megatron.core.distributed",
)


def spawn(
    worker: Callable[..., Any],
    world: int,
    *args: Any,
    env: Mapping[str, str | None] | None = None,
    preload: Sequence[str] = (),
) -> None:
    """Run ``worker(rank, world, port, *args)`` in `world` spawned processes; raise if any fails.

    `env` is set for the spawn (None: unset) and os.environ is restored afterwards. `preload` (modules): fork the
    ranks from a fork server that imported them (``start_ranks``) instead of starting `world` fresh interpreters.
    """
    import torch.multiprocessing as mp

    saved = dict(os.environ)
    try:
        for k, v in (env or {}).items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if preload:
            start_ranks(worker, (world, free_port(), *args), world, preload=preload, exit_after=True)
        else:
            mp.spawn(_run_and_exit, args=(worker, world, free_port(), *args), nprocs=world, join=True)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def start_ranks(
    fn: Callable[..., Any],
    args: tuple = (),
    nprocs: int = 1,
    join: bool = True,
    *,
    preload: Sequence[str] = MEGATRON_CORE,
    exit_after: bool = False,
) -> None:
    """torch.multiprocessing.spawn's ``fn(rank, *args)`` in `nprocs` processes (joined; raise if any fails), each
    forked from multiprocessing's fork server: a process started once per test process (at the first call, with that
    call's `preload`) that has imported `preload` and nothing else, so no state of this process or of an earlier rank.

    A rank otherwise starts as spawn starts it: in this process's working directory and sys.path (multiprocessing's
    preparation data), with os.environ set to this process's as it is now, then it imports `fn`'s module by name
    (`fn` must be importable, as spawn needs). A forked rank inherits the server's stdout and stderr, not this
    test's: each writes to a file copied to this process's stderr afterwards. `exit_after`: end each rank with
    ``exit_process`` once `fn` returns.
    """
    import multiprocessing

    import torch.multiprocessing as mp

    assert join, "start_ranks joins its ranks"
    multiprocessing.get_context("forkserver").set_forkserver_preload(list(preload))
    fd, log = tempfile.mkstemp(prefix="ranks-", suffix=".log")
    os.close(fd)
    try:
        mp.start_processes(
            _forked_rank,
            args=(dict(os.environ), log, fn.__module__, fn.__qualname__, exit_after, *args),
            nprocs=nprocs,
            join=True,
            start_method="forkserver",
        )
    finally:
        output = Path(log).read_text(errors="replace")
        os.unlink(log)
        if output:
            sys.stderr.write(output)


def _forked_rank(
    rank: int, environ: dict[str, str], log: str, module: str, name: str, exit_after: bool, *args: Any
) -> None:
    os.environ.clear()
    os.environ.update(environ)
    fd = os.open(log, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    fn = importlib.import_module(module)
    for part in name.split("."):
        fn = getattr(fn, part)
    fn(rank, *args)
    if exit_after:
        exit_process(0)


def read_ranks(directory: str | os.PathLike[str], pattern: str, world: int) -> list[Any]:
    """The JSON each rank wrote: ``pattern.format(rank=r)`` in `directory`, for r in 0..world-1."""
    return [json.loads((Path(directory) / pattern.format(rank=r)).read_text()) for r in range(world)]

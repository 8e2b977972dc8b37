"""Per-iteration measurement: time (s, max over ranks) and GPU energy (J, sum over ranks) -> JSONL.

An *iteration* is one training call of the megatron-core schedule (forward_backward_func), from entry
to exit; on a GPU both points are GPU-aligned (CUDA events waited for off the training thread by the
clock client), on a CPU they are ``time.monotonic()`` on the training thread. Energy comes from the
device's counter (NVML: total-energy counter; simulated: the power model). Ranks exchange their
figures in groups (one small all_gather over a gloo group, CPU tensors, so the GPU is never
synchronised), leaving out the newest iteration, whose end the GPU may not have reached yet; ``flush()``
(at close) publishes the rest. The first group is ``publish_every`` iterations (default 10); after each
exchange every rank sizes the next group from the exchanged iteration times so that exchanges come
about every ``publish_interval_s`` (default 10 s; at most MAX_GROUP iterations). Every rank sees the
same exchanged figures, so all ranks agree on the next group without talking. Global rank 0 appends
one line per iteration:

    {"kind": "iteration", "iteration": i, "time_s": T, "energy_j": E,
     "stages": [{"pp_rank": r, "time_s": max, "energy_j": sum, "gpus": n}, ...]}

The first line is a header: {"kind": "header", "plan": ..., "plan_sha256": ..., "gpu": ..., "world": ...}.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from typing import Any

from kareus_megatron.jsonl import JsonlAppender

_FIELDS = 4  # iteration, pp_rank, time_s, energy_j
MAX_GROUP = 1000  # iterations exchanged at most in one collective (bounds held tickets and lag)


def _resolve(point: Any, timeout_s: float = 60.0) -> tuple[float, float]:
    """(time s, energy J) of a measurement point: a ticket (.wait/.t/.energy_j) or a bare time."""
    if isinstance(point, float):
        return point, math.nan
    if point.wait(timeout_s) and point.t is not None:
        return float(point.t), float(point.energy_j)
    return math.nan, math.nan


class IterationMeter:
    """Collects each iteration's time and energy on every rank; rank 0 writes the JSONL log."""

    def __init__(self, log_path: str | os.PathLike[str] | None, mark: Callable[[], Any] | None = None,
                 header: dict[str, Any] | None = None, publish_every: int = 10,
                 publish_interval_s: float | None = 10.0) -> None:
        """`mark()` returns a ticket with .wait()/.t/.energy_j (the clock client); None: CPU time only.
        Iterations are exchanged between ranks in groups (one collective each): first `publish_every`,
        then as many as take about `publish_interval_s` (None: always `publish_every`)."""
        self._publish_every = max(1, int(publish_every))
        self._publish_interval_s = publish_interval_s
        self._mark = mark
        self._log_path = os.fspath(log_path) if log_path else None
        self._log: JsonlAppender | None = None
        self._header = dict(header or {})
        self._pending: list[tuple[int, Any, Any]] = []  # (iteration, start point, end point)
        self._start: Any = None
        self.pp_rank = 0
        self.records: list[dict[str, Any]] = []  # what rank 0 wrote (kept for tests and reports)

    def _point(self) -> Any:
        """A measurement point: the clock client's ticket, or the time now (s) without a client."""
        mark = self._mark
        return mark() if mark is not None else time.monotonic()

    def begin(self, iteration: int) -> None:
        """Mark the start of `iteration` (training thread; does not wait)."""
        self._start = self._point()

    def end(self, iteration: int) -> None:
        """Mark the end of `iteration`; publish the previous iteration (one small collective)."""
        if self._start is None:
            return
        pending = self._pending
        pending.append((iteration, self._start, self._point()))
        self._start = None
        if len(pending) > self._publish_every:  # the newest stays: its end may not be reached yet
            self._publish(pending[:-1])
            del pending[:-1]

    def flush(self) -> None:
        """Publish every pending iteration; all ranks must call it (collective when distributed)."""
        if self._pending:
            self._publish(self._pending)
            self._pending.clear()

    def close(self) -> None:
        """Release the log file (call flush first)."""
        if self._log is not None:
            self._log.close()
            self._log = None

    # -- exchange --------------------------------------------------------------------------
    def _local_rows(self, items: list[tuple[int, Any, Any]]) -> list[list[float]]:
        rows = []
        for iteration, p0, p1 in items:
            t0, e0 = _resolve(p0)
            t1, e1 = _resolve(p1)
            rows.append([float(iteration), float(self.pp_rank), t1 - t0, e1 - e0])
        return rows

    def _publish(self, items: list[tuple[int, Any, Any]]) -> None:
        rows = self._local_rows(items)
        gathered, writer = _all_gather_rows(rows)
        self._size_next_group(gathered)
        if not writer:
            return  # not rank 0
        for k in range(len(rows)):
            per_rank = [g[k] for g in gathered]
            self._write(per_rank)

    def _size_next_group(self, gathered: list[list[list[float]]]) -> None:
        """Iterations in the next exchange: `publish_interval_s` over the median iteration time (s)
        just exchanged. Computed from the gathered figures only, so every rank gets the same number."""
        if self._publish_interval_s is None or not gathered:
            return
        times = [max(r[2] for r in per_rank) for per_rank in zip(*gathered)]
        times = sorted(t for t in times if math.isfinite(t) and t > 0)
        if times:
            median = times[len(times) // 2]
            self._publish_every = max(1, min(MAX_GROUP, math.ceil(self._publish_interval_s / median)))

    def _write(self, per_rank: list[list[float]]) -> None:
        stages: dict[int, dict[str, Any]] = {}
        for _, pp_rank, t, e in per_rank:
            s = stages.setdefault(int(pp_rank), {"pp_rank": int(pp_rank), "time_s": -math.inf, "energy_j": 0.0,
                                                 "gpus": 0})
            s["time_s"] = max(s["time_s"], t)
            s["energy_j"] += e
            s["gpus"] += 1
        record = {
            "kind": "iteration",
            "iteration": int(per_rank[0][0]),
            "ranks_reporting": len(per_rank),
            "time_s": _num(max(r[2] for r in per_rank)),
            "energy_j": _num(sum(r[3] for r in per_rank)),
            "stages": [{**s, "time_s": _num(s["time_s"]), "energy_j": _num(s["energy_j"])}
                       for _, s in sorted(stages.items())],
        }
        if self._log is None and self._log_path is not None:
            self._log = JsonlAppender(self._log_path)
            self._log.write({"kind": "header", "world": len(per_rank), **self._header})
        if self._log is not None:
            self._log.write(record)
        self.records.append(record)


def _num(x: float) -> float | None:
    return None if (x is None or math.isnan(x) or math.isinf(x)) else float(x)


def _all_gather_rows(rows: list[list[float]]) -> tuple[list[list[list[float]]], bool]:
    """Gather every rank's rows as [rank][row][field] (on every rank); True on the rank that writes (0)."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - the runtime always has torch
        return [rows], True
    if not (dist.is_available() and dist.is_initialized()):
        # No process group (single process, or already destroyed at exit): rank 0 writes its own rows.
        return [rows], os.environ.get("RANK", "0") == "0"
    if dist.get_world_size() == 1:
        return [rows], True
    global _held_exchange
    local = torch.tensor(rows, dtype=torch.float64).reshape(len(rows), _FIELDS)
    out = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    work = dist.all_gather(out, local, group=_cpu_group(), async_op=True)
    work.wait()
    _held_exchange = work  # until the next exchange; see _held_exchange
    return [o.tolist() for o in out], dist.get_rank() == 0


# The last exchange's gloo work, kept referenced from Python. Otherwise a gloo worker thread may drop
# the last reference after wait() returns; freeing the work frees tensors that Python has seen, which
# takes the GIL, and if the trainer is already exiting (the final exchange is at close, often just
# before exit) the thread is unwound through a noexcept frame and the process aborts with
# "terminate called without an active exception". Held here, the work is freed by the main thread.
# benchmarks/gloo_exit_race.py (loaded 2-core machine, 3 all_gathers then exit): 6 of 20 runs aborted
# with plain dist.all_gather, 0 of 20 with this function.
_held_exchange: Any = None
_gloo_group: Any = None


def _cpu_group() -> Any:
    """A gloo group over all ranks (the default group when it is gloo): CPU tensors, no GPU sync."""
    global _gloo_group
    import torch.distributed as dist

    if dist.get_backend() == "gloo":
        return None
    if _gloo_group is None:
        _gloo_group = dist.new_group(backend="gloo")  # collective: every rank reaches the first publish
    return _gloo_group

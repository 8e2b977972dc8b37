"""Collectives of the overlap engine: async TP all-reduce (and, with sequence parallelism, all-gather and
reduce-scatter along dim 0), and context parallelism's K/V all-gather and dK/dV reduce-scatter over the CP
group (``cp_all_gather`` / ``cp_reduce_scatter``), on a communicator chosen by comm SM count.

The SM-limited communicators (one per distinct SM count, NCCL only; the budget, NCCL's environment,
shared resources and their costs) are built by comm_groups.py. On gloo (and any other backend) the
request is recorded in the trace and has no effect; the default TP group is used. Each collective
reports whether its SM limit was *requested* (issued on an SM-limited communicator), which is not a
guarantee that NCCL ran that many CTAs (it may use fewer for small messages).

``async_op=True`` collectives on NCCL run on the process group's own stream; ``wait()`` makes the
current (compute) stream wait for it, so the collective starts when the compute stream reaches the point
where it was issued: the launch slot.

``Communicator(delay_s=..., delay_s_per_byte=...)`` slows every collective by a fixed delay (s) plus a
delay per byte (s/byte; the all-reduced or reduce-scattered input, the all-gathered output) to emulate
a slow link on CPU (benchmarks only): collectives then run in issue order on one helper thread that
sleeps, then communicates.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from kareus_megatron.runtime.overlap.comm_groups import (  # noqa: F401  (re-exported: the engine's names)
    NCCL_CTA_ENV,
    CommGroupInfo,
    build_sm_group_set,
    build_sm_groups,
    is_nccl_backend,
    nccl_cta_overrides,
)


class Pending:
    """A collective in flight; ``wait()`` blocks (or orders the compute stream) until it is done."""

    def __init__(self, work: Any | None, future: Future | None = None) -> None:
        self._work = work
        self._future = future

    def wait(self) -> None:
        """Block until the collective's result may be used."""
        if self._future is not None:
            self._future.result()
        elif self._work is not None:
            self._work.wait()


class Communicator:
    """Issues the engine's TP collectives, on the communicator for the requested comm SM count."""

    def __init__(
        self,
        tp_group: dist.ProcessGroup | None = None,
        sm_groups: dict[int, dist.ProcessGroup] | None = None,
        delay_s: float = 0.0,
        delay_s_per_byte: float = 0.0,
        cp_sm_groups: dict[int, dist.ProcessGroup] | None = None,
        group_infos: tuple[CommGroupInfo, ...] = (),
    ) -> None:
        self.tp_group = tp_group
        self.sm_groups = dict(sm_groups or {})
        self.cp_sm_groups = dict(cp_sm_groups or {})  # CP groups by SM count (build_sm_groups on the CP group)
        self.group_infos = tuple(group_infos)  # what each SM-limited communicator cost (comm_groups.py)
        self.delay_s = delay_s
        self.delay_s_per_byte = delay_s_per_byte
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def group_for(
        self, comm_sms: int | None, layer_group: dist.ProcessGroup | None = None
    ) -> tuple[dist.ProcessGroup | None, bool]:
        """(group, whether the SM limit is requested: an SM-limited communicator exists for it) for an SM count.

        Falls back to `layer_group` (the calling layer's TP group), then to this communicator's.
        """
        if comm_sms is not None and comm_sms in self.sm_groups:
            return self.sm_groups[comm_sms], True
        return (layer_group if layer_group is not None else self.tp_group), False

    @staticmethod
    def world(group: dist.ProcessGroup | None) -> int:
        """Size of `group` (1 when torch.distributed is not initialised)."""
        if not dist.is_available() or not dist.is_initialized():
            return 1
        return dist.get_world_size(group)

    def all_reduce(
        self, tensor: torch.Tensor, comm_sms: int | None, layer_group: dist.ProcessGroup | None = None
    ) -> tuple[Pending, bool]:
        """Start an in-place sum all-reduce of `tensor`; return it pending and whether an SM limit was requested."""
        group, requested = self.group_for(comm_sms, layer_group)
        if self.world(group) == 1:
            return Pending(None), requested
        return self._start(lambda a: dist.all_reduce(tensor, group=group, async_op=a), tensor), requested

    def all_gather(
        self,
        out: torch.Tensor,
        tensor: torch.Tensor,
        comm_sms: int | None,
        layer_group: dist.ProcessGroup | None = None,
    ) -> tuple[Pending, bool]:
        """Start gathering `tensor` of every rank into `out` along dim 0 (rank order; sequence parallelism's
        all-gather, ``out`` is world × `tensor`'s first dim); return it pending and whether an SM limit was
        requested."""
        group, requested = self.group_for(comm_sms, layer_group)
        if self.world(group) == 1:
            out.copy_(tensor)
            return Pending(None), requested
        return self._start(lambda a: dist.all_gather_into_tensor(out, tensor, group=group, async_op=a), out), requested

    def reduce_scatter(
        self,
        out: torch.Tensor,
        tensor: torch.Tensor,
        comm_sms: int | None,
        layer_group: dist.ProcessGroup | None = None,
    ) -> tuple[Pending, bool]:
        """Start summing `tensor` over the ranks and keeping this rank's dim-0 slice in `out` (sequence
        parallelism's reduce-scatter); return it pending and whether an SM limit was requested."""
        group, requested = self.group_for(comm_sms, layer_group)
        if self.world(group) == 1:
            out.copy_(tensor)
            return Pending(None), requested
        pending = self._start(lambda a: dist.reduce_scatter_tensor(out, tensor, group=group, async_op=a), tensor)
        return pending, requested

    def cp_all_gather(
        self, out: torch.Tensor, tensor: torch.Tensor, comm_sms: int | None, cp_group: dist.ProcessGroup | None
    ) -> tuple[Pending, bool]:
        """Start context parallelism's K/V all-gather: `tensor` of every rank of `cp_group` into `out` along
        dim 0 (rank order), on the CP communicator for `comm_sms`; return it pending and whether an SM limit
        was requested."""
        group, requested = self._cp_group_for(comm_sms, cp_group)
        return self.all_gather(out, tensor, None, group)[0], requested

    def cp_reduce_scatter(
        self, out: torch.Tensor, tensor: torch.Tensor, comm_sms: int | None, cp_group: dist.ProcessGroup | None
    ) -> tuple[Pending, bool]:
        """Start context parallelism's dK/dV reduce-scatter over `cp_group` (sum, this rank's dim-0 slice into
        `out`); return it pending and whether an SM limit was requested."""
        group, requested = self._cp_group_for(comm_sms, cp_group)
        return self.reduce_scatter(out, tensor, None, group)[0], requested

    def _cp_group_for(
        self, comm_sms: int | None, cp_group: dist.ProcessGroup | None
    ) -> tuple[dist.ProcessGroup | None, bool]:
        if comm_sms is not None and comm_sms in self.cp_sm_groups:
            return self.cp_sm_groups[comm_sms], True
        return cp_group, False

    def _start(self, collective, tensor: torch.Tensor) -> Pending:
        """Run ``collective(async_op)``: async now, or after the slow-link delay for `tensor`'s bytes on the
        helper thread (collectives then run in issue order)."""
        if self.delay_s <= 0 and self.delay_s_per_byte <= 0:
            return Pending(collective(True))
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kareus-slow-link")
        delay = self.delay_s + self.delay_s_per_byte * tensor.numel() * tensor.element_size()
        return Pending(None, self._pool.submit(self._slow, collective, delay))

    @staticmethod
    def _slow(collective, delay_s: float) -> None:
        time.sleep(delay_s)
        collective(False)

    def close(self) -> None:
        """Stop the slow-link helper thread, if any."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

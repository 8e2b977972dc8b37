"""Collectives of the overlap engine: async TP all-reduce (and, with sequence parallelism, all-gather and
reduce-scatter along dim 0), and context parallelism's K/V all-gather and dK/dV reduce-scatter over the CP
group (``cp_all_gather`` / ``cp_reduce_scatter``), on a communicator chosen by comm SM count.

On NCCL, SMs given to a collective are set per communicator: ``ProcessGroupNCCL.Options().config``
``max_ctas``/``min_ctas`` (NCCL >= 2.17 runs one CTA per SM). Communicators cannot change this after
creation, so ``build_sm_groups`` creates, once at start-up and collectively on every rank, one TP group per
distinct SM count the plan uses. On gloo (and any other backend) the request is recorded in the trace and
has no effect; the default TP group is used. A mixed group (``"cpu:gloo,cuda:nccl"``, torch's backend
string for a group with a backend per device type) counts as NCCL: its CUDA tensors go through NCCL.

NCCL's environment variables NCCL_MAX_CTAS / NCCL_MIN_CTAS / NCCL_MIN_NCHANNELS / NCCL_MAX_NCHANNELS
bound the CTAs of every communicator and win over a communicator's config (NCCL docs, "Environment
Variables" and ``ncclConfig_t``), so with any of them set the plan's limits would be overridden while the
trace said they applied: ``build_sm_groups`` then warns in one line and builds no groups (every
request is recorded as not applied). Each group is warmed up when it is built (one 1-element
all-reduce): NCCL creates a communicator at its first collective, which would otherwise land inside
iteration 0 of the layer, and its memory (about 1 GB on large nodes) is logged from the device's free
memory before and after.

``async_op=True`` collectives on NCCL run on the process group's own stream; ``wait()`` makes the
current (compute) stream wait for it, so the collective starts when the compute stream reaches the point
where it was issued: the launch slot.

``Communicator(delay_s=..., delay_s_per_byte=...)`` slows every collective by a fixed delay (s) plus a
delay per byte (s/byte; the all-reduced or reduce-scattered input, the all-gathered output) to emulate
a slow link on CPU (benchmarks only): collectives then run in issue order on one helper thread that
sleeps, then communicates.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import warnings
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist

NCCL_CTA_ENV = ("NCCL_MAX_CTAS", "NCCL_MIN_CTAS", "NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS")
_log = logging.getLogger("kareus_megatron.overlap")


def is_nccl_backend(backend: str) -> bool:
    """Whether torch's backend string `backend` uses NCCL (``"nccl"``, or ``"cuda:nccl"`` within a mixed
    ``"cpu:gloo,cuda:nccl"``)."""
    return any(part.strip().rsplit(":", 1)[-1].lower() == "nccl" for part in str(backend).split(","))


def nccl_cta_overrides(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The NCCL CTA/channel variables set in `environ` (os.environ when None) that override the plan's limits."""
    env = os.environ if environ is None else environ
    return {k: env[k] for k in NCCL_CTA_ENV if env.get(k, "").strip()}


def warm_up(group: dist.ProcessGroup, sms: int) -> float | None:
    """One 1-element all-reduce on `group` so NCCL creates its communicator now; return the device memory it
    took (bytes, from the free memory before and after) where CUDA is available, else None; log it."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    free0 = torch.cuda.mem_get_info()[0] if cuda else 0
    dist.all_reduce(torch.zeros(1, device=device), group=group)
    if not cuda:
        return None
    torch.cuda.synchronize()
    used = float(free0 - torch.cuda.mem_get_info()[0])
    _log.info("kareus: comm group for %d SMs ready; its communicator took %.0f MiB of device memory",
              sms, used / 2**20)
    return used


class Pending:
    """A collective in flight; ``wait()`` blocks (or orders the compute stream) until it is done."""

    def __init__(self, work: object | None, future: Future | None = None) -> None:
        self._work = work
        self._future = future

    def wait(self) -> None:
        """Block until the collective's result may be used."""
        if self._future is not None:
            self._future.result()
        elif self._work is not None:
            self._work.wait()


def _nccl_options(comm_sms: int) -> object:
    """``ProcessGroupNCCL.Options`` limiting the communicator to `comm_sms` CTAs.

    The same fields megatron-core sets from its ``nccl_communicator_config_path`` (parallel_state.py,
    ``get_nccl_options``: ``config.max_ctas`` / ``config.min_ctas``).
    """
    opts = dist.ProcessGroupNCCL.Options()
    opts.config.max_ctas = comm_sms
    opts.config.min_ctas = comm_sms
    return opts


def build_sm_groups(comm_sms: Iterable[int], tp_group: dist.ProcessGroup) -> dict[int, dist.ProcessGroup]:
    """One NCCL TP group per SM count (collective over the world; call once on every rank, same args).

    Returns {} on non-NCCL backends and when NCCL's environment overrides CTA limits (a warning then; the
    request is only recorded). Each group this rank belongs to is warmed up (``warm_up``).
    """
    values = sorted(set(comm_sms))
    if not values or not is_nccl_backend(dist.get_backend(tp_group)):
        return {}
    overrides = nccl_cta_overrides()
    if overrides:
        warnings.warn("kareus: " + ", ".join(f"{k}={v}" for k, v in overrides.items()) + " override every NCCL "
                      "communicator's CTA limit, so the plan's comm SM counts cannot apply; running without them "
                      "(unset these to apply the plan's limits)", stacklevel=2)
        return {}
    mine = tuple(dist.get_process_group_ranks(tp_group))
    everyone: list[tuple[int, ...] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    tp_lists = sorted({tuple(r) for r in everyone if r is not None})
    groups: dict[int, dist.ProcessGroup] = {}
    for sms in values:
        for ranks in tp_lists:  # every rank creates every group, in the same order
            g = dist.new_group(list(ranks), backend="nccl", pg_options=_nccl_options(sms))
            if ranks == mine:
                groups[sms] = g
    for sms in values:  # members only, in the same order on every rank of a group: no rank waits on another
        warm_up(groups[sms], sms)
    return groups


class Communicator:
    """Issues the engine's TP collectives, on the communicator for the requested comm SM count."""

    def __init__(
        self,
        tp_group: dist.ProcessGroup | None = None,
        sm_groups: dict[int, dist.ProcessGroup] | None = None,
        delay_s: float = 0.0,
        delay_s_per_byte: float = 0.0,
        cp_sm_groups: dict[int, dist.ProcessGroup] | None = None,
    ) -> None:
        self.tp_group = tp_group
        self.sm_groups = dict(sm_groups or {})
        self.cp_sm_groups = dict(cp_sm_groups or {})  # CP groups by SM count (build_sm_groups on the CP group)
        self.delay_s = delay_s
        self.delay_s_per_byte = delay_s_per_byte
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def group_for(
        self, comm_sms: int | None, layer_group: dist.ProcessGroup | None = None
    ) -> tuple[dist.ProcessGroup | None, bool]:
        """(group, whether the SM limit is applied) for a requested SM count.

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
        """Start an in-place sum all-reduce of `tensor`; return it pending and whether SMs were limited."""
        group, applied = self.group_for(comm_sms, layer_group)
        if self.world(group) == 1:
            return Pending(None), applied
        return self._start(lambda a: dist.all_reduce(tensor, group=group, async_op=a), tensor), applied

    def all_gather(
        self, out: torch.Tensor, tensor: torch.Tensor, comm_sms: int | None,
        layer_group: dist.ProcessGroup | None = None,
    ) -> tuple[Pending, bool]:
        """Start gathering `tensor` of every rank into `out` along dim 0 (rank order; sequence parallelism's
        all-gather, ``out`` is world × `tensor`'s first dim); return it pending and whether SMs were limited."""
        group, applied = self.group_for(comm_sms, layer_group)
        if self.world(group) == 1:
            out.copy_(tensor)
            return Pending(None), applied
        return self._start(lambda a: dist.all_gather_into_tensor(out, tensor, group=group, async_op=a), out), applied

    def reduce_scatter(
        self, out: torch.Tensor, tensor: torch.Tensor, comm_sms: int | None,
        layer_group: dist.ProcessGroup | None = None,
    ) -> tuple[Pending, bool]:
        """Start summing `tensor` over the ranks and keeping this rank's dim-0 slice in `out` (sequence
        parallelism's reduce-scatter); return it pending and whether SMs were limited."""
        group, applied = self.group_for(comm_sms, layer_group)
        if self.world(group) == 1:
            out.copy_(tensor)
            return Pending(None), applied
        return self._start(lambda a: dist.reduce_scatter_tensor(out, tensor, group=group, async_op=a), tensor), applied

    def cp_all_gather(
        self, out: torch.Tensor, tensor: torch.Tensor, comm_sms: int | None, cp_group: dist.ProcessGroup | None
    ) -> tuple[Pending, bool]:
        """Start context parallelism's K/V all-gather: `tensor` of every rank of `cp_group` into `out` along
        dim 0 (rank order), on the CP communicator for `comm_sms`; return it pending and whether SMs were
        limited."""
        group, applied = self._cp_group_for(comm_sms, cp_group)
        return self.all_gather(out, tensor, None, group)[0], applied

    def cp_reduce_scatter(
        self, out: torch.Tensor, tensor: torch.Tensor, comm_sms: int | None, cp_group: dist.ProcessGroup | None
    ) -> tuple[Pending, bool]:
        """Start context parallelism's dK/dV reduce-scatter over `cp_group` (sum, this rank's dim-0 slice into
        `out`); return it pending and whether SMs were limited."""
        group, applied = self._cp_group_for(comm_sms, cp_group)
        return self.reduce_scatter(out, tensor, None, group)[0], applied

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

"""SM-limited communicators of the overlap engine: which comm SM counts NCCL honours here, the budget,
building them (sharing one parent's resources where torch can split), and what each one cost.

Terms:

- *SM-limited communicator*: an NCCL process group built with ``ProcessGroupNCCL.Options().config``
  ``max_ctas = min_ctas = comm_sms`` (NCCL >= 2.17 runs one CTA per SM; megatron-core sets the same fields
  from its ``nccl_communicator_config_path``). A collective issued on it has the SM limit *requested*: NCCL
  may still run fewer CTAs (small messages, the algorithm and protocol it picks), so the trace says
  ``sm_limit_requested``, never "ran on N SMs". Communicators cannot change their limit after creation:
  one per distinct count, built once at start-up, collectively on every rank.
- *budget*: at most ``vocab.MAX_COMM_SM_VALUES`` SM-limited communicators per process group (the TP
  group's partitions; the CP group's K/V ones), so at most twice that per rank. The planner searches at
  most that many values per group (search/tables.py ``knob_sms``), so every plan it writes fits; a plan
  that does not (hand-made, older) is refused at load in one line (config.validate_plan_for_layer), and an
  explicit list over the budget here (benchmarks) raises ConfigError before anything is built.
- *sharing*: where torch can split communicators (the default process group is bound to a device,
  ``init_process_group(device_id=...)``, and torch has ``split_group``), one parent per group is created with
  ``config.split_share = 1`` (its CTAs capped at the largest planned count) and every SM-limited communicator
  is split from it (``ncclCommSplit``), sharing its buffers and proxy (NCCL ``ncclConfig_t.splitShare``);
  otherwise (Megatron-LM binds no device) each is its own ``new_group``. ``CommGroupInfo.shared`` records
  which.
- *NCCL's environment*: NCCL_MIN_CTAS / NCCL_MAX_CTAS replace every communicator's config values, so with
  either set no SM-limited communicator is built (one warning). NCCL_MAX_NCHANNELS=c caps the channels
  (one CTA each) and NCCL_MIN_NCHANNELS=c floors them: only the counts above the cap (below the floor) could
  not run as planned, and only those are dropped (one warning naming them); their partitions run on the
  layer's default communicator and are recorded as not SM-limited. A value that is not a positive integer
  counts as overriding everything.

Each communicator is warmed up when built (one 1-element all-reduce): NCCL creates it at its first
collective, which would otherwise land inside iteration 0. ``CommGroupInfo`` holds its init time (s, creation
plus warm-up) and the device memory it took (bytes, from the free memory before and after; None on CPU), for
the run log header.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from kareus_megatron.errors import ConfigError
from kareus_megatron.vocab import MAX_COMM_SM_VALUES

NCCL_CTA_ENV = ("NCCL_MAX_CTAS", "NCCL_MIN_CTAS", "NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS")
_REPLACING_ENV = ("NCCL_MAX_CTAS", "NCCL_MIN_CTAS")  # replace the config's values on every communicator
_log = logging.getLogger("kareus_megatron.overlap")


@dataclass(frozen=True, slots=True)
class CommGroupInfo:
    """One communicator this rank built: its SM count (None: the shared parent, NCCL's default CTAs), group
    kind ("tp"/"cp"), init time (s), device memory (bytes; None off CUDA), and whether it shares a parent's
    resources."""

    comm_sms: int | None
    kind: str
    init_s: float
    memory_bytes: int | None
    shared: bool

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, for the run log header."""
        return asdict(self)


@dataclass(frozen=True, slots=True)
class SmGroupSet:
    """What ``build_sm_group_set`` built on this rank: {count: group}, each one's cost (the shared parent's
    first, if any), and the parent group (None when not sharing)."""

    groups: dict[int, Any] = field(default_factory=dict)
    infos: tuple[CommGroupInfo, ...] = ()
    parent: Any = None


def is_nccl_backend(backend: str) -> bool:
    """Whether torch's backend string `backend` uses NCCL (``"nccl"``, or ``"cuda:nccl"`` within a mixed
    ``"cpu:gloo,cuda:nccl"``, whose CUDA tensors go through NCCL)."""
    return any(part.strip().rsplit(":", 1)[-1].lower() == "nccl" for part in str(backend).split(","))


def nccl_cta_overrides(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The NCCL CTA/channel variables set (non-blank) in `environ` (os.environ when None)."""
    env = os.environ if environ is None else environ
    return {k: env[k] for k in NCCL_CTA_ENV if env.get(k, "").strip()}


def usable_sm_counts(values: Iterable[int], environ: Mapping[str, str] | None = None) -> tuple[list[int], str]:
    """(the counts of `values` NCCL's environment lets run as planned, ascending; why the others cannot: ""
    when none is dropped). See the module doc for the rules."""
    values = sorted(set(values))
    env = nccl_cta_overrides(environ)
    if not env or not values:
        return values, ""
    named = ", ".join(f"{k}={v}" for k, v in env.items())
    limits: dict[str, int] = {}
    for k, v in env.items():
        v = v.strip()
        if k in _REPLACING_ENV or not v.isdigit() or int(v) < 1:
            return [], (
                f"{named} override every NCCL communicator's CTA limit, so no comm SM count of the plan can apply"
            )
        limits[k] = int(v)
    lo, hi = limits.get("NCCL_MIN_NCHANNELS", 0), limits.get("NCCL_MAX_NCHANNELS", 1 << 30)
    keep = [s for s in values if lo <= s <= hi]
    dropped = [s for s in values if s not in keep]
    if not dropped:
        return keep, ""
    return keep, (
        f"{named} leave(s) NCCL no room for comm SM counts {', '.join(map(str, dropped))} "
        f"(channels {lo or 1}..{hi if hi < 1 << 30 else 'max'})"
    )


def check_budget(values: Iterable[int], kind: str = "tp") -> None:
    """ConfigError when `values` has more distinct counts than one group's budget (vocab.MAX_COMM_SM_VALUES)."""
    n = len(set(values))
    if n > MAX_COMM_SM_VALUES:
        raise ConfigError(
            f"{n} distinct comm SM counts for the {kind.upper()} group; the overlap engine builds at "
            f"most {MAX_COMM_SM_VALUES} SM-limited communicators per group; use at most "
            f"{MAX_COMM_SM_VALUES} (the planner's grid: search/tables.py knob_sms)"
        )


def nccl_options(comm_sms: int | None = None, share: bool = False, max_ctas: int | None = None) -> Any:
    """``ProcessGroupNCCL.Options`` limiting the communicator to `comm_sms` CTAs (max and min; None: NCCL's
    default) or at most `max_ctas`; `share`: ``config.split_share = 1`` (a parent whose children share its
    resources)."""
    opts = dist.ProcessGroupNCCL.Options()
    if comm_sms is not None:
        opts.config.max_ctas = comm_sms
        opts.config.min_ctas = comm_sms
    if max_ctas is not None:
        opts.config.max_ctas = max_ctas
    if share:
        opts.config.split_share = 1  # type: ignore[attr-defined]  # an NCCL config field torch's stub lacks
    return opts


def can_share() -> bool:
    """Whether SM-limited communicators can be split from a shared parent here: torch has ``split_group``
    and ``split_share``, and the default process group is bound to a device."""
    if not hasattr(dist, "split_group") or not hasattr(dist, "ProcessGroupNCCL"):
        return False
    if not hasattr(dist.ProcessGroupNCCL.Options().config, "split_share"):
        return False
    return getattr(dist.group.WORLD, "bound_device_id", None) is not None


def _device_free_bytes() -> int | None:
    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    return int(torch.cuda.mem_get_info()[0])


def scratch_tensor() -> torch.Tensor:
    """The 1-element tensor warm-ups all-reduce, on the current CUDA device (else the CPU)."""
    cuda = torch.cuda.is_available()
    return torch.zeros(1, device=torch.device("cuda", torch.cuda.current_device()) if cuda else "cpu")


def warm_up(group: Any, scratch: torch.Tensor | None = None) -> None:
    """One 1-element all-reduce on `group`, so NCCL creates its communicator now (not in iteration 0)."""
    dist.all_reduce(scratch_tensor() if scratch is None else scratch, group=group)


def _timed(kind: str, sms: int | None, shared: bool, make: Any, scratch: torch.Tensor) -> tuple[Any, CommGroupInfo]:
    """(`make()`'s group warmed up, its CommGroupInfo): init time from creation to warm-up, free-memory delta."""
    free0, t0 = _device_free_bytes(), time.perf_counter()
    g = make()
    warm_up(g, scratch)  # members only, in the same order on every rank of a group: no rank waits on another
    free1 = _device_free_bytes()
    info = CommGroupInfo(
        comm_sms=sms,
        kind=kind,
        init_s=time.perf_counter() - t0,
        shared=shared,
        memory_bytes=None if free0 is None or free1 is None else free0 - free1,
    )
    _log.info(
        "kareus: %s communicator %s ready in %.3f s%s",
        kind.upper(),
        "parent (shared)" if sms is None else f"for {sms} SMs" + (" (shared)" if shared else ""),
        info.init_s,
        "" if info.memory_bytes is None else f", {info.memory_bytes / 2**20:.0f} MiB of device memory",
    )
    return g, info


def build_sm_group_set(comm_sms: Iterable[int], group: Any, kind: str = "tp") -> SmGroupSet:
    """One SM-limited NCCL communicator per usable count over `group`'s ranks (collective over the world: call
    once on every rank, same arguments); see the module doc.

    Empty on non-NCCL backends; counts NCCL's environment overrides are left out with one warning;
    ConfigError over the budget (before anything is built).
    """
    values = sorted(set(comm_sms))
    check_budget(values, kind)
    if not values or not is_nccl_backend(dist.get_backend(group)):
        return SmGroupSet()
    values, why = usable_sm_counts(values)
    if why:
        warnings.warn(
            f"kareus: {why}; those partitions run on the default communicator, recorded as not "
            "SM-limited (unset the variables to apply the plan)",
            stacklevel=2,
        )
    if not values:
        return SmGroupSet()
    mine = tuple(dist.get_process_group_ranks(group))
    everyone: list[tuple[int, ...] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    lists = sorted({tuple(r) for r in everyone if r is not None})
    scratch, shared = scratch_tensor(), can_share()

    def every_group(options: Any) -> Any:  # every rank creates every group, in the same order
        made = None
        for ranks in lists:  # fresh options per group: torch writes the group's ranks and name into them
            g = dist.new_group(list(ranks), backend="nccl", pg_options=options())
            made = g if ranks == mine else made
        return made

    infos: list[CommGroupInfo] = []
    parent = None
    if shared:  # one parent per group, created with split_share: the children split from it share its resources;
        # its channels (CTAs) capped at the largest child's: a child has at most its parent's channels
        def parent_options() -> Any:
            return nccl_options(share=True, max_ctas=values[-1])

        parent, info = _timed(kind, None, True, lambda: every_group(parent_options), scratch)
        infos.append(info)
    groups: dict[int, Any] = {}
    for sms in values:
        if shared:  # ncclCommSplit, collective over the parent (this rank's group) only

            def make(sms: int = sms) -> Any:
                return dist.split_group(
                    parent_pg=parent, split_ranks=[list(range(len(mine)))], pg_options=nccl_options(sms)
                )
        else:

            def make(sms: int = sms) -> Any:
                return every_group(lambda: nccl_options(sms))

        groups[sms], info = _timed(kind, sms, shared, make, scratch)
        infos.append(info)
    return SmGroupSet(groups=groups, infos=tuple(infos), parent=parent)


def build_sm_groups(comm_sms: Iterable[int], group: Any, kind: str = "tp") -> dict[int, Any]:
    """``build_sm_group_set``'s groups: {count: this rank's SM-limited group}."""
    return build_sm_group_set(comm_sms, group, kind).groups

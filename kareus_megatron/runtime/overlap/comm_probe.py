"""GPU probe of the SM-limited communicators, on one rank: what building them costs here.

``probe_sm_limited_comms(device, sm_counts)`` builds the communicators the overlap engine would build for
`sm_counts` (comm_groups.build_sm_group_set: same budget, same NCCL-environment rule, same sharing),
runs one small all-reduce on each and reports, JSON-ready: per communicator its init time (s), device
memory before/after (bytes: free memory from ``torch.cuda.mem_get_info`` and ``torch.cuda.memory_allocated``)
and the all-reduce's time (s) and result; the torch and NCCL versions; whether this torch/NCCL can express an
SM limit (``ProcessGroupNCCL.Options().config.max_ctas``/``min_ctas``) and share resources (``split_share``,
``split_group``). Without a process group it makes a world of one (nccl on cuda, bound to the device so
torch may split; gloo on cpu) and destroys it afterwards, with every group it made; inside a world of
one it uses that one (its groups destroyed, the world kept); a larger world is refused (ConfigError): the
build is collective over every rank. On cpu (gloo) no SM-limited communicator exists: the all-reduce runs
on the world group and ``not_applicable`` names the fields that have no value there. With one rank an
all-reduce moves no data between GPUs, so its time is a launch, not a bandwidth.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from kareus_megatron.errors import ConfigError
from kareus_megatron.runtime.overlap.comm_groups import (
    build_sm_group_set,
    can_share,
    nccl_cta_overrides,
    usable_sm_counts,
)
from kareus_megatron.vocab import MAX_COMM_SM_VALUES

PROBE_ELEMENTS = 1024  # float32 elements of the probe's all-reduce (4 KiB)
CUDA_ONLY = (
    "memory_free_before_bytes",
    "memory_free_after_bytes",
    "memory_bytes",
    "memory_allocated_before_bytes",
    "memory_allocated_after_bytes",
    "nccl_version",
)


def _nccl_version() -> str | None:
    try:
        v = torch.cuda.nccl.version()
    except Exception:  # a CPU build of torch, or no NCCL in it
        return None
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def sm_limit_support() -> dict[str, Any]:
    """Whether this torch can express an SM limit (``max_ctas``/``min_ctas``) and shared communicators."""
    opts_cls = getattr(dist, "ProcessGroupNCCL", None)
    config = None
    if opts_cls is not None:
        try:
            config = opts_cls.Options().config
        except Exception:
            config = None
    return {
        "sm_limit_expressible": config is not None and all(hasattr(config, f) for f in ("max_ctas", "min_ctas")),
        "split_share_available": config is not None and hasattr(config, "split_share"),
        "split_group_available": hasattr(dist, "split_group"),
    }


def _memory(cuda: bool) -> tuple[int | None, int | None]:
    if not cuda:
        return None, None
    torch.cuda.synchronize()
    return int(torch.cuda.mem_get_info()[0]), int(torch.cuda.memory_allocated())


def _world(device: torch.device) -> bool:
    """Make a world of one for `device` when there is none; True when this call made it."""
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise ConfigError(
                f"probe_sm_limited_comms runs on one rank, but this process is in a world of "
                f"{dist.get_world_size()}; call it before init_process_group or in a world of one"
            )
        return False
    if device.type == "cuda":
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return True


def probe_sm_limited_comms(device: str, sm_counts: Sequence[int]) -> dict[str, Any]:
    """Build the engine's SM-limited communicators for `sm_counts` on one rank of `device` ("cuda", "cuda:N",
    "cpu"), one small all-reduce on each; a JSON-ready report (see the module doc). Cleans up after itself."""
    t_start = time.perf_counter()
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = torch.device("meta")  # refused below
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device {device!r}: CUDA is not available here; use device='cpu'")
        dev = torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)
        torch.cuda.set_device(dev)
    elif dev.type != "cpu":
        raise ConfigError(f"device {device!r}: use 'cuda', 'cuda:N' or 'cpu'")
    counts = sorted({int(s) for s in sm_counts})
    if any(s < 1 for s in counts):
        raise ConfigError(f"sm_counts {list(sm_counts)}: comm SM counts are positive integers")
    cuda = dev.type == "cuda"
    report: dict[str, Any] = {
        "device": str(dev),
        "torch_version": torch.__version__,
        "nccl_version": _nccl_version() if cuda else None,
        "backend": "nccl" if cuda else "gloo",
        "sm_counts": counts,
        "budget_per_group": MAX_COMM_SM_VALUES,
        "nccl_env": nccl_cta_overrides(),
        **sm_limit_support(),
        "not_applicable": [] if cuda else [*CUDA_ONLY, "init_s", "sm_limit_requested"],
        "notes": ["one rank: each all-reduce moves no data between GPUs (a launch, not a bandwidth)"]
        + (
            []
            if cuda
            else ["gloo has no CTA limit: no SM-limited communicator is built, the all-reduces run on the world group"]
        ),
    }
    usable, why = usable_sm_counts(counts)
    report["usable_sm_counts"], report["dropped_by_nccl_env"] = usable, why or None
    made_world = _world(dev)
    built = None
    try:
        report["shared"] = cuda and can_share()
        f0, a0 = _memory(cuda)
        built = build_sm_group_set(counts, dist.group.WORLD, "tp")
        f1, a1 = _memory(cuda)
        infos = {i.comm_sms: i for i in built.infos}
        report["parent"] = infos[None].to_dict() if None in infos else None
        x = torch.ones(PROBE_ELEMENTS, device=dev)
        rows = []
        for s in counts:
            group = built.groups.get(s)
            info = infos.get(s)
            x.fill_(1.0)
            fb, ab = _memory(cuda)
            t0 = time.perf_counter()
            dist.all_reduce(x, group=group if group is not None else dist.group.WORLD)
            if cuda:
                torch.cuda.synchronize()
            t_ar = time.perf_counter() - t0
            fa, aa = _memory(cuda)
            rows.append(
                {
                    "comm_sms": s,
                    "sm_limit_requested": group is not None,
                    "init_s": None if info is None else info.init_s,
                    "memory_bytes": None if info is None else info.memory_bytes,
                    "shared": bool(info and info.shared),
                    "memory_free_before_bytes": fb,
                    "memory_free_after_bytes": fa,
                    "memory_allocated_before_bytes": ab,
                    "memory_allocated_after_bytes": aa,
                    "all_reduce_s": t_ar,
                    "all_reduce_ok": bool(torch.all(x == float(dist.get_world_size()))),
                }
            )
        report["communicators"] = rows
        report["build_memory_free_before_bytes"], report["build_memory_free_after_bytes"] = f0, f1
        report["build_memory_allocated_before_bytes"], report["build_memory_allocated_after_bytes"] = a0, a1
    finally:
        if built is not None:
            for g in [*built.groups.values(), built.parent]:
                if g is not None:
                    dist.destroy_process_group(g)
        if made_world:
            dist.destroy_process_group()
    report["cleaned_up"] = not made_world or not dist.is_initialized()
    report["total_s"] = time.perf_counter() - t_start
    return report

"""`kareus env`: what this machine offers the runtime (driver, NVML, clocks, permissions, versions).

Reads versions from package metadata (nothing heavy is imported) and asks NVML about one GPU (by NVML
index; supported clocks at the highest memory clock, UUID, temperature). ``--check-permission`` finds
out whether this user may lock clocks (root or CAP_SYS_ADMIN): without either the answer is no and
nothing is touched; otherwise it locks the supported clock nearest the current one and resets that lock
(which also ends a lock an administrator set; nvml.check_clock_permission).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

MAX_GPU_INDEX = 1024  # GPU indices accepted: 0 .. MAX_GPU_INDEX - 1
HELP = "show the GPU driver, NVML, supported SM clocks, clock permissions and framework versions"

_PACKAGES = ("kareus-megatron", "torch", "megatron-core", "deepspeed", "nvidia-ml-py")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register `kareus env` flags."""
    parser.add_argument("--gpu-index", "--device", dest="gpu_index", type=int, default=0,
                        help="local GPU index to inspect (default 0)")
    parser.add_argument("--check-permission", action="store_true",
                        help="test clock-lock permission: no change without root/CAP_SYS_ADMIN, else lock the "
                        "current clock and reset that lock once")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def _versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {}
    for name in _PACKAGES:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def environment(gpu_index: int = 0, check_permission: bool = False) -> dict[str, Any]:
    """The environment report as a dict (see module doc)."""
    from kareus_megatron.hardware.device.nvml import nvml_report
    from kareus_megatron.versions import is_supported, supported_series

    versions = _versions()
    backend = os.environ.get("KAREUS_GPU_BACKEND") or None
    report: dict[str, Any] = {
        "versions": versions,
        "megatron_core_supported": bool(versions["megatron-core"])
        and is_supported("megatron-core", versions["megatron-core"] or ""),
        "supported_megatron_core": [s.series + ".x" for s in supported_series("megatron-core")],
        "deepspeed_supported": bool(versions["deepspeed"]) and is_supported("deepspeed", versions["deepspeed"] or ""),
        "supported_deepspeed": [s.series + ".x" for s in supported_series("deepspeed")],
        "gpu_backend": backend or "(default: nvml when available)",
        "root": os.geteuid() == 0 if hasattr(os, "geteuid") else None,
        "nvml": nvml_report(gpu_index, check_permission),
    }
    if backend == "simulated":
        from kareus_megatron.hardware.device.sim import latency_from_env

        report["simulated"] = {
            "gpu": os.environ.get("KAREUS_GPU") or "(the plan's GPU)",
            "latency_ms": latency_from_env() * 1000.0,
            "log": os.environ.get("KAREUS_SIMULATED_LOG") or None,
        }
    return report


def _clock_range(clocks: list[int]) -> str:
    if not clocks:
        return "none"
    return f"{clocks[-1]}..{clocks[0]} MHz ({len(clocks)} clocks)"


def run(args: argparse.Namespace) -> int:
    """Print the environment report; exit 0."""
    if not 0 <= args.gpu_index < MAX_GPU_INDEX:
        from kareus_megatron.errors import ConfigError

        raise ConfigError(f"--gpu-index {args.gpu_index} must be a GPU index from 0 to {MAX_GPU_INDEX - 1}.")
    rep = environment(args.gpu_index, args.check_permission)
    if args.json:
        print(json.dumps(rep, indent=1))
        return 0
    v = rep["versions"]
    for name in _PACKAGES:
        print(f"{name:16s} {v[name] or 'not installed'}")
    for name, key in (("megatron-core", "megatron_core"), ("deepspeed", "deepspeed")):
        if v[name] is not None and not rep[f"{key}_supported"]:
            print(f"{'':16s} the runtime supports {name} {', '.join(rep[f'supported_{key}'])} only")
    print(f"{'GPU backend':16s} {rep['gpu_backend']}")
    n = rep["nvml"]
    if not n.get("nvml"):
        print(f"{'NVML':16s} unavailable: {n.get('error')}")
    else:
        print(f"{'NVML driver':16s} {n.get('driver_version')} ({n.get('device_count')} GPUs)")
        if "name" in n:
            print(f"{'GPU ' + str(n['index']):16s} {n['name']} (preset: {n['preset'] or 'none; pass --gpu'})")
            print(f"{'SM clocks':16s} {_clock_range(n['supported_sm_clocks_mhz'])} at memory clock "
                  f"{n['memory_clock_mhz']} MHz; now {n['sm_clock_mhz']} MHz")
            print(f"{'energy counter':16s} "
                  f"{'readable' if n.get('energy_counter_mj') is not None else n.get('energy_error')}")
        if "clock_permission" in n:
            print(f"{'lock clocks':16s} {'allowed' if n['clock_permission'] else n.get('permission_error')}")
        else:
            print(f"{'lock clocks':16s} {'likely (running as root)' if rep['root'] else 'needs root or CAP_SYS_ADMIN'}"
                  " (test with --check-permission)")
        if n.get("error"):
            print(f"{'NVML error':16s} {n['error']}")
    if "simulated" in rep:
        s = rep["simulated"]
        print(f"{'simulated GPU':16s} {s['gpu']}, NVML latency {s['latency_ms']:g} ms, log {s['log'] or 'off'}")
    return 0

"""`kareus env`: what this machine offers the runtime (driver, NVML, clocks, permissions, versions).

Reads versions from package metadata (nothing heavy is imported) and asks NVML about one GPU (by NVML
index; supported clocks at the highest memory clock, UUID, temperature, power). ``--check-permission``
tells from what it can read whether this user may lock clocks (root or CAP_SYS_ADMIN, a clock setting in
force, persistence mode; nvml_report.clock_permission) and changes nothing. ``--try-lock`` also locks the
clock the GPU runs at and resets that lock, unless a clock setting is in force (left alone) or
KAREUS_GPU_READ_ONLY is set (refused in one line).
"""

from __future__ import annotations

import argparse
import json
import os
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from kareus_megatron.environment import kareus_settings
from kareus_megatron.errors import ConfigError
from kareus_megatron.versions import is_supported, supported_series

# lazy (`kareus --help` imports every command module): the device layer (hardware.device and NVML, ~7 ms;
# hardware.device.sim_model, for the simulated backend only).

MAX_GPU_INDEX = 1024  # GPU indices accepted: 0 .. MAX_GPU_INDEX - 1
HELP = "show the GPU driver, NVML, supported SM clocks, clock permissions and framework versions"

_PACKAGES = ("kareus-megatron", "torch", "megatron-core", "deepspeed", "nvidia-ml-py")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register `kareus env` flags."""
    parser.add_argument(
        "--gpu-index", "--device", dest="gpu_index", type=int, default=0, help="local GPU index to inspect (default 0)"
    )
    parser.add_argument(
        "--check-permission",
        action="store_true",
        help="tell whether this user may lock clocks from what can be read (capabilities, a clock "
        "setting in force); changes nothing on the GPU",
    )
    parser.add_argument(
        "--try-lock",
        action="store_true",
        help="with --check-permission: also lock the current clock once and reset that lock (not "
        "when a clock setting is in force, nor with KAREUS_GPU_READ_ONLY)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def _versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in _PACKAGES:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def environment(gpu_index: int = 0, check_permission: bool = False, try_lock: bool = False) -> dict[str, Any]:
    """The environment report as a dict (see module doc)."""
    from kareus_megatron.hardware.device import read_only_from_env
    from kareus_megatron.hardware.device.nvml_report import nvml_report

    versions = _versions()
    backend = kareus_settings().gpu_backend or None
    report: dict[str, Any] = {
        "versions": versions,
        "megatron_core_supported": bool(versions["megatron-core"])
        and is_supported("megatron-core", versions["megatron-core"] or ""),
        "supported_megatron_core": [s.series + ".x" for s in supported_series("megatron-core")],
        "deepspeed_supported": bool(versions["deepspeed"]) and is_supported("deepspeed", versions["deepspeed"] or ""),
        "supported_deepspeed": [s.series + ".x" for s in supported_series("deepspeed")],
        "gpu_backend": backend or "(default: nvml when available)",
        "root": os.geteuid() == 0 if hasattr(os, "geteuid") else None,
        "read_only": read_only_from_env(),
        "nvml": nvml_report(gpu_index, check_permission, try_lock=try_lock),
    }
    if backend == "simulated":
        from kareus_megatron.hardware.device.sim_model import latency_from_env

        report["simulated"] = {
            "gpu": kareus_settings().gpu or "(the plan's GPU)",
            "latency_ms": latency_from_env() * 1000.0,
            "log": kareus_settings().simulated_log or None,
        }
    return report


def _clock_range(clocks: list[int]) -> str:
    if not clocks:
        return "none"
    return f"{clocks[-1]}..{clocks[0]} MHz ({len(clocks)} clocks)"


def run(args: argparse.Namespace) -> int:
    """Print the environment report; exit 0."""
    if not 0 <= args.gpu_index < MAX_GPU_INDEX:
        raise ConfigError(f"--gpu-index {args.gpu_index} must be a GPU index from 0 to {MAX_GPU_INDEX - 1}.")
    if args.try_lock:
        from kareus_megatron.hardware.device import READ_ONLY_ENV, read_only_from_env

        if not args.check_permission:
            raise ConfigError("--try-lock goes with --check-permission.")
        if read_only_from_env():
            raise ConfigError(
                f"--try-lock locks and resets the SM clock, and {READ_ONLY_ENV} is set (change nothing "
                "on the GPU); drop --try-lock, or unset it."
            )
    rep = environment(args.gpu_index, args.check_permission, args.try_lock)
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
        error = str(n.get("error"))
        if rep["gpu_backend"] == "simulated":  # the advice to set it is for those who have not
            error = error.replace(" To run without an NVIDIA GPU, set KAREUS_GPU_BACKEND=simulated.", "")
            error += " (not needed: KAREUS_GPU_BACKEND=simulated runs on the simulated GPU)"
        print(f"{'NVML':16s} unavailable: {error}")
    else:
        print(f"{'NVML driver':16s} {n.get('driver_version')} ({n.get('device_count')} GPUs)")
        if "name" in n:
            print(f"{'GPU ' + str(n['index']):16s} {n['name']} (preset: {n['preset'] or 'none; pass --gpu'})")
            print(
                f"{'SM clocks':16s} {_clock_range(n['supported_sm_clocks_mhz'])} at memory clock "
                f"{n['memory_clock_mhz']} MHz; now {n['sm_clock_mhz']} MHz"
            )
            print(
                f"{'energy counter':16s} "
                f"{'readable' if n.get('energy_counter_mj') is not None else n.get('energy_error')}"
            )
        if "power_w" in n and n["power_w"] is not None:
            print(f"{'power':16s} {n['power_w']:.1f} W (limit {n['power_limit_w']:.0f} W)")
        if "clock_permission" in n:
            print(f"{'lock clocks':16s} {_permission_text(n)}")
            in_force = _settings_text(n["clock_settings"])
            if in_force:
                print(f"{'clock settings':16s} {in_force}")
        else:
            print(
                f"{'lock clocks':16s} {'likely (running as root)' if rep['root'] else 'needs root or CAP_SYS_ADMIN'}"
                " (test with --check-permission)"
            )
        if n.get("error"):
            print(f"{'NVML error':16s} {n['error']}")
    if rep["read_only"]:
        print(f"{'read-only':16s} yes (KAREUS_GPU_READ_ONLY): no command changes a GPU setting")
    if "simulated" in rep:
        s = rep["simulated"]
        print(f"{'simulated GPU':16s} {s['gpu']}, NVML latency {s['latency_ms']:g} ms, log {s['log'] or 'off'}")
    return 0


def _permission_text(n: dict[str, Any]) -> str:
    if n["clock_permission"] is True:
        return f"allowed (locked {n['locked_mhz']} MHz once and reset that lock)"
    if n["clock_permission"] is False:
        return str(n.get("permission_error"))
    return str(n.get("permission_note"))


def _settings_text(s: dict[str, Any]) -> str:
    """The clock settings in force, in words ('' when nothing is known to be set)."""
    from kareus_megatron.hardware.device.nvml_report import setting_in_force

    parts = []
    if setting_in_force(s):
        parts.append("a lock or application clocks limit the SM clock now (left alone)")
    if s.get("persistence_mode") is not None:
        parts.append(f"persistence mode {'on' if s['persistence_mode'] else 'off'}")
    return "; ".join(parts)

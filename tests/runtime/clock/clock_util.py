"""Helpers shared by the clock path's tests (imported as ``clock_util``: this folder is on sys.path)."""

from __future__ import annotations

import json
import os
import time

from kareus_megatron.hardware.device.sim import SimulatedGPU
from kareus_megatron.hardware.gpus import gpu_spec


def records(path):
    """Every line of the JSONL log at `path` ([] when it does not exist yet)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def decisions(path):
    """(event, mhz, reason) of each set/skip line of the log at `path`."""
    return [(r["event"], r["mhz"], r.get("reason")) for r in records(path) if r["event"] in ("set", "skip")]


def sim(tmp_path, latency_s=0.0, **kw):
    """A simulated a100-sxm4-40gb logging to tmp_path/clocks.jsonl."""
    return SimulatedGPU(gpu_spec("a100-sxm4-40gb"), 0, log_path=tmp_path / "clocks.jsonl", latency_s=latency_s, **kw)


def wait_for(pred, timeout_s):
    """Poll `pred` until it is true (True) or `timeout_s` s have passed (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.01)
    return False


def sim_env(tmp_path, **extra):
    """Environment for a side process on a simulated GPU logging to tmp_path/clocks.jsonl."""
    env = dict(
        os.environ,
        KAREUS_GPU_BACKEND="simulated",
        KAREUS_SIMULATED_LOG=str(tmp_path / "clocks.jsonl"),
        KAREUS_SIMULATED_LATENCY_MS="15",
        **extra,
    )
    env.pop("KAREUS_GPU", None)
    return env

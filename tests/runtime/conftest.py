"""Fixtures shared by the runtime tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture
def simulated_env(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """(environment, device log) for a trainer subprocess on the simulated GPU: clock latency 0 ms, every device
    call logged to tmp_path/sim.jsonl, clock control on (KAREUS_GPU_READ_ONLY unset)."""
    sim_log = tmp_path / "sim.jsonl"
    env = {
        **os.environ,
        "KAREUS_GPU_BACKEND": "simulated",
        "KAREUS_SIMULATED_LOG": str(sim_log),
        "KAREUS_SIMULATED_LATENCY_MS": "0",
    }
    env.pop("KAREUS_GPU_READ_ONLY", None)
    return env, sim_log

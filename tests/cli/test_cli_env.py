"""`kareus env` (cli/env.py): versions, the GPU backend in use and NVML, as text and as JSON."""

from __future__ import annotations

import json

from kareus_megatron.cli.main import main


def test_env_cli(capsys, monkeypatch):
    monkeypatch.setenv("KAREUS_GPU_BACKEND", "simulated")
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "megatron-core    0.16.1" in out and "simulated GPU" in out and "NVML" in out
    assert "set KAREUS_GPU_BACKEND=simulated" not in out  # it is set: no advice to set it (issue 25)
    assert main(["env", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["megatron_core_supported"] is True and rep["simulated"]["latency_ms"] == 15.0

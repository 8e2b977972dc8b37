"""A powercap plan under the in-process (thread) clock controller: SIGTERM, whose default action ends the
process without atexit, must still restore the board power limit before the process goes, as the clocks
are reset (with the side process, the controller restores it itself when its trainer is gone)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

TRAINER = """
import sys, time
sys.path.insert(0, {here!r})
import plans
from kareus_megatron.plan.schema import Plan
from kareus_megatron.runtime.session import RuntimeSession

base = plans.tiny_plan(pp=1, m=2, gpus_per_node=1).model_dump()
base["method"], base["power_limit_w"] = "powercap", 260.0
for st in base["stages"]:
    for ins in st["instructions"]:
        ins["sm_clock_mhz"] = 1410
plan = Plan.model_validate(base)
s = RuntimeSession(plan, controller="thread", log_path={log!r}).start()
print(s.ready["op"], s.ready["power_limit_w"], flush=True)
time.sleep(60)
"""


def _events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_sigterm_restores_the_power_limit_with_the_thread_controller(tmp_path, simulated_env):
    env, sim_log = simulated_env
    code = TRAINER.format(here=str(HERE), log=str(tmp_path / "run"))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().split() == ["ready", "260.0"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == -signal.SIGTERM  # still ends as SIGTERM does
    finally:
        if proc.poll() is None:
            proc.kill()
    events = [e["event"] for e in _events(sim_log)]
    assert "power_limit" in events, events
    assert "power_limit_reset" in events, f"SIGTERM left the GPU power-capped: {events}"

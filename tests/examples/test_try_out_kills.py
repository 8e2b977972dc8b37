"""Kill tests on the try-out run: examples/tiny_train.py on 2 gloo ranks under torchrun and the generic
launcher, simulated GPUs, as `make try-runtime` runs it.

The run is signalled after it has printed K finished iterations (`iteration K/N`, printed by the last
stage as each iteration ends). The first stage ends an iteration after the last one (its last backward runs
once the last stage's is done), so when the last stage has printed F, every rank has finished F - 1: afterwards
the run log must hold at least F - 1 complete iterations (both stages logged), F read when the signal is sent.
SIGTERM and SIGINT write what has resolved on the way out; for SIGKILL, everything up to the last flush, so the
test waits one second (the log is on disk within a second) before killing.
Every GPU's clock must be reset within 1 s of the signal (the simulated device's log, KAREUS_SIMULATED_LOG);
a powercap plan's board power limit must be restored within the same bound after SIGKILL.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kareus_megatron.cli.main import main
from kareus_megatron.report.runlog import read_run_log

ROOT = Path(__file__).resolve().parents[2]
JOB = ["--tp", "1", "--pp", "2", "--mbs", "2", "--seq", "16", "--microbatches", "4"]
K = 25  # finished iterations printed before the signal


@pytest.fixture(scope="module")
def plan_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("try") / "plan"
    assert (
        main(
            [
                "plan",
                "--model",
                str(ROOT / "examples" / "tiny-gpt.yaml"),
                "--gpu",
                "a100-sxm4-40gb",
                *JOB,
                "--nodes",
                "1",
                "--gpus-per-node",
                "2",
                "--precision",
                "fp32",
                "--recompute",
                "none",
                "--points",
                "3",
                "--band-samples",
                "0",  # the runs read a plan's clocks or cap, no band and no figure
                "--no-figures",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    return out


class _Run:
    """The try-out run in its own session (one process group: torchrun and both ranks)."""

    def __init__(self, plan: Path, tmp: Path, iterations: int, point: str = "kareus-00") -> None:
        self.log_dir, self.clock_log = tmp / "run", tmp / "clocks.jsonl"
        env = {
            **os.environ,
            "KAREUS_GPU_BACKEND": "simulated",
            "KAREUS_SIMULATED_LOG": str(self.clock_log),
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
        }
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "kareus_megatron.launch",
            "--kareus-plan",
            str(plan),
            "--kareus-point",
            point,
            "--kareus-log",
            str(self.log_dir),
            "--",
            str(ROOT / "examples" / "tiny_train.py"),
            "--iterations",
            str(iterations),
            *JOB,
        ]
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        self.lines: list[str] = []
        self.finished = 0  # iterations printed so far
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            m = re.match(r"iteration (\d+)/", line)
            if m:
                self.finished = int(m.group(1))

    def wait_for(self, k: int, timeout_s: float = 90.0) -> int:
        deadline = time.monotonic() + timeout_s
        while self.finished < k:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"the run never printed iteration {k}:\n{''.join(self.lines[-40:])}")
            time.sleep(0.02)
        return self.finished

    def _workers(self) -> list[int]:
        """PIDs of the training ranks: torchrun starts them in sessions of their own."""
        out = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == self.proc.pid:  # the parent PID
                out.append(int(stat.parent.name))
        return out

    def signal(self, sig: int) -> float:
        """Send `sig` as a cluster would: SIGTERM/SIGINT to the launcher (torchrun forwards it to the
        ranks), SIGKILL to every process of the job at once."""
        workers = self._workers() if sig == signal.SIGKILL else []
        t = time.monotonic()
        os.killpg(self.proc.pid, sig)
        for pid in workers:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        return t

    def kill(self) -> None:
        for pid in self._workers():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def wait(self, timeout_s: float = 30.0) -> None:
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail("the run did not end after the signal")

    def complete_iterations(self) -> int:
        log = read_run_log(self.log_dir)
        return sum(1 for r in log.iterations if r["iteration"] not in log.partial)

    def resets_after(self, t_signal_s: float, event: str = "reset") -> dict[int, float]:
        """GPU index -> seconds from the signal to its first `event` (a clock reset) after it."""
        first: dict[int, float] = {}
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:  # controllers reset on their own once their trainer is gone
            for line in self.clock_log.read_text().splitlines():
                e = json.loads(line)
                if e["event"] == event and e["t"] >= t_signal_s and e["gpu"] not in first:
                    first[e["gpu"]] = e["t"] - t_signal_s
            if len(first) == 2:
                break
            time.sleep(0.1)
        return first


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=["SIGTERM", "SIGINT", "SIGKILL"])
def test_a_killed_try_out_run_keeps_every_finished_iteration(plan_dir: Path, tmp_path: Path, sig: int) -> None:
    run = _Run(plan_dir, tmp_path, iterations=100_000)
    try:
        k = run.wait_for(K)
        if sig == signal.SIGKILL:
            time.sleep(1.0)  # SIGKILL keeps what was flushed: everything finished a second ago
        printed = run.finished  # the last stage's count; the first stage may be in that iteration's backward
        t_signal = run.signal(sig)
        run.wait()
    finally:
        run.kill()
    tail = "".join(run.lines[-30:])
    done = k if sig == signal.SIGKILL else printed - 1  # SIGKILL: what was flushed, iteration k a second ago
    assert run.complete_iterations() >= done, f"{run.complete_iterations()} complete, {done} finished\n{tail}"
    log = read_run_log(run.log_dir)  # what was kept is whole: iterations 0, 1, ... with both stages' figures
    complete = [r for r in log.iterations if r["iteration"] not in log.partial]
    assert [r["iteration"] for r in complete] == list(range(len(complete))), log.partial
    assert all(r["time_s"] > 0 and r["energy_j"] > 0 and len(r["stages"]) == 2 for r in complete)
    if sig != signal.SIGKILL:  # SIGTERM/SIGINT: the resolved iterations were written on the way out
        assert len(log.partial) <= 2, log.partial
    resets = run.resets_after(t_signal)
    assert set(resets) == {0, 1}, f"clock resets after the signal: {resets}\n{tail}"
    assert max(resets.values()) <= 1.0, f"clock resets after the signal (s): {resets}\n{tail}"


def test_a_killed_powercap_run_restores_every_power_limit(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """The same SIGKILL as above on a powercap plan: each GPU's limit was set, and is restored within 1 s."""
    plan = tmp_path_factory.mktemp("try-powercap") / "plan"
    assert (
        main(
            [
                "plan",
                "--model",
                str(ROOT / "examples" / "tiny-gpt.yaml"),
                "--gpu",
                "a100-sxm4-40gb",
                *JOB,
                "--nodes",
                "1",
                "--gpus-per-node",
                "2",
                "--precision",
                "fp32",
                "--recompute",
                "none",
                "--methods",
                "powercap",
                "--points",
                "3",
                "--band-samples",
                "0",  # the runs read a plan's clocks or cap, no band and no figure
                "--no-figures",
                "--out",
                str(plan),
            ]
        )
        == 0
    )
    point = sorted(p.stem for p in (plan / "plans").glob("powercap-*.json"))[-1]  # the lowest cap planned
    limit = json.loads((plan / "plans" / f"{point}.json").read_text())["power_limit_w"]
    run = _Run(plan, tmp_path, iterations=10_000, point=point)
    run.wait_for(5)
    time.sleep(0.5)
    t_signal = run.signal(signal.SIGKILL)
    run.wait()
    tail = "".join(run.lines[-30:])
    sets = [json.loads(line) for line in run.clock_log.read_text().splitlines()]
    assert {e["gpu"] for e in sets if e["event"] == "power_limit" and e["w"] == limit} == {0, 1}, tail
    restored = run.resets_after(t_signal, event="power_limit_reset")
    assert set(restored) == {0, 1}, f"power limits restored after SIGKILL: {restored}\n{tail}"
    assert max(restored.values()) <= 1.0, f"power limits restored after SIGKILL (s): {restored}\n{tail}"

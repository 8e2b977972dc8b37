"""jobs/children.py: a SIGTERM to a `kareus` process that runs a command reaches that command, then one line and 143.

Each case runs in a process of its own: a signal handler is per process, and a stray SIGTERM would end a worker."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

PY = sys.executable


def _wait_for(path: Path, p: subprocess.Popen[str], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()[1]
        time.sleep(0.05)


def test_kareus_torchrun_passes_sigterm_to_torchrun_which_stops_its_ranks(tmp_path: Path) -> None:
    """A real torchrun of one CPU rank: SIGTERM to kareus alone (`kill PID`) reaches the rank through torchrun, the rank
    ends, and kareus ends last with one line and 128 + SIGTERM. Before, kareus ended at once and the job went on."""
    rank = tmp_path / "rank.py"
    rank.write_text(
        textwrap.dedent(
            f"""
            import os, signal, sys, time
            def on_term(signum, frame):
                open({str(tmp_path / "rank-got-sigterm")!r}, "w").close()
                sys.exit(0)
            signal.signal(signal.SIGTERM, on_term)
            open({str(tmp_path / "rank-pid")!r}, "w").write(str(os.getpid()))
            while True:
                time.sleep(0.05)
            """
        )
    )
    cmd = [PY, "-m", "kareus_megatron.cli.main", "torchrun", "--standalone", "--nproc-per-node", "1", str(rank)]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _wait_for(tmp_path / "rank-pid", p)
        os.kill(p.pid, signal.SIGTERM)  # to kareus alone, not to its process group
        _, err = p.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)  # torchrun and its rank, had they been left running
    assert (tmp_path / "rank-got-sigterm").exists(), err
    assert p.returncode == 143, err
    assert err.strip().splitlines()[-1] == "kareus torchrun: terminated", err
    pid = int((tmp_path / "rank-pid").read_text())
    assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()


def _run_script(body: str, tmp_path: Path) -> subprocess.Popen[str]:
    script = tmp_path / "main.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, signal, sys
            from kareus_megatron.errors import Terminated
            from kareus_megatron.jobs import children
            """
        )
        + textwrap.dedent(body)
    )
    return subprocess.Popen([PY, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_command_that_ignores_sigterm_is_killed_after_the_grace(tmp_path: Path) -> None:
    started = tmp_path / "started"
    p = _run_script(
        f"""
        children.KILL_AFTER_S = 1.0
        try:
            with children.sigterm_passed_on():
                children.run(["sh", "-c", "trap '' TERM; touch {started}; while :; do sleep 0.05; done"])
        except Terminated:
            print("terminated")
        """,
        tmp_path,
    )
    _wait_for(started, p)
    t0 = time.monotonic()
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=30)
    assert out.strip() == "terminated" and p.returncode == 0, err
    assert 0.9 <= time.monotonic() - t0 < 10  # killed after the grace, not at once, not never


def test_a_sigterm_between_commands_starts_nothing_more(tmp_path: Path) -> None:
    """No command running (between a comparison's runs): Terminated at once, and the next command never starts."""
    never = tmp_path / "never"
    p = _run_script(
        f"""
        try:
            with children.sigterm_passed_on():
                children.run(["true"])
                os.kill(os.getpid(), signal.SIGTERM)
                children.run(["touch", {str(never)!r}])
        except Terminated:
            print("terminated")
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # restored on the way out
        """,
        tmp_path,
    )
    out, err = p.communicate(timeout=30)
    assert out.strip() == "terminated" and p.returncode == 0, err
    assert not never.exists()


def test_an_ignored_sigterm_stays_ignored(tmp_path: Path) -> None:
    p = _run_script(
        """
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        with children.sigterm_passed_on():
            os.kill(os.getpid(), signal.SIGTERM)
            print(children.run(["sh", "-c", "exit 3"]))
        """,
        tmp_path,
    )
    out, err = p.communicate(timeout=30)
    assert out.strip() == "3" and p.returncode == 0, err

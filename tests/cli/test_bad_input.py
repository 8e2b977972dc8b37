"""Every `kareus` command × every class of bad input: exit 2, one stderr line naming it, nothing left behind.

Commands run in-process through kareus_megatron.cli.main.main (fast); only the broken pipe and Ctrl-C
need a real process. A class that a command cannot be given (env reads no file) is listed in NOT_APPLICABLE.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kareus_megatron.cli.main import main

PROFILE = Path(__file__).parents[1] / "data" / "perseus_gpt3_stage0_7.csv"
GPT3 = [
    "--gpu",
    "a100-sxm4-80gb",
    "--model",
    "gpt3-175b",
    "--tp",
    "8",
    "--pp",
    "8",
    "--mbs",
    "1",
    "--seq",
    "2048",
    "--recompute",
    "none",
]
BINARY = b"\xff\xfe\x00\x81\x9c binary \xc3\x28\n"
CLASSES = ("binary", "empty", "truncated", "wrong_shape", "huge", "negative", "under_file", "in_proc", "dir_for_file")
COMMANDS = (
    "env",
    "predict",
    "partitions",
    "plan",
    "calibrate",
    "solve",
    "report",
    "compare",
    "launch",
    "validate",
    "torchrun",
)
NOT_APPLICABLE = {("env", c) for c in CLASSES if c not in ("huge", "negative")}  # env reads and writes no file
NOT_APPLICABLE |= {("validate", c) for c in ("binary", "empty", "truncated", "wrong_shape")}  # reads no file
NOT_APPLICABLE |= {("torchrun", c) for c in CLASSES}  # every argument is torchrun's (tests/jobs/test_launch.py)


@pytest.fixture(scope="module")
def plan_dir(tmp_path_factory):
    """A real `kareus plan` output (2 plans per method) to point report and launch at; no prediction bands (none is
    read here, and their 32 draws were most of the plan's time)."""
    out = tmp_path_factory.mktemp("plan") / "out"
    assert main(["plan", "--out", str(out), "--points", "2", "--band-samples", "0"]) == 0
    return out


def _file(d: Path, name: str, data: bytes | str) -> Path:
    p = d / name
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data if isinstance(data, bytes) else data.encode())
    return p


def _content(cls: str, kind: str) -> bytes | str:
    """The bad bytes of class `cls` for an input of kind "json", "csv" or "jsonl"."""
    if cls == "binary":
        return BINARY
    if cls == "empty":
        return b""
    if cls == "truncated":
        return {
            "json": '{"format": "kareus-plan/1", "gpu": "a1',
            "csv": "stage,instruction,frequency,time,en",
            "jsonl": '{"kind": "header", "back',
        }[kind]
    assert cls == "wrong_shape"
    return {"json": "[1, 2, 3]\n", "csv": "a,b\n1,2\n", "jsonl": '[1, 2]\n{"kind": "iteration"}\n'}[kind]


def _argv(cmd: str, cls: str, d: Path, plan_dir: Path) -> tuple[list[str], str]:
    """(argv, a word the one error line must contain) for `cmd` given input of class `cls` under `d`."""
    a_file = _file(d, "a_file", "x")
    plan = plan_dir / "plans" / "kareus-00.json"
    content_classes = ("binary", "empty", "truncated", "wrong_shape")
    if cmd in ("predict", "partitions", "plan"):
        own = ["--out", str(d / "out")] if cmd == "plan" else []
        if cls in content_classes:  # a model file (predict, plan) or a calibration file (partitions)
            if cmd == "partitions":
                return [cmd, "--calibration", str(_file(d, "cal.json", _content(cls, "json")))], "cal.json"
            return [cmd, *own, "--model", str(_file(d, "m.json", _content(cls, "json")))], "m.json"
        if cls == "huge":
            return [cmd, *own, "--seq", "1000000000"], "--seq"
        if cls == "negative":
            return [cmd, *own, "--tp", "-8"], "--tp"
        if cls == "under_file":
            if cmd == "plan":
                return [cmd, "--out", str(a_file / "sub")], "a_file"
            return [cmd, "--model", str(a_file / "m.json")], "m.json"
        if cls == "in_proc":
            if cmd == "plan":
                return [cmd, "--out", "/proc/kareus-out"], "/proc"
            return [cmd, "--calibration", "/proc/self/mem"], "/proc/self/mem"
        (d / "dir.json").mkdir()
        if cmd == "plan":  # --out wants a directory: give it a file instead
            return [cmd, "--out", str(a_file)], "a_file"
        return [cmd, "--calibration", str(d / "dir.json")], "dir.json"
    if cmd == "calibrate":
        base = [cmd, *GPT3]
        if cls in content_classes:
            return [*base, "--profile", str(_file(d, "p.csv", _content(cls, "csv")))], "p.csv"
        base += ["--profile", str(PROFILE)]
        if cls == "huge":
            return [*base, "--seconds", "1e9"], "--seconds"
        if cls == "negative":
            return [*base, "--seconds", "-1"], "--seconds"
        if cls == "under_file":
            return [*base, "-o", str(a_file / "cal.json")], "a_file"
        if cls == "in_proc":
            return [*base, "--out", "/proc/cal.json"], "/proc"
        (d / "dir").mkdir()
        return [*base, "-o", str(d / "dir")], "dir"
    if cmd == "solve":
        base = [
            cmd,
            "--pp",
            "8",
            "--microbatches",
            "4",
            "--gpu",
            "a100-sxm4-80gb",
            "--mbs",
            "1",
            "--seq",
            "2048",
            "--layers-per-stage",
            "12,12,12,12,12,12,12,12",
            "--out",
            str(d / "out"),
        ]
        if cls in content_classes:
            return [*base, "--profile", str(_file(d, "p.csv", _content(cls, "csv")))], "p.csv"
        if cls == "dir_for_file":
            (d / "p.csv").mkdir()
            return [*base, "--profile", str(d / "p.csv")], "p.csv"
        base = [*base[:-2], "--profile", str(PROFILE)]
        if cls == "huge":
            return [*base, "--out", str(d / "out"), "--microbatches", "1000000000"], "--microbatches"
        if cls == "negative":
            return [*base, "--out", str(d / "out"), "--p2p-time", "-1"], "--p2p-time"
        if cls == "under_file":
            return [*base, "--out", str(a_file / "sub")], "a_file"
        return [*base, "--out", "/proc/kareus-solve"], "/proc"
    if cmd == "report":
        log = _file(d, "run.jsonl", '{"kind": "header"}\n')
        if cls in content_classes:
            return [
                cmd,
                str(log),
                "--plan",
                str(_file(d, "plan.json", _content(cls, "json"))),
                "--no-plot",
            ], "plan.json"
        if cls == "huge":
            return [cmd, str(log), "--plan", str(plan), "--skip", "1000000000", "--no-plot"], "skip"
        if cls == "negative":
            return [cmd, str(log), "--plan", str(plan), "--skip-iterations", "-1", "--no-plot"], "skip"
        if cls == "under_file":
            return [cmd, str(a_file / "run.jsonl"), "--plan", str(plan)], "run.jsonl"
        if cls == "in_proc":
            return [cmd, "/proc/self/mem", "--plan", str(plan)], "/proc/self/mem"
        (d / "dir.jsonl").mkdir()
        return [cmd, str(d / "dir.jsonl"), "--plan", str(plan)], "dir.jsonl"
    if cmd == "compare":
        logs = d / "logs"
        if cls in ("huge", "negative"):
            _file(logs, "kareus-00/measurement.jsonl", '{"kind": "header"}\n')
        if cls in content_classes:
            _file(logs, "kareus-00/measurement.jsonl", _content(cls, "jsonl"))
            return [cmd, str(logs), "--out", str(d / "cmp")], "measurement.jsonl"
        if cls == "huge":
            return [cmd, str(logs), "--skip-iterations", "1000000000"], "skip"
        if cls == "negative":
            return [cmd, str(logs), "--skip-iterations", "-1"], "skip"
        if cls == "under_file":
            return [cmd, str(logs), "--out", str(a_file / "cmp")], "a_file"
        if cls == "in_proc":
            return [cmd, str(logs), "--out", "/proc/kareus-cmp"], "/proc"
        return [cmd, str(a_file)], "a_file"  # a file where the log directory is expected
    if cmd == "launch":
        base = [cmd, "run", "--dry-run", "--log-dir", str(d / "runs")]
        if cls in content_classes:
            _file(d, "pd/frontier.json", _content(cls, "json"))
            return [*base, "--plan-dir", str(d / "pd")], "frontier.json"
        base += ["--plan-dir", str(plan_dir)]
        if cls == "huge":
            return [*base, "--train-iters", "1000000000000"], "--train-iters"
        if cls == "negative":
            return [*base, "--train-iters", "-5"], "--train-iters"
        if cls == "under_file":
            return [*base[:-2], "--plan-dir", str(a_file / "pd")], "a_file"
        if cls == "in_proc":
            return [*base[:-2], "--plan-dir", "/proc/self"], "/proc/self"
        (d / "pd2" / "frontier.json").mkdir(parents=True)
        return [*base[:-2], "--plan-dir", str(d / "pd2")], "frontier.json"
    if cmd == "validate":  # writes --out DIR only
        base = [cmd, "--dry-run"]
        if cls == "huge":
            return [*base, "--seconds", "1e9", "--out", str(d / "v")], "--seconds"
        if cls == "negative":
            return [*base, "--device", "-1", "--out", str(d / "v")], "--device"
        if cls == "under_file":
            return [*base, "--out", str(a_file / "v")], "a_file"
        if cls == "in_proc":
            return [*base, "--out", "/proc/kareus-validate"], "/proc"
        return [*base, "--out", str(a_file)], "a_file"  # a file where the output directory goes
    assert cmd == "env"
    return [cmd, "--gpu-index", "1000000000" if cls == "huge" else "-1"], "--gpu-index"


def _tree(d: Path) -> set[str]:
    return {str(p.relative_to(d)) for p in d.rglob("*")}


CASES = [(c, k) for c in COMMANDS for k in CLASSES if (c, k) not in NOT_APPLICABLE]


@pytest.mark.parametrize(("cmd", "cls"), CASES, ids=[f"{c}-{k}" for c, k in CASES])
def test_bad_input_is_one_line_exit_2_and_leaves_nothing(cmd, cls, tmp_path, plan_dir, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    inputs = tmp_path / "in"
    inputs.mkdir()
    argv, word = _argv(cmd, cls, inputs, plan_dir)
    before, plan_before = _tree(tmp_path), _tree(plan_dir)
    capsys.readouterr()
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's own usage errors
        rc = e.code
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert rc == 2, (argv, err)
    assert "Traceback" not in err
    assert len(lines) == 1, err
    assert lines[0].startswith(f"kareus {cmd}") and "error" in lines[0], err
    assert word in lines[0], (word, err)
    assert _tree(tmp_path) == before, "a file was left behind"
    assert _tree(plan_dir) == plan_before
    assert not any(n.startswith(".kareus-probe-") for n in os.listdir("/tmp"))


def test_the_table_covers_every_command_and_class():
    from kareus_megatron.cli.main import COMMANDS as REGISTERED

    assert set(COMMANDS) == set(REGISTERED)
    assert len(CASES) + len(NOT_APPLICABLE) == len(COMMANDS) * len(CLASSES)


def test_kareus_torchrun_without_arguments_is_one_line(capsys):
    assert main(["torchrun"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "needs torchrun's arguments" in err


def test_debug_after_the_subcommand_shows_the_traceback():
    from kareus_megatron.errors import UnknownPresetError

    with pytest.raises(UnknownPresetError):
        main(["predict", "--gpu", "nope", "--debug"])
    with pytest.raises(UnknownPresetError):
        main(["--debug", "predict", "--gpu", "nope"])


def test_oserror_and_unicode_error_from_any_command_are_one_line(monkeypatch, capsys):
    import kareus_megatron.cli.env as env

    def raise_(e):
        def run(args):
            raise e

        return run

    for exc, word in (
        (PermissionError(13, "Permission denied", "/x/y"), "'/x/y': Permission denied"),
        (UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"), "not UTF-8 text"),
    ):
        monkeypatch.setattr(env, "run", raise_(exc))
        assert main(["env"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and word in err[0], err


def test_calibrate_without_out_writes_only_the_json_to_stdout(capsys):
    assert main(["calibrate", "--profile", str(PROFILE), *GPT3]) == 0
    cap = capsys.readouterr()
    assert json.loads(cap.out)["format"] == "kareus-calibration/1"  # stdout is a calibration file as is
    assert "power E/t MAPE" in cap.err


def test_predict_suggests_only_tp_values_that_pass_both_head_checks(capsys):
    big = ["--gpu", "h200-sxm-141gb", "--format", "json"]  # memory fits at every suggested TP
    assert main(["predict", *big, "--tp", "16"]) == 2  # llama3.2-3b: 24 heads, 8 KV heads
    err = capsys.readouterr().err
    suggested = [int(x) for x in err.rsplit("one of", 1)[1].strip(" .\n").split(", ")]
    assert suggested == [1, 2, 4, 8]
    for tp in suggested:
        assert main(["predict", *big, "--tp", str(tp)]) == 0, capsys.readouterr().err
    capsys.readouterr()


def test_solve_takes_the_workload_flag_names_and_the_old_ones(tmp_path, capsys):
    assert main(["predict", "--format", "csv"]) == 0  # a 2-stage profile of the default job
    profile = _file(tmp_path, "p.csv", capsys.readouterr().out)
    for mbs, seq in (("--mbs", "--seq"), ("--micro-batch-size", "--seq-length")):
        out = tmp_path / mbs.strip("-")
        assert (
            main(
                [
                    "solve",
                    "--profile",
                    str(profile),
                    "--pp",
                    "2",
                    "--microbatches",
                    "4",
                    "--points",
                    "2",
                    "--out",
                    str(out),
                    mbs,
                    "2",
                    seq,
                    "512",
                    "--gpu",
                    "a100-sxm4-40gb",
                    "--layers-per-stage",
                    "14,14",
                ]
            )
            == 0
        )
        layout = json.loads((out / "plans" / "solve-00.json").read_text())["parallel"]
        assert (layout["micro_batch_size"], layout["seq_length"]) == (2, 512)
    capsys.readouterr()


def _kareus(*args: str, **kw):
    return subprocess.Popen(
        [sys.executable, "-m", "kareus_megatron.cli.main", *args], stderr=subprocess.PIPE, text=True, **kw
    )


def test_a_closed_stdout_pipe_is_silent_and_succeeds():
    """`kareus predict | head -3` exits 0: the reader stopped reading, nothing went wrong (issue 25)."""
    r, w = os.pipe()
    os.close(r)  # like `kareus predict | head` once head has exited
    for fmt in ("json", "table"):  # plain writes (the boundary in cli/main.py) and rich's console
        p = _kareus("predict", "--format", fmt, stdout=w)
        _, err = p.communicate(timeout=120)
        assert err == "" and p.returncode == 0, (fmt, err)
    os.close(w)


def _launch_a_stand_in_torchrun(tmp_path, plan_dir, *wrap: str) -> tuple[subprocess.Popen, Path]:
    """`kareus launch run` (behind `wrap`, a command that execs it) whose torchrun is a shell loop recording the SIGINT
    it gets in the returned marker file (a SIGTERM in child-got-sigterm beside it), once that loop has started; kareus
    leads its own session."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    marker = tmp_path / "child-got-sigint"
    fake = bin_dir / "torchrun"  # the command `kareus launch run` starts: records the SIGINT or SIGTERM it gets
    fake.write_text(
        f"#!/bin/sh\ntrap 'touch {marker}; exit 130' INT\ntrap 'touch {tmp_path}/child-got-sigterm; exit 143' TERM\n"
        f"touch {tmp_path}/started\nwhile true; do sleep 0.05; done\n"
    )
    fake.chmod(0o755)
    # TMPDIR: the launch's error directory (jobs/torchrun.py), left behind by a SIGKILL, lands under tmp_path
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "TMPDIR": str(tmp_path)}
    args = ("launch", "run", "--plan-dir", str(plan_dir), "--log-dir", str(tmp_path / "runs"), "--script", "train.py")
    cmd = [*wrap, sys.executable, "-m", "kareus_megatron.cli.main", *args]
    p = subprocess.Popen(
        cmd, stderr=subprocess.PIPE, text=True, stdout=subprocess.DEVNULL, env=env, cwd=tmp_path, start_new_session=True
    )
    deadline = time.monotonic() + 60
    while not (tmp_path / "started").exists():
        assert p.poll() is None and time.monotonic() < deadline, p.stderr.read() if p.stderr else ""
        time.sleep(0.05)
    return p, marker


def test_ctrl_c_on_launch_is_one_line_exit_130_and_reaches_the_child(tmp_path, plan_dir):
    p, marker = _launch_a_stand_in_torchrun(tmp_path, plan_dir)
    os.kill(p.pid, signal.SIGINT)  # to kareus alone, not to its process group
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130, err
    assert err.strip().splitlines() == ["kareus launch: interrupted"]
    deadline = time.monotonic() + 10
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.exists(), "the child never got SIGINT"


def test_sigterm_on_launch_reaches_the_child_then_one_line_exit_143(tmp_path, plan_dir):
    """`kill PID` on kareus alone: the job it started gets the SIGTERM (it went on training before), and kareus ends
    after it with one line and 128 + SIGTERM."""
    p, _ = _launch_a_stand_in_torchrun(tmp_path, plan_dir)
    try:
        os.kill(p.pid, signal.SIGTERM)  # to kareus alone, not to its process group
        _, err = p.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)  # an orphaned child, had it been left running
    assert (tmp_path / "child-got-sigterm").exists(), "the child never got SIGTERM"
    assert p.returncode == 143, err
    assert err.strip().splitlines()[-1] == "kareus launch: terminated", err


def test_a_launch_started_ignoring_sigint_keeps_ignoring_it(tmp_path, plan_dir):
    """`kareus launch ... &` in a script starts ignoring SIGINT, as do the commands it starts: a SIGINT to kareus then
    neither stops it nor reaches the job (handled, it would stop both: the test above)."""
    p, marker = _launch_a_stand_in_torchrun(tmp_path, plan_dir, "sh", "-c", 'trap "" INT; exec "$@"', "sh")
    try:
        os.kill(p.pid, signal.SIGINT)
        time.sleep(1.0)  # handled, kareus leaves and the child records it well within this (the test above)
        assert p.poll() is None, p.stderr.read() if p.stderr else ""
        assert not marker.exists()
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate(timeout=30)

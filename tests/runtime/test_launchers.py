"""Entry points end to end: the generic launcher and launch/pretrain_gpt.py, 2 processes each, running
stand-in training scripts on the real megatron-core schedule with simulated GPUs; plus bad inputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import plans
import pytest
from _dist import free_port

from kareus_megatron import launch
from kareus_megatron.cli.main import main
from kareus_megatron.plan.io import save_plan, write_json_atomic
from kareus_megatron.report.runlog import read_run_log

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
ITERS = 3

# A training script that knows nothing about kareus: megatron-core schedule, its own arguments.
STANDIN_TRAIN = textwrap.dedent(
    """
    import argparse, json, os
    import tiny_gpt
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, required=True)
    p.add_argument("--microbatches", type=int, required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    tiny_gpt.setup(rank, world, int(os.environ["MASTER_PORT"]))
    tiny_gpt.init_parallel(2, None)
    losses, _ = tiny_gpt.train(tiny_gpt.build_chunks(2, None), a.microbatches, a.iters)
    json.dump(losses, open(os.path.join(a.out, f"losses{rank}.json"), "w"))
    import sys, megatron.core.jit as jit  # what the launcher's CPU import hooks left (cpu_imports.py)
    imports = {"inductor_compiler": "torch._inductor.compile_fx" in sys.modules, "jit_fuser": jit.jit_fuser.__name__}
    json.dump(imports, open(os.path.join(a.out, f"imports{rank}.json"), "w"))
    """
)

# Megatron-LM's pretrain_gpt.py stand-in: Megatron-style flags only (argparse rejects any --kareus-*).
STANDIN_PRETRAIN = textwrap.dedent(
    """
    import argparse, json, os
    import tiny_gpt
    p = argparse.ArgumentParser()
    p.add_argument("--pipeline-model-parallel-size", type=int, required=True)
    p.add_argument("--micro-batch-size", type=int, required=True)
    p.add_argument("--global-batch-size", type=int, required=True)
    p.add_argument("--seq-length", type=int, required=True)
    p.add_argument("--train-iters", type=int, required=True)
    p.add_argument("--save", required=True)
    a = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    tiny_gpt.setup(rank, world, int(os.environ["MASTER_PORT"]))
    pp = a.pipeline_model_parallel_size
    tiny_gpt.init_parallel(pp, None)
    m = a.global_batch_size // a.micro_batch_size // (world // pp)
    losses, _ = tiny_gpt.train(tiny_gpt.build_chunks(pp, None), m, a.train_iters)
    json.dump(losses, open(os.path.join(a.save, f"losses{rank}.json"), "w"))
    """
)


def _run_two(cmd: list[str], tmp: Path) -> list[subprocess.CompletedProcess]:
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE="2",
            LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            KAREUS_GPU_BACKEND="simulated",
            KAREUS_SIMULATED_LATENCY_MS="15",
            KAREUS_SIMULATED_LOG=str(tmp / "clocks.jsonl"),
            PYTHONWARNINGS="ignore",
            PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")]),
        )
        env.pop("KAREUS_GPU", None)
        procs.append(subprocess.Popen(cmd, env=env, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=120)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


def _check_run(tmp: Path, plan, results) -> None:
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
    recs = [json.loads(line) for line in (tmp / "clocks.jsonl").read_text().splitlines()]
    for rank in range(2):
        seq = [x["mhz"] for x in recs if x["gpu"] == rank and x["event"] in ("set", "skip")]
        assert seq == plan.clock_sequence(rank) * ITERS
        assert [x["event"] for x in recs if x["gpu"] == rank][-2:] == ["reset", "close"]
    run = read_run_log(tmp / "run.jsonl")  # the --kareus-log directory: one file per rank, merged here
    assert run.header["world"] == 2 and not run.partial
    assert [x["iteration"] for x in run.iterations] == list(range(ITERS))
    assert {s["pp_rank"] for x in run.iterations for s in x["stages"]} == {0, 1}
    losses = json.loads((tmp / "losses1.json").read_text())
    assert len(losses) == ITERS and all(3.0 < x < 6.0 for x in losses)


def test_generic_launcher_end_to_end(tmp_path, capsys):
    plan = plans.tiny_plan(pp=2, vp=1, m=4, seed=2)
    save_plan(plan, tmp_path / "plan.json")
    (tmp_path / "train.py").write_text(STANDIN_TRAIN)
    cmd = [
        sys.executable,
        "-m",
        "kareus_megatron.launch",
        "--kareus-plan",
        "plan.json",
        "--kareus-log",
        "run.jsonl",
        "--",
        "train.py",
        "--iters",
        str(ITERS),
        "--microbatches",
        "4",
        "--out",
        str(tmp_path),
    ]
    _check_run(tmp_path, plan, _run_two(cmd, tmp_path))
    # on this CPU-only torch the launcher's hooks came before its patch imported megatron: fused functions eager, and
    # inductor's compiler, which torch.compile looks up for each fused function, never imported
    for rank in range(2):
        imports = json.loads((tmp_path / f"imports{rank}.json").read_text())
        assert imports == {"inductor_compiler": False, "jit_fuser": "noop_decorator"}, imports
    # the log of a real 2-stage run reads back in `kareus report`
    assert main(["report", str(tmp_path / "run.jsonl"), "--plan", str(tmp_path / "plan.json"), "--no-plot"]) == 0
    out = capsys.readouterr().out
    assert "stage 0 energy" in out and "stage 1 energy" in out and "note:" not in out


def _plan_dir(root: Path) -> list:
    """A `kareus plan`-style output directory with two kareus plans (00 fastest, 01 lowest energy)."""
    fast = plans.tiny_plan(pp=2, m=4, seed=1)
    slow = plans.tiny_plan(pp=2, m=4, seed=4, clocks=(990, 1005, 1095))
    save_plan(fast, root / "plans" / "kareus-00.json")
    save_plan(slow, root / "plans" / "kareus-01.json")
    write_json_atomic(
        root / "frontier.json",
        {
            "format": "kareus-frontier/1",
            "config": {},
            "methods": {
                "kareus": {
                    "points": [
                        {"time_s": 0.04, "energy_j": 50.0, "plan": "plans/kareus-00.json"},
                        {"time_s": 0.06, "energy_j": 30.0, "plan": "plans/kareus-01.json"},
                    ]
                }
            },
            "reductions": {},
        },
    )
    return [fast, slow]


def test_pretrain_gpt_dropin_end_to_end(tmp_path):
    mlm = tmp_path / "Megatron-LM"
    mlm.mkdir()
    (mlm / "pretrain_gpt.py").write_text(STANDIN_PRETRAIN)
    fast, slow = _plan_dir(tmp_path / "kareus-out")
    cmd = [
        sys.executable,
        str(ROOT / "launch" / "pretrain_gpt.py"),
        "--pipeline-model-parallel-size",
        "2",
        "--kareus-plan",
        "kareus-out",
        "--kareus-point",
        "min-energy",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "8",
        "--kareus-log",
        "run.jsonl",
        "--seq-length",
        "16",
        "--train-iters",
        str(ITERS),
        "--save",
        str(tmp_path),
        "--megatron-lm-dir",
        str(mlm),
    ]
    _check_run(tmp_path, slow, _run_two(cmd, tmp_path))


# ---- bad input: one line, exit status 2, before training ----------------------------------------


def _one_line_error(capsys, code: int, *needles: str) -> None:
    err = capsys.readouterr().err
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in lines[0], lines[0]


def test_launcher_bad_inputs(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("raise SystemExit(0)\n")
    _one_line_error(
        capsys, launch.main(["--kareus-plan", "missing.json", "--", "train.py"]), "missing.json", "no such file"
    )
    (tmp_path / "bad.json").write_text("{not json")
    _one_line_error(capsys, launch.main(["--kareus-plan", "bad.json", "--", "train.py"]), "not valid JSON")
    save_plan(plans.tiny_plan(), tmp_path / "plan.json")
    _one_line_error(capsys, launch.main(["--kareus-plan", "plan.json", "--", "nope.py"]), "nope.py does not exist")
    _one_line_error(capsys, launch.main(["--kareus-plan", "plan.json"]), "no training script")
    _one_line_error(
        capsys,
        launch.main(["--kareus-plan", "plan.json", "--kareus-point", "01", "--", "train.py"]),
        "--kareus-point 01 needs",
    )
    _one_line_error(capsys, launch.main(["--kareus-plan", "plan.json", "--bogus", "--", "train.py"]), "--bogus")
    monkeypatch.setenv("KAREUS_GPU_BACKEND", "simulated")
    monkeypatch.setenv("KAREUS_SIMULATED_NO_PERMISSION", "1")
    _one_line_error(capsys, launch.main(["--kareus-plan", "plan.json", "--", "train.py"]), "no permission")
    monkeypatch.delenv("KAREUS_SIMULATED_NO_PERMISSION")
    (tmp_path / "out").mkdir()
    _one_line_error(capsys, launch.main(["--kareus-plan", "out", "--", "train.py"]), "without frontier.json")
    _plan_dir(tmp_path / "kout")
    for point, needle in [
        ("banana", "--kareus-point 'banana' is not valid"),
        ("07", "kareus has points 00..01"),
        ("perseus-00", "has no points for method 'perseus'"),
        ("all", "'all' is not allowed here"),
        ("zeus-00", "names unknown method 'zeus'"),
    ]:
        code = launch.main(["--kareus-plan", "kout", "--kareus-point", point, "--", "train.py"])
        _one_line_error(capsys, code, needle)


def test_pretrain_gpt_needs_megatron_lm(tmp_path, capsys, monkeypatch):
    sys.path.insert(0, str(ROOT / "launch"))
    try:
        import pretrain_gpt
    finally:
        sys.path.remove(str(ROOT / "launch"))
    monkeypatch.delenv("MEGATRON_LM_DIR", raising=False)
    save_plan(plans.tiny_plan(), tmp_path / "plan.json")
    _one_line_error(capsys, pretrain_gpt.main(["--kareus-plan", str(tmp_path / "plan.json")]), "MEGATRON_LM_DIR")
    _one_line_error(
        capsys,
        pretrain_gpt.main(["--kareus-plan", str(tmp_path / "plan.json"), "--megatron-lm-dir", str(tmp_path)]),
        "has no pretrain_gpt.py",
    )


@pytest.mark.parametrize(
    "point,index",
    [
        ("fastest", 0),
        ("min-energy", 1),
        ("00", 0),
        ("kareus-01", 1),
        (None, 0),
        ("kareus-fastest", 0),
        ("kareus-min-energy", 1),
    ],
)
def test_plan_directory_points(tmp_path, point, index):
    from kareus_megatron.runtime.frameworks.entry import resolve_plan

    expected = _plan_dir(tmp_path)[index]
    plan, source = resolve_plan(str(tmp_path), point)
    assert plan == expected and source.endswith(f"kareus-0{index}.json")


@pytest.mark.parametrize(
    "cmd",
    [
        [sys.executable, "-m", "kareus_megatron.launch", "--help"],
        [sys.executable, str(ROOT / "launch" / "pretrain_gpt.py"), "--help"],
    ],
)
def test_entry_points_answer_help_without_megatron_lm(cmd):
    """--help lists the kareus flags and exits 0 (pretrain_gpt.py: without MEGATRON_LM_DIR too)."""
    env = {**{k: v for k, v in os.environ.items() if k != "MEGATRON_LM_DIR"}, "COLUMNS": "200"}  # no wrapping
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert "--kareus-plan PATH" in r.stdout and "--kareus-point POINT" in r.stdout and "METHOD-min-energy" in r.stdout

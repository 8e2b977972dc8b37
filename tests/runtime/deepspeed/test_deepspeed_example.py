"""DeepSpeed's own pipeline example runs a kareus plan on 2 gloo CPU processes, unmodified.

DeepSpeedExamples' training/pipeline_parallelism (../shared/vendor/, see its README.md) is extracted
to a temporary directory and started as its run.sh does (``train.py --deepspeed_config=ds_config.json -p
2 --steps=N``, plus ``--backend gloo``), each rank as torchrun would start it (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_*), through the documented launcher ``-m kareus_megatron.deepspeed --kareus-plan DIR
--kareus-point P --kareus-log LOG -- train.py ...`` behind ds_example_shim.py (synthetic CIFAR-10, a
torchvision stand-in, no JIT builds). The plans are ``kareus plan --framework deepspeed`` for the
example's shape: 2 stages, micro-batch 8, 256 / 8 = 32 micro-batches per step, DP 1.

Checked on DeepSpeed 0.19.8 (the test venv) and 0.18.9 (`make install-test` puts it in .venv/alt/, first
on PYTHONPATH here): the simulated GPU's clock log equals the plan's clock sequence for every step on every
rank, the run log holds every step of every stage, ``kareus report`` exits 0; on 0.19.8 a plan for
another micro-batch count is refused before step 1 with one line and exit status 2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from _dist import free_port

from kareus_megatron.plan.io import load_plan
from kareus_megatron.report.runlog import read_run_log
from kareus_megatron.versions import supported_series

ROOT = Path(__file__).resolve().parents[3]
HERE = Path(__file__).resolve().parent
ARCHIVE = ROOT.parent / "shared" / "vendor" / "DeepSpeedExamples-pipeline_parallelism.tar.gz"
EXAMPLE = "DeepSpeedExamples-pipeline_parallelism/training/pipeline_parallelism"
STEPS = 3
SHAPE = ["--tp", "1", "--pp", "2", "--dp", "1", "--mbs", "8", "--nodes", "1", "--gpus-per-node", "2"]
DS_018, DS_019 = (next(s.tested for s in supported_series("deepspeed") if s.series == x) for x in ("0.18", "0.19"))
LAUNCHER = "python -m kareus_megatron.deepspeed"


@pytest.fixture(scope="module")
def example(tmp_path_factory) -> Path:
    """The example's directory, extracted unmodified."""
    assert ARCHIVE.is_file(), f"{ARCHIVE} is missing: the upstream snapshots live in ../shared/vendor (see its README)"
    d = tmp_path_factory.mktemp("dsx")
    with tarfile.open(ARCHIVE) as t:
        t.extractall(d, filter="data")
    return d / EXAMPLE


@pytest.fixture(scope="module")
def plans(tmp_path_factory) -> dict[str, Path]:
    """`kareus plan --framework deepspeed` for the example (32 micro-batches) and for 16 (the mismatch)."""
    from kareus_megatron.cli import main as cli_main

    d = tmp_path_factory.mktemp("dsplans")
    out = {}
    for name, m in (("example", 32), ("mismatch", 16)):
        out[name] = d / name
        assert (
            cli_main.main(
                [
                    "plan",
                    "--framework",
                    "deepspeed",
                    "--model",
                    str(ROOT / "examples" / "tiny-gpt.yaml"),
                    "--gpu",
                    "a100-sxm4-40gb",
                    *SHAPE,
                    "--seq",
                    "16",
                    "--microbatches",
                    str(m),
                    "--precision",
                    "fp32",
                    "--recompute",
                    "none",
                    "--points",
                    "2",
                    # clock changes at once: the tiny model's instructions last microseconds, and the
                    # test follows a clock per instruction through DeepSpeed's schedule
                    "--clock-latency-ms",
                    "0",
                    "--out",
                    str(out[name]),
                ]
            )
            == 0
        )
    return out


@pytest.fixture(scope="session")
def deepspeed_018() -> Path:
    """deepspeed 0.18.x in a directory of its own: `make install-test` puts it in .venv/alt (pip --target)."""
    alt = Path(sys.prefix) / "alt" / f"deepspeed-{DS_018}"
    assert (alt / "deepspeed" / "__init__.py").is_file(), (
        f"{alt} is missing: `make install-test` installs deepspeed=={DS_018} there"
    )
    return alt


def run_example(
    example: Path, out: Path, kareus_args: list[str], pythonpath: Path | None = None
) -> list[tuple[int, str]]:
    """Start the example's 2 ranks under the launcher; (exit status, stdout+stderr) per rank."""
    out.mkdir(parents=True)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_", "KAREUS_"))}
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = {
            **base,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": "2",
            "KAREUS_GPU_BACKEND": "simulated",
            "KAREUS_SIMULATED_LATENCY_MS": "1",
            "KAREUS_SIMULATED_LOG": str(out / f"clock-r{rank}.jsonl"),
            "DS_ACCELERATOR": "cpu",
            "OMP_NUM_THREADS": "1",
            "PYTHONWARNINGS": "ignore::UserWarning",
        }
        if pythonpath is not None:
            env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), *filter(None, [os.environ.get("PYTHONPATH")])])
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    str(HERE / "ds_example_shim.py"),
                    *kareus_args,
                    "--",
                    "train.py",
                    "--deepspeed_config=ds_config.json",
                    "-p",
                    "2",
                    f"--steps={STEPS}",
                    "--backend",
                    "gloo",
                ],
                cwd=example,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    results = []
    for p in procs:
        try:
            text, _ = p.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        results.append((p.returncode, text))
    return results


@pytest.mark.parametrize("version", [DS_019, DS_018])
def test_example_runs_the_plan_on_every_rank(example, plans, tmp_path, request, version):
    from kareus_megatron.cli import main as cli_main

    pythonpath = request.getfixturevalue("deepspeed_018") if version == DS_018 else None
    point = "kareus-00"  # the fastest kareus plan: its clocks differ between instructions
    plan = load_plan(plans["example"] / "plans" / f"{point}.json")
    assert {i.nanobatches for s in plan.stages for i in s.instructions} == {1}  # what DeepSpeed runs
    assert any(len(set(plan.clock_sequence(r))) > 1 for r in range(2))
    log = tmp_path / "run" / "log"
    ranks = run_example(
        example,
        tmp_path / "run",
        ["--kareus-plan", str(plans["example"]), "--kareus-point", point, "--kareus-log", str(log)],
        pythonpath,
    )
    for rank, (rc, text) in enumerate(ranks):
        assert rc == 0, f"rank {rank}:\n{text[-4000:]}"
        assert f"ds-shim: deepspeed {version}" in text
        events = [json.loads(line) for line in (tmp_path / "run" / f"clock-r{rank}.jsonl").read_text().splitlines()]
        decided = [e["mhz"] for e in events if e["event"] in ("set", "skip")]
        assert decided == plan.clock_sequence(rank) * STEPS
        assert events[-1]["event"] == "close"
    run = read_run_log(log)
    assert run.header["framework"] == "deepspeed" and not run.partial
    assert [x["iteration"] for x in run.iterations] == list(range(STEPS))
    assert all([s["pp_rank"] for s in x["stages"]] == [0, 1] for x in run.iterations)
    assert cli_main.main(["report", str(log), "--plan", str(plans["example"] / "plans" / f"{point}.json")]) == 0


def test_example_refuses_a_mismatched_plan_before_step_1(example, plans, tmp_path):
    ranks = run_example(
        example, tmp_path / "run", ["--kareus-plan", str(plans["mismatch"]), "--kareus-point", "perseus-01"]
    )
    for rank, (rc, text) in enumerate(ranks):
        assert rc == 2, f"rank {rank}:\n{text[-4000:]}"
        (line,) = [x for x in text.splitlines() if x.startswith(f"{LAUNCHER}: error:")]
        assert "micro-batches per step (gradient_accumulation_steps): plan 16, engine 32" in line
        assert "Traceback" not in text
        events = [json.loads(x) for x in (tmp_path / "run" / f"clock-r{rank}.jsonl").read_text().splitlines()]
        assert not [e for e in events if e["event"] in ("set", "skip")]  # no clock was planned-set: no step ran

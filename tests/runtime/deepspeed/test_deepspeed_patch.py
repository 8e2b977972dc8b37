"""DeepSpeed 0.19.8 PipelineEngine on CPU/gloo (2 stages, 4 micro-batches per step) with the kareus patch.

One spawn of 2 ranks runs every scenario (see ds_worker.py): the simulated backend's clock log equals
each stage's planned clock sequence, losses are identical with and without the patch, eval_batch is
left alone, a plan for the wrong micro-batch count and a real DualPipeVEngine are rejected before the
first step, and the measured logs feed `kareus compare`. Without a spawn: the planner's deepspeed-train
order equals DeepSpeed's TrainSchedule, the config/env entry points, and the version check.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import ds_worker  # noqa: E402
from _dist import MEGATRON_CORE, read_ranks, spawn  # noqa: E402

from kareus_megatron.errors import ConfigError, UnsupportedVersionError  # noqa: E402
from kareus_megatron.plan.io import save_plan, write_json_atomic  # noqa: E402
from kareus_megatron.plan.schema import Plan  # noqa: E402
from kareus_megatron.report.runlog import MEASUREMENT_FILE, read_run_log  # noqa: E402
from kareus_megatron.runtime.frameworks import deepspeed_patch  # noqa: E402
from kareus_megatron.search.schedules import instruction_order  # noqa: E402

M, PP = ds_worker.MICRO_BATCHES, 2
# Lockable on the A100 preset (15 MHz grid); repeats exercise the controller's "unchanged" skips.
CYCLE = (1410, 1200, 1200, 1005, 1305, 990, 1095, 1410, 1155)


def ds_plan(method: str, clocks, m: int = M, *, time_s: float = 0.05, energy_j: float = 40.0) -> Plan:
    """A deepspeed-train plan for ds_worker's model; stage r's k-th instruction gets clocks(r, k)."""
    order = instruction_order("deepspeed-train", PP, m)
    return Plan.model_validate(
        {
            "format": "kareus-plan/1",
            "method": method,
            "framework": "deepspeed",
            "gpu": "a100-sxm4-40gb",
            "parallel": dict(
                tp=1,
                cp=1,
                pp=PP,
                vp=1,
                dp=1,
                micro_batch_size=ds_worker.MBS,
                seq_length=1,
                num_microbatches=m,
                layers_per_stage=(2, 2),
                nodes=1,
                gpus_per_node=2,
                schedule="deepspeed-train",
            ),
            "predicted": {"iteration_time_s": time_s, "iteration_energy_j": energy_j},
            "stages": [
                {
                    "pp_rank": r,
                    "instructions": [
                        {"kind": k, "microbatch": mb, "sm_clock_mhz": clocks(r, i)}
                        for i, (k, mb, _) in enumerate(order[r])
                    ],
                }
                for r in range(PP)
            ],
        }
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Spawn the 2 ranks once; return (workdir, {rank: {scenario: result}}, plans, log_dir)."""
    from kareus_megatron.report.runlog import MANIFEST_FILE, RUN_FORMAT

    d = tmp_path_factory.mktemp("ds")
    logs = d / "logs"
    plans = {
        "perseus-00": ds_plan("perseus", lambda r, i: 1200, time_s=0.06, energy_j=30.0),
        "kareus-00": ds_plan("kareus", lambda r, i: CYCLE[(i + 3 * r) % len(CYCLE)]),
        "mismatch": ds_plan("kareus", lambda r, i: 1410, m=2),
    }
    for name, plan in plans.items():
        save_plan(plan, d / f"{name}.json")
    scenarios = [
        {"name": "reference", "mode": "reference"},
        {"name": "megatron-00", "mode": "measure", "log": str(logs / "megatron-00" / MEASUREMENT_FILE)},
        {
            "name": "perseus-00",
            "mode": "plan",
            "plan": str(d / "perseus-00.json"),
            "log": str(logs / "perseus-00" / MEASUREMENT_FILE),
            "controller": "thread",
        },
        {
            "name": "kareus-00",
            "mode": "plan",
            "plan": str(d / "kareus-00.json"),
            "log": str(logs / "kareus-00" / MEASUREMENT_FILE),
            "controller": "process",
        },
        {"name": "mismatch", "mode": "plan", "plan": str(d / "mismatch.json"), "controller": "thread"},
        {
            "name": "dualpipev",
            "mode": "plan",
            "plan": str(d / "kareus-00.json"),
            "controller": "thread",
            "dualpipev": True,
        },
    ]
    for sc in scenarios[1:4]:  # what `kareus launch` writes beside each run's log
        method = sc["name"].split("-")[0]
        write_json_atomic(
            logs / sc["name"] / MANIFEST_FILE,
            {"format": RUN_FORMAT, "method": method, "point": 0, "plan": sc.get("plan")},
        )
    # Ranks forked from the fork server (torch imported there once; megatron-core too, unused here: one server per test
    # process, the other spawn users' preload); each imports DeepSpeed itself, after setting DS_ACCELERATOR.
    spawn(ds_worker.worker, 2, str(d), scenarios, preload=MEGATRON_CORE)  # restores os.environ
    results = dict(enumerate(read_ranks(d, "r{rank}.json", 2)))
    for r in range(2):
        assert "crash" not in results[r], results[r]["crash"]
    return d, results, plans, logs


def _clock_log(d: Path, name: str, rank: int) -> list[dict]:
    return [json.loads(line) for line in (d / f"{name}-clock-r{rank}.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("name", ["kareus-00", "perseus-00"])
def test_simulated_clock_log_equals_each_stages_planned_sequence(runs, name):
    d, results, plans, _ = runs
    for rank in range(2):
        log = _clock_log(d, name, rank)
        decided = [e["mhz"] for e in log if e["event"] in ("set", "skip")]
        assert decided == plans[name].clock_sequence(rank) * ds_worker.STEPS
        assert log[-1]["event"] == "close" and any(e["event"] == "reset" for e in log[-3:])
        # eval_batch ran after training: no instruction announced for it
        assert len(results[rank][name]["events"]) == results[rank][name]["events_after_train"]
        assert len(results[rank][name]["events"]) == 2 * M * ds_worker.STEPS


def test_microbatches_are_counted_per_step(runs):
    _, results, plans, _ = runs
    for rank in range(2):
        ev = results[rank]["kareus-00"]["events"]
        planned = [(i.kind, i.microbatch) for i in plans["kareus-00"].stages[rank].instructions]
        for step in range(ds_worker.STEPS):
            mine = ev[step * 2 * M : (step + 1) * 2 * M]
            assert [e[0] for e in mine] == [step] * 2 * M
            assert [(e[2], e[3]) for e in mine] == planned
            assert [e[1] for e in mine] == list(range(2 * M))


def test_losses_identical_with_and_without_the_patch(runs):
    _, results, _, _ = runs
    for rank in range(2):
        ref = results[rank]["reference"]
        assert len(ref["losses"]) == ds_worker.STEPS and ref["error"] is None
        for name in ("megatron-00", "perseus-00", "kareus-00"):
            assert results[rank][name]["error"] is None
            assert results[rank][name]["losses"] == ref["losses"]
            assert results[rank][name]["eval_loss"] == ref["eval_loss"]


def test_wrong_micro_batch_count_rejected_before_the_first_step(runs):
    d, results, _, _ = runs
    for rank in range(2):
        res = results[rank]["mismatch"]
        assert res["error"].startswith("PlanMismatchError")
        assert "micro-batches per step (gradient_accumulation_steps): plan 2, engine 4" in res["error"]
        assert res["losses"] == [] and res["events"] == []
        assert not [e for e in _clock_log(d, "mismatch", rank) if e["event"] in ("set", "skip")]


def test_dualpipev_engine_refused_before_the_first_step(runs):
    d, results, _, _ = runs
    for rank in range(2):
        res = results[rank]["dualpipev"]
        assert res["engine"] == "DualPipeVEngine"  # the real engine deepspeed.initialize built
        assert res["error"].startswith("InfeasibleConfigError: DualPipeVEngine runs DeepSpeed's DualPipeV schedule")
        assert "\n" not in res["error"] and "PipelineModule, not a DualPipeVModule" in res["error"]
        assert res["losses"] == [] and res["events"] == []
        assert not [e for e in _clock_log(d, "dualpipev", rank) if e["event"] in ("set", "skip")]
    for rank in range(2):  # the PipelineEngine scenarios were not refused
        assert results[rank]["kareus-00"]["engine"] == "PipelineEngine"


def test_engine_problem_names_engines_the_patch_cannot_follow():
    from deepspeed.runtime.pipe.dualpipev import DualPipeVEngine
    from deepspeed.runtime.pipe.engine import PipelineEngine

    assert deepspeed_patch.engine_problem(PipelineEngine) is None
    assert deepspeed_patch.engine_problem(type("MyEngine", (PipelineEngine,), {})) is None  # inherits the map
    assert deepspeed_patch.engine_problem(DualPipeVEngine).startswith("DualPipeVEngine runs DeepSpeed's DualPipeV")
    own = type("OwnMap", (PipelineEngine,), {"_INSTRUCTION_MAP": dict(PipelineEngine._INSTRUCTION_MAP)})
    assert "its own instruction map" in deepspeed_patch.engine_problem(own)


def test_measured_logs_are_written_per_step(runs):
    _, _, _, logs = runs
    for name in ("megatron-00", "perseus-00", "kareus-00"):
        run = read_run_log(logs / name / MEASUREMENT_FILE)  # one file per rank, merged
        assert run.header["framework"] == "deepspeed" and not run.partial
        its = run.iterations
        assert [x["iteration"] for x in its] == list(range(ds_worker.STEPS))
        assert all(x["time_s"] > 0 and x["energy_j"] > 0 for x in its)
        assert [s["pp_rank"] for s in its[0]["stages"]] == [0, 1]


def test_kareus_compare_on_the_cpu_runs(runs, tmp_path, monkeypatch):
    from kareus_megatron.cli import main as cli_main

    main = cli_main.main
    _, _, _, logs = runs
    out = tmp_path / "cmp"
    assert main(["compare", str(logs), "--skip-iterations", "1", "--out", str(out)]) == 0
    doc = json.loads((out / "frontier.json").read_text())
    assert set(doc["methods"]) == {"megatron", "perseus", "kareus"}
    for method in doc["methods"]:
        its = read_run_log(logs / f"{method}-00" / MEASUREMENT_FILE).iterations[1:]
        (pt,) = doc["methods"][method]["points"]
        assert pt["time_s"] == pytest.approx(statistics.median(x["time_s"] for x in its), rel=1e-12)
        assert pt["energy_j"] == pytest.approx(statistics.median(x["energy_j"] for x in its), rel=1e-12)
    p = doc["methods"]["perseus"]["points"][0]
    k = doc["methods"]["kareus"]["points"][0]
    want = (p["energy_j"] - k["energy_j"]) / p["energy_j"] if k["time_s"] <= p["time_s"] * (1 + 1e-9) else None
    assert doc["reductions"]["kareus"]["iso_time_energy"] == (pytest.approx(want) if want is not None else None)
    assert (out / "frontier.png").stat().st_size > 1000


@pytest.mark.parametrize("stages, micro_batches", [(2, 4), (2, 1), (3, 5), (4, 8), (4, 2)])
def test_planner_order_matches_deepspeeds_train_schedule(stages, micro_batches):
    from deepspeed.runtime.pipe.schedule import TrainSchedule

    planned = instruction_order("deepspeed-train", stages, micro_batches)
    for s in range(stages):
        real = deepspeed_patch.train_schedule_order(micro_batches, stages, s)
        assert [(k, mb) for k, mb, _ in real] == [(k, mb) for k, mb, _ in planned[s]]
        nbuf = TrainSchedule(micro_batches=micro_batches, stages=stages, stage_id=s).num_pipe_buffers()
        assert all(buf == mb % nbuf for _, mb, buf in real)  # the buffer -> microbatch map the patch counts by


def test_plan_mismatches_lists_every_problem():
    plan = ds_plan("kareus", lambda r, i: 1417)
    live = deepspeed_patch.LiveEngine(stages=3, stage_id=0, micro_batches=8, micro_batch_size=4, dp=2)
    problems = deepspeed_patch.plan_mismatches(plan, live, (1410, 1395), "a100-sxm4-80gb")
    assert [p.split(":")[0] for p in problems] == [
        "pipeline stages",
        "micro-batches per step (gradient_accumulation_steps)",
        "micro-batch size (train_micro_batch_size_per_gpu)",
        "data parallel size",
        "GPU",
        "SM clocks 1417 MHz are not lockable on this GPU",
    ]
    megatron_plan = plan.model_copy(update={"framework": "megatron"})
    live_ok = deepspeed_patch.LiveEngine(stages=2, stage_id=1, micro_batches=M, micro_batch_size=2, dp=1)
    assert deepspeed_patch.plan_mismatches(megatron_plan, live_ok)[0].startswith("framework: plan megatron")
    swapped = plan.model_dump()
    instrs = list(swapped["stages"][1]["instructions"])
    instrs[0], instrs[1] = instrs[1], instrs[0]
    swapped["stages"][1]["instructions"] = instrs
    (msg,) = deepspeed_patch.plan_mismatches(Plan.model_validate(swapped), live_ok)
    assert "differs from DeepSpeed's TrainSchedule at position 0" in msg
    nano = plan.model_dump()
    nano["stages"][0]["instructions"][0]["nanobatches"] = 2
    (msg,) = deepspeed_patch.plan_mismatches(Plan.model_validate(nano), live_ok)
    assert msg.startswith("nanobatches: ") and "DeepSpeed runs them whole" in msg


def test_version_check():
    assert deepspeed_patch.check_deepspeed_version() == "0.19.8"
    assert deepspeed_patch.check_deepspeed_version("0.18.5") == "0.18.5"
    with pytest.raises(UnsupportedVersionError, match=r"0.17.6 is not supported.*supported: 0.18.x, 0.19.x"):
        deepspeed_patch.check_deepspeed_version("0.17.6")


def test_config_section_is_read_and_removed(tmp_path, monkeypatch):
    import kareus_megatron.deepspeed as kds

    cfg = {"train_micro_batch_size_per_gpu": 2, "kareus": {"plan": None, "log": str(tmp_path / "m.jsonl")}}
    monkeypatch.setenv("KAREUS_GPU_BACKEND", "simulated")
    try:
        cleaned = kds.from_config(cfg)
        assert cleaned == {"train_micro_batch_size_per_gpu": 2}
        assert kds.current_session() is not None and kds.current_session().plan is None
        assert deepspeed_patch.installed_state() is kds.current_session().patch
    finally:
        kds.uninstall()
    assert deepspeed_patch.installed_state() is None
    from deepspeed.runtime.pipe import schedule
    from deepspeed.runtime.pipe.engine import PipelineEngine

    assert PipelineEngine._INSTRUCTION_MAP[schedule.ForwardPass] is PipelineEngine.__dict__["_exec_forward_pass"]
    with pytest.raises(ConfigError, match="unknown key.*plna"):
        kds.from_config({"kareus": {"plna": "x"}})
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"steps_per_print": 5}))
    assert kds.from_config(path) == {"steps_per_print": 5}
    monkeypatch.delenv("KAREUS_PLAN", raising=False)
    monkeypatch.delenv("KAREUS_LOG", raising=False)
    assert kds.install_from_env() is None


def test_launcher_bad_input_is_one_line_exit_2(tmp_path, capsys):
    import kareus_megatron.deepspeed as kds

    plan = tmp_path / "p.json"
    save_plan(ds_plan("kareus", lambda r, i: 1410), plan)
    assert kds.main(["--help"]) == 0 and "--kareus-plan" in capsys.readouterr().out
    assert kds.main(["--kareus-plan", str(plan), "--", str(tmp_path / "missing.py")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{kds.PROG}: error: training script ") and err.count("\n") == 1
    assert kds.main(["--kareus-plan", str(plan), "--kareus-bogus", "--", "train.py"]) == 2
    assert "unknown launcher argument(s) --kareus-bogus" in capsys.readouterr().err
    assert kds.current_session() is None and deepspeed_patch.installed_state() is None

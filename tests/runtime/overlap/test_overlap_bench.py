"""benchmarks/overlap_gpu.py: imports without a GPU, its dry run measures, predicts and calibrates on CPU;
overlap_cpu.py --cp: the CP collectives are issued at their planned slots."""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def bench():
    # importable by name, so that the dry run's spawned workers can unpickle its functions
    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.insert(0, str(ROOT / "benchmarks"))
    return importlib.import_module("overlap_gpu")


@pytest.fixture
def forked_ranks(monkeypatch):
    """The benchmarks' torch.multiprocessing.spawn starts its ranks from a fork server that imported torch and
    megatron-core once for this test process (_dist.start_ranks), not from fresh interpreters (about 4 s of CPU
    each): the ranks still import the benchmark's worker by name and run it as spawned."""
    import torch.multiprocessing as mp
    from _dist import start_ranks

    monkeypatch.setattr(mp, "spawn", start_ranks)


def test_dry_run_measures_predicts_and_writes_calibration(bench, tmp_path, forked_ranks):
    from kareus_megatron.cost.calibration import load_calibration

    out, cal = tmp_path / "m.json", tmp_path / "cal.json"
    assert bench.main(["--dry-run", "--out", str(out), "--write-calibration", str(cal)]) == 0
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert doc["dry_run"] and doc["tp"] == 2 and len(rows) == 4 + 4 * 2
    assert doc["core_attention"] == "sdpa"  # the measured layer's default: torch SDPA
    assert set(doc["attention_op"]) == {"local_s", "sdpa_s"} and min(doc["attention_op"].values()) > 0
    for r in rows:
        for k in ("measured_time_s", "measured_energy_j", "predicted_time_s", "predicted_energy_j"):
            assert math.isfinite(r[k]), (k, r)
        assert r["predicted_time_s"] > 0 and r["predicted_energy_j"] > 0
        assert r["sm_limit_requested"] is False  # gloo: the SM request is recorded only
    fwd = [r for r in rows if r["phase"] == "forward" and r["nanobatches"] == 2 and r["partition"] == "fwd_mlp"]
    assert len({round(r["predicted_time_s"], 12) for r in fwd}) == 2  # the slot matters to the model
    c = load_calibration(cal)
    assert set(c.params) == {name for name, *_ in bench.OVERLAP_FREE} and "calibrated" in c.fit


def _dry_run_rows(bench, tmp_path, *args: str) -> tuple[dict, list[dict]]:
    """Run the dry run with `args`; return its document and rows, each checked finite with a positive prediction."""
    out = tmp_path / "m.json"
    assert bench.main(["--dry-run", "--sms", "6,18", "--out", str(out), *args]) == 0
    doc = json.loads(out.read_text())
    for r in doc["rows"]:
        for k in ("measured_time_s", "measured_energy_j", "predicted_time_s", "predicted_energy_j"):
            assert math.isfinite(r[k]), (k, r)
        assert r["predicted_time_s"] > 0 and r["predicted_energy_j"] > 0, r
        assert r["sm_limit_requested"] is False  # gloo: the SM request is recorded only
    return doc, doc["rows"]


def _slot_matters(rows: list[dict]) -> set[str]:
    """The partitions whose predicted time differs between the launch slots measured."""
    by_part: dict[str, set[float]] = {}
    for r in rows:
        if r["partition"]:
            by_part.setdefault(r["partition"], set()).add(round(r["predicted_time_s"], 12))
    return {p for p, t in by_part.items() if len(t) > 1}


def test_dry_run_sp_covers_every_sp_partition(bench, tmp_path, forked_ranks):
    """--sp (TP=2): the sequence-parallel layer; a row for every SP partition (first and last slot), and the
    prediction's layout is sequence-parallel (the slot changes it)."""
    from kareus_megatron.vocab import SP_BACKWARD_PARTITIONS, SP_FORWARD_PARTITIONS, SP_PARTITION_SLOTS

    doc, rows = _dry_run_rows(bench, tmp_path, "--sp")
    assert doc["tp"] == 2 and doc["cp"] == 1 and doc["sequence_parallel"] is True
    assert list(doc["partitions"]) == [*SP_FORWARD_PARTITIONS, *SP_BACKWARD_PARTITIONS]
    parts = [r["partition"] for r in rows if r["partition"]]
    assert set(parts) == set(SP_PARTITION_SLOTS)
    for r in rows:
        if r["partition"]:
            slots = SP_PARTITION_SLOTS[r["partition"]]
            assert r["slot"] in (slots[0], slots[-1]) and r["comm_sms"] == 6, r
            assert r["phase"] == ("forward" if r["partition"] in SP_FORWARD_PARTITIONS else "backward"), r
    n_slots = sum(len({s[0], s[-1]}) for s in SP_PARTITION_SLOTS.values())  # 1-op segments: one row
    assert len(rows) == 4 + n_slots  # 2 reference rows per phase
    assert _slot_matters(rows), rows
    assert set(doc["attention_op"]) == {"local_s", "sdpa_s"}


def test_dry_run_cp_covers_the_cp_partitions(bench, tmp_path, forked_ranks):
    """--cp 2 (TP=1, CP=2): megatron's CP layout; a row for each CP K/V partition (with TP=1 the TP all-reduce
    partitions of cp_engine_slots have no collective), and the prediction's layout is CP (the slot changes it)."""
    from kareus_megatron.runtime.overlap.config import cp_engine_slots
    from kareus_megatron.vocab import CP_PARTITION_SLOTS

    doc, rows = _dry_run_rows(bench, tmp_path, "--cp", "2")
    assert doc["tp"] == 1 and doc["cp"] == 2 and doc["sequence_parallel"] is False
    layout = {n: s for n, s in cp_engine_slots().items() if n in CP_PARTITION_SLOTS}
    assert doc["partitions"] == {n: list(s) for n, s in layout.items()}
    assert {r["partition"] for r in rows if r["partition"]} == set(layout)
    assert len(rows) == 4 + 2 * len(layout)  # references, then each partition's first and last slot
    assert _slot_matters(rows), rows
    assert doc["attention_op"] == {}  # megatron's DotProductAttention does not run CP


@pytest.mark.parametrize(
    "bad",
    [
        ["--cp", "2", "--core-attention", "local"],  # CP runs on SDPA
        ["--sp", "--cp", "2"],  # the dry run's 2 processes at CP=2 leave TP=1
        ["--cp", "3"],  # does not divide the world size
        ["--cp", "2", "--partitions", "fwd_attn"],  # no collective at TP=1
        ["--sp", "--partitions", "fwd_attn,fwd_sp_mlp"],  # a TP partition on the SP layout
        ["--partitions", "fwd_sp_mlp"],  # an SP partition on the TP layout
    ],
)
def test_layout_misfits_are_refused_in_one_line(bench, capsys, bad):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--dry-run", *bad])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("overlap_gpu.py: error: --"), err
    assert not any("Traceback" in line for line in err)


def test_fit_recovers_a_perturbed_overlap_model(bench):
    from kareus_megatron.cost.kernel import KernelModel
    from kareus_megatron.cost.params import KernelParams
    from kareus_megatron.hardware.gpus import gpu_spec
    from kareus_megatron.workload.parallel import make_parallel

    gpu = gpu_spec("a100-sxm4-40gb")
    args = bench.parse_args(
        [
            "--dry-run",
            "--model",
            "qwen3-1.7b",
            "--seq",
            "4096",
            "--mbs",
            "8",
            "--sms",
            "6,18",
            "--partitions",
            "fwd_mlp",
        ]
    )
    model = bench.model_spec(args)
    par = make_parallel(model, tp=8, micro_batch_size=8, seq_length=4096, gpus_per_node=8)
    rows = bench.knob_rows(args, gpu)
    truth = KernelModel.from_params(
        gpu, dataclasses.replace(KernelParams(), nvlink_efficiency=0.55, comm_sm_bytes_per_cycle=9.0, time_scale=1.2)
    )
    t, e = bench.predict_rows(rows, truth, model, par, 1410)
    for r, ti, ei in zip(rows, t, e):
        r["measured_time_s"], r["measured_energy_j"] = float(ti), float(ei)
    cal = bench.fit_overlap(rows, gpu, model, par, 1410, None)
    before, after = cal.fit["uncalibrated"], cal.fit["calibrated"]
    assert after["time_abs_mape_pct"] < 0.5 * before["time_abs_mape_pct"] and after["time_abs_mape_pct"] < 2.0
    fitted = KernelModel(gpu, cal)
    t2, _ = bench.predict_rows(rows, fitted, model, par, 1410)
    assert np.max(np.abs(t2 / t - 1)) < 0.05


def test_runtime_package_does_not_import_the_planner():
    # layer.py adds only megatron-core to these (its imports are in plain sight); importing it here
    # would cost seconds of megatron import
    code = (
        "import sys, kareus_megatron.runtime.overlap as o; o.setup_overlap; "
        "import kareus_megatron.runtime.overlap.schedule; "
        "bad = [m for m in sys.modules if m.startswith(('kareus_megatron.cost', "
        "'kareus_megatron.search', 'kareus_megatron.cli'))]; assert not bad, bad; "
        "assert 'megatron' not in sys.modules"
    )
    subprocess.run([sys.executable, "-W", "ignore", "-c", code], check=True, cwd=ROOT)


def test_cpu_benchmark_cp_mode_traces_each_cp_collective_at_its_slot(capsys, forked_ranks):
    """benchmarks/overlap_cpu.py --cp, tiny layer: 2 gloo ranks at CP=2 run every delay model, and the traced
    2-nanobatch run issues the 4 CP collectives (K/V all-gather, dK/dV reduce-scatter, per nanobatch) at their
    planned slots. Timings are not asserted (a shared machine)."""
    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.insert(0, str(ROOT / "benchmarks"))
    cpu_bench = importlib.import_module("overlap_cpu")
    args = ["--cp", "--hidden", "64", "--heads", "4", "--seq", "32", "--mbs", "2", "--reps", "1", "--delay-ms", "1"]
    assert cpu_bench.main(args) == 0
    out = capsys.readouterr().out
    assert "gloo CP=2 (TP=1)" in out and "fixed 1 ms" in out and "1 ms per microbatch" in out
    traces = [line for line in out.splitlines() if line.startswith("trace rank")]
    assert len(traces) == 2
    for line in traces:
        assert "4 CP collectives issued" in line and line.endswith("overlap violations: none"), line
        assert "fwd_cp_kv@input_norm" in line and "bwd_cp_kv@pre_mlp_norm" in line, line
    with pytest.raises(SystemExit) as e:  # refused before anything is spawned
        cpu_bench.main(["--cp", "--sp"])
    assert e.value.code == 2


def test_cpu_benchmark_cross_layer_mode_carries_each_last_allreduce(capsys, forked_ranks):
    """benchmarks/overlap_cpu.py --cross-layer, 2 tiny layers: the traced run issues layer 1's last all-reduce in
    layer 2's call at fwd_attn's slot, with no overlap violation. Timings are not asserted (a shared machine)."""
    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.insert(0, str(ROOT / "benchmarks"))
    cpu_bench = importlib.import_module("overlap_cpu")
    args = [
        "--cross-layer",
        "--layers",
        "2",
        "--hidden",
        "64",
        "--heads",
        "4",
        "--seq",
        "16",
        "--mbs",
        "2",
        "--reps",
        "1",
        "--delay-ms",
        "1",
    ]
    assert cpu_bench.main(args) == 0
    out = capsys.readouterr().out
    assert "2 partitioned layers (TransformerBlock)" in out and "2 nb + cross-layer" in out
    traces = [line for line in out.splitlines() if line.startswith("trace rank")]
    assert len(traces) == 2
    for line in traces:
        assert line.startswith(("trace rank 0: 1 collectives issued", "trace rank 1: 1 collectives issued")), line
        assert "fwd_attn@input_norm" in line and line.endswith("overlap violations: none"), line
    for bad in (["--cross-layer", "--cp"], ["--cross-layer", "--layers", "1"]):
        with pytest.raises(SystemExit) as e:  # refused before anything is spawned
            cpu_bench.main(bad)
        assert e.value.code == 2


def _one_process_worker(rank: int, world: int, port: int, bench_dir: str, out: str, printed: str) -> None:
    """The benchmark's single-GPU path (``--dry-run --procs 1``) in this rank, its spawn run in place so that the
    device stand-in applies: the device runs at 1200 MHz without being locked. What it prints goes to `printed`."""
    import contextlib

    import torch.multiprocessing as mp

    from kareus_megatron.hardware import device

    sys.path.insert(0, bench_dir)
    import overlap_gpu

    mp.spawn = lambda fn, args, nprocs, join: fn(0, *args)
    real = device.open_gpu

    def running_at_1200(*a, **k):
        gpu = real(*a, **k)
        gpu.sm_clock_mhz = lambda: 1200
        return gpu

    device.open_gpu = running_at_1200
    with open(printed, "w") as f, contextlib.redirect_stdout(f):
        code = overlap_gpu.main(["--dry-run", "--procs", "1", "--out", out])
    assert code == 0, code


# One process (the single-GPU path) whose device runs at 1200 MHz without being locked (a power cap, heat):
# the rows are predicted at the clock the device reports while they run, not at the preset's maximum.
def test_one_process_measures_the_references_and_predicts_at_the_measured_clock(bench, tmp_path):
    from _dist import MEGATRON_CORE, spawn

    from kareus_megatron.cost.kernel import KernelModel
    from kareus_megatron.hardware.gpus import gpu_spec

    out, printed = tmp_path / "single.json", tmp_path / "stdout.txt"
    spawn(_one_process_worker, 1, str(ROOT / "benchmarks"), str(out), str(printed), preload=MEGATRON_CORE)
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert doc["tp"] == 1 and doc["partitions"] == {} and doc["notes"] and "2 or more GPUs" in printed.read_text()
    assert [(x["phase"], x["nanobatches"], x["partition"]) for x in rows] == [
        ("forward", 1, None),
        ("forward", 2, None),
        ("backward", 1, None),
        ("backward", 2, None),
    ]
    assert doc["clock_mhz"] is None and doc["clock_source"] == "measured" and doc["measured_clock_mhz"] == 1200
    assert all(x["clock_mhz"] == 1200 for x in rows)
    args = bench.parse_args(["--dry-run", "--procs", "1"])
    km = KernelModel(gpu_spec("a100-sxm4-40gb"))
    at_1200, _ = bench.predict_rows(rows, km, bench.model_spec(args), args.par, 1200)
    at_max, _ = bench.predict_rows(rows, km, bench.model_spec(args), args.par, 1410)
    assert np.allclose([x["predicted_time_s"] for x in rows], at_1200) and not np.allclose(at_1200, at_max)
    comms = doc["communicators"]  # the engine's communicators for the planner's TP grid, built on this one rank
    assert comms["backend"] == "gloo" and comms["cleaned_up"] and len(comms["communicators"]) == len(comms["sm_counts"])


def test_one_process_refuses_what_needs_a_collective(bench, capsys):
    for extra in (["--partitions", "fwd_attn"], ["--write-calibration", "c.json"]):
        with pytest.raises(SystemExit) as e:
            bench.parse_args(["--dry-run", "--procs", "1", *extra])
        assert e.value.code == 2 and "2 or more GPUs" in capsys.readouterr().err

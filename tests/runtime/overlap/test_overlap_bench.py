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


def test_dry_run_measures_predicts_and_writes_calibration(bench, tmp_path):
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
        assert r["sm_limit_applied"] is False  # gloo: the SM request is recorded only
    fwd = [r for r in rows if r["phase"] == "forward" and r["nanobatches"] == 2 and r["partition"] == "fwd_mlp"]
    assert len({round(r["predicted_time_s"], 12) for r in fwd}) == 2  # the slot matters to the model
    c = load_calibration(cal)
    assert set(c.params) == {name for name, *_ in bench.OVERLAP_FREE} and "calibrated" in c.fit


def test_fit_recovers_a_perturbed_overlap_model(bench):
    from kareus_megatron.cost.kernel import KernelModel
    from kareus_megatron.cost.params import KernelParams
    from kareus_megatron.hardware.gpus import gpu_spec
    from kareus_megatron.workload.parallel import make_parallel

    gpu = gpu_spec("a100-sxm4-40gb")
    args = bench.parse_args(["--dry-run", "--model", "qwen3-1.7b", "--seq", "4096", "--mbs", "8", "--sms", "6,18",
                             "--partitions", "fwd_mlp"])
    model = bench.model_spec(args)
    par = make_parallel(model, tp=8, micro_batch_size=8, seq_length=4096, gpus_per_node=8)
    rows = bench.knob_rows(args, gpu)
    truth = KernelModel.from_params(gpu, dataclasses.replace(KernelParams(), nvlink_efficiency=0.55,
                                                             comm_sm_bytes_per_cycle=9.0, time_scale=1.2))
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


def test_cpu_benchmark_cp_mode_traces_each_cp_collective_at_its_slot(capsys):
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

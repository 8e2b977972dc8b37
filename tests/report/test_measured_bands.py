"""report/measured_bands.py, alone and through `kareus compare LOG_DIR`: iteration percentiles on constructed data,
no band under MIN_BAND_ITERATIONS, a seeded bootstrap, "n.d." where two runs' iterations overlap and a real
reduction where they do not, and a frontier.json that plan/points.py's reader accepts."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kareus_megatron.cli import main as cli_main
from kareus_megatron.plan.frontier import REDUCTION_KEYS
from kareus_megatron.plan.points import read_frontier
from kareus_megatron.report.measured_bands import (
    BOOTSTRAP_RESAMPLES,
    MIN_BAND_ITERATIONS,
    RunIterations,
    bootstrap,
    point_bands,
)

WARM = (9.0, 9999.0)  # the one warm-up iteration every run starts with (--skip-iterations 1)
SPREAD = [-1.0, -0.5, 0.0, 0.5, 1.0] * 4  # 20 iterations, symmetric around the point


@pytest.fixture(autouse=True)
def only_compare(monkeypatch):
    """The real `kareus` dispatcher with just this subcommand."""
    monkeypatch.setattr(cli_main, "COMMANDS", {"compare": "compare"})


def write_run(root: Path, name: str, rows: list[tuple[float, float]]) -> None:
    """A run directory NAME-NN/measurement.jsonl: a header, the warm-up iteration, then `rows` (time s, energy J)."""
    d = root / name
    d.mkdir(parents=True)
    lines = [{"kind": "header", "world": 8, "gpu": "a100-sxm4-40gb"}]
    lines += [
        {"kind": "iteration", "iteration": i, "time_s": t, "energy_j": e, "stages": []}
        for i, (t, e) in enumerate([WARM, *rows])
    ]
    (d / "measurement.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def spread_rows(time_s: float, energy_j: float, rel: float) -> list[tuple[float, float]]:
    """20 iterations at `time_s` (s) whose energies spread +-`rel` around `energy_j` (J)."""
    return [(time_s, energy_j * (1 + rel * s)) for s in SPREAD]


def compare(root: Path, out: Path, capsys) -> tuple[dict, str]:
    assert cli_main.main(["compare", str(root), "--skip-iterations", "1", "--out", str(out), "--no-plot"]) == 0
    return json.loads((out / "frontier.json").read_text()), capsys.readouterr().out


def reference_runs(root: Path) -> None:
    write_run(root, "megatron-00", spread_rows(2.0, 1000.0, 0.1))
    write_run(root, "perseus-00", spread_rows(2.0, 900.0, 0.1))


def test_point_band_is_the_iterations_5th_to_95th_percentile():
    # 21 iterations 1..21 s: the 5th percentile is 1 + 0.05 * 20 = 2, the 95th 1 + 0.95 * 20 = 20 (linear)
    run = RunIterations(name="kareus-00", time_s=np.arange(1.0, 22.0), energy_j=10 * np.arange(1.0, 22.0))
    assert point_bands(run) == {"time_s_band": [2.0, 20.0], "energy_j_band": [20.0, 200.0]}


def test_point_bands_reach_frontier_json(tmp_path, capsys):
    root = tmp_path / "runs"
    reference_runs(root)
    write_run(root, "kareus-00", [(float(t), 10.0 * t) for t in range(1, 22)])
    doc, text = compare(root, tmp_path / "out", capsys)
    (p,) = doc["methods"]["kareus"]["points"]
    assert p["time_s"] == 11.0 and p["time_s_band"] == [2.0, 20.0] and p["energy_j_band"] == [20.0, 200.0]
    assert "2-20" in text and "20-200" in text  # the run's band cells


def test_no_band_under_five_iterations(tmp_path, capsys):
    short = RunIterations(name="k", time_s=np.ones(MIN_BAND_ITERATIONS - 1), energy_j=np.ones(MIN_BAND_ITERATIONS - 1))
    assert point_bands(short) == {}
    assert np.isnan(bootstrap([short])["k"][0]).all()
    root = tmp_path / "runs"
    reference_runs(root)
    write_run(root, "kareus-00", [(2.0, 950.0), (2.0, 970.0), (2.0, 960.0), (2.0, 955.0)])  # 4 after warm-up
    write_run(root, "kareus-01", [(2.5, 600.0)] * MIN_BAND_ITERATIONS)  # just enough for a band
    doc, text = compare(root, tmp_path / "out", capsys)
    fast, slow = doc["methods"]["kareus"]["points"]
    assert "time_s_band" not in fast and "energy_j_band" not in fast
    assert slow["time_s_band"] == [2.5, 2.5] and slow["energy_j_band"] == [600.0, 600.0]
    r = doc["reductions"]["kareus"]
    # kareus-00 is the only point at Perseus's time (its energy is above Perseus's least), kareus-01 the only one
    # within Perseus's least energy
    assert r["iso_time_energy"] is not None and r["iso_time_energy_band"] is None  # reads kareus-00
    assert r["max_throughput_time_vs_megatron_band"] is None
    assert r["iso_energy_time_band"] is not None  # reads kareus-01 and perseus-00 only
    assert "no band for kareus-00 (4): fewer than 5 iterations" in text
    assert doc["methods"]["megatron"]["points"][0]["time_s_band"] == [2.0, 2.0]


def test_bootstrap_is_reproducible_with_its_seed(tmp_path, capsys):
    runs = [
        RunIterations(name=n, time_s=np.linspace(1.0, 2.0, 9) * k, energy_j=np.linspace(100.0, 300.0, 9) * k)
        for n, k in (("b", 1.0), ("a", 1.5))
    ]
    one, two = bootstrap(runs), bootstrap(list(reversed(runs)))  # run order does not matter, names do
    other = bootstrap(runs, seed=1)
    for name in ("a", "b"):
        assert one[name][0].shape == (BOOTSTRAP_RESAMPLES,)
        assert np.array_equal(one[name][0], two[name][0]) and np.array_equal(one[name][1], two[name][1])
        assert not np.array_equal(one[name][1], other[name][1])
    root = tmp_path / "runs"
    reference_runs(root)
    write_run(root, "kareus-00", spread_rows(2.0, 890.0, 0.1))
    first, _ = compare(root, tmp_path / "o1", capsys)
    again, _ = compare(root, tmp_path / "o2", capsys)
    assert first["reductions"] == again["reductions"] and first["bands"]["seed"] == again["bands"]["seed"]


def _kareus_row(text: str) -> str:
    (row,) = [line for line in text.splitlines() if line.strip().startswith("kareus ")]
    return row


def test_overlapping_runs_are_not_distinguishable(tmp_path, capsys):
    root = tmp_path / "runs"
    reference_runs(root)
    write_run(root, "kareus-00", spread_rows(2.0, 900.0 * 0.995, 0.1))  # 0.5% less, iterations spread +-10%
    doc, text = compare(root, tmp_path / "out", capsys)
    r = doc["reductions"]["kareus"]
    assert r["iso_time_energy"] == pytest.approx(0.005)
    lo, hi = r["iso_time_energy_band"]
    assert lo < 0 < hi
    assert "0.5% [" in _kareus_row(text) and "n.d." in _kareus_row(text)
    assert "kareus: iso-time energy" in text and "not distinguishable" in text


def test_separated_runs_show_a_real_reduction(tmp_path, capsys):
    root = tmp_path / "runs"
    reference_runs(root)
    write_run(root, "kareus-00", spread_rows(2.0, 720.0, 0.01))  # 20% less, iterations spread +-1%
    doc, text = compare(root, tmp_path / "out", capsys)
    r = doc["reductions"]["kareus"]
    assert r["iso_time_energy"] == pytest.approx(0.2)
    lo, hi = r["iso_time_energy_band"]
    assert 0.15 < lo < 0.2 < hi < 0.25
    assert "20.0% [" in _kareus_row(text) and "n.d." not in _kareus_row(text)


def test_written_frontier_json_validates(tmp_path, capsys):
    root = tmp_path / "runs"
    reference_runs(root)
    write_run(root, "perseus-01", spread_rows(2.5, 800.0, 0.05))
    write_run(root, "kareus-00", spread_rows(2.0, 850.0, 0.05))
    out = tmp_path / "out"
    compare(root, out, capsys)
    doc = read_frontier(out)  # the one reader, which checks every point's bands
    assert list(doc) == ["format", "config", "methods", "reductions", "bands"]
    assert doc["bands"] == {
        "source": "bootstrap",
        "draws": BOOTSTRAP_RESAMPLES,
        "seed": 0,
        "percentiles": [5.0, 95.0],
        "min_iterations": MIN_BAND_ITERATIONS,
    }
    for entry in doc["methods"].values():
        for p in entry["points"]:
            assert p["time_s_band"][0] <= p["time_s"] <= p["time_s_band"][1]
            assert p["energy_j_band"][0] <= p["energy_j"] <= p["energy_j_band"][1]
    for name, red in doc["reductions"].items():
        assert set(red) == set(REDUCTION_KEYS) | {f"{k}_band" for k in REDUCTION_KEYS}, name
        for k in REDUCTION_KEYS:
            assert (red[k] is None) == (red[f"{k}_band"] is None), (name, k)

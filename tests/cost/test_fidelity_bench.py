"""benchmarks/fidelity.py --quick (leave-one-out errors on the Perseus A100/A40 profiles) and that it can fail."""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import sys
from pathlib import Path

import pytest

from kareus_megatron.cost.params import with_gpu_params
from kareus_megatron.hardware.gpus import gpu_spec

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.insert(0, str(ROOT / "benchmarks"))
    return importlib.import_module("fidelity")


@pytest.fixture(scope="module")
def quick(bench, tmp_path_factory):
    """`fidelity.py --quick --json FILE`, run once for the table's test and the leave-one-GPU-out one: (exit status,
    printed text, the JSON document, per transfer() call in row order the GPUs its inputs were fitted on)."""
    fitted_gpus: dict[int, set[str]] = {}  # id of the fitted KernelParams -> GPUs of the profiles it saw
    transferred: list[set[str]] = []  # per transfer() call (leave-one-GPU-out rows only), in row order
    real_fit, real_transfer = bench.fit, bench.transfer

    def fit(cases, *args, **kw):
        out = real_fit(cases, *args, **kw)
        fitted_gpus[id(out[1])] = {c.gpu for c in cases}
        return out

    def transfer(fitted):
        transferred.append(set().union(*(fitted_gpus[id(p)] for p in fitted)))
        return real_transfer(fitted)

    out = tmp_path_factory.mktemp("fidelity") / "fidelity.json"
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(printed):
        mp.setattr(bench, "fit", fit)
        mp.setattr(bench, "transfer", transfer)
        rc = bench.main(["--quick", "--json", str(out)])
    return rc, printed.getvalue(), json.loads(out.read_text()) if out.exists() else None, transferred


def test_quick_table_has_every_gpu_workload_and_mode(bench, quick):
    rc, text, doc, _ = quick
    assert rc == 0
    table = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    assert table[0].startswith("| GPU | workload | mode |") and len(table) == 1 + 2 * 2 * 4, text
    assert all(line.rstrip().endswith(("| met |", "| missed |")) for line in table[1:]), text
    assert "targets: power MAPE <= 12% and energy-minimising clock within 60 MHz" in text
    keys = {(r["gpu"], r["workload"], r["mode"]) for r in doc["rows"]}
    assert keys == {(g, w, m) for g in ("A100-SXM4-80GB", "A40") for w in ("GPT-3", "BLOOM") for m in bench.MODES}
    for r in doc["rows"]:
        assert 0 <= r["time_ratio_mape_pct"] < 100 and 0 <= r["power_mape_pct"] < 100, r
        assert r["argmin_err_max_mhz"] % 15 == 0 and r["argmin_err_mean_mhz"] <= r["argmin_err_max_mhz"], r
        assert r["met"] == (r["power_mape_pct"] <= 12 and r["argmin_err_max_mhz"] <= 60), r
        # leave-one-GPU-out fits on the other GPU only; leave-one-workload-out on the other workload of this GPU
        other_gpu = "A40" if r["gpu"] != "A40" else "A100-SXM4-80GB"
        other_wl = "BLOOM" if r["workload"] == "GPT-3" else "GPT-3"
        assert (
            r["fitted_on"]
            == {
                "presets": "-",
                "leave-one-GPU-out": other_gpu,
                "boost-draw rule, other GPU": other_gpu,
                "leave-one-workload-out": f"{r['gpu']} {other_wl}",
            }[r["mode"]]
        ), r
    fitted_on = ("GPT-3+BLOOM", "GPT-3", "BLOOM", "boost-draw rule")
    assert set(doc["fits"]) == {f"{g} {w}" for g in ("A100-SXM4-80GB", "A40") for w in fitted_on}
    assert all("compute_dynamic_w" in v for v in doc["fits"].values())
    # each GPU's measured draw at its max clock (A100 0.94 of 500 W, A40 0.98 of 300 W: at its limit) sets the
    # other's dynamic power, above the preset's on both (the presets draw less than that at the max clock)
    for g in ("A100-SXM4-80GB", "A40"):
        rule = doc["fits"][f"{g} boost-draw rule"]
        assert 0.9 < rule["measured_draw_fraction"] <= 1.0, rule
        assert rule["compute_dynamic_w"] > gpu_spec(bench.GPUS[g][0]).compute_dynamic_w, rule
    # the same-GPU fit on the other workload predicts the A40's power far better than its derived preset
    by = {(r["gpu"], r["workload"], r["mode"]): r for r in doc["rows"]}
    for w in ("GPT-3", "BLOOM"):
        assert by[("A40", w, "leave-one-workload-out")]["power_mape_pct"] < by[("A40", w, "presets")]["power_mape_pct"]


def test_perturbed_preset_misses_the_power_target(bench):
    """The fitted A100 preset meets the targets; the same preset drawing 1.5x the power misses them."""
    a100 = gpu_spec("a100-sxm4-80gb")
    scaled = with_gpu_params(
        a100,
        {
            k: 1.5 * getattr(a100, k)
            for k in ("static_power_w", "idle_dynamic_w", "compute_dynamic_w", "memory_dynamic_w")
        },
    )
    rows = {
        m: {r.workload: r for r in bench.run(presets=p, modes=("presets",))[0] if r.gpu == "A100-SXM4-80GB"}
        for m, p in (("as shipped", None), ("perturbed", {"A100-SXM4-80GB": scaled}))
    }
    assert all(r.met and r.power_mape_pct <= 12 for r in rows["as shipped"].values()), rows
    assert all(not r.met and r.power_mape_pct > 12 for r in rows["perturbed"].values()), rows


def test_leave_one_gpu_out_never_fits_on_the_held_out_gpu(quick):
    """Each leave-one-GPU-out row's kernel parameters come only from fits to the other GPU's profiles (the --quick run
    of `quick`: transfer() makes the leave-one-GPU-out rows only, one call each, in row order)."""
    _, _, doc, transferred = quick
    rows = [r for r in doc["rows"] if r["mode"] == "leave-one-GPU-out"]
    assert len(rows) == len(transferred) == 4
    for row, gpus in zip(rows, transferred):
        assert gpus == {row["fitted_on"]} and row["gpu"] not in gpus, (row, gpus)


def test_bad_paths_are_one_line_and_status_2(bench, tmp_path, capsys):
    for args, named in (
        (["--data", str(tmp_path / "nowhere")], "nowhere"),
        (["--json", str(tmp_path / "no-dir" / "f.json")], "no-dir"),
    ):
        assert bench.main([*args, "--quick"]) == 2
        captured = capsys.readouterr()
        err = captured.err.strip()
        assert len(err.splitlines()) == 1 and named in err and not captured.out, err
    assert not (tmp_path / "no-dir").exists()

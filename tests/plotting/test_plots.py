"""The figures people read: rendered with the Agg canvas from small in-memory inputs, checked on the artists."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kareus_megatron.plan.frontier import frontier_document
from kareus_megatron.plotting.frontier import METHOD_STYLE, plot_frontier, plot_reductions
from kareus_megatron.plotting.report import plot_run_report
from kareus_megatron.plotting.timeline import Bar, plot_timeline
from kareus_megatron.plotting.units import energy_unit, time_unit
from kareus_megatron.vocab import KAREUS, MEGATRON, NANOBATCH_PERSEUS, PERSEUS, PLAN_METHODS

pytest.importorskip("matplotlib")


def _ax():
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4))
    FigureCanvasAgg(fig)
    return fig.add_subplot(1, 1, 1)


def _xy(values):
    """Artist data as a flat list (pytest.approx compares flat sequences)."""
    return [float(v) for xy in values for v in xy]


def _gid(ax, gid):
    found = [a for a in (*ax.lines, *ax.collections) if a.get_gid() == gid]
    assert len(found) <= 1, gid
    return found[0] if found else None


# measured runs (time s, energy J); (0.058, 820), (0.075, 720) and (0.047, 705) are dominated
MEASURED = {
    MEGATRON: [(0.050, 900.0)],
    PERSEUS: [(0.050, 880.0), (0.055, 800.0), (0.058, 820.0), (0.062, 700.0), (0.070, 690.0), (0.075, 720.0)],
    KAREUS: [(0.042, 760.0), (0.045, 700.0), (0.047, 705.0), (0.052, 610.0), (0.060, 600.0)],
}
PARETO = {
    MEGATRON: [(0.050, 900.0)],
    PERSEUS: [(0.050, 880.0), (0.055, 800.0), (0.062, 700.0), (0.070, 690.0)],
    KAREUS: [(0.042, 760.0), (0.045, 700.0), (0.052, 610.0), (0.060, 600.0)],
}


def _doc(methods, source="measured"):
    return frontier_document(
        {"source": source}, {m: [{"time_s": t, "energy_j": e} for t, e in pts] for m, pts in methods.items()}
    )


def test_units_scale_with_the_data():
    assert time_unit([0.004, 0.05]) == (1e3, "ms")
    assert time_unit([0.5, 4.8]) == (1.0, "s")
    assert time_unit([]) == (1e3, "ms")
    assert energy_unit([900.0, None]) == (1.0, "J")
    assert energy_unit([24_000.0]) == (1e-3, "kJ")
    assert energy_unit([3.2e6]) == (1e-6, "MJ")


def test_measured_frontier_line_is_exactly_the_pareto_set():
    ax = plot_frontier(_doc(MEASURED), _ax(), title="measured")
    assert ax.get_xlabel() == "iteration time (ms)"
    assert ax.get_ylabel().endswith("(J)")
    for name, pts in MEASURED.items():
        want = [(t * 1e3, e) for t, e in PARETO[name]]
        line = _gid(ax, f"frontier/{name}")
        if len(want) == 1:
            assert line is None  # a single point is no line
        else:
            assert _xy(line.get_xydata()) == pytest.approx(_xy(want))
        assert _xy(_gid(ax, f"points/{name}").get_offsets()) == pytest.approx(_xy(want))
        faint = _gid(ax, f"dominated/{name}")
        off = [(t * 1e3, e) for t, e in pts if (t, e) not in PARETO[name]]
        assert (faint is None) == (not off)
        if off:
            assert _xy(faint.get_offsets()) == pytest.approx(_xy(off))
            assert faint.get_alpha() < 0.5
    assert ax.get_title() == "measured"


def test_planned_frontier_line_is_the_pareto_set_of_the_whole_search():
    doc = _doc({MEGATRON: [(4.8, 24_600.0)], PERSEUS: [(4.8, 23_900.0), (5.4, 20_100.0)]}, source="model")
    # the search found more plans, one dominated (5.0, 23 000) and one equal to a written point up to rounding
    curves = {PERSEUS: ([4.8, 5.0, 5.1, 5.2, 5.4], [23_900.0 - 1e-9, 23_000.0, 22_000.0, 22_500.0, 20_100.0])}
    ax = plot_frontier(doc, _ax(), curves=curves)
    assert ax.get_xlabel() == "iteration time (s)"
    assert ax.get_ylabel().endswith("(kJ)")
    line = _gid(ax, f"frontier/{PERSEUS}")
    assert _xy(line.get_xydata()) == pytest.approx(_xy([(4.8, 23.9), (5.0, 23.0), (5.1, 22.0), (5.4, 20.1)]))
    assert _gid(ax, f"dominated/{PERSEUS}") is None  # both written plans are on the frontier


def test_points_with_bands_draw_crosses_spanning_them():
    """`kareus compare`'s measured bands: a cross per point over its time band (at its energy) and its energy band (at
    its time), in the axes' units; points without bands draw none."""
    doc = _doc({MEGATRON: [(0.050, 900.0)], PERSEUS: [(0.050, 880.0)], KAREUS: [(0.042, 760.0), (0.052, 610.0)]})
    doc["methods"][KAREUS]["points"][0].update(time_s_band=[0.041, 0.044], energy_j_band=[740.0, 790.0])
    doc["methods"][KAREUS]["points"][1].update(energy_j_band=[600.0, 630.0])  # no time band: the energy bar only
    doc["bands"] = {"percentiles": [5, 95]}
    assert _gid(plot_frontier(doc, _ax()), f"bands/{KAREUS}") is None  # kareus plan's: not drawn (correlated draws)
    ax = plot_frontier(doc, _ax(), bands=True)
    bars = _gid(ax, f"bands/{KAREUS}")
    segments = [[tuple(map(float, xy)) for xy in seg] for seg in bars.get_segments()]
    assert segments == [
        [(pytest.approx(41.0), 760.0), (pytest.approx(44.0), 760.0)],
        [(pytest.approx(42.0), 740.0), (pytest.approx(42.0), 790.0)],
        [(pytest.approx(52.0), 600.0), (pytest.approx(52.0), 630.0)],
    ]
    assert _gid(ax, f"bands/{MEGATRON}") is None
    assert ax.get_legend().get_title().get_text() == "bars: 5th-95th percentile band"
    assert ax.get_ylim()[1] >= 790.0  # the bars are inside the axes
    assert _gid(plot_frontier(_doc(MEASURED), _ax(), bands=True), f"bands/{KAREUS}") is None


def test_legend_names_start_with_the_cli_names():
    methods = {**MEASURED, NANOBATCH_PERSEUS: [(0.048, 720.0)]}
    ax = plot_frontier(_doc(methods), _ax())
    texts = [t.get_text() for t in ax.get_legend().get_texts()]
    assert [t.split(":")[0].split(" ")[0] for t in texts] == list(methods)
    ax = plot_reductions(["#1"], {m: [0.1] for m in PLAN_METHODS}, _ax())
    assert [t.get_text().split(" ")[0] for t in ax.get_legend().get_texts()] == list(PLAN_METHODS)
    assert set(METHOD_STYLE) == set(PLAN_METHODS)


def test_a_frontier_drawn_under_an_equal_one_says_so_in_the_legend():
    """Perseus's frontier equal to Kareus's (no 2-nanobatch plan pays) is covered by it: its legend entry says so."""
    methods = {MEGATRON: MEASURED[MEGATRON], PERSEUS: PARETO[PERSEUS], KAREUS: PARETO[PERSEUS]}
    texts = [t.get_text() for t in plot_frontier(_doc(methods), _ax()).get_legend().get_texts()]
    assert texts[1] == "perseus: 4 runs (same frontier as kareus (joint), drawn under it)", texts
    assert "same frontier" not in texts[0] + texts[2]
    texts = [t.get_text() for t in plot_frontier(_doc(MEASURED), _ax()).get_legend().get_texts()]
    assert not any("same frontier" in t for t in texts)  # different frontiers: nothing said


def _colorbar_norm(ax):
    cax = [a for a in ax.figure.axes if a is not ax][0]
    from matplotlib.collections import QuadMesh

    assert cax.get_ylabel() == "SM clock (MHz)"
    (solids,) = [c for c in cax.collections if isinstance(c, QuadMesh)]  # the colour bar's colours
    assert cax.get_ylim() == (solids.norm.vmin, solids.norm.vmax)
    return solids.norm


def test_timeline_colours_span_the_plans_own_clocks():
    clocks = [1200, 1350, 1410, 1275]
    bars = [
        Bar(rank=r, start_s=0.01 * k, end_s=0.01 * k + 0.008, clock_mhz=c, kind="forward", microbatch=k)
        for r in (0, 1)
        for k, c in enumerate(clocks)
    ]
    ax = plot_timeline(bars, _ax(), title="t")
    norm = _colorbar_norm(ax)
    assert (norm.vmin, norm.vmax) == (1200, 1410)
    assert ax.get_xlabel() == "time in iteration (ms)"
    ax = plot_timeline(bars, _ax(), clock_range_mhz=(1000, 1500))
    assert (_colorbar_norm(ax).vmin, _colorbar_norm(ax).vmax) == (1000, 1500)


def test_colour_bar_labels_never_crowd():
    """Close clocks (1200/1215/1230 next to 1980) are not all labelled: the colour bar's labels overlapped."""
    from kareus_megatron.plotting.timeline import spaced_ticks

    clocks = [1200, 1215, 1230, 1410, 1965, 1980]
    bars = [
        Bar(rank=0, start_s=0.01 * k, end_s=0.01 * k + 0.008, clock_mhz=c, kind="forward", microbatch=k)
        for k, c in enumerate(clocks)
    ]
    ax = plot_timeline(bars, _ax())
    cax = [a for a in ax.figure.axes if a is not ax][0]
    ticks = sorted(float(t) for t in cax.get_yticks())
    assert ticks == [1200, 1410, 1980]
    assert min(b - a for a, b in zip(ticks, ticks[1:])) >= 0.08 * (1980 - 1200)
    assert spaced_ticks([1410]) == [1410] and spaced_ticks([1200, 1300, 1410]) == [1200, 1300, 1410]


def test_plan_command_draws_the_timeline_on_the_chosen_plans_clocks(tmp_path, monkeypatch):
    """`kareus plan`: the colour scale of timeline.png is the drawn plan's lowest to highest clock (MHz)."""
    import kareus_megatron.plotting.timeline as timeline
    from kareus_megatron.cli import main as cli_main
    from kareus_megatron.hardware.gpus import clock_grid_mhz, gpu_spec
    from kareus_megatron.plan.io import load_plan

    seen = []
    real = timeline.plot_timeline

    def spy(bars, ax, **kw):
        seen.append(real(bars, ax, **kw))
        return seen[-1]

    monkeypatch.setattr(cli_main, "COMMANDS", {"plan": "plan"})
    monkeypatch.setattr(timeline, "plot_timeline", spy)
    out = tmp_path / "out"
    argv = ["plan", "--out", str(out), "--methods", "perseus", "--points", "2", "--timeline", "perseus-01"]
    assert cli_main.main([*argv, "--band-samples", "0"]) == 0  # the low-energy end: a narrow clock range
    (ax,) = seen
    name = ax.get_title().split(" ")[0]
    plan = load_plan(out / "plans" / f"{name}.json")
    clocks = [c for s in range(plan.parallel.pp) for c in plan.clock_sequence(s)]
    norm = _colorbar_norm(ax)
    lo, hi = min(clocks), max(clocks)
    assert (norm.vmin, norm.vmax) == ((lo, hi) if lo < hi else (lo - 1, hi + 1))
    grid = clock_grid_mhz(gpu_spec(plan.gpu).sm_clocks_mhz)
    assert (lo, hi) != (min(grid), max(grid))  # narrower than the clocks planned over: the test tells them apart


def test_report_ticks_whole_iterations_and_scales_units():
    cmp = SimpleNamespace(
        iteration_time_s=[6.1, 4.9, None, 4.85],
        skipped=1,
        stage_energy_j={0: (52_000.0, 50_500.0), 1: (49_000.0, None)},
    )
    fig = plot_run_report(cmp, 4.7, title="short run")
    ax_t, ax_e = fig.axes
    fig.canvas.draw()
    ticks = [t for t in ax_t.get_xticks() if ax_t.get_xlim()[0] <= t <= ax_t.get_xlim()[1]]
    assert ticks and all(float(t).is_integer() for t in ticks)
    assert ax_t.get_ylabel() == "iteration time (s)"
    assert ax_e.get_ylabel() == "energy per iteration (kJ)"
    assert max(p.get_height() for p in ax_e.patches) == pytest.approx(52.0)
    assert "n/a" in [t.get_text() for t in ax_e.texts]
    cmp.iteration_time_s = [0.2, 0.05, 0.051]
    assert plot_run_report(cmp, 0.048).axes[0].get_ylabel() == "iteration time (ms)"

"""report/measurements.py (and the runlog.py lines it needs): instruction samples, energy windows and events
from hand-written rank logs; older logs without the new keys; malformed per-instruction columns."""

from __future__ import annotations

import json

import pytest

from kareus_megatron.errors import ConfigError
from kareus_megatron.report.measurements import energy_windows, instruction_samples, run_events
from kareus_megatron.report.runlog import read_run_log
from kareus_megatron.report.summary import summarize


def _cols(times, clock=1410):
    n = len(times)
    return {
        "index": list(range(n)),
        "chunk": [0] * n,
        "microbatch": [k // 2 for k in range(n)],
        "kind": "FB" * (n // 2),
        "sm_clock_mhz": [clock] * n,
        "t_start_s": [0.01 * k for k in range(n)],
        "time_s": times,
    }


def _line(i, time_s=0.4, energy_j=100.0, **extra):
    return {
        "kind": "iteration",
        "iteration": i,
        "t_start": 10.0 + i,
        "t_end": 10.0 + i + time_s,
        "time_s": time_s,
        "energy_j": energy_j,
        **extra,
    }


def _write(d, rank, lines, pp_rank=0, world=1):
    d.mkdir(exist_ok=True)
    head = {
        "kind": "header",
        "format": "kareus-rank-log/1",
        "rank": rank,
        "world": world,
        "pp_rank": pp_rank,
        "pp": world,
    }
    (d / f"rank-{rank:05d}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in [head, *lines]))
    return d


def test_windows_aggregate_until_a_second_and_break_at_switches_stale_calls_and_gaps(tmp_path):
    new = dict(temperature_c=60.0, sm_clock_mhz=1410, clock_stale=0, clock_errors=0)
    lines = [_line(i, instructions=_cols([0.1, 0.2]), phase="profile", **new) for i in range(7)]
    lines[5]["temperature_c"] = 62.0
    lines += [_line(7, instructions=_cols([0.1, 0.2], 1200), phase="plan", **new)]  # switch: left out
    lines += [_line(i, instructions=_cols([0.1, 0.2], 1200), phase="plan", **new) for i in (8, 9, 10)]
    lines += [_line(11, phase="plan", **{**new, "clock_stale": 1})]  # a stale clock call: ends the window
    lines += [_line(i, phase="plan", **new) for i in (12, 13, 14)]
    lines += [_line(i, phase="plan", **new) for i in (16, 17, 18)]  # 15 missing: not consecutive
    log = read_run_log(_write(tmp_path / "log", 0, lines))
    ws = energy_windows(log)  # skip 2 (the default), 1 s windows
    assert [w.iterations for w in ws] == [(2, 3, 4), (8, 9, 10), (12, 13, 14), (16, 17, 18)]  # (5, 6) < 1 s: dropped
    first = ws[0]
    assert first.time_s == pytest.approx(1.2) and first.energy_j == pytest.approx(300.0)
    assert first.busy_s == {(0, "forward", 1410): pytest.approx(0.3), (0, "backward", 1410): pytest.approx(0.6)}
    assert first.temperature_c == 60.0 and first.tags == {"phase": "profile"} and first.rank == 0
    assert ws[1].busy_s[(0, "backward", 1200)] == pytest.approx(0.6) and ws[1].tags == {"phase": "plan"}
    assert ws[2].busy_s == {}  # no columns: energy and time only
    assert [w.iterations for w in energy_windows(log, min_window_s=0.5, skip_iterations=5)][:2] == [(5, 6), (8, 9)]
    with pytest.raises(ConfigError, match="energy window 0 s must be a positive number"):
        energy_windows(log, min_window_s=0)
    samples = instruction_samples(log)
    assert len(samples) == 2 * 11
    s = samples[-1]
    assert (s.iteration, s.index, s.kind, s.microbatch, s.sm_clock_mhz, s.time_s, s.tags) == (
        10,
        1,
        "backward",
        0,
        1200,
        0.2,
        {"phase": "plan"},
    )


def test_windows_are_per_rank_and_events_are_merged_in_time_order(tmp_path):
    d = tmp_path / "log"
    for rank in (0, 1):
        ev = {"kind": "event", "event": "switch", "iteration": 2, "t": 12.0 + 0.1 * (1 - rank), "to": "plan"}
        _write(
            d,
            rank,
            [_line(0), _line(1), ev, _line(2, energy_j=50.0 * (rank + 1)), _line(3), _line(4)],
            pp_rank=rank,
            world=2,
        )
    log = read_run_log(d)
    assert [(w.rank, w.pp_rank, w.iterations) for w in energy_windows(log, skip_iterations=0)] == [
        (0, 0, (0, 1, 2)),
        (1, 1, (0, 1, 2)),
    ]
    assert [w.energy_j for w in energy_windows(log, skip_iterations=0)] == [250.0, 300.0]
    events = run_events(log)
    assert [e["rank"] for e in events] == [1, 0] and all(e["to"] == "plan" and e["iteration"] == 2 for e in events)
    assert instruction_samples(log) == []


def test_old_logs_without_the_new_keys_still_read(tmp_path):
    log = read_run_log(_write(tmp_path / "log", 0, [_line(i) for i in range(6)]))
    assert summarize(log).used == 4 and run_events(log) == [] and instruction_samples(log) == []
    ws = energy_windows(log)
    assert [w.iterations for w in ws] == [(2, 3, 4)] and ws[0].temperature_c is None and ws[0].tags == {}


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda c: c["time_s"].pop(), r"column 'time_s' must be a list of 2 values"),
        (lambda c: c.update(kind="FX"), r"'kind' is a string of F and B"),
        (lambda c: c.update(index=[0, -1]), r"column 'index' holds a value that is not an integer >= 0"),
        (lambda c: c.update(time_s=[0.1, "x"]), r"column 'time_s' holds a value that is not a time"),
    ],
)
def test_a_bad_instructions_object_is_one_line_naming_file_and_line(tmp_path, change, message):
    cols = _cols([0.1, 0.2])
    change(cols)
    d = _write(tmp_path / "log", 0, [_line(0, instructions=_cols([0.1, 0.2])), _line(1, instructions=cols)])
    with pytest.raises(ConfigError, match=rf"rank-00000\.jsonl:3: iteration 1: 'instructions'.*{message}") as e:
        read_run_log(d)
    assert "\n" not in str(e.value)


def test_a_bad_event_line_is_one_line(tmp_path):
    d = _write(tmp_path / "log", 0, [_line(0), {"kind": "event", "iteration": 0}])
    with pytest.raises(ConfigError, match=r"rank-00000\.jsonl:3: an event line needs an event name"):
        read_run_log(d)

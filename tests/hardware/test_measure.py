"""The measurement protocol (hardware/measure.py) and the read-only guard (hardware/validate.py), on fakes."""

from __future__ import annotations

import pytest

from kareus_megatron.errors import ClockControlError
from kareus_megatron.hardware.device import open_gpu
from kareus_megatron.hardware.measure import (
    Sweep,
    Window,
    WindowPolicy,
    interleaved_order,
    sample_energy_counter,
    warm_up,
)
from kareus_megatron.hardware.validate import ClockCallGuard, lock_grid


class SteppingCounter:
    """A device whose energy counter moves by 0.1 J every `period_s`, like NVML's (ms steps)."""

    def __init__(self, period_s: float, temps: list[float] | None = None) -> None:
        import time

        self.t0 = time.monotonic()
        self.period_s = period_s
        self.temps = list(temps or [])

    def energy_j(self) -> float:
        import time

        return 0.1 * int((time.monotonic() - self.t0) / self.period_s)

    def temperature_c(self) -> float:
        return self.temps.pop(0) if len(self.temps) > 1 else self.temps[0]


class StallingCounter(SteppingCounter):
    """A SteppingCounter whose reader, for its first `busy_s`, is descheduled `stall_s` after each `awake_s`."""

    def __init__(self, period_s: float, busy_s: float, awake_s: float, stall_s: float) -> None:
        import time

        super().__init__(period_s)
        self.calm_at, self.awake_s, self.stall_s = self.t0 + busy_s, awake_s, stall_s
        self.next_stall = time.monotonic() + awake_s

    def energy_j(self) -> float:
        import time

        now = time.monotonic()
        if now < self.calm_at and now >= self.next_stall:
            time.sleep(self.stall_s)
            self.next_stall = time.monotonic() + self.awake_s
        return super().energy_j()


def test_counter_period_is_measured_not_assumed():
    got = sample_energy_counter(SteppingCounter(0.02), 0.3)  # type: ignore[arg-type]
    assert got["update_period_s"] == pytest.approx(0.02, rel=0.25)
    assert got["smallest_step_j"] == pytest.approx(0.1) and got["monotone"]


def test_a_stalled_sampler_reads_on_until_it_sees_the_period_clearly():
    # a host so loaded that the reader wakes 5 ms in every 65 (the CI run that read 0.207 s for 0.02 s):
    # every gap it sees spans merged updates, so it samples on past its 0.3 s until the host calms at 0.4 s
    counter = StallingCounter(0.02, busy_s=0.4, awake_s=0.005, stall_s=0.06)
    got = sample_energy_counter(counter, 0.3)  # type: ignore[arg-type]
    assert got["update_period_s"] == pytest.approx(0.02, rel=0.25)
    assert got["gaps_set_aside"] >= 3 and got["clear_gaps"] >= 5 and 0.4 < got["seconds"] < 2.0  # the cap: 4 x 0.3 s


def test_window_spans_ten_counter_periods_and_a_second():
    p = WindowPolicy()
    assert p.window_s(0.02) == 1.0 and p.window_s(0.25) == pytest.approx(2.5)


def test_interleaved_order_visits_every_pair_once_per_repeat_in_fresh_orders():
    order = interleaved_order([1410, 1200, 1005, 810, 705, 600], ["gemm", "copy"], repeats=2, seed=3)
    assert len(order) == 24 and len(set(order)) == 24
    first = [c for c, _, r in order if r == 0][::2]
    second = [c for c, _, r in order if r == 1][::2]
    assert first != second and sorted(first) == sorted(second)
    assert [r for _, _, r in order] == [0] * 12 + [1] * 12


def test_warm_up_stops_once_the_temperature_holds():
    dev = SteppingCounter(0.01, temps=[30, 40, 50, 60, 61, 61.2, 61.1, 61.3, 61.2])
    got = warm_up(
        dev,
        lambda: None,
        lambda: None,  # type: ignore[arg-type]
        WindowPolicy(warmup_max_s=5.0, warmup_stable_s=0.03, stable_c=1.0),
    )
    assert got["stable"] and got["end_c"] >= 60 and got["seconds"] < 1.0
    # never settles (2 °C per reading, above stable_c even when a loaded host reads twice per span): bounded by
    # warmup_max_s (0.1 s); unbounded it would read on for ~3 s (1,485 readings, one per 2 ms chunk), so the bound
    # below leaves a loaded host's stalls room
    hot = SteppingCounter(0.01, temps=[float(t) for t in range(30, 3000, 2)])
    got = warm_up(
        hot,
        lambda: None,
        lambda: None,  # type: ignore[arg-type]
        WindowPolicy(warmup_max_s=0.1, warmup_stable_s=0.02),
    )
    assert got["stable"] is False and got["seconds"] < 1.5


def test_per_clock_pools_repeats_total_over_total():
    w = dict(
        kernel="gemm",
        clock_mhz=1410,
        seconds=1.0,
        read_clock_mhz=1410,
        temperature_start_c=None,
        temperature_end_c=None,
        started_s=0.0,
        power_w=0.0,
    )
    s = Sweep(
        windows=[
            Window(repeat=0, calls=10, time_s=0.1, energy_j=10.0, **w),
            Window(repeat=1, calls=30, time_s=0.2, energy_j=20.0, **w),
        ]
    )
    clocks, t, e = s.per_clock("gemm")
    assert clocks == [1410] and t == [pytest.approx(0.175)] and e == [pytest.approx(17.5)]


def test_read_only_guard_refuses_clock_calls_and_full_guard_counts_them():
    dev = open_gpu(0, backend="simulated", read_only=False)
    try:
        ro = ClockCallGuard(dev, read_only=True)
        with pytest.raises(ClockControlError, match="read-only"):
            ro.set_sm_clock_mhz(1410)
        with pytest.raises(ClockControlError, match="read-only"):
            ro.reset_clocks()
        assert ro.calls == {"set": 0, "reset": 0} and ro.sm_clock_mhz() == 1410
        full = ClockCallGuard(dev, read_only=False)
        full.set_sm_clock_mhz(1005)
        full.reset_clocks()
        assert full.calls == {"set": 1, "reset": 1}
    finally:
        dev.close()


def test_lock_grid_keeps_both_ends():
    assert lock_grid(list(range(210, 1411, 15)), 5) == [1410, 1110, 810, 510, 210]
    assert lock_grid([1410, 1395], 8) == [1410, 1395]


def test_one_reading_within_the_stable_span_is_not_stable(monkeypatch):
    """A host stalled past the whole span takes one reading in it: the span's start (the reading before) counts."""
    import kareus_megatron.hardware.measure as measure

    clock = iter([0.0, 0.0, 0.0, 0.05, 0.05, 0.05, 1.0, 1.0, 1.0, 1.05, 1.05, 1.05, 2.0, 2.0, 2.0, 3.0, 3.0, 3.0])
    monkeypatch.setattr(measure.time, "monotonic", lambda: next(clock, 9.0))
    hot = SteppingCounter(0.01, temps=[30.0, 40.0, 50.0, 60.0, 70.0])
    got = warm_up(
        hot,
        lambda: None,
        lambda: None,  # type: ignore[arg-type]
        WindowPolicy(warmup_max_s=2.5, warmup_stable_s=0.02, stable_c=1.0),
    )
    assert got["stable"] is False, got["trace"]

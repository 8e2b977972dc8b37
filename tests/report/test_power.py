"""The measured power waveform of a run (report/power.py): rank samples folded onto one iteration and summed."""

from __future__ import annotations

import pytest

from kareus_megatron.errors import ConfigError
from kareus_megatron.report.power import measured_power


def _line(rank: int, t_start: float, watts: list[float], **over: object) -> dict[str, object]:
    power = {"t0": t_start, "dt_s": 0.05, "w": watts, "reading": "model", **over}
    return {"rank": rank, "t_start": t_start, "power": power}


def test_ranks_fold_onto_one_iteration_and_add_up():
    # a 0.2 s iteration at 20 Hz: rank 0 busy in its first half, rank 1 in its second: the job is flat at 400 W
    recs = [
        {
            "iteration": i,
            "ranks": [_line(0, 10.0 + 0.2 * i, [300, 300, 100, 100]), _line(1, 10.0 + 0.2 * i, [100, 100, 300, 300])],
        }
        for i in range(3)
    ]
    m, job, step = measured_power(recs, 0.2)
    assert job.tolist() == [400.0] * 4 and step == pytest.approx(0.05)
    assert (m["swing_w"], m["mean_power_w"], m["gpus"], m["samples"]) == (0.0, 400.0, 2, 24)
    assert m["sample_hz"] == pytest.approx(20.0) and m["reading"] == "model"
    recs[1]["ranks"][1]["power"]["w"] = [300, 300, 100, 100]  # one iteration in phase: the fold averages it in
    m, job, _ = measured_power(recs, 0.2)
    assert job[0] == pytest.approx(600 - 200 * 2 / 3) and m["swing_w"] > 0
    assert measured_power([{"iteration": 0, "ranks": [{"rank": 0, "t_start": 1.0}]}], 0.2) is None  # older logs


@pytest.mark.parametrize("bad", [{"dt_s": 0}, {"w": [1, -2]}, {"w": "abc"}, {"t0": None}])
def test_malformed_samples_are_one_line(bad):
    with pytest.raises(ConfigError, match="iteration 0, rank 0: 'power' must be") as e:
        measured_power([{"iteration": 0, "ranks": [_line(0, 1.0, [100.0], **bad)]}], 0.2)
    assert "\n" not in str(e.value)

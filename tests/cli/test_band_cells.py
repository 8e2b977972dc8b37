"""cli/band_cells.py, the band cells `kareus plan` and `kareus compare` both print: a reduction with its band,
"n.d." only where the band holds 0 and is not rounding noise, and a point's band in the table's unit."""

from __future__ import annotations

from kareus_megatron.cli.band_cells import ND, band_cell, not_distinguishable_notes, reduction_cell


def test_reduction_cells_mark_bands_that_hold_zero():
    r = {
        "iso_time_energy": 0.05,
        "iso_time_energy_band": [-0.01, 0.09],  # holds 0: n.d.
        "iso_energy_time": 0.2,
        "iso_energy_time_band": [0.18, 0.22],
        "max_throughput_time_vs_megatron": 0.0,
        "max_throughput_time_vs_megatron_band": [-1e-4, 1e-4],  # the same plan on both sides: rounding noise
        "max_throughput_energy_vs_megatron": None,
        "max_throughput_energy_vs_megatron_band": None,
    }
    assert reduction_cell(r, "iso_time_energy") == f"5.0% [-1.0,9.0] {ND}"
    assert reduction_cell(r, "iso_energy_time") == "20.0% [18.0,22.0]"
    assert reduction_cell(r, "max_throughput_time_vs_megatron") == "0.0% [-0.0,0.0]"
    assert reduction_cell(r, "max_throughput_energy_vs_megatron") == "n/a"
    (note,) = not_distinguishable_notes({"reductions": {"kareus": r}}, "holds 0")
    assert note.startswith("note: kareus: iso-time energy not distinguishable (n.d.)") and note.endswith("holds 0.")


def test_band_cells_scale_and_say_when_there_is_none():
    p = {"time_s_band": [0.00401, 0.00425], "energy_j_band": [962.84, 1027.3]}
    assert band_cell(p, "time_s", 1e3) == "4.01-4.25"
    assert band_cell(p, "energy_j", digits=4) == "962.8-1027"
    assert band_cell({}, "time_s") == "-"

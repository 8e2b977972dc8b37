"""Every A100 preset against the measured A100 evidence (issue 24, item 1): the GA100 die's curves are shared.

Measured: the Perseus artifact's GPT-3 175B stage profile (benchmarks/data/perseus_sosp24/, A100-SXM4-80GB HGX
board, 500 W limit, NVLink). Boards of the die (hardware/dies.toml) differ only in their datasheet fields, so the
measured power-vs-clock ratios hold for every A100 preset on the measuring board's limit and link, and on its own
board wherever its limit does not bind; above that the preset sits at its limit, as the datasheet says.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest

from kareus_megatron.cost.kernel import KernelModel
from kareus_megatron.cost.overlap import OverlapCost
from kareus_megatron.hardware.gpus import die_table, gpu_names, gpu_spec
from kareus_megatron.search.tables import phase_table
from kareus_megatron.workload.models import model_from_dict
from kareus_megatron.workload.parallel import make_parallel

ROOT = Path(__file__).resolve().parents[2]
A100_PRESETS = [n for n in gpu_names() if gpu_spec(n).die == "ga100"]
MEASURING_BOARD = gpu_spec(die_table("ga100")["reference_preset"])
UNTHROTTLED_FRACTION = 0.9  # a clock counts as below a board's limit when the measured mean power is <= 0.9 x it


@pytest.fixture(scope="module")
def gpt3():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from calibration_fit import DATA, load
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    series = load("gpt3", DATA)[3]
    return series, np.mean([s.energy_j / s.time_s for s in series], axis=0)


def _power_ratios(km: KernelModel, series) -> tuple[np.ndarray, np.ndarray]:
    """(per-series predicted power ratio P(f)/P(f_max) over the measured one, minus 1; predicted mean power (W))."""
    pred = [s.predict(km) for s in series]
    err = np.array(
        [
            (e / t) / (e[0] / t[0]) / ((s.energy_j / s.time_s) / (s.energy_j[0] / s.time_s[0])) - 1
            for (t, e), s in zip(pred, series)
        ]
    )
    return err, np.mean([e / t for t, e in pred], axis=0)


def test_the_a100_presets_are_the_three_boards_of_the_die():
    assert set(A100_PRESETS) == {"a100-sxm4-40gb", "a100-sxm4-80gb", "a100-pcie-80gb"}


@pytest.mark.parametrize("name", A100_PRESETS)
def test_every_a100_preset_on_the_measuring_board_reproduces_the_gpt3_power_ratios(name, gpt3):
    """The board's limit and link set to the measuring board's (its memory stays its own): the die's curves give the
    measured P(f)/P(1410 MHz) at every clock, 1410 -> 855 MHz (measured 0.726 at 1200 MHz)."""
    series, measured = gpt3
    board = dataclasses.replace(
        gpu_spec(name),
        power_limit_w=MEASURING_BOARD.power_limit_w,
        nvlink_bytes_per_s=MEASURING_BOARD.nvlink_bytes_per_s,
    )
    err, pred = _power_ratios(KernelModel(board), series)
    assert np.mean(np.abs(err)) <= 0.02 and np.max(np.abs(err)) <= 0.05, (np.mean(np.abs(err)), np.max(np.abs(err)))
    i = int(np.flatnonzero(series[0].clocks_mhz == 1200)[0])
    assert measured[i] / measured[0] == pytest.approx(0.726, abs=0.002)
    assert pred[i] / pred[0] == pytest.approx(measured[i] / measured[0], abs=0.01)


@pytest.mark.parametrize("name", A100_PRESETS)
def test_every_a100_preset_on_its_own_board_follows_the_profile_below_its_limit_and_caps_above(name, gpt3):
    """Own board (limit 300/400/500 W; the measuring node's NVLink): below the highest clock whose measured power is
    within 0.9 x its limit the ratios match the measured ones; above it the preset holds its limit."""
    series, measured = gpt3
    g = gpu_spec(name)
    km = KernelModel(dataclasses.replace(g, nvlink_bytes_per_s=MEASURING_BOARD.nvlink_bytes_per_s))
    _, pred = _power_ratios(km, series)
    i0 = int(np.flatnonzero(measured <= UNTHROTTLED_FRACTION * g.power_limit_w)[0])
    err = (pred[i0:] / pred[i0]) / (measured[i0:] / measured[i0]) - 1
    assert np.mean(np.abs(err)) <= 0.015 and np.max(np.abs(err)) <= 0.03, (series[0].clocks_mhz[i0], err)
    assert np.all(pred <= g.power_limit_w + 1e-6)


# ---- the A100 attention partition reported in issue 24 (benchmarks/data/issue24_a100_attention/README.md) ---------


def _attention_partition_power_w(name: str, clock_mhz: int) -> float:
    """Mean power (W) of the forward attention partition at its fastest knobs: a nanobatch of 2 x 4096 tokens,
    hidden 2048, 32 heads, TP=2, fp16, the other nanobatch's all-reduce overlapped."""
    model = model_from_dict(
        dict(
            num_layers=1,
            hidden_size=2048,
            num_attention_heads=32,
            num_query_groups=32,
            ffn_hidden_size=8192,
            vocab_size=50257,
        ),
        "issue24-attention",
    )
    par = make_parallel(model, tp=2, micro_batch_size=4, seq_length=4096, gpus_per_node=2)
    table = phase_table(OverlapCost(KernelModel(gpu_spec(name))), model, par, "forward", [clock_mhz], 2)
    t, e = table.partitions["fwd_attn"].time_s[0], table.partitions["fwd_attn"].energy_j[0]
    k = np.unravel_index(np.argmin(t), t.shape)
    return float(e[k] / t[k])


@pytest.mark.xfail(
    strict=True,
    reason="issue 24 open: the model's attention partition draws GPT-3-stage power "
    "(~480 W uncapped at 1410 MHz, ~365 W at 1200 MHz) where the measured one falls by about a third "
    "from well below the 400 W cap; the cause (per-op activity or launch gaps) needs a per-kernel "
    "measurement (docs/fidelity.md)",
)
@pytest.mark.parametrize("name", [n for n in A100_PRESETS if gpu_spec(n).power_limit_w >= 400])
def test_the_attention_partition_power_falls_by_about_a_third_from_1410_to_1200_mhz(name):
    p_1410, p_1200 = _attention_partition_power_w(name, 1410), _attention_partition_power_w(name, 1200)
    assert 0.25 <= 1 - p_1200 / p_1410 <= 0.40, (p_1410, p_1200)
    assert p_1410 < 0.95 * 400  # measured well below a 400 W board's limit (the PCIe board's 300 W would cap it)

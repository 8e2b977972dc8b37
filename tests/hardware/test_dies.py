"""Dies (hardware/dies.toml): boards of one die share its power curves and differ only where datasheets do."""

from __future__ import annotations

import tomllib
from importlib import resources

import pytest

from kareus_megatron.errors import ConfigError
from kareus_megatron.hardware.gpus import (
    DIE_FIELDS,
    die_names,
    die_table,
    gpu_names,
    gpu_spec,
    preset_table,
    spec_from_table,
)

# What a board's datasheet may set apart from another board of its die (everything else power-related is the die's).
BOARD_POWER_FIELDS = ("power_limit_w", "min_power_limit_w", "memory_dynamic_w", "hbm_bytes_per_s")


def _raw(name: str) -> dict:
    text = resources.files("kareus_megatron.hardware").joinpath("gpus.toml").read_text(encoding="utf-8")
    return dict(tomllib.loads(text)[name])


@pytest.mark.parametrize("name", gpu_names())
def test_every_preset_names_a_die_and_takes_its_fields_from_it(name):
    g, die = gpu_spec(name), _raw(name).get("die")
    assert die in die_names(), f"{name}: die {die!r}"
    assert g.die == die
    table = die_table(die)
    for k in DIE_FIELDS:
        assert k not in _raw(name), f"{name} repeats the die field {k}"
        assert preset_table(name)[k] == table[k]
        assert g.sources[k].startswith(f"[die {die}] ["), (k, g.sources[k])


@pytest.mark.parametrize("die", die_names())
def test_every_die_is_used_and_its_reference_board_is_one_of_its_presets(die):
    boards = [n for n in gpu_names() if gpu_spec(n).die == die]
    assert boards, f"die {die} has no preset"
    assert die_table(die)["reference_preset"] in boards


def test_boards_of_one_die_differ_only_in_board_fields():
    """A100-SXM4-40GB/80GB and A100-PCIe (GA100), H100 SXM5 and H200 (GH100): identical power curves."""
    groups: dict[str, list] = {}
    for n in gpu_names():
        groups.setdefault(gpu_spec(n).die, []).append(gpu_spec(n))
    assert {g.name for g in groups["ga100"]} >= {"a100-sxm4-40gb", "a100-sxm4-80gb", "a100-pcie-80gb"}
    assert {g.name for g in groups["gh100"]} >= {"h100-sxm5-80gb", "h200-sxm-141gb"}
    for boards in groups.values():
        first = boards[0]
        for b in boards[1:]:
            for k in (
                "static_power_w",
                "idle_dynamic_w",
                "compute_dynamic_w",
                "voltage_floor",
                "voltage_knee_mhz",
                "p_blocked_w",
                "architecture",
            ):
                assert getattr(b, k) == getattr(first, k), (b.name, k)


def test_a_preset_repeating_a_die_field_or_naming_an_unknown_die_is_refused():
    t = _raw("a100-sxm4-40gb")
    spec_from_table("a100-ok", t)
    with pytest.raises(ConfigError, match="'a100-bad'.*die 'ga100'.*compute_dynamic_w"):
        spec_from_table("a100-bad", {**t, "compute_dynamic_w": 400.0})
    with pytest.raises(ConfigError, match="unknown die 'gb202'.*ga100, ga102, gh100"):
        spec_from_table("b-bad", {**t, "die": "gb202"})
    own = {k: v for k, v in t.items() if k != "die"} | {k: die_table("ga100")[k] for k in DIE_FIELDS}
    assert spec_from_table("a100-own", own).compute_dynamic_w == gpu_spec("a100-sxm4-40gb").compute_dynamic_w

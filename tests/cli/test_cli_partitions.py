"""`kareus partitions`: output and one-line errors for bad overlap configurations."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kareus_megatron.cli import main as cli_main
from kareus_megatron.cli.partitions import parse_overlap
from kareus_megatron.errors import ConfigError
from kareus_megatron.vocab import PARTITION_SLOTS


@pytest.fixture(autouse=True)
def only_partitions(monkeypatch):
    """Register only this subcommand, so these tests do not depend on the other CLI modules."""
    monkeypatch.setattr(cli_main, "COMMANDS", {"partitions": "partitions"})


def _run(capsys, *argv):
    rc = cli_main.main(["partitions", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_json_output(capsys):
    rc, out, err = _run(capsys, "--freq", "1110", "--format", "json", "--overlap", "fwd_attn=12@qkv,bwd_mlp=9@fc1")
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["clock_mhz"] == 1110 and doc["nanobatches"] == 2 and doc["default_comm_sms"] == 24
    names = [(p["phase"], p["partition"]) for p in doc["partitions"]]
    assert names == [
        ("forward", "fwd_attn"),
        ("forward", "fwd_mlp"),
        ("recompute", "fwd_attn"),
        ("recompute", "fwd_mlp"),
        ("backward", "bwd_mlp"),
        ("backward", "bwd_attn"),
    ]
    for p in doc["partitions"]:
        times = [pt["time_s"] for pt in p["frontier"]]
        assert times == sorted(times) and p["fastest"] == p["frontier"][0]
        assert p["fastest"]["slot"] in PARTITION_SLOTS[p["partition"]]
        d = p["nccl_default"]
        assert d["comm_sms"] == 24 and d["slot"] == PARTITION_SLOTS[p["partition"]][0]
        assert p["fastest"]["time_s"] <= d["time_s"]  # the baseline's knob is one of the knobs searched
    assert len(doc["instructions"]) == 4
    for row in doc["instructions"]:
        assert row["joint_fastest"]["time_s"] <= row["nanobatch_default"]["time_s"]
        assert row["joint_fastest"]["time_s"] <= row["given"]["time_s"]


def test_table_output_and_one_nanobatch(capsys):
    rc, out, _ = _run(capsys, "--tp", "4", "--cp", "2")
    assert rc == 0 and "fwd_cp_kv" in out and "bwd_cp_kv" in out and "joint fastest" in out
    rc, out, _ = _run(capsys, "--nanobatches", "1")
    assert rc == 0 and "no partitions" in out


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--overlap", "fwd_foo=12@qkv"], "partition 'fwd_foo'"),
        (["--overlap", "fwd_attn=12@fc1"], "slot 'fc1'"),
        (["--overlap", "fwd_attn=12@qkv,bwd_cp_kv=3@attention"], "partition 'bwd_cp_kv'"),  # TP only: no CP
        (["--overlap", "fwd_attn=108@qkv"], "108 comm SMs"),
        (["--overlap", "fwd_attn=0@qkv"], "0 comm SMs"),
        (["--overlap", "fwd_attn=twelve@qkv"], "'twelve'"),
        (["--overlap", "fwd_attn@qkv"], "malformed"),
        (["--overlap", "fwd_attn=3@qkv,fwd_attn=6@qkv"], "twice"),
        (["--mbs", "3"], "do not divide the microbatch of 3"),
        (["--nanobatches", "4"], "4 nanobatches"),
        (["--nanobatches", "1", "--overlap", "fwd_attn=3@qkv"], "needs --nanobatches 2"),
        (["--freq", "1411"], "1411 MHz"),
    ],
)
def test_bad_input_is_one_line_exit_2(capsys, argv, needle):
    rc, out, err = _run(capsys, *argv)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and needle in err and "Traceback" not in err


names = st.sampled_from(sorted(PARTITION_SLOTS))
items = st.tuples(names, st.integers(1, 10_000), st.sampled_from(["qkv", "fc1", "attention", "x_y"]))


@settings(max_examples=200, deadline=None)
@given(st.lists(items, min_size=1, max_size=6, unique_by=lambda i: i[0]))
def test_parse_overlap_round_trip(entries):
    text = ",".join(f"{n}={s}@{slot}" for n, s, slot in entries)
    assert parse_overlap(text) == {n: (s, slot) for n, s, slot in entries}


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=40))
def test_parse_overlap_rejects_garbage_with_config_error(text):
    try:
        parsed = parse_overlap(text)
    except ConfigError as e:
        assert "\n" not in str(e)
    else:
        assert all(isinstance(s, int) and slot for s, slot in parsed.values())

"""The validation kit's runtime checks (runtime/selfcheck/checks.py) as a CPU dry run, in their own process.

The simulated GPU writes every clock call to KAREUS_SIMULATED_LOG, so "read-only: recorded, none applied"
is checked on what the device saw.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kareus_megatron.runtime.selfcheck.checks import CHECKS


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("selfcheck")
    out, log = tmp / "selfcheck.json", tmp / "sim.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KAREUS_")}
    env["KAREUS_SIMULATED_LOG"] = str(log)
    proc = subprocess.run(
        [sys.executable, "-m", "kareus_megatron.runtime.selfcheck", "--dry-run", "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = [json.loads(line) for line in log.read_text().splitlines()]
    return json.loads(out.read_text()), events


def test_every_check_runs_within_the_dry_run_budget(dry_run):
    report, _ = dry_run
    assert report["format"] == "kareus-selfcheck/1" and report["dry_run"] and report["device"] == "cpu"
    assert {c: report[c]["status"] for c in CHECKS} == dict.fromkeys(CHECKS, "ok")
    assert report["elapsed_s"] <= 30.0


def test_megatron_patch_leaves_losses_bit_identical_on_the_read_only_device(dry_run):
    report, events = dry_run
    mp = report["megatron_patch"]
    assert mp["losses_identical"] and mp["losses_with"] == mp["losses_without"]
    assert len(mp["losses_with"]) == mp["iterations"] >= 3 and len(set(mp["losses_with"])) > 1  # it trained
    assert mp["read_only"] and mp["device_syncs_in_schedule"].startswith("not applicable")
    assert mp["iteration_s_median_with"] > 0 and "overhead_pct" in mp
    kinds = [e["event"] for e in events]
    recorded = [e for e in events if e["event"] == "recorded" and e["call"] == "set"]
    assert recorded and mp["controller_counts"]["applied"] == len(recorded)  # decided and recorded ...
    assert "set" not in kinds and "reset" not in kinds and "power_limit" not in kinds, kinds  # ... none applied
    assert all(e["read_only"] for e in events if e["event"] == "open")


def test_event_alignment_on_cpu_is_the_mark_latency_labelled_so(dry_run):
    ea = dry_run[0]["event_alignment"]
    assert ea["measure"] == "cpu_mark_latency_s" and "CPU" in ea["note"]
    assert ea["samples"] >= 25 and 0 < ea["cpu_mark_latency_s_median"] <= ea["cpu_mark_latency_s_p95"] < 1.0


@pytest.mark.parametrize(
    "attention,core", [("local_attention", "DotProductAttention"), ("sdpa_attention", "SDPAttention")]
)
def test_partitioned_layer_matches_the_standard_layer(dry_run, attention, core):
    pl = dry_run[0]["partitioned_layer"]
    r = pl[attention]
    assert r["status"] == "ok" and r["core_attention"] == [core] and r["partitioned_layers"] >= 1
    for n in (1, 2):
        nb = r[f"nanobatches_{n}"]
        assert nb["grad_keys_equal"] and nb["grads_compared"] >= 10
        assert nb["out_max_rel"] <= pl["max_rel_limit"] and nb["grad_max_rel"] <= pl["max_rel_limit"]
    assert r["nanobatches_1"]["out_max_abs"] == 0.0  # one nanobatch: the same computation
    assert r["nanobatches_2"]["grad_max_abs"] > 0.0  # two: really split (sums in another order)

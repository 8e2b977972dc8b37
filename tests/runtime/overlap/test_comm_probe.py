"""The GPU probe of the SM-limited communicators, run for real on this CPU (one gloo rank): it builds what the
engine would build, all-reduces on each, reports JSON-ready fields (saying which have no value on a CPU) and
leaves no process group behind, also when it refuses its input."""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist

from kareus_megatron.errors import ConfigError
from kareus_megatron.runtime.overlap.comm_probe import probe_sm_limited_comms
from kareus_megatron.vocab import MAX_COMM_SM_VALUES


@pytest.fixture(autouse=True)
def no_world(monkeypatch):
    for k in ("NCCL_MAX_CTAS", "NCCL_MIN_CTAS", "NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS"):
        monkeypatch.delenv(k, raising=False)
    assert not dist.is_initialized()
    yield
    assert not dist.is_initialized()  # the probe destroyed the world it made


def test_cpu_probe_runs_gloo_and_names_what_does_not_apply():
    r = probe_sm_limited_comms("cpu", [8, 4, 8])
    json.dumps(r)  # JSON-ready
    assert r["backend"] == "gloo" and r["sm_counts"] == [4, 8] and r["nccl_version"] is None
    assert r["cleaned_up"] and r["total_s"] < 30 and r["budget_per_group"] == MAX_COMM_SM_VALUES
    assert [c["comm_sms"] for c in r["communicators"]] == [4, 8]
    for c in r["communicators"]:
        assert c["all_reduce_ok"] and c["all_reduce_s"] >= 0 and c["sm_limit_requested"] is False
        assert c["memory_free_before_bytes"] is None and c["init_s"] is None
    assert {"memory_free_before_bytes", "nccl_version", "init_s", "sm_limit_requested"} <= set(r["not_applicable"])
    assert isinstance(r["sm_limit_expressible"], bool) and isinstance(r["split_group_available"], bool)


def test_probe_applies_the_runtime_rules(monkeypatch):
    monkeypatch.setenv("NCCL_MAX_NCHANNELS", "6")
    r = probe_sm_limited_comms("cpu", [4, 8])
    assert r["usable_sm_counts"] == [4] and "8" in r["dropped_by_nccl_env"] and r["nccl_env"]
    with pytest.raises(ConfigError, match=f"at most {MAX_COMM_SM_VALUES}"):  # the budget, as the engine's
        probe_sm_limited_comms("cpu", range(1, MAX_COMM_SM_VALUES + 2))


@pytest.mark.parametrize(("device", "counts", "needle"), [("tpu", [4], "use 'cuda'"), ("cpu", [0, 4], "positive")])
def test_bad_input_is_one_line(device, counts, needle):
    with pytest.raises(ConfigError, match=needle) as e:
        probe_sm_limited_comms(device, counts)
    assert "\n" not in str(e.value)

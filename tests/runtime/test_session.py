"""RuntimeSession around the clock controller: no clock permission fails or warns before training."""

from __future__ import annotations

import plans
import pytest

from kareus_megatron.errors import ClockControlError
from kareus_megatron.runtime.session import RuntimeSession


def test_session_fail_and_warn_on_no_permission(monkeypatch):
    monkeypatch.setenv("KAREUS_GPU_BACKEND", "simulated")
    monkeypatch.setenv("KAREUS_SIMULATED_NO_PERMISSION", "1")
    with pytest.raises(ClockControlError, match="no permission"):
        RuntimeSession(plans.tiny_plan(), controller="thread").start()
    with pytest.warns(UserWarning, match="training at default clocks"):
        s = RuntimeSession(plans.tiny_plan(), controller="thread", on_error="warn").start()
    assert not s.client.clock_control
    assert s.simulation is None  # the thread controller got the hooks; the session reads no device itself
    s.close()

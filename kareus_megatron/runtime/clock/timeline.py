"""The clock controller's input for a simulated GPU, handled on the simulated time line.

On a CPU host the trainer's records arrive in batches, long after the fact. A simulated GPU can
account for that (``SimulationHooks``): busy/idle edges are integrated at their own times, a mark is
answered with the energy at its own time, and a clock call is *scheduled*: issued at the begin's own
time if the simulated device is free then, else when it becomes free; a begin still waiting when a
later one begins is skipped as stale. A begin's power field (wire.py, e; a simulated truth's busy power in
W, NaN: the device's model) goes with its busy edge. So the decisions are those of a controller that saw every message
at its own time, however late and batched the messages arrive. The wall-time (NVML) path is in
controller.py and never comes here.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from kareus_megatron.errors import KareusError
from kareus_megatron.hardware.device.base import GPUDevice, SimulationHooks
from kareus_megatron.runtime.clock.decisions import Begin, Decisions, route_control
from kareus_megatron.runtime.clock.power_samples import ModelSampler
from kareus_megatron.runtime.clock.wire import CODE_BEGIN, CODE_END, NO_POWER, MarkReply


class SimulatedTimeLine:
    """Input handling for `device`, a simulated GPU (`simulation` is its SimulationHooks)."""

    def __init__(self, device: GPUDevice, simulation: SimulationHooks, decisions: Decisions) -> None:
        self._device = device
        self._sim = simulation
        self._dec = decisions
        self._lock = threading.Lock()  # the input thread schedules, the control loop resets
        self._free_at = float("-inf")  # when the simulated device finishes its last clock call (s)
        self._pending: tuple[Begin, float] | None = None  # a begin waiting for the device, and its time (s)
        self._power = ModelSampler(simulation.energy_j_at)  # the power model sampled on the time line

    def take(self, items: list[Any], rest: list[Any], answers: list[MarkReply], held: list[MarkReply]) -> bool:
        """Handle what arrived, in order: record blocks here (busy/idle edges, marks into `answers`, or
        `held` when lazy, clock calls on the time line), control messages into `rest` for the control
        loop. Return whether one of them releases the held mark answers."""
        sim, dec = self._sim, self._dec
        schedule = dec.clock_control  # without clock control begins only mark the device busy
        release = False
        edges: list[float] = []  # t0, busy0, t1, busy1, ... (busy as 1.0 / 0.0)
        powers: list[float] = []  # one per edge: a busy edge's power (W; NaN: the device's model)
        t = None
        with self._lock:
            for item in items:
                if isinstance(item, dict):
                    release = route_control(item, rest) or release
                    continue
                it = iter(item)
                for code, t, idle, a, b, c, d, e in zip(it, it, it, it, it, it, it, it):
                    if idle == idle:  # not NaN: the previous instruction ended then
                        self._sample(idle, edges, powers)
                        edges += (idle, 0.0)
                        powers.append(NO_POWER)
                    self._sample(t, edges, powers)
                    if code == CODE_BEGIN:
                        edges += (t, 1.0)
                        powers.append(e)
                        if schedule:
                            self._begin((int(c), int(a), int(b), int(d)), t)  # mhz, iteration, index, kind
                    elif code == CODE_END:
                        edges += (t, 0.0)
                        powers.append(NO_POWER)
                    else:  # a mark: its energy includes every edge and clock change before it
                        self._catch_up(t)
                        if edges:
                            sim.busy_edges(edges, powers)
                            edges, powers = [], []
                        answer = dec.mark(int(a), t, sim.energy_j_at, t)
                        answer["power"] = self._power.take()  # samples since the previous mark
                        (held if b else answers).append(answer)
            if t is not None:
                self._catch_up(t)  # every record up to t has arrived: a call due by then is made
            if edges:
                sim.busy_edges(edges, powers)
        return release

    def _sample(self, t: float, edges: list[float], powers: list[float]) -> None:
        """Before a record at `t` (s): read the power model at every grid time up to `t`, with every edge
        before that grid time applied (edges still pending all lie before `t`)."""
        power = self._power
        power.start(t)
        if t < power.next_t - 1e-9:
            return
        while power.next_t <= t + 1e-9:
            cut = 0
            while cut < len(edges) and edges[cut] <= power.next_t:
                cut += 2
            if cut:
                self._sim.busy_edges(edges[:cut], powers[: cut // 2])
                del edges[:cut], powers[: cut // 2]
            power.reach(power.next_t)

    def _begin(self, begin: Begin, t: float) -> None:
        """A begin at time `t` (s): call at once if the device is free then, else wait (a begin still
        waiting is overtaken: stale; a begin asking for the clock already asked for: unchanged)."""
        self._catch_up(t)
        if self._free_at <= t:
            self._call(begin, t, t)
            return
        dec = self._dec
        if begin[0] == (dec.locked_mhz if self._pending is None else self._pending[0][0]):
            dec.skip(begin, "unchanged")  # the clock already asked for (a waiting call keeps its begin time)
            return
        if self._pending is not None:
            dec.skip(self._pending[0], "stale")
            self._pending = None
            if begin[0] == dec.locked_mhz:  # back to the clock the device is locking: no change left
                dec.skip(begin, "unchanged")
                return
        self._pending = (begin, t)

    def _catch_up(self, t: float) -> None:
        """Make the waiting call if the device became free by `t` (s); it starts when the device is free."""
        if self._pending is not None and self._free_at <= t:
            (begin, t_begin), self._pending = self._pending, None
            self._call(begin, self._free_at, t_begin)

    def _call(self, begin: Begin, at: float, t_begin: float) -> None:
        """Issue `begin`'s clock call at `at` (s) on the simulated time line (its instruction began at
        `t_begin`, s: a call made later is counted late by the decisions)."""
        if not self._dec.wanted(begin):
            return
        try:
            self._free_at = float(self._sim.schedule_sm_clock(begin[0], at))
        except KareusError as e:
            self._dec.failed(begin, e)
            return
        self._dec.applied(begin, at - t_begin)

    def settle(self) -> None:
        """Before a reset or close: a call due by now is made; one still waiting is overtaken."""
        with self._lock:
            self._catch_up(time.monotonic())
            if self._pending is not None:
                self._dec.skip(self._pending[0], "stale")
                self._pending = None

    def reset_clocks(self) -> None:
        """Reset the device's clocks now (blocking, as NVML); forget any waiting call."""
        with self._lock:
            self._device.reset_clocks()
            self._dec.locked_mhz = None  # under the lock: a begin taken meanwhile sees the reset
            self._pending = None
            self._free_at = time.monotonic()

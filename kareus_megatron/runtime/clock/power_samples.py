"""GPU power samples at SAMPLE_HZ, taken off the training thread and handed out with each mark answer.

The clock controller (controller.py) owns the GPU, so it samples it:

- NVML (``WallSampler``): a daemon thread reads the device's power every 1 / SAMPLE_HZ s. NVMLGPU.power_w
  reads NVML's instantaneous power field (``NVML_FI_DEV_POWER_INSTANT``) where the GPU has one, else
  ``nvmlDeviceGetPowerUsage``, which on Ampere and later boards is a 1 s average (``reading``
  ``nvml_average_1s``: the samples then show a smoothed waveform; docs/power.md).
- a simulated GPU (``ModelSampler``): its power model, on the simulated time line (timeline.py): at every
  grid time k / SAMPLE_HZ the busy/idle edges up to then are applied and the modelled energy read; a
  sample is the mean power (W) over its grid interval. No thread: the samples follow the records' own
  times however late the records arrive.

Each mark answer carries the samples taken since the previous mark as ``"power": {"t0": s, "dt_s": s,
"w": [W, ...], "reading": ...}`` (t0: time.monotonic() of the first sample's start; dt_s: the sampling
interval; one value per sample, rounded to 0.1 W). The iteration line of the run log keeps the end mark's
(runtime/measure/measurement.py), so every iteration carries its own waveform.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Any, Final

from kareus_megatron.vocab import POWER_READING_MODEL

_GRID_TOL = 1e-9  # s: a record this close to a grid time counts as on it (float rounding of k * dt)
SAMPLE_HZ: Final = 50.0  # ≥ 20 Hz, the rate the issue asks for; an NVML read costs about 1 µs-1 ms


def compact(t: list[float], w: list[float], dt_s: float, reading: str) -> dict[str, Any] | None:
    """The run-log form of samples at times `t` (s, each a sample's start) and powers `w` (W)."""
    if not t:
        return None
    return {"t0": t[0], "dt_s": dt_s, "w": [round(x, 1) for x in w], "reading": reading}


class ModelSampler:
    """Samples of a simulated GPU's modelled power on a grid of 1 / hz s (see the module doc)."""

    def __init__(self, read_energy_j_at: Callable[[float], float], hz: float = SAMPLE_HZ) -> None:
        self._read = read_energy_j_at
        self.dt_s = 1.0 / hz
        self.next_t = math.inf  # the next grid time (s) to read; inf until the first record
        self._k = 0  # its index on the grid: next_t = k * dt_s, without drift
        self._e_prev: float | None = None
        self._t: list[float] = []
        self._w: list[float] = []

    def start(self, t: float) -> None:
        """Begin at the first grid time after `t` (s), the first record's time."""
        if self.next_t == math.inf:
            self._k = math.ceil(t / self.dt_s - _GRID_TOL)
            self.next_t = self._k * self.dt_s

    def reach(self, t: float) -> None:
        """Read every grid time up to `t` (s); the caller has applied every edge before each of them."""
        while self.next_t <= t + _GRID_TOL:
            e = float(self._read(self.next_t))
            if self._e_prev is not None and e == e:
                self._t.append(self.next_t - self.dt_s)
                self._w.append(max(0.0, (e - self._e_prev) / self.dt_s))
            self._e_prev = e if e == e else None
            self._k += 1
            self.next_t = self._k * self.dt_s

    def take(self) -> dict[str, Any] | None:
        """The samples since the last take, compact (None: none)."""
        out = compact(self._t, self._w, self.dt_s, POWER_READING_MODEL)
        self._t, self._w = [], []
        return out


class WallSampler:
    """A daemon thread that reads `read_power_w()` (W) every 1 / hz s of wall time (NVML; module doc)."""

    def __init__(self, read_power_w: Callable[[], float], reading: str, hz: float = SAMPLE_HZ) -> None:
        self._read = read_power_w
        self.reading = reading
        self.dt_s = 1.0 / hz
        self._lock = threading.Lock()
        self._t: list[float] = []
        self._w: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kareus-power-sampler", daemon=True)

    def start(self) -> WallSampler:
        """Start sampling; returns self."""
        self._thread.start()
        return self

    def _run(self) -> None:
        next_t = time.monotonic()
        while not self._stop.is_set():
            t = time.monotonic()
            try:
                w = float(self._read())
            except Exception:  # a failed read is a gap in the samples, never an error of the run
                w = math.nan
            if w == w:
                with self._lock:
                    self._t.append(t)
                    self._w.append(w)
            next_t = max(next_t + self.dt_s, time.monotonic())
            self._stop.wait(max(0.0, next_t - time.monotonic()))

    def take(self, t_upto: float) -> dict[str, Any] | None:
        """The samples taken up to `t_upto` (s) since the last take, compact (None: none)."""
        with self._lock:
            n = sum(1 for t in self._t if t <= t_upto)
            t, w = self._t[:n], self._w[:n]
            del self._t[:n], self._w[:n]
        dt = (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else self.dt_s
        return compact(t, w, dt, self.reading)

    def stop(self) -> None:
        """Stop the thread (bounded wait)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=1.0)

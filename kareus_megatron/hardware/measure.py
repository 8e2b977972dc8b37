"""Energy measurement on one GPU that holds still: warm-up, counter-sized windows, randomised clock order.

Terms. The *energy counter* is the device's cumulative energy (J, ``GPUDevice.energy_j``); on NVIDIA
boards it moves in steps (its *update period*, about 20-100 ms, measured here by sampling, never assumed).
A *window* runs one piece of work back to back for at least ``max(min_window_s, min_counter_updates ×
period)`` seconds and reports time per call (s), energy per call (J) and average power (W) as total over
total. A *sweep* measures every (clock, kernel) pair ``repeats`` times: each repeat visits the clocks in
a fresh random order (interleaving repeats against thermal drift; a monotone high-to-low sweep would fold
the drift into the clock's effect), with an idle *cooldown* between windows; the GPU temperature (°C) is
recorded at each window's start and end. The *warm-up* runs the heaviest kernel until the temperature
is stable within ``stable_c`` over ``stable_s`` seconds, or ``warmup_max_s`` passes.

This module knows only the device contract and callables: work is ``fn()`` (enqueue one call) and
``sync()`` (wait for the accelerator), so it imports neither torch nor the cost model. Clocks are locked
only when ``lock_clocks`` is true; a read-only run measures at whatever clock the GPU runs at.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kareus_megatron.hardware.device.base import GPUDevice, SimulationHooks

Work = Callable[[], Any]

# A sampling hole wider than this share of a counter gap makes the gap unreliable: two updates merged
# into one change need a hole of more than one period inside a gap of more than two (a share above 0.5).
STALL_SHARE = 0.4


def temperature_c(device: GPUDevice) -> float | None:
    """The GPU temperature (°C), or None where the device contract in use offers none."""
    try:
        return float(device.temperature_c())
    except Exception:  # a temperature sensor NVML does not expose: record no temperature, measure anyway
        return None


@dataclass(frozen=True, kw_only=True)
class WindowPolicy:
    """How long windows, cooldowns and the warm-up are. Units: s, °C."""

    min_window_s: float = 1.0
    min_counter_updates: int = 10
    cooldown_s: float = 0.3
    repeats: int = 2
    warmup_max_s: float = 60.0
    warmup_stable_s: float = 10.0
    stable_c: float = 1.0
    seed: int = 0

    def window_s(self, counter_period_s: float) -> float:
        """Window length (s): at least min_window_s and min_counter_updates counter periods."""
        return max(self.min_window_s, self.min_counter_updates * counter_period_s)


@dataclass(frozen=True, kw_only=True)
class Window:
    """One measured window: per-call time (s) and energy (J), power (W), temperatures (°C) and clock (MHz)."""

    kernel: str
    clock_mhz: int | None  # the clock locked for it (None: not locked)
    repeat: int
    calls: int
    seconds: float
    time_s: float
    energy_j: float
    power_w: float
    read_clock_mhz: int
    temperature_start_c: float | None
    temperature_end_c: float | None
    started_s: float  # since the sweep began


@dataclass
class Sweep:
    """What a sweep measured, in the order it measured it."""

    windows: list[Window] = field(default_factory=list)
    warmup: dict[str, Any] = field(default_factory=dict)
    window_s: float = 0.0
    order: list[tuple[int | None, str]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (windows as dicts)."""
        return {"window_s": self.window_s, "warmup": self.warmup, "windows": [asdict(w) for w in self.windows]}

    def per_clock(self, kernel: str) -> tuple[list[int], list[float], list[float]]:
        """(clocks MHz ascending, time per call s, energy per call J) of `kernel`, repeats pooled total over total."""
        acc: dict[int, list[float]] = {}
        for w in self.windows:
            if w.kernel != kernel:
                continue
            clk = w.clock_mhz if w.clock_mhz is not None else w.read_clock_mhz
            a = acc.setdefault(clk, [0.0, 0.0, 0.0])
            a[0] += w.time_s * w.calls
            a[1] += w.energy_j * w.calls
            a[2] += w.calls
        clocks = sorted(acc)
        return clocks, [acc[c][0] / acc[c][2] for c in clocks], [acc[c][1] / acc[c][2] for c in clocks]


def sample_energy_counter(
    device: GPUDevice, seconds: float, work: Work | None = None, sync: Work | None = None, min_clear_gaps: int = 5
) -> dict[str, Any]:
    """Sample the energy counter for `seconds` (s), under `work` when given: update period (s), step (J).

    The period is the median gap (s) between observed counter changes, over the gaps the sampler saw
    clearly: a gap is set aside when the sampler was away (descheduled on a loaded host, or one long
    `work` call) for more than STALL_SHARE of it, inside the gap or just before the change that opens it,
    because such a gap may hide updates or start late. Sampling goes on past `seconds` until
    `min_clear_gaps` clear gaps are seen, for at most four times `seconds`; with none, every gap counts.
    """
    t0 = time.monotonic()
    t_end, t_cap = t0 + seconds, t0 + 4 * seconds
    t_last, e_prev = t0, device.energy_j()
    changes: list[tuple[float, float, float]] = []  # (time s, step J, hole s just before it was seen)
    gaps: list[float] = []
    clear: list[float] = []
    samples, widest = 0, 0.0
    while (now := time.monotonic()) < t_end or (len(clear) < min_clear_gaps and now < t_cap):
        if work is not None:
            work()
        e, t = device.energy_j(), time.monotonic()
        samples += 1
        hole, t_last = t - t_last, t
        widest = max(widest, hole)
        if e != e_prev:
            if changes:  # the first change ends a partial period
                t_prev, _, before = changes[-1]
                gaps.append(t - t_prev)
                if max(before, widest) <= STALL_SHARE * (t - t_prev):
                    clear.append(t - t_prev)
            changes.append((t, e - e_prev, hole))
            e_prev, widest = e, 0.0
    if sync is not None:
        sync()
    kept = sorted(clear or gaps)
    steps = sorted(de for _, de, _ in changes if de > 0)
    period = kept[len(kept) // 2] if kept else seconds
    return {
        "seconds": round(time.monotonic() - t0, 3),
        "samples": samples,
        "updates": len(changes),
        "update_period_s": period,
        "clear_gaps": len(clear),
        "gaps_set_aside": len(gaps) - len(clear),
        "smallest_step_j": steps[0] if steps else None,
        "median_step_j": steps[len(steps) // 2] if steps else None,
        "unit": "J (driver: mJ, converted once)",
        "monotone": all(de >= 0 for _, de, _ in changes),
    }


def measure_window(
    device: GPUDevice,
    fn: Work | None,
    sync: Work,
    seconds: float,
    *,
    kernel: str,
    clock_mhz: int | None,
    repeat: int,
    t0: float,
    sim: SimulationHooks | None = None,
    activity: tuple[float, float] | None = None,
) -> Window:
    """Run fn() back to back for about `seconds` (s) (fn None: idle) and return the window's per-call figures.

    On the simulated backend (`sim`) the window is marked busy at `activity` (compute, memory; 0..1), so
    its modelled energy is that of the work; on NVML the counter measures it.
    """
    temp0 = temperature_c(device)
    n = 1
    if fn is not None:
        fn()
        sync()
        t_a = time.perf_counter()
        fn()
        sync()
        n = max(3, int(seconds / max(time.perf_counter() - t_a, 1e-6)))
    if sim is not None and fn is not None:
        ca, ma = activity or (0.0, 0.0)
        sim.set_busy(True, compute_activity=ca, memory_activity=ma)
    started = time.monotonic()
    e0, ta = device.energy_j(), time.perf_counter()
    if fn is None:
        time.sleep(seconds)
    else:
        for _ in range(n):
            fn()
        sync()
    dt = time.perf_counter() - ta
    read = device.sm_clock_mhz()  # the clock at the end of the window, while it still ran
    e1 = device.energy_j()
    if sim is not None and fn is not None:
        sim.set_busy(False)
    energy = max(e1 - e0, 0.0)
    return Window(
        kernel=kernel,
        clock_mhz=clock_mhz,
        repeat=repeat,
        calls=n,
        seconds=dt,
        time_s=dt / n,
        energy_j=energy / n,
        power_w=energy / dt if dt > 0 else 0.0,
        read_clock_mhz=int(read),
        temperature_start_c=temp0,
        temperature_end_c=temperature_c(device),
        started_s=started - t0,
    )


def warm_up(
    device: GPUDevice,
    fn: Work,
    sync: Work,
    policy: WindowPolicy,
    sim: SimulationHooks | None = None,
    activity: tuple[float, float] | None = None,
) -> dict[str, Any]:
    """Run fn() until the temperature holds within policy.stable_c over policy.warmup_stable_s (s), or at
    most policy.warmup_max_s; without a temperature reading, for the stable span alone."""
    t0 = time.monotonic()
    first = temperature_c(device)
    trace: list[tuple[float, float]] = []  # (s since start, °C)
    chunk_s = min(1.0, max(policy.warmup_stable_s / 10, 1e-3))
    limit = policy.warmup_max_s if first is not None else min(policy.warmup_stable_s, policy.warmup_max_s)
    stable = False
    if sim is not None:
        ca, ma = activity or (0.0, 0.0)
        sim.set_busy(True, compute_activity=ca, memory_activity=ma)
    try:
        while time.monotonic() - t0 < limit:
            t_chunk = time.monotonic()
            while time.monotonic() - t_chunk < chunk_s:
                fn()
                sync()
            now = time.monotonic() - t0
            temp = temperature_c(device)
            if temp is None:
                continue
            trace.append((now, temp))
            start = now - policy.warmup_stable_s
            # the readings over the whole span: the last one before it too, so a stalled host that took a single
            # reading within the span does not call one sample "stable"
            before = [c for s, c in trace if s < start]
            recent = before[-1:] + [c for s, c in trace if s >= start]
            if now >= policy.warmup_stable_s and len(recent) >= 2 and max(recent) - min(recent) <= policy.stable_c:
                stable = True
                break
    finally:
        if sim is not None:
            sim.set_busy(False)
    return {
        "seconds": time.monotonic() - t0,
        "start_c": first,
        "end_c": trace[-1][1] if trace else first,
        "stable": stable if first is not None else None,
        "stable_c": policy.stable_c,
        "stable_s": policy.warmup_stable_s,
        "max_s": policy.warmup_max_s,
        "trace": trace,
    }


def interleaved_order(
    clocks: Sequence[int | None], kernels: Sequence[str], repeats: int, seed: int = 0
) -> list[tuple[int | None, str, int]]:
    """(clock, kernel, repeat) visits: each repeat a fresh random order of clocks, kernels shuffled within."""
    rng = random.Random(seed)
    out = []
    for r in range(repeats):
        cs = list(clocks)
        rng.shuffle(cs)
        for c in cs:
            ks = list(kernels)
            rng.shuffle(ks)
            out += [(c, k, r) for k in ks]
    return out


def sweep(
    device: GPUDevice,
    kernels: dict[str, Work | None],
    sync: Work,
    clocks: Sequence[int] | None,
    policy: WindowPolicy,
    counter_period_s: float,
    *,
    warmup_kernel: str | None = None,
    sim: SimulationHooks | None = None,
    activity: Callable[[str, int], tuple[float, float]] | None = None,
    progress: Callable[[str], None] | None = None,
) -> Sweep:
    """Warm up, then measure every kernel at every clock `repeats` times in interleaved random order.

    `clocks` None: read-only, no clock is ever locked (the device is measured as it runs). `activity`
    (kernel, clock MHz) -> (compute, memory) activity is for the simulated backend; None kernels are idle.
    """
    out = Sweep(window_s=policy.window_s(counter_period_s))
    t0 = time.monotonic()
    if warmup_kernel is not None:
        fn = kernels[warmup_kernel]
        assert fn is not None
        if clocks:
            device.set_sm_clock_mhz(max(clocks))
        act = activity(warmup_kernel, device.sm_clock_mhz()) if activity else None
        out.warmup = warm_up(device, fn, sync, policy, sim, act)
    current: int | None = None
    for clk, name, rep in interleaved_order(
        list(clocks) if clocks else [None], list(kernels), policy.repeats, policy.seed
    ):
        if clk is not None and clk != current:
            device.set_sm_clock_mhz(clk)
            current = clk
        act = activity(name, clk or device.sm_clock_mhz()) if activity and kernels[name] is not None else None
        w = measure_window(
            device,
            kernels[name],
            sync,
            out.window_s,
            kernel=name,
            clock_mhz=clk,
            repeat=rep,
            t0=t0,
            sim=sim,
            activity=act,
        )
        out.windows.append(w)
        out.order.append((clk, name))
        if progress is not None:
            progress(f"{name} at {w.read_clock_mhz} MHz")
        if policy.cooldown_s > 0:
            time.sleep(policy.cooldown_s)
    return out


def sweep_seconds(policy: WindowPolicy, counter_period_s: float, n_clocks: int, n_kernels: int) -> float:
    """Planned duration (s) of a sweep (warm-up bound included), for the time budget."""
    per = policy.window_s(counter_period_s) * 1.15 + policy.cooldown_s  # + the calibration calls
    return policy.warmup_max_s + max(n_clocks, 1) * n_kernels * policy.repeats * per

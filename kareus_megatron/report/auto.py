"""What a ``--kareus-plan auto`` run did (runtime/closed_loop/auto.py): its phases, the model error, and what it saved.

Read from the run log alone: each iteration's tags (``phase``, ``plan_version``, ``profile_mhz``) and the
closed loop's events (``phase``, ``calibrated``, ``switch``, ``checked``, ``drift``, ``objective-unmet``,
``auto-failed``; report/measurements.py ``run_events``). Per *stretch* (consecutive complete iterations with the
same tags) the median time and mean energy per iteration, its first iteration left out (a switch lands inside
it). The *saving* compares the last plan's stretch with the max-clock iterations of the profile phase
just before it (its warm-up and its top clock; after a drift, the re-profile's, i.e. the GPU as it is now):
energy saved per iteration and the change in iteration time.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

AUTO_EVENTS = ("phase", "calibrated", "switch", "checked", "drift", "objective-unmet", "auto-failed")
TAGS = ("phase", "plan_version", "profile_mhz")
PROFILE_PHASES = ("warmup", "profile", "reprofile")


@dataclass
class Stretch:
    """Consecutive complete iterations run with the same phase, plan version and profile clock."""

    phase: str
    plan_version: int | None
    profile_mhz: int | None
    first: int
    last: int
    time_s: float | None = None  # median over the stretch, its first iteration left out
    energy_j: float | None = None  # mean over the same iterations
    used: int = 0


@dataclass
class AutoSummary:
    """The closed loop's phases, events and saving."""

    stretches: list[Stretch]
    events: list[dict[str, Any]]
    saving_energy: float | None = None  # 1 - E(last plan) / E(max clock of the profile before it)
    time_change: float | None = None  # T(last plan) / T(max clock) - 1
    notes: list[str] = field(default_factory=list)

    def of(self, name: str) -> list[dict[str, Any]]:
        """The events called `name`, in order."""
        return [e for e in self.events if e.get("event") == name]


def _tags(rec: dict[str, Any]) -> tuple[Any, ...] | None:
    ranks = rec.get("ranks") or []
    if not ranks:
        return None
    tags = {tuple(r.get(k) for k in TAGS) for r in ranks}
    return tags.pop() if len(tags) == 1 else None


def stretches(log: Any) -> list[Stretch]:
    """The log's complete iterations cut into stretches of equal tags (see the module doc)."""
    out: list[Stretch] = []
    samples: list[tuple[list[float], list[float]]] = []
    prev_it = None
    for rec in log.iterations:
        it = rec["iteration"]
        tags = _tags(rec) if it not in log.partial else None
        if tags is None or tags[0] is None:
            prev_it = None
            continue
        cur = out[-1] if out else None
        if cur is None or prev_it != it - 1 or (cur.phase, cur.plan_version, cur.profile_mhz) != tags:
            out.append(Stretch(tags[0], tags[1], tags[2], it, it))
            samples.append(([], []))
        else:
            cur.last = it
            if rec.get("time_s") is not None and rec.get("energy_j") is not None:
                samples[-1][0].append(float(rec["time_s"]))
                samples[-1][1].append(float(rec["energy_j"]))
        prev_it = it
    for s, (ts, es) in zip(out, samples):
        if ts:
            s.time_s, s.energy_j, s.used = statistics.median(ts), sum(es) / len(es), len(ts)
    return out


def auto_summary(log: Any) -> AutoSummary | None:
    """The summary of an auto run; None when the log holds no closed-loop events."""
    from kareus_megatron.report.measurements import run_events

    events = [e for e in run_events(log) if e.get("event") in AUTO_EVENTS and e.get("rank", 0) == 0]
    if not any(e.get("event") == "phase" for e in events):
        return None
    parts = stretches(log)
    summary = AutoSummary(parts, events)
    top = max((s.profile_mhz for s in parts if s.profile_mhz is not None), default=None)
    # the baseline: the max-clock iterations of the profile phase just before the last plan (after a drift,
    # the re-profile's: the GPU as it is now)
    base: list[tuple[float, float, int]] = []
    last_plan: tuple[float, float] | None = None
    fresh = True
    for s in parts:
        if s.phase in PROFILE_PHASES:
            if fresh:
                group: list[tuple[float, float, int]] = []
                fresh = False
            if s.profile_mhz == top and s.time_s is not None and s.energy_j is not None:
                group.append((s.time_s, s.energy_j, s.used))
        elif s.phase == "plan" and s.time_s is not None and s.energy_j is not None:
            if not fresh:
                base, fresh = group, True
            last_plan = (s.time_s, s.energy_j)
    if base and last_plan is not None:
        e0 = sum(e * n for _, e, n in base) / sum(n for _, _, n in base)
        t0 = statistics.median(t for t, _, _ in base)
        summary.saving_energy = 1.0 - last_plan[1] / e0
        summary.time_change = last_plan[0] / t0 - 1.0
    elif last_plan is None:
        summary.notes.append("the run ended before a plan made from its own measurements ran")
    return summary


def _pct(x: Any) -> str:
    return "n/a" if x is None else f"{x * 100:+.1f}%"


def auto_lines(summary: AutoSummary) -> list[str]:
    """The text section of `kareus report` for an auto run."""
    lines = ["closed loop (--kareus-plan auto): phases"]
    lines.append(f"  {'phase':10s} {'iterations':>11s} {'plan':>5s} {'clock':>9s} {'time':>10s} {'energy':>10s}")
    for s in summary.stretches:
        clock = f"{s.profile_mhz} MHz" if s.profile_mhz is not None else "plan"
        t = "n/a" if s.time_s is None else f"{s.time_s * 1e3:.2f} ms"
        e = "n/a" if s.energy_j is None else f"{s.energy_j:.2f} J"
        lines.append(
            f"  {s.phase:10s} {f'{s.first}-{s.last}':>11s} {str(s.plan_version):>5s} {clock:>9s} {t:>10s} {e:>10s}"
        )
    for ev in summary.of("calibrated"):
        lines.append(
            f"  calibrated from iterations {ev.get('iterations')}: model error at the max clock, time "
            f"{_pct(ev.get('error_before_time'))} -> {_pct(ev.get('error_after_time'))}, energy "
            f"{_pct(ev.get('error_before_energy'))} -> {_pct(ev.get('error_after_energy'))}; "
            f"objective {ev.get('objective')}: point {ev.get('point')} (plan {ev.get('plan_version')})"
        )
    for ev in summary.of("checked"):
        lines.append(
            f"  plan {ev.get('plan_version')} on the run: time {_pct(ev.get('error_time'))}, energy "
            f"{_pct(ev.get('error_energy'))} against its prediction ({ev.get('iterations')} iterations)"
        )
    for ev in summary.of("drift"):
        lines.append(
            f"  drift at iteration {ev.get('iteration')}: time {_pct(ev.get('error_time'))}, energy "
            f"{_pct(ev.get('error_energy'))} against plan {ev.get('plan_version')}; re-planned"
        )
    for name in ("objective-unmet", "auto-failed"):
        for ev in summary.of(name):
            lines.append(f"  {name} at iteration {ev.get('iteration')}: {ev.get('reason')}")
    if summary.saving_energy is not None:
        lines.append(
            f"  last plan against the max-clock iterations of its profile: energy per iteration "
            f"{_pct(-summary.saving_energy)}, time {_pct(summary.time_change)}"
        )
    lines += [f"  note: {n}" for n in summary.notes]
    return lines

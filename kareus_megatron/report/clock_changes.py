"""How many of a run's clock changes the clock controller made late or skipped, from its run log.

Each iteration line of a run with a clock controller counts the clock calls decided between the
iteration's two marks (runtime/measure/measurement.py): ``clock_applied`` (of which ``clock_late``: made more
than half the GPU's clock latency after their instruction began, runtime/clock/decisions.py) and
``clock_stale`` (skipped: a later instruction began before the call could be made). A *requested change* is
an applied or a skipped one (a clock that is locked already is no change). Over every rank and the
iterations the report uses (after the warm-up), the share of requested changes made late or skipped is
``(late + stale) / (applied + stale)``; above LATE_SHARE_LIMIT the run executed another clock plan than the
one whose savings were predicted (the plan's segments are shorter than the controller can follow), and
``kareus report`` flags it. Logs without the counts (older runs, runs without a clock controller) give None.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kareus_megatron.report.runlog import RunLog
from kareus_megatron.report.summary import check_skip

LATE_SHARE_LIMIT = 0.05  # more than this share of clock changes late or skipped: the run is flagged


def _count(line: dict[str, Any], key: str) -> int | None:
    value = line.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


@dataclass(frozen=True, slots=True)
class ClockChanges:
    """Clock changes of the iterations a report uses, summed over ranks: applied, late (of the applied), stale."""

    applied: int
    late: int
    stale: int
    iterations: int  # iterations whose lines carried the counts

    @property
    def requested(self) -> int:
        """Changes the plan asked for: applied or skipped."""
        return self.applied + self.stale

    @property
    def share_late_or_skipped(self) -> float:
        """(late + stale) / requested (0 when nothing was requested)."""
        return (self.late + self.stale) / self.requested if self.requested else 0.0

    @property
    def flagged(self) -> bool:
        """More than LATE_SHARE_LIMIT of the requested changes were late or skipped."""
        return self.share_late_or_skipped > LATE_SHARE_LIMIT

    def as_json(self) -> dict[str, Any]:
        """The ``clock_changes`` object of ``kareus report --format json``."""
        return {
            "requested": self.requested,
            "applied": self.applied,
            "late": self.late,
            "skipped": self.stale,
            "share_late_or_skipped": self.share_late_or_skipped,
            "limit": LATE_SHARE_LIMIT,
            "flagged": self.flagged,
            "iterations": self.iterations,
        }

    def line(self) -> str:
        """One line for the text report; a flagged run's says what it means."""
        head = (
            f"clock changes: {self.requested} requested, {self.late} applied late, {self.stale} skipped "
            f"({self.share_late_or_skipped * 100:.1f}%)"
        )
        if not self.flagged:
            return head
        return (
            f"WARNING {head}: more than {LATE_SHARE_LIMIT * 100:g}% late or skipped, so the run executed "
            "another clock plan than the predicted one; plan with the GPU's measured --clock-latency-ms "
            "(docs/clock_latency.md)"
        )


def clock_changes(log: RunLog, skip_iterations: int) -> ClockChanges | None:
    """The clock changes of `log` after `skip_iterations` warm-up iterations (None: no line carries the counts)."""
    applied = late = stale = seen = 0
    for record in log.iterations[check_skip(skip_iterations) :]:
        counted = False
        for line in record.get("ranks", ()):
            a, s = _count(line, "clock_applied"), _count(line, "clock_stale")
            if a is None or s is None:
                continue
            applied, stale, late = applied + a, stale + s, late + (_count(line, "clock_late") or 0)
            counted = True
        seen += counted
    return ClockChanges(applied, late, stale, seen) if seen else None

"""Clock segments the clock controller can apply: merge the short ones, cost the lag of every change.

Terms: a rank's *clock segment* is a maximal run of its instructions at one SM clock (MHz), taken
cyclically (an iteration's last instruction is followed by the next iteration's first); its *length* is
its busy time (s, the sum of its instructions' durations). The clock controller (runtime/clock/) makes one
locked-clock call per segment, when the segment's first instruction begins; the new clock is in force one
*latency* later (``GPUSpec.clock_latency_s``, s; gpus.toml [LAT]) and the previous clock runs until then
(the *lag*). A change that is requested while the previous one is still pending is skipped as stale.

- ``merge_short_segments``: until every segment of a rank lasts at least ``min_segment_s`` (k × latency,
  k = CLOCK_SEGMENT_LATENCIES), the rank's shortest segment is merged with a neighbour (the previous or the
  next segment) at one clock between the two segments' clocks; each instruction takes its option at that
  clock nearest in time to the option the solver gave it. Of those (neighbour, clock) candidates, the one
  with the least energy among those that keep every merged instruction within its slack in the solver's
  plan (the running sum of their slowdowns, in order, never exceeds the time the instruction may end later
  without delaying the iteration) wins; if none does, the one that overruns the slack least.
- ``lagged_costs``: each instruction's duration (s) and energy (J, one GPU) with the lag: the first latency
  of busy time of each segment runs at the previous segment's clock (the instruction's option at that clock
  nearest in time to its own; at the nearest clock it has an option for, if none). Only busy time counts
  down the lag, so a change that completes during a wait is still charged: this over-counts the lag.
- ``raise_ahead``: every raise of the clock requested one latency early, so that it is in force when the
  faster segment begins and never slows it: each instruction runs at least the highest clock of those that
  begin within one latency of busy time after it (busy time at their fastest options: a slower run only
  adds margin). A lowering is still requested at its segment's begin (its lag runs the first instructions
  faster, never slower). A segment this leaves shorter than one latency before a higher one is raised whole.
  The price is energy: the tail of the slower segment runs at the faster clock.
- ``latency_aware_plans``: merge, then each plan as is and with its raises ahead, the lag and the event
  simulation of both; the frontier keeps whichever is better (as is: energy where the raised segment's
  first instructions have slack; ahead: time where they are on the critical path).

Segments of at least 2 latencies (docs/clock_latency.md): a change issued at a segment's begin is done one
latency later, before the next segment's begin, so no change is stale and at most half of a segment runs at
the previous clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kareus_megatron.cost.energy import iteration_energy_j
from kareus_megatron.errors import ConfigError, PlanError
from kareus_megatron.search.pipeline import PipelineDAG
from kareus_megatron.search.simulate import earliest_times, iteration_time, latest_finish

_SLACK_TOL_S = 1e-9  # slack (s) below this is none (the critical path)
CLOCK_SEGMENT_LATENCIES = 2.0  # k: shortest segment = k × the controller's latency (docs/sources.md#clock-latency)


@dataclass(frozen=True, slots=True)
class ClockLatency:
    """The clock controller's latency (s) a plan assumes and the shortest clock segment (s) it allows."""

    latency_s: float
    segment_latencies: float = CLOCK_SEGMENT_LATENCIES

    def __post_init__(self) -> None:
        if not (self.latency_s >= 0.0 and np.isfinite(self.latency_s)) or not self.segment_latencies >= 1.0:
            raise ConfigError(
                f"clock latency {self.latency_s:g} s must be >= 0 and the segment floor "
                f"{self.segment_latencies:g} latencies >= 1."
            )

    @property
    def min_segment_s(self) -> float:
        """Shortest clock segment (s, busy time) a plan may hold."""
        return self.latency_s * self.segment_latencies


def cyclic_runs(clocks: Sequence[int]) -> list[tuple[int, int]]:
    """(start position, length) of each maximal run of equal values in `clocks`, taken cyclically, in
    order from the first position where the value changes; [(0, n)] when all are equal."""
    n = len(clocks)
    first = next((i for i in range(n) if clocks[i] != clocks[i - 1]), None)
    if first is None:
        return [(0, n)] if n else []
    runs: list[tuple[int, int]] = []
    pos, covered = first, 0
    while covered < n:
        length = 1
        while length < n - covered and clocks[(pos + length) % n] == clocks[pos % n]:
            length += 1
        runs.append((pos % n, length))
        covered += length
        pos += length
    return runs


def segment_lengths_s(clocks: Sequence[int], busy_s: Sequence[float]) -> list[tuple[int, float]]:
    """(clock MHz, busy time s) of every cyclic clock segment of one rank's instruction sequence."""
    n = len(clocks)
    return [(int(clocks[s]), float(sum(busy_s[(s + j) % n] for j in range(m)))) for s, m in cyclic_runs(clocks)]


def short_segment_share(clocks: Sequence[int], busy_s: Sequence[float], threshold_s: float) -> float:
    """Share (0..1) of one rank's busy time that lies in clock segments shorter than `threshold_s` (s); a rank
    at one clock never changes it (its one segment lasts across iterations): 0."""
    segs = segment_lengths_s(clocks, busy_s)
    total = sum(b for _, b in segs)
    return 0.0 if total <= 0 or len(segs) < 2 else sum(b for _, b in segs if b < threshold_s) / total


class _Options:
    """Per-node option lookups by clock (nodes sharing one options object share the tables)."""

    def __init__(self, node_opts: Sequence[Any]) -> None:
        self.opts = node_opts
        self._by_clock: dict[int, dict[int, np.ndarray]] = {}

    def time_s(self, i: int, k: int) -> float:
        return float(self.opts[i].time_s[k])

    def energy_j(self, i: int, k: int) -> float:
        return float(self.opts[i].energy_j[k])

    def clock(self, i: int, k: int) -> int:
        return int(self.opts[i].clock_mhz[k])

    def clocks(self, i: int) -> dict[int, np.ndarray]:
        """Option indices of node i by clock (MHz)."""
        o = self.opts[i]
        table = self._by_clock.get(id(o))
        if table is None:
            c = np.asarray(o.clock_mhz, dtype=np.int64)
            table = {int(f): np.flatnonzero(c == f) for f in np.unique(c)}
            self._by_clock[id(o)] = table
        return table

    def at(self, i: int, k_ref: int, mhz: int, nearest: bool = False) -> int:
        """Node i's option at `mhz` nearest in time to its option `k_ref`; with `nearest`, at the nearest clock
        it has (ties: the higher) when it has none at `mhz`."""
        table = self.clocks(i)
        ks = table.get(mhz)
        if ks is None:
            if not nearest:
                raise KeyError(mhz)
            ks = table[min(table, key=lambda f: (abs(f - mhz), -f))]
        t = np.asarray(self.opts[i].time_s, dtype=float)
        return int(ks[np.argmin(np.abs(t[ks] - t[k_ref]))])


def _merge_rank(
    seq: Sequence[int], look: _Options, ref: np.ndarray, choice: np.ndarray, min_s: float, slack_s: np.ndarray
) -> None:
    """Merge rank `seq`'s short segments in place in `choice` (`ref`: the solver's choice, the reference;
    `slack_s`: how much later each node may end without delaying the iteration, in the reference plan)."""
    n = len(seq)
    while True:
        clocks = [look.clock(i, int(choice[i])) for i in seq]
        runs = [[(s + j) % n for j in range(m)] for s, m in cyclic_runs(clocks)]
        if len(runs) < 2:
            return
        lengths = [sum(look.time_s(seq[p], int(choice[seq[p]])) for p in r) for r in runs]
        r = int(np.argmin(lengths))
        if lengths[r] >= min_s:
            return
        best: tuple[tuple[bool, float, float], list[int], list[int]] | None = None
        for nb in sorted({(r - 1) % len(runs), (r + 1) % len(runs)}):
            after = nb == (r + 1) % len(runs)
            members = [seq[p] for p in (runs[r] + runs[nb] if after else runs[nb] + runs[r])]
            lo, hi = sorted((clocks[runs[r][0]], clocks[runs[nb][0]]))
            common = set.intersection(*(set(look.clocks(i)) for i in members))
            cands = sorted(f for f in common if lo <= f <= hi) or sorted(f for f in common if f > hi)[:1]
            t_ref = np.array([look.time_s(i, int(ref[i])) for i in members])
            slack = slack_s[members]
            for f in cands:
                ks = [look.at(i, int(ref[i]), f) for i in members]
                t = np.array([look.time_s(i, k) for i, k in zip(members, ks)])
                late = float(np.max(np.cumsum(t - t_ref) - slack))  # > 0: the iteration ends later
                energy = sum(look.energy_j(i, k) for i, k in zip(members, ks))
                key = (late > _SLACK_TOL_S, max(late, 0.0), energy)
                if best is None or key < best[0]:
                    best = (key, members, ks)
        if best is None:
            raise PlanError(
                f"no SM clock is an option of every instruction of a {lengths[r] * 1e3:.3g} ms clock "
                f"segment and its neighbour (rank of {n} instructions); plan with --freqs that "
                "every instruction can run at"
            )
        for i, k in zip(best[1], best[2]):
            choice[i] = k


def merge_short_segments(
    dag: PipelineDAG, node_opts: Sequence[Any], choice: np.ndarray, min_segment_s: float
) -> np.ndarray:
    """A copy of `choice` in which every rank's cyclic clock segments last at least `min_segment_s` (s of busy
    time), or the rank runs one clock (see the module doc)."""
    out = np.array(choice, dtype=np.int64, copy=True)
    if min_segment_s <= 0:
        return out
    look = _Options(node_opts)
    ref = np.asarray(choice, dtype=np.int64)
    dur = np.array([look.time_s(i, int(k)) for i, k in enumerate(ref)])
    _start, end = earliest_times(dag, dur)
    slack = latest_finish(dag, dur, iteration_time(dag, end)) - end
    for seq in dag.rank_orders:
        _merge_rank(seq, look, ref, out, min_segment_s, slack)
    return out


def lagged_costs(
    dag: PipelineDAG, node_opts: Sequence[Any], choice: np.ndarray, latency_s: float
) -> tuple[np.ndarray, np.ndarray]:
    """Duration (s) and energy (J, one GPU) of every node of `choice` with the lag of each clock change."""
    look = _Options(node_opts)
    ch = np.asarray(choice, dtype=np.int64)
    dur = np.array([look.time_s(i, int(k)) for i, k in enumerate(ch)])
    en = np.array([look.energy_j(i, int(k)) for i, k in enumerate(ch)])
    if latency_s <= 0:
        return dur, en
    for seq in dag.rank_orders:
        n = len(seq)
        clocks = [look.clock(i, int(ch[i])) for i in seq]
        runs = cyclic_runs(clocks)
        if len(runs) < 2:
            continue
        for start, length in runs:
            before = clocks[(start - 1) % n]
            left = latency_s
            for j in range(length):
                if left <= 0:
                    break
                i = seq[(start + j) % n]
                k_old = look.at(i, int(ch[i]), before, nearest=True)
                t_old, e_old = look.time_s(i, k_old), look.energy_j(i, k_old)
                if left >= t_old:
                    dur[i], en[i] = t_old, e_old
                    left -= t_old
                else:
                    share = left / t_old  # of the instruction's work, done at the previous clock
                    dur[i] = left + (1.0 - share) * dur[i]
                    en[i] = share * e_old + (1.0 - share) * en[i]
                    left = 0.0
    return dur, en


def _ahead_max(clocks: list[int], busy_s: list[float], latency_s: float) -> list[int]:
    """Each position's clock raised to the highest clock that begins within `latency_s` of busy time after it
    (cyclic)."""
    n = len(clocks)
    issued = list(clocks)
    for p in range(n):
        ahead = 0.0
        for step in range(1, n):
            if ahead >= latency_s:
                break
            q = (p + step) % n
            issued[p] = max(issued[p], clocks[q])
            ahead += busy_s[q]
    return issued


def raise_ahead(dag: PipelineDAG, node_opts: Sequence[Any], choice: np.ndarray, latency_s: float) -> np.ndarray:
    """A copy of `choice` in which every raise of the clock is requested one latency ahead (see the module doc)."""
    out = np.array(choice, dtype=np.int64, copy=True)
    if latency_s <= 0:
        return out
    look = _Options(node_opts)
    for seq in dag.rank_orders:
        n = len(seq)
        clocks = [look.clock(i, int(out[i])) for i in seq]
        if len(set(clocks)) < 2:
            continue
        # busy time at each instruction's fastest option: the run can only be slower, so a change is in force
        # no later than predicted (waits between instructions only add to the margin)
        fastest = [float(np.min(look.opts[i].time_s)) for i in seq]
        wanted = list(clocks)
        while True:
            issued = _ahead_max(wanted, fastest, latency_s)
            runs = cyclic_runs(issued)
            # a segment left under one latency before a higher one is raised whole (and the filter run again), so
            # no change is requested within one latency of the one before: none goes stale or late
            short = next(
                (
                    (s, m, issued[runs[(r + 1) % len(runs)][0]])
                    for r, (s, m) in enumerate(runs)
                    if len(runs) > 1
                    and issued[runs[(r + 1) % len(runs)][0]] > issued[s]
                    and sum(fastest[(s + j) % n] for j in range(m)) < latency_s
                ),
                None,
            )
            if short is None:
                break
            s, m, up = short
            for j in range(m):
                wanted[(s + j) % n] = up
        for p, i in enumerate(seq):
            if issued[p] != clocks[p]:
                out[i] = look.at(i, int(out[i]), issued[p], nearest=True)
    return out


def simulate_many(
    dag: PipelineDAG, dur_s: np.ndarray, energy_j: np.ndarray, p_blocked_w: float, gpus_per_stage: int
) -> tuple[np.ndarray, np.ndarray]:
    """Iteration time (s) and energy (J, all GPUs) of plans given per node durations and energies (P, n)."""
    _start, end = earliest_times(dag, dur_s)
    t = iteration_time(dag, end)
    onehot = np.zeros((dag.n, dag.pp))
    onehot[np.arange(dag.n), dag.stage] = 1.0
    busy = dur_s @ onehot
    e = iteration_energy_j(energy_j.sum(axis=-1), busy.sum(axis=-1), t, p_blocked_w, gpus_per_stage, ranks=dag.pp)
    return np.asarray(t, float), np.asarray(e, float)


def latency_aware_plans(
    dag: PipelineDAG,
    node_opts: Sequence[Any],
    plans: Sequence[Any],
    p_blocked_w: float,
    gpus_per_stage: int,
    latency: ClockLatency,
) -> list[Any]:
    """Every plan of `plans` (SolvedPlan) with its short clock segments merged, as is and with its raises
    requested ahead, re-simulated with the lag; choices met twice are kept once (the caller's Pareto filter
    picks between the two forms)."""
    from kareus_megatron.search.solver import SolvedPlan

    seen: set[bytes] = set()
    choices, durs, ens = [], [], []
    for p in plans:
        merged = merge_short_segments(dag, node_opts, p.choice, latency.min_segment_s)
        for ch in (merged, raise_ahead(dag, node_opts, merged, latency.latency_s)):
            key = ch.tobytes()
            if key in seen:
                continue
            seen.add(key)
            dur, en = lagged_costs(dag, node_opts, ch, latency.latency_s)
            choices.append(ch)
            durs.append(dur)
            ens.append(en)
    if not choices:
        return []
    t, e = simulate_many(dag, np.array(durs), np.array(ens), p_blocked_w, gpus_per_stage)
    return [SolvedPlan(ch, float(ti), float(ei)) for ch, ti, ei in zip(choices, t, e)]

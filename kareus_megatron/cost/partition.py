"""Time (s) and energy (J) of one nanobatch partition: a compute segment beside a pending collective.

Terms. A *partition* is one nanobatch's compute segment (ops ``0..n-1`` in execution order) running
beside the other nanobatch's pending collective. Its knobs are the *comm SMs* ``s`` given to the
collective kernel and the *launch slot* ``k``: the collective is issued just before compute op ``k``.
Everything is evaluated at once over a knob grid with numpy; no Python loop per configuration.

Phases of a partition with slot ``k`` (the model, one GPU):

1. ops ``i < k`` run alone on all SMs: time ``a_i``, power ``pa_i``;
2. from op ``k`` on, compute runs on (SMs − s) beside the collective. Op ``i`` then takes ``w_i`` wall
   seconds and draws ``po_i`` W while the collective progresses at ``rho_i`` (seconds of its stand-alone
   time per wall second, ≤ 1: both share HBM bandwidth). When the collective finishes part-way through an
   op, the rest of that op runs alone again (time and energy pro rata);
3. if compute ends first, the rest of the collective is *exposed*: it runs alone at power ``pc``.

Power integrates over the phases; every phase power includes the static power, so static energy is
charged over the partition's whole wall time. HBM sharing: when the op's bandwidth demand ``d`` (bytes/s
at the reduced SM count) plus the collective's ``D`` exceed the peak ``B``, both slow down by the same
factor ``r = (d + D) / B`` (proportional sharing; ``r ≤ 2`` since ``d, D ≤ B``), so ``w = b r`` and
``rho = 1 / r`` where ``b`` is the op's time on (SMs − s) without contention.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class PhaseArrays:
    """Per-op inputs of the partition simulation; every array broadcasts to (n_ops, *grid).

    a_s: time alone on all SMs (s); pa_w: its power (W); w_s: wall time beside the collective (s);
    rho: collective progress per wall second while beside op i (0..1]; po_w: power beside it (W);
    coll_s: the collective's stand-alone time, shape (*grid) (s); pc_w: its stand-alone power (W).
    """

    a_s: np.ndarray
    pa_w: np.ndarray
    w_s: np.ndarray
    rho: np.ndarray
    po_w: np.ndarray
    coll_s: np.ndarray
    pc_w: np.ndarray


def simulate_overlap(p: PhaseArrays) -> tuple[np.ndarray, np.ndarray]:
    """Time (s) and energy (J) of the partition for every launch slot: arrays of shape (n_ops, *grid).

    Axis 0 of the result is the launch slot k (collective issued before op k); the grid axes are those
    the inputs broadcast to (e.g. clock × comm SMs).
    """
    a, pa, w, rho, po = np.broadcast_arrays(p.a_s, p.pa_w, p.w_s, p.rho, p.po_w)
    n = a.shape[0]
    grid = np.broadcast_shapes(a.shape[1:], np.shape(p.coll_s), np.shape(p.pc_w))
    a, pa, w, rho, po = (np.broadcast_to(x, (n, *grid)) for x in (a, pa, w, rho, po))
    coll = np.broadcast_to(np.asarray(p.coll_s, dtype=float), grid)
    pc = np.broadcast_to(np.asarray(p.pc_w, dtype=float), grid)

    # after[k, i]: op i runs at or after the launch slot k (shape (n_slots, n_ops, 1, ...)).
    after = (np.arange(n)[None, :] >= np.arange(n)[:, None]).reshape(n, n, *([1] * len(grid)))
    prog = w * rho  # collective progress (s of stand-alone time) if op i runs beside it throughout
    prog_k = np.where(after, prog[None], 0.0)
    done_after = np.cumsum(prog_k, axis=1)  # progress by the end of op i
    left_before = np.maximum(coll[None, None] - (done_after - prog_k), 0.0)  # remaining at op i start
    with np.errstate(divide="ignore", invalid="ignore"):
        frac = np.where(prog_k > 0.0, np.minimum(left_before / np.where(prog_k > 0, prog_k, 1.0), 1.0), 0.0)
    frac = np.where(after, frac, 0.0)  # fraction of op i spent beside the collective
    # An op of zero progress (zero time) contributes nothing either way.
    op_time = frac * w[None] + (1.0 - frac) * a[None]
    op_energy = frac * w[None] * po[None] + (1.0 - frac) * a[None] * pa[None]
    exposed = np.maximum(coll[None] - done_after[:, -1], 0.0)
    time_s = op_time.sum(axis=1) + exposed
    energy_j = op_energy.sum(axis=1) + exposed * pc[None]
    return time_s, energy_j


def contention(
    demand_op_bytes_per_s: np.ndarray, demand_coll_bytes_per_s: np.ndarray, hbm_bytes_per_s: float
) -> np.ndarray:
    """Slow-down factor r ≥ 1 of an op and a collective sharing HBM: max(1, (d + D) / B), with d, D ≤ B."""
    d = np.minimum(np.asarray(demand_op_bytes_per_s, dtype=float), hbm_bytes_per_s)
    big_d = np.minimum(np.asarray(demand_coll_bytes_per_s, dtype=float), hbm_bytes_per_s)
    return np.maximum(1.0, (d + big_d) / hbm_bytes_per_s)


def sequential_time_energy(a_s: np.ndarray, pa_w: np.ndarray, coll_s: np.ndarray, pc_w: np.ndarray):
    """Time (s) and energy (J) of compute ops then the whole collective, no overlap: sums over axis 0."""
    a_s, pa_w = np.asarray(a_s, float), np.asarray(pa_w, float)
    return a_s.sum(axis=0) + coll_s, (a_s * pa_w).sum(axis=0) + coll_s * pc_w

"""LP relaxation and exact MILP of the deadline-constrained pipeline problem (HiGHS).

Both minimise the iteration energy over one GPU per rank, ``sum_i c_i + p_blocked * pp * T``, subject to
the DAG's precedence constraints and ``T <= deadline``; ``c_i`` is node i's effective cost (see
solver_options). Start times S_i are variables, so waiting is free except through T.

- LP: node i's duration is continuous between its fastest and slowest useful option and costs the
  piecewise-linear convex hull of its options; exact for that convex relaxation. Solved with HiGHS through
  the ``highspy`` package: the model is passed once and re-solved from its last basis when only the
  deadline changes (a *warm* solve, about 7x faster than a cold one; docs/sources.md#highs). Without
  highspy it falls back to cold ``scipy.optimize.linprog`` solves and says so once (logging.warning).
- MILP: node i picks exactly one useful option (binary z_ik); exact for the discrete problem, used for
  tiny DAGs (its frontier equals exhaustive enumeration in the tests). Solved with scipy.optimize.milp.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from itertools import repeat
from types import ModuleType
from typing import Any

import numpy as np
import scipy.sparse as sp
from scipy.optimize import Bounds, LinearConstraint, linprog, milp

from kareus_megatron.search.pipeline import PipelineDAG
from kareus_megatron.search.solver_options import PreparedOptions


def _import_highspy() -> ModuleType | None:
    """The highspy module, or None where it is not installed."""
    try:
        import highspy
    except ImportError:  # a missing optional speed-up: HullLP says so once and solves cold
        return None
    return highspy


highspy = _import_highspy()

log = logging.getLogger(__name__)
BACKEND_HIGHSPY = "highspy"  # warm-started re-solves through highspy.Highs
BACKEND_LINPROG = "linprog"  # cold scipy.optimize.linprog solve per deadline
HIGHSPY_MISSING = (
    "highspy is not installed: the pipeline LP is solved cold with scipy.optimize.linprog for every "
    "deadline (about 7x slower). Install it with: pip install highspy==1.16.0"
)
_warned_missing = False


def _warn_missing_once() -> None:
    global _warned_missing
    if not _warned_missing:
        _warned_missing = True
        log.warning(HIGHSPY_MISSING)


def _quiet_highs(hs: Any) -> Any:
    """A silent highspy.Highs.

    Its constructor prints HiGHS's two-line banner on the C-level stdout before any option can be set
    (ERGO-Code/HiGHS issues #1932 and #2749: the banner cannot be switched off on its own), so file
    descriptor 1 points at os.devnull while it runs; output_flag then silences everything else.
    """
    try:
        sys.stdout.flush()
        saved = os.dup(1)
    except (OSError, ValueError):  # no usable stdout: nothing to protect
        saved = None
    if saved is not None:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
    try:
        h = hs.Highs()
    finally:
        if saved is not None:
            os.dup2(saved, 1)
            os.close(saved)
            os.close(null)
    h.setOptionValue("output_flag", False)
    return h


def _precedence_rows(dag: PipelineDAG, t_col: int) -> Iterator[tuple[int, int, float]]:
    """(u, w, lag) of each precedence row ``S_u + duration_u - X_w <= -lag``, in row order: X_w = S_w for
    every DAG edge u -> w, then X_w = T (column `t_col`) for every rank's last node u (lag = its end lag)."""
    yield from zip(dag.src, dag.dst, dag.lag_s)
    yield from zip(dag.last_nodes, repeat(t_col), dag.end_lag_s)


class HullLP:
    """LP relaxation on the options' convex hulls.

    Node i's duration is its fastest time plus one variable per hull segment k, 0 <= x_ik <= segment
    length, costing the segment's slope per second; slopes increase along the hull (convexity), so the
    LP fills the steepest segments first and no hull rows are needed. Variables [S (n), x (segments), T].
    """

    def __init__(self, dag: PipelineDAG, prep: PreparedOptions, p_blocked_w: float) -> None:
        n = dag.n
        self.n = n
        seg_len, seg_slope, seg_node = [], [], []
        for i in range(n):
            h = prep.hull[i]
            t = prep.time_s[i, h]
            c = prep.cost_j[i, h]
            if h.size > 1:
                seg_len.append(np.diff(t))
                seg_slope.append(np.diff(c) / np.diff(t))
                seg_node.append(np.full(h.size - 1, i))
        self.seg_len = np.concatenate(seg_len) if seg_len else np.zeros(0)
        slope = np.concatenate(seg_slope) if seg_slope else np.zeros(0)
        self.seg_node = np.concatenate(seg_node) if seg_node else np.zeros(0, dtype=np.int64)
        ns = self.seg_len.size
        self.ns = ns
        segs_of: list[list[int]] = [[] for _ in range(n)]
        for k, i in enumerate(self.seg_node):
            segs_of[i].append(n + k)
        t0 = prep.fastest
        rows, cols, vals, rhs = [], [], [], []
        r = 0
        for u, w, lag in _precedence_rows(dag, n + ns):  # S_u + t0_u + sum_k x_uk - (S_w or T) <= -lag
            su = segs_of[u]
            rows += [r] * (len(su) + 2)
            cols += [u, w] + su
            vals += [1.0, -1.0] + [1.0] * len(su)
            rhs.append(-lag - t0[u])
            r += 1
        self.A = sp.csr_matrix((vals, (rows, cols)), shape=(r, n + ns + 1))
        self.b = np.array(rhs)
        self.c = np.r_[np.zeros(n), slope, p_blocked_w * dag.pp]
        self.lo = np.zeros(n + ns + 1)
        self.hi = np.r_[np.full(n, np.inf), self.seg_len, np.inf]
        self.t0 = t0
        hs = highspy  # the module this instance solves with (fixed at construction)
        self.backend = BACKEND_HIGHSPY if hs is not None else BACKEND_LINPROG
        self.solves = 0  # LP solves so far
        self.warm_solves = 0  # of which started from the previous solve's basis (highspy only)
        self.simplex_iterations: list[int] = []  # per highspy solve: a warm re-solve needs few
        self.last_time_s = float("nan")  # iteration time T (s) of the last LP optimum
        # (highspy, a Highs holding this LP) when highspy is installed
        self._highs: tuple[ModuleType, Any] | None = (hs, self._passed_model(hs)) if hs is not None else None
        if hs is None:
            _warn_missing_once()

    def _passed_model(self, hs: ModuleType) -> Any:
        """A silent highspy.Highs holding this LP; only the deadline (T's upper bound) changes afterwards."""
        a = self.A.tocsc()
        lp = hs.HighsLp()
        lp.num_col_, lp.num_row_ = a.shape[1], a.shape[0]
        lp.col_cost_ = self.c
        lp.col_lower_ = self.lo
        lp.col_upper_ = self.hi  # np.inf is HiGHS's infinity (highspy.kHighsInf)
        lp.row_lower_ = np.full(a.shape[0], -hs.kHighsInf)
        lp.row_upper_ = self.b
        lp.a_matrix_.format_ = hs.MatrixFormat.kColwise
        lp.a_matrix_.num_col_, lp.a_matrix_.num_row_ = a.shape[1], a.shape[0]
        lp.a_matrix_.start_ = a.indptr
        lp.a_matrix_.index_ = a.indices
        lp.a_matrix_.value_ = a.data
        h = _quiet_highs(hs)
        status = h.passModel(lp)
        if status != hs.HighsStatus.kOk:
            raise RuntimeError(f"HiGHS refused the pipeline LP ({status}); this is a bug in HullLP")
        return h

    def _solve_x(self, deadline_s: float) -> np.ndarray | None:
        """LP optimum (all variables) with T <= deadline_s; None if infeasible."""
        self.solves += 1
        if self._highs is not None:
            hs, h = self._highs
            # HiGHS keeps the basis of the last solve and starts the next one from it (a bound change
            # keeps the model): every solve after the first is warm.
            if self.solves > 1:
                self.warm_solves += 1
            h.changeColBounds(self.n + self.ns, 0.0, float(deadline_s))
            h.run()
            self.simplex_iterations.append(int(h.getInfo().simplex_iteration_count))
            status = h.getModelStatus()
            if status == hs.HighsModelStatus.kOptimal:
                return np.asarray(h.getSolution().col_value)
            if status == hs.HighsModelStatus.kInfeasible:
                return None
            log.warning(
                "HiGHS ended the pipeline LP at deadline %.6g s with status %s; solving it cold with "
                "scipy.optimize.linprog instead",
                deadline_s,
                h.modelStatusToString(status),
            )
        hi = self.hi.copy()
        hi[-1] = deadline_s
        res = linprog(self.c, A_ub=self.A, b_ub=self.b, bounds=np.c_[self.lo, hi], method="highs")
        return res.x if res.status == 0 else None

    def solve(self, deadline_s: float) -> np.ndarray | None:
        """Optimal durations d (s) of the relaxation with T <= deadline_s; None if infeasible."""
        x = self._solve_x(deadline_s)
        if x is None:
            return None
        self.last_time_s = float(x[-1])
        seg = np.clip(x[self.n : self.n + self.ns], 0.0, self.seg_len)
        return self.t0 + np.bincount(self.seg_node, weights=seg, minlength=self.n)


class ExactMILP:
    """Discrete problem as a MILP; variables [S (n), z_ik (sum of useful options), T]."""

    def __init__(self, dag: PipelineDAG, prep: PreparedOptions, p_blocked_w: float) -> None:
        n = dag.n
        self.n = n
        self.prep = prep
        # Scale times so the fastest makespan is about 1: keeps HiGHS's absolute tolerances relative.
        self.t_scale = float(np.sum(prep.fastest)) / dag.pp or 1.0
        offs = np.r_[0, np.cumsum(prep.count)]
        self.offs = offs
        nz = int(offs[-1])
        nv = n + nz + 1
        tcol = n + nz
        ts = prep.time_s / self.t_scale
        rows, cols, vals = [], [], []
        lo, hi = [], []
        r = 0
        for i in range(n):  # sum_k z_ik = 1
            k = np.arange(prep.count[i])
            rows += [r] * k.size
            cols += list(n + offs[i] + k)
            vals += [1.0] * k.size
            lo.append(1.0)
            hi.append(1.0)
            r += 1

        def dur_terms(u: int) -> tuple[list[int], list[float]]:
            k = np.arange(prep.count[u])
            return list(n + offs[u] + k), list(ts[u, k])

        for u, w, lag in _precedence_rows(dag, tcol):  # S_u + dur_u - (S_w or T) <= -lag
            dc, dv = dur_terms(u)
            rows += [r] * (len(dc) + 2)
            cols += [u, w] + dc
            vals += [1.0, -1.0] + dv
            lo.append(-np.inf)
            hi.append(-lag / self.t_scale)
            r += 1
        self.constraint = LinearConstraint(sp.csr_matrix((vals, (rows, cols)), shape=(r, nv)), lo, hi)
        cost = np.concatenate([prep.cost_j[i, : prep.count[i]] for i in range(n)])
        self.c = np.r_[np.zeros(n), cost, p_blocked_w * dag.pp * self.t_scale]
        self.integrality = np.r_[np.zeros(n), np.ones(nz), 0]
        self.lo = np.r_[np.zeros(n), np.zeros(nz), 0.0]
        self.hi = np.r_[np.full(n, np.inf), np.ones(nz), np.inf]

    def solve(self, deadline_s: float, time_limit_s: float | None = None) -> np.ndarray | None:
        """Optimal useful-option position of every node with T <= deadline_s; None if infeasible.

        HiGHS (scipy 1.17) has, on these small models, called feasible deadlines infeasible with presolve
        off and returned a non-optimal plan with presolve on when the deadline sat within its tolerance of
        a plan's makespan; callers keep deadlines 1e-5 (relative) away from known makespans, and a
        failed or infeasible answer is retried with presolve switched.
        """
        for presolve in (True, False):
            hi = self.hi.copy()
            hi[-1] = deadline_s / self.t_scale
            opts: dict[str, Any] = {"mip_rel_gap": 1e-9, "presolve": presolve}
            if time_limit_s is not None:
                opts["time_limit"] = time_limit_s
            res = milp(
                self.c,
                constraints=self.constraint,
                integrality=self.integrality,
                bounds=Bounds(self.lo, hi),
                options=opts,
            )
            if res.x is not None:
                z = res.x[self.n : self.n + int(self.offs[-1])]
                return np.array(
                    [int(np.argmax(z[self.offs[i] : self.offs[i + 1]])) for i in range(self.n)], dtype=np.int64
                )
        return None

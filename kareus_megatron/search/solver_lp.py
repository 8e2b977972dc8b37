"""LP relaxation and exact MILP of the deadline-constrained pipeline problem (HiGHS through scipy).

Both minimise the iteration energy over one GPU per rank, ``sum_i c_i + p_blocked * pp * T``, subject to
the DAG's precedence constraints and ``T <= deadline``; ``c_i`` is node i's effective cost (see
solver_options). Start times S_i are variables, so waiting is free except through T.

- LP: node i's duration is continuous between its fastest and slowest useful option and costs the
  piecewise-linear convex hull of its options; exact for that convex relaxation.
- MILP: node i picks exactly one useful option (binary z_ik); exact for the discrete problem, used for
  tiny DAGs (its frontier equals exhaustive enumeration in the tests).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import scipy.sparse as sp
from scipy.optimize import Bounds, LinearConstraint, linprog, milp

from kareus_megatron.search.pipeline import PipelineDAG
from kareus_megatron.search.solver_options import PreparedOptions


# scipy ships HiGHS's Python binding privately; through it the LP is re-solved from its last basis when
# only the deadline changes (about 5x faster than a cold linprog). Absent or changed: cold linprog solves.
try:
    from scipy.optimize._highspy import _core as _highs_core
except ImportError:  # pragma: no cover
    _highs_core = None
_INF = 1e30  # HiGHS's infinity


def _make_highs() -> Any:
    h = _highs_core._Highs()
    h.setOptionValue("output_flag", False)
    return h


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
        segs_of = [[] for _ in range(n)]
        for k, i in enumerate(self.seg_node):
            segs_of[i].append(n + k)
        t0 = prep.fastest
        rows, cols, vals, rhs = [], [], [], []
        r = 0
        for u, v, lag in zip(dag.src, dag.dst, dag.lag_s):  # S_u + t0_u + sum_k x_uk - S_v <= -lag
            su = segs_of[u]
            rows += [r] * (len(su) + 2)
            cols += [u, v] + su
            vals += [1.0, -1.0] + [1.0] * len(su)
            rhs.append(-lag - t0[u])
            r += 1
        for l, lag in zip(dag.last_nodes, dag.end_lag_s):  # S_l + t0_l + sum_k x_lk - T <= -end_lag
            sl = segs_of[l]
            rows += [r] * (len(sl) + 2)
            cols += [l, n + ns] + sl
            vals += [1.0, -1.0] + [1.0] * len(sl)
            rhs.append(-lag - t0[l])
            r += 1
        self.A = sp.csr_matrix((vals, (rows, cols)), shape=(r, n + ns + 1))
        self.b = np.array(rhs)
        self.c = np.r_[np.zeros(n), slope, p_blocked_w * dag.pp]
        self.lo = np.zeros(n + ns + 1)
        self.hi = np.r_[np.full(n, np.inf), self.seg_len, np.inf]
        self.t0 = t0
        self._highs: Any = None
        self.last_time_s = float("nan")  # iteration time T (s) of the last LP optimum
        self._no_highs = _highs_core is None

    def _warm_solver(self) -> Any:
        """A HiGHS instance holding this LP, re-solved from its last basis (None if unavailable)."""
        if self._highs is not None or self._no_highs:
            return self._highs
        try:
            h = _make_highs()
            a = self.A.tocsc()
            model = _highs_core.HighsLp()
            model.num_col_, model.num_row_ = a.shape[1], a.shape[0]
            model.col_cost_ = self.c
            model.col_lower_ = self.lo
            model.col_upper_ = np.minimum(self.hi, _INF)
            model.row_lower_ = np.full(a.shape[0], -_INF)
            model.row_upper_ = self.b
            model.a_matrix_.format_ = _highs_core.MatrixFormat.kColwise
            model.a_matrix_.num_col_, model.a_matrix_.num_row_ = a.shape[1], a.shape[0]
            model.a_matrix_.start_ = a.indptr
            model.a_matrix_.index_ = a.indices
            model.a_matrix_.value_ = a.data
            if h.passModel(model) != _highs_core.HighsStatus.kOk:
                raise RuntimeError("passModel failed")
            self._highs = h
        except Exception:  # private scipy API moved: fall back to cold linprog solves
            self._no_highs = True
        return self._highs

    def solve(self, deadline_s: float) -> np.ndarray | None:
        """Optimal durations d (s) of the relaxation with T <= deadline_s; None if infeasible."""
        h = self._warm_solver()
        x = None
        if h is not None:
            h.changeColBounds(self.n + self.ns, 0.0, float(deadline_s))
            h.run()
            status = h.getModelStatus()
            if status == _highs_core.HighsModelStatus.kInfeasible:
                return None
            if status == _highs_core.HighsModelStatus.kOptimal:
                x = np.asarray(h.getSolution().col_value)
        if x is None:
            hi = self.hi.copy()
            hi[-1] = deadline_s
            res = linprog(self.c, A_ub=self.A, b_ub=self.b, bounds=np.c_[self.lo, hi], method="highs")
            if res.status != 0:
                return None
            x = res.x
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

        for u, v, lag in zip(dag.src, dag.dst, dag.lag_s):  # S_u + dur_u - S_v <= -lag
            dc, dv = dur_terms(u)
            rows += [r] * (len(dc) + 2)
            cols += [u, v] + dc
            vals += [1.0, -1.0] + dv
            lo.append(-np.inf)
            hi.append(-lag / self.t_scale)
            r += 1
        for l, lag in zip(dag.last_nodes, dag.end_lag_s):  # S_l + dur_l - T <= -end_lag
            dc, dv = dur_terms(l)
            rows += [r] * (len(dc) + 2)
            cols += [l, tcol] + dc
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
            res = milp(self.c, constraints=self.constraint, integrality=self.integrality,
                       bounds=Bounds(self.lo, hi), options=opts)
            if res.x is not None:
                z = res.x[self.n : self.n + int(self.offs[-1])]
                return np.array(
                    [int(np.argmax(z[self.offs[i] : self.offs[i + 1]])) for i in range(self.n)], dtype=np.int64
                )
        return None

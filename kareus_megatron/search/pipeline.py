"""The pipeline DAG: instructions as nodes, execution-order and data dependencies as edges.

A *node* is one instruction on one pipeline rank, keyed ``(stage, kind, microbatch, chunk)``. An edge
``u -> v`` with lag ``l`` (s) says v cannot start before u ends plus l. Edges:

- rank order: consecutive instructions of one rank (lag 0; a GPU runs one instruction at a time);
- forward data: the forward of microbatch m on virtual stage ``v = chunk * pp + stage`` needs the forward
  of m on virtual stage v - 1 (lag = P2P send/recv time when the two live on different ranks, which
  includes the wrap from the last rank's chunk c to rank 0's chunk c + 1);
- backward data: the backward of m on virtual stage v needs the backward on v + 1 (same lags), and the
  backward on the last virtual stage needs its own forward.

The iteration ends when every rank has finished its last instruction plus, with DP > 1, its gradient
reduction (``dp_reduce_time_s``, a fixed lag to the end of the iteration during which the GPU is not
computing). Every rank starts the iteration at time 0.

Nodes are grouped into topological *levels* (a node's level is one more than its deepest predecessor)
so that the simulator can evaluate many plans at once with array operations, level by level.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kareus_megatron.errors import ConfigError, InfeasibleConfigError
from kareus_megatron.search.schedules import InstrKey
from kareus_megatron.vocab import InstructionKind

NodeKey = tuple[int, InstructionKind, int, int]  # (stage, kind, microbatch, chunk)


@dataclass(frozen=True, eq=False)
class PipelineDAG:
    """Instruction DAG of one pipeline iteration; times in s.

    ``pred``/``pred_lag_s`` (n, k) list each node's predecessors padded with index ``n`` (a virtual
    node that ends at time 0) and ``succ``/``succ_lag_s`` likewise its successors (padding ``n`` starts at
    the end of the iteration). ``levels`` lists node indices by topological level.
    """

    keys: tuple[NodeKey, ...]
    stage: np.ndarray  # (n,) pipeline rank of each node
    rank_orders: tuple[tuple[int, ...], ...]  # node indices of each rank in execution order
    src: np.ndarray  # (e,) edge source node
    dst: np.ndarray  # (e,) edge destination node
    lag_s: np.ndarray  # (e,) lag (s) of each edge
    end_lag_s: np.ndarray  # (pp,) lag (s) from each rank's last node to the iteration end
    pred: np.ndarray
    pred_lag_s: np.ndarray
    succ: np.ndarray
    succ_lag_s: np.ndarray
    levels: tuple[np.ndarray, ...]
    topo: np.ndarray  # (n,) a topological order
    p2p_time_s: float
    dp_reduce_time_s: float
    index: dict[NodeKey, int] = field(repr=False)

    @property
    def n(self) -> int:
        """Number of instructions."""
        return len(self.keys)

    @property
    def pp(self) -> int:
        """Number of pipeline ranks."""
        return len(self.rank_orders)

    @property
    def last_nodes(self) -> np.ndarray:
        """(pp,) the last instruction of each rank."""
        return np.array([o[-1] for o in self.rank_orders], dtype=np.int64)


def _padded(lists: list[list[tuple[int, float]]], pad: int) -> tuple[np.ndarray, np.ndarray]:
    width = max(1, max((len(x) for x in lists), default=1))
    idx = np.full((len(lists), width), pad, dtype=np.int64)
    lag = np.zeros((len(lists), width))
    for i, x in enumerate(lists):
        for j, (k, lag_s) in enumerate(x):
            idx[i, j], lag[i, j] = k, lag_s
    return idx, lag


def build_dag(
    orders: Sequence[Sequence[InstrKey]], p2p_time_s: float = 0.0, dp_reduce_time_s: float | None = None
) -> PipelineDAG:
    """DAG of the per-rank instruction `orders` with P2P lag `p2p_time_s` (s) on cross-rank data edges."""
    pp = len(orders)
    if pp < 1:
        raise ConfigError("a pipeline needs at least one rank")
    if not (np.isfinite(p2p_time_s) and p2p_time_s >= 0):
        raise ConfigError(f"p2p_time_s={p2p_time_s!r} must be a finite number >= 0")
    red = 0.0 if dp_reduce_time_s is None else float(dp_reduce_time_s)
    if not (np.isfinite(red) and red >= 0):
        raise ConfigError(f"dp_reduce_time_s={dp_reduce_time_s!r} must be a finite number >= 0")
    keys: list[NodeKey] = []
    rank_orders = []
    for s, order in enumerate(orders):
        if not order:
            raise ConfigError(f"pipeline rank {s} has no instructions")
        idx = []
        for kind, mb, chunk in order:
            if kind not in ("forward", "backward"):
                raise ConfigError(f"instruction kind {kind!r} must be 'forward' or 'backward'")
            idx.append(len(keys))
            keys.append((s, kind, int(mb), int(chunk)))
        rank_orders.append(tuple(idx))
    index = {k: i for i, k in enumerate(keys)}
    if len(index) != len(keys):
        raise ConfigError("an instruction appears twice in the pipeline order")
    vp = 1 + max(k[3] for k in keys)
    n_virtual = vp * pp
    edges: list[tuple[int, int, float]] = []
    for rank_order in rank_orders:
        edges.extend((a, b, 0.0) for a, b in zip(rank_order[:-1], rank_order[1:]))
    for i, (s, kind, mb, c) in enumerate(keys):
        v = c * pp + s
        if kind == "forward" and v > 0:
            ps, pc = (v - 1) % pp, (v - 1) // pp
            j = index.get((ps, "forward", mb, pc))
            if j is None:
                raise ConfigError(f"forward of microbatch {mb} chunk {pc} missing on rank {ps}")
            edges.append((j, i, p2p_time_s if ps != s else 0.0))
        elif kind == "backward":
            if v == n_virtual - 1:
                j = index.get((s, "forward", mb, c))
                if j is None:
                    raise ConfigError(f"forward of microbatch {mb} chunk {c} missing on rank {s}")
                edges.append((j, i, 0.0))
            else:
                ns, nc = (v + 1) % pp, (v + 1) // pp
                j = index.get((ns, "backward", mb, nc))
                if j is None:
                    raise ConfigError(f"backward of microbatch {mb} chunk {nc} missing on rank {ns}")
                edges.append((j, i, p2p_time_s if ns != s else 0.0))
    # Drop duplicate edges (rank order that coincides with a data edge), keeping the larger lag.
    best: dict[tuple[int, int], float] = {}
    for a, b, lag_s in edges:
        best[(a, b)] = max(lag_s, best.get((a, b), 0.0))
    n = len(keys)
    src = np.array([a for a, _ in best], dtype=np.int64)
    dst = np.array([b for _, b in best], dtype=np.int64)
    lag = np.array(list(best.values()), dtype=float)
    preds: list[list[tuple[int, float]]] = [[] for _ in range(n)]
    succs: list[list[tuple[int, float]]] = [[] for _ in range(n)]
    for (a, b), lag_s in best.items():
        preds[b].append((a, lag_s))
        succs[a].append((b, lag_s))
    # Kahn's algorithm: topological order and levels; a leftover node means the order deadlocks.
    indeg = np.array([len(p) for p in preds])
    level = np.zeros(n, dtype=np.int64)
    ready = [i for i in range(n) if indeg[i] == 0]
    topo = []
    while ready:
        i = ready.pop()
        topo.append(i)
        for j, _ in succs[i]:
            level[j] = max(level[j], level[i] + 1)
            indeg[j] -= 1
            if indeg[j] == 0:
                ready.append(j)
    if len(topo) != n:
        stuck = keys[int(np.flatnonzero(indeg > 0)[0])]
        raise InfeasibleConfigError(
            f"the pipeline order deadlocks (instruction {stuck} waits on a cycle); check the schedule"
        )
    levels = tuple(np.flatnonzero(level == k) for k in range(int(level.max()) + 1))
    pred, pred_lag = _padded(preds, n)
    succ, succ_lag = _padded(succs, n)
    return PipelineDAG(
        keys=tuple(keys),
        stage=np.array([k[0] for k in keys], dtype=np.int64),
        rank_orders=tuple(rank_orders),
        src=src,
        dst=dst,
        lag_s=lag,
        end_lag_s=np.full(pp, red),
        pred=pred,
        pred_lag_s=pred_lag,
        succ=succ,
        succ_lag_s=succ_lag,
        levels=levels,
        topo=np.array(topo, dtype=np.int64),
        p2p_time_s=float(p2p_time_s),
        dp_reduce_time_s=red,
        index=index,
    )

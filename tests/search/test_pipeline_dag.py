"""Pipeline DAG construction: dependencies, P2P lags, chunk wrap, DP reduction, deadlock detection."""

from __future__ import annotations

import numpy as np
import pytest

from kareus_megatron.errors import ConfigError, InfeasibleConfigError
from kareus_megatron.search.pipeline import build_dag
from kareus_megatron.search.schedules import instruction_order


def _edges(dag):
    return {(dag.keys[a], dag.keys[b]): lag for a, b, lag in zip(dag.src, dag.dst, dag.lag_s)}


def test_1f1b_edges_and_lags():
    dag = build_dag(instruction_order("1f1b", 2, 2), p2p_time_s=0.01)
    e = _edges(dag)
    assert e[((0, "forward", 1, 0), (1, "forward", 1, 0))] == 0.01
    assert e[((1, "backward", 0, 0), (0, "backward", 0, 0))] == 0.01
    assert e[((1, "forward", 0, 0), (1, "backward", 0, 0))] == 0.0  # last stage: own forward, also rank order
    assert e[((0, "forward", 0, 0), (0, "forward", 1, 0))] == 0.0  # rank order
    assert ((0, "forward", 0, 0), (0, "backward", 0, 0)) not in e  # only the last stage links F -> B
    # rank orders: 4 per rank -> 3 edges each; data: 2 forward + 2 backward cross edges; F->B on stage 1
    # coincides with rank order for microbatches 0 and 1 (F0 B0 F1 B1).
    assert len(e) == 3 + 3 + 4
    assert dag.n == 8 and dag.pp == 2
    assert [dag.keys[i] for i in dag.last_nodes] == [(0, "backward", 1, 0), (1, "backward", 1, 0)]


def test_interleaved_chunk_wrap_edges():
    dag = build_dag(instruction_order("interleaved-1f1b", 2, 4, vp=2), p2p_time_s=0.5)
    e = _edges(dag)
    # virtual stage 1 (rank 1, chunk 0) -> virtual stage 2 (rank 0, chunk 1): the wrap
    assert e[((1, "forward", 3, 0), (0, "forward", 3, 1))] == 0.5
    assert e[((0, "backward", 3, 1), (1, "backward", 3, 0))] == 0.5
    # last virtual stage (rank 1, chunk 1): backward needs its own forward, no lag
    assert e[((1, "forward", 2, 1), (1, "backward", 2, 1))] == 0.0
    assert ((0, "forward", 2, 1), (0, "backward", 2, 1)) not in e


def test_single_rank_interleaving_has_no_p2p():
    orders = [[("forward", 0, 0), ("forward", 0, 1), ("backward", 0, 1), ("backward", 0, 0)]]
    dag = build_dag(orders, p2p_time_s=1.0)
    assert np.all(dag.lag_s == 0.0)


def test_dp_reduction_is_an_end_lag():
    dag = build_dag(instruction_order("1f1b", 3, 4), 0.0, dp_reduce_time_s=0.2)
    assert np.allclose(dag.end_lag_s, 0.2)
    assert dag.dp_reduce_time_s == 0.2


def test_levels_are_a_topological_partition():
    dag = build_dag(instruction_order("interleaved-1f1b", 4, 8, vp=2), 0.001)
    level = np.empty(dag.n, dtype=int)
    for k, lv in enumerate(dag.levels):
        level[lv] = k
    assert sorted(np.concatenate(dag.levels).tolist()) == list(range(dag.n))
    assert np.all(level[dag.src] < level[dag.dst])


def test_deadlocking_order_is_rejected():
    orders = instruction_order("1f1b", 2, 2)
    orders[1] = [("backward", 0, 0), ("forward", 0, 0), ("forward", 1, 0), ("backward", 1, 0)]
    with pytest.raises(InfeasibleConfigError, match="deadlock"):
        build_dag(orders)


def test_bad_inputs():
    with pytest.raises(ConfigError, match="p2p_time_s"):
        build_dag(instruction_order("1f1b", 2, 2), p2p_time_s=-1.0)
    with pytest.raises(ConfigError, match="dp_reduce_time_s"):
        build_dag(instruction_order("1f1b", 2, 2), dp_reduce_time_s=float("nan"))
    with pytest.raises(ConfigError, match="missing"):
        build_dag([[("forward", 0, 0), ("backward", 0, 0)], [("backward", 0, 0)]])
    with pytest.raises(ConfigError, match="twice"):
        build_dag([[("forward", 0, 0), ("forward", 0, 0), ("backward", 0, 0)]])

"""Iteration energy of a pipeline: the one formula the solver, the simulator and the report share.

Every GPU of a stage (``gpus_per_stage`` = tp * cp * dp of them) draws its instructions' energy while
it computes and the blocked power ``p_blocked_w`` (W) for the rest of the iteration (pipeline bubbles,
waiting for data, P2P, the gradient reduction, waiting for the slowest rank):

    E = gpus_per_stage * ( sum_i e_i  +  p_blocked_w * max(0, ranks * T - sum_i t_i) )

with e_i and t_i each instruction's energy (J, one GPU) and duration (s), T the iteration time (s) and
``ranks`` the pipeline ranks the sums run over (1 for one stage, pp for the whole pipeline). Idle time is
clamped at 0: a prediction whose instructions add up to more than T (a stage compared against a
shorter iteration) has no idle time rather than negative idle energy.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike


def idle_time_s(busy_s: ArrayLike, iteration_time_s: ArrayLike, ranks: int = 1) -> np.ndarray:
    """Blocked time (s, one GPU per rank, summed over `ranks` ranks): ranks * T - busy, at least 0."""
    return np.maximum(0.0, ranks * np.asarray(iteration_time_s, float) - np.asarray(busy_s, float))


def iteration_energy_j(
    busy_energy_j: ArrayLike,
    busy_s: ArrayLike,
    iteration_time_s: ArrayLike,
    p_blocked_w: float,
    gpus_per_stage: int = 1,
    ranks: int = 1,
) -> np.ndarray:
    """Iteration energy (J, all GPUs of the `ranks` stages) from the summed instruction energy (J, one GPU
    per rank), the summed instruction time (s) and the iteration time (s); arrays broadcast."""
    idle = idle_time_s(busy_s, iteration_time_s, ranks)
    return gpus_per_stage * (np.asarray(busy_energy_j, float) + p_blocked_w * idle)

"""Per-stage instruction predictions: time (s), energy (J), average power (W) at each SM clock (MHz)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kareus_megatron.cost.kernel import KernelModel
from kareus_megatron.workload.models import ModelSpec
from kareus_megatron.workload.parallel import ParallelConfig


@dataclass(frozen=True, slots=True)
class PredictRow:
    """One GPU of `stage` running one instruction of one microbatch at a locked clock."""

    stage: int
    instruction: str
    frequency_mhz: int
    time_s: float
    energy_j: float

    @property
    def avg_power_w(self) -> float:
        """Average power (W) over the instruction."""
        return self.energy_j / self.time_s

    def as_dict(self) -> dict[str, float | int | str]:
        """JSON row: stage, instruction, frequency_mhz, time_s, energy_j, avg_power_w."""
        return {
            "stage": self.stage,
            "instruction": self.instruction,
            "frequency_mhz": self.frequency_mhz,
            "time_s": self.time_s,
            "energy_j": self.energy_j,
            "avg_power_w": self.avg_power_w,
        }


def predict_rows(
    km: KernelModel, model: ModelSpec, par: ParallelConfig, sm_clocks_mhz: Sequence[int]
) -> list[PredictRow]:
    """Rows for every stage (first chunk summed over VP chunks), instruction and clock, Perseus order."""
    clocks = np.asarray(sm_clocks_mhz, dtype=float)
    rows: list[PredictRow] = []
    cache: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
    for stage in range(par.pp):
        costs = {}
        for phase in ("forward", "backward"):
            t = np.zeros_like(clocks)
            e = np.zeros_like(clocks)
            for chunk in range(par.vp):
                # stages with the same layer count and no embedding/output cost the same
                key = (
                    phase,
                    par.chunk_layers(stage, chunk),
                    par.is_first_chunk(stage, chunk),
                    par.is_last_chunk(stage, chunk),
                )
                if key not in cache:
                    cache[key] = km.instruction_cost(model, par, stage, phase, clocks, chunk)
                t += cache[key][0]
                e += cache[key][1]
            costs[phase] = (t, e)
        for i, f in enumerate(sm_clocks_mhz):
            for phase in ("forward", "backward"):
                t, e = costs[phase]
                rows.append(PredictRow(stage, phase, int(f), float(t[i]), float(e[i])))
    return rows

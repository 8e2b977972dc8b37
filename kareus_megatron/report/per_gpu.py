"""Per-GPU energy of a run: each rank's mean energy (J per iteration), median time (s) and share of the job's energy.

A rank's figures come from its own lines in the merged records (``ranks`` of runlog.merge_rank_dir), over
the iterations the run's figures use (RunSummary.records: complete ones after warm-up). Its *share* is
its energy summed over those iterations divided by the job's summed over them, so the shares add up to 1.
Its predicted energy is its stage's (against_plan.predicted_stage_energy_j) divided by the stage's GPUs
(tp * cp * dp). Which GPU a rank measured is RunLog.gpus (its header). A log in the single merged-file
layout holds no per-rank lines, so it has no per-GPU figures.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from kareus_megatron.report.summary import RunSummary


@dataclass(frozen=True, kw_only=True, slots=True)
class GpuFigures:
    """One rank's GPU over the run's used iterations: mean energy, median time per iteration (J, s), its share."""

    rank: int
    pp_rank: int | None
    gpu_index: int | None = None
    gpu_uuid: str | None = None
    gpu_name: str | None = None
    iterations: int  # used iterations this rank logged (all of them in a complete run)
    energy_j: float | None  # mean GPU energy per iteration (J): total over the iterations / their number
    time_s: float | None  # median iteration time on this rank (s)
    share: float | None  # of the job's energy over the same iterations (0..1)
    predicted_energy_j: float | None = None  # the plan's, per GPU of its stage (J per iteration)

    @property
    def error(self) -> float | None:
        """(measured - predicted) / predicted energy, or None."""
        if self.energy_j is None or not self.predicted_energy_j:
            return None
        return (self.energy_j - self.predicted_energy_j) / self.predicted_energy_j

    @property
    def label(self) -> str:
        """The GPU as the header names it: index, then the UUID's first 12 characters (or the name)."""
        parts = [str(self.gpu_index) if self.gpu_index is not None else "?"]
        if self.gpu_uuid:
            parts.append(self.gpu_uuid[:12])
        elif self.gpu_name:
            parts.append(self.gpu_name)
        return " ".join(parts)

    def as_json(self) -> dict[str, Any]:
        """The JSON object `kareus report --format json` prints for this GPU."""
        return {
            "rank": self.rank,
            "pp_rank": self.pp_rank,
            "gpu_index": self.gpu_index,
            "gpu_uuid": self.gpu_uuid,
            "gpu_name": self.gpu_name,
            "iterations": self.iterations,
            "measured_energy_j": self.energy_j,
            "measured_time_s": self.time_s,
            "share": self.share,
            "predicted_energy_j": self.predicted_energy_j,
        }


def per_gpu(
    summary: RunSummary, predicted_stage_energy_j: dict[int, float | None] | None = None, gpus_per_stage: int = 1
) -> list[GpuFigures]:
    """Every rank's GPU figures (see the module doc), by rank; [] when the log has no per-rank lines."""
    energy: dict[int, list[float]] = {}
    time: dict[int, list[float]] = {}
    total_j = 0.0
    for rec in summary.records:
        lines = rec.get("ranks")
        if not isinstance(lines, list):
            continue
        total_j += float(rec["energy_j"])
        for line in lines:
            energy.setdefault(line["rank"], []).append(float(line["energy_j"]))
            time.setdefault(line["rank"], []).append(float(line["time_s"]))
    gpus = summary.log.gpus
    out = []
    for rank in sorted(energy):
        ident = gpus.get(rank, {})
        stage = ident.get("pp_rank")
        pred = (predicted_stage_energy_j or {}).get(stage) if stage is not None else None
        es = energy[rank]
        out.append(
            GpuFigures(
                rank=rank,
                pp_rank=stage,
                gpu_index=ident.get("gpu_index"),
                gpu_uuid=ident.get("gpu_uuid"),
                gpu_name=ident.get("gpu_name"),
                iterations=len(es),
                energy_j=sum(es) / len(es),
                time_s=float(statistics.median(time[rank])),
                share=sum(es) / total_j if total_j > 0 else None,
                predicted_energy_j=None if pred is None else pred / max(1, gpus_per_stage),
            )
        )
    return out

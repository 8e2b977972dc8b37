"""Small plans and hand-written run logs for the tests of kareus_megatron.report (no runtime, no GPU)."""

from __future__ import annotations

import json
from pathlib import Path

from kareus_megatron.plan.schema import Plan
from kareus_megatron.search.schedules import instruction_order

GPU = "a100-sxm4-40gb"


def tiny_plan(
    method: str = "kareus",
    *,
    pp: int = 2,
    m: int = 2,
    tp: int = 2,
    gpu: str = GPU,
    p_blocked_w: float | None = None,
    time_s: float = 0.5,
    energy_j: float = 1000.0,
    instr_time_s: float = 0.05,
    instr_energy_j: float = 10.0,
) -> Plan:
    """A valid 1F1B plan of pp stages x tp GPUs, every instruction at 1410 MHz with the given predictions."""
    order = instruction_order("1f1b", pp, m)
    data = {
        "format": "kareus-plan/1",
        "method": method,
        "gpu": gpu,
        "parallel": dict(
            tp=tp,
            cp=1,
            pp=pp,
            vp=1,
            dp=1,
            micro_batch_size=1,
            seq_length=8,
            num_microbatches=m,
            layers_per_stage=[1] * pp,
            nodes=1,
            gpus_per_node=tp * pp,
        ),
        "predicted": {"iteration_time_s": time_s, "iteration_energy_j": energy_j},
        "stages": [
            {
                "pp_rank": r,
                "instructions": [
                    {
                        "kind": k,
                        "microbatch": mb,
                        "chunk": c,
                        "sm_clock_mhz": 1410,
                        "predicted_time_s": instr_time_s,
                        "predicted_energy_j": instr_energy_j,
                    }
                    for k, mb, c in order[r]
                ],
            }
            for r in range(pp)
        ],
    }
    if p_blocked_w is not None:
        data["p_blocked_w"] = p_blocked_w
    return Plan.model_validate(data)


def log_lines(
    rows: list[tuple[float | None, float | None]], *, header: bool = True, pp: int = 2, world: int = 4, gpu: str = GPU
) -> list[str]:
    """Run-log lines: a header, then one iteration per (time_s, energy_j); stage r gets energy/pp, time."""
    out = [json.dumps({"kind": "header", "world": world, "gpu": gpu, "backend": "simulated"})] if header else []
    for i, (t, e) in enumerate(rows):
        stages = [
            {"pp_rank": r, "time_s": t, "energy_j": None if e is None else e / pp, "gpus": world // pp}
            for r in range(pp)
        ]
        out.append(
            json.dumps(
                {
                    "kind": "iteration",
                    "iteration": i,
                    "time_s": t,
                    "energy_j": e,
                    "ranks_reporting": world,
                    "stages": stages,
                }
            )
        )
    return out


def write_log(path: Path, rows: list[tuple[float | None, float | None]], *, tail: str = "", **kw) -> Path:
    """Write a run log (see log_lines), then `tail` verbatim (e.g. a cut last line)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in log_lines(rows, **kw)) + tail)
    return path

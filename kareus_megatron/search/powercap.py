"""The power-cap baseline ``powercap``: one board power limit (W) for every GPU of the job, no clock locks.

This is the knob a user turns first: ``nvidia-smi -pl W`` (NVML ``nvmlDeviceSetPowerManagementLimit``),
and the one Zeus's power-limit optimizer searches per job (You, Chung and Chowdhury, "Zeus", NSDI '23;
Zeus docs, ``zeus.optimizer.power_limit.GlobalPowerLimitOptimizer``: it profiles the power limits of the
GPU's range during training and keeps one for the whole job). Under a cap the driver lowers the SM clock
until the board's power is at the cap; the GPU runs at the maximum clock otherwise.

Model, on the same machinery as the other methods: for each cap of a grid, the cost model runs with the
preset's board limit replaced by the cap (``cost/kernel.py`` already solves the clock a board limit
sustains, ``hardware.power.sustained_clock_mhz``), every instruction is requested at the maximum SM
clock with 1 nanobatch (Megatron's order), and the pipeline is simulated as for every other plan
(``search.simulate``). Each cap gives one plan; the method's frontier is the Pareto set over caps. The
cap acts per kernel (each op sustains its own clock), an approximation of the driver's capping loop,
which averages power over a short window.

Grid: ``DEFAULT_CAPS`` caps, evenly from the lowest useful one to the board limit, rounded to whole W. The
lowest useful cap is the highest power any op draws at the minimum SM clock (below it the GPU could not
meet the cap by clocking down), but no lower than the lowest limit the driver accepts
(``hardware.device.base.min_power_limit_w``: the preset's NVML minimum, or a quarter of the board limit where
the preset has none); a real GPU's range is NVML's power-limit constraints, which
the runtime checks before it sets a limit.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from kareus_megatron.cost.kernel import KernelModel
from kareus_megatron.cost.overlap import OverlapCost
from kareus_megatron.errors import ConfigError
from kareus_megatron.hardware.device.base import min_power_limit_w
from kareus_megatron.search.options import InstructionOptions, OptionKey, instruction_phases
from kareus_megatron.search.solver import SolvedPlan
from kareus_megatron.workload.opgraph import layer_ops, stage_extra_ops

DEFAULT_CAPS = 16  # power limits on the grid (the board limit included)


@dataclass(frozen=True, eq=False)
class PowerCapPlan(SolvedPlan):
    """One cap's plan: every node at option `choice` (the cap's index), and the power limit (W)."""

    power_limit_w: float


def capped_kernel(kernel: KernelModel, power_limit_w: float) -> KernelModel:
    """The cost model of `kernel` with the board power limit set to `power_limit_w` (W)."""
    return KernelModel.from_params(replace(kernel.gpu, power_limit_w=float(power_limit_w)), kernel.params)


def _instruction_ops(model: Any, par: Any, stage: int, chunk: int, kind: str) -> tuple[list[Any], list[Any]]:
    """(layer ops per layer phase, stage extra ops) of one instruction with 1 nanobatch."""
    phases = [layer_ops(model, par, ph, 1) for ph in instruction_phases(par, kind)]
    extras = [op for op in stage_extra_ops(model, par, stage, kind, 1, chunk=chunk) if op.kind != "p2p"]
    return phases, extras


def cap_grid_w(kernel: KernelModel, model: Any, par: Any, n: int = DEFAULT_CAPS) -> np.ndarray:
    """Power limits (W, ascending, whole W) from the lowest useful cap to the board limit."""
    if n < 1:
        raise ConfigError(f"need at least one power limit on the grid, not {n}")
    g = kernel.gpu
    ops: list[Any] = []
    for stage in range(par.pp):
        for chunk in range(par.vp):
            for kind in ("forward", "backward"):
                phases, extras = _instruction_ops(model, par, stage, chunk, kind)
                ops += [op for ph in phases for op in ph] + extras
    lo = float(np.max(kernel.op_profile(ops, float(g.min_sm_clock_mhz), precision=par.precision).power_w))
    hi = float(g.power_limit_w)
    lo = min(np.ceil(max(lo, min_power_limit_w(g))), hi)
    return np.unique(np.rint(np.linspace(lo, hi, n)))


def _costs(
    kernel: KernelModel, model: Any, par: Any, caps_w: np.ndarray
) -> dict[OptionKey, tuple[np.ndarray, np.ndarray]]:
    """(time s, energy J) per cap of every instruction on one GPU requested at the max clock, 1 nanobatch.

    Every cap at once: the cost model's board limit is the array of caps (W), one per element of the clock axis;
    the power model is elementwise (hardware/power.py), so each element is that cap's cost.
    """
    caps = np.asarray(caps_w, dtype=float)
    limits: dict[str, Any] = {"power_limit_w": caps}  # a GPUSpec field is a float; here it broadcasts
    capped = KernelModel.from_params(replace(kernel.gpu, **limits), kernel.params)
    adapter = OverlapCost(capped, precision=par.precision)
    clocks = np.full(caps.shape, float(kernel.gpu.max_sm_clock_mhz))
    phases = {ph for kind in ("forward", "backward") for ph in instruction_phases(par, kind)}
    per_phase = {ph: adapter.alone(layer_ops(model, par, ph, 1), clocks) for ph in sorted(phases)}
    out: dict[OptionKey, tuple[np.ndarray, np.ndarray]] = {}
    for stage in range(par.pp):
        for chunk in range(par.vp):
            layers = par.chunk_layers(stage, chunk)
            for kind in ("forward", "backward"):
                _, extras = _instruction_ops(model, par, stage, chunk, kind)
                t, e = adapter.alone(extras, clocks)
                for ph in instruction_phases(par, kind):
                    t = t + layers * per_phase[ph][0]
                    e = e + layers * per_phase[ph][1]
                out[(stage, chunk, kind)] = (np.asarray(t, float), np.asarray(e, float))
    return out


def powercap_options(
    kernel: KernelModel, model: Any, par: Any, caps_w: np.ndarray
) -> dict[OptionKey, InstructionOptions]:
    """Per instruction, one option per cap (index k = caps_w[k]): time (s), energy (J), clock = max MHz.

    Unlike the other methods' options these are not a Pareto set of one instruction: option k of every
    instruction belongs to the same cap, and a plan runs all of them at one k.
    """
    fmax = int(kernel.gpu.max_sm_clock_mhz)
    n = len(caps_w)
    return {
        key: InstructionOptions(
            time_s=t,
            energy_j=e,
            clock_mhz=np.full(n, fmax, dtype=np.int64),
            nanobatches=np.ones(n, dtype=np.int64),
            partitions=[{} for _ in range(n)],
        )
        for key, (t, e) in _costs(kernel, model, par, caps_w).items()
    }


def powercap_plans(
    dag: Any, node_opts: list[InstructionOptions], caps_w: np.ndarray, p_blocked_w: float, gpus_per_stage: int
) -> list[PowerCapPlan]:
    """One simulated plan per cap (all nodes at that cap's option), highest cap first; time s, energy J of all
    GPUs. Caps that change nothing (the job never draws that much) give the same point as the board limit."""
    from kareus_megatron.search.simulate import simulate

    plans = []
    for k in np.argsort(-np.asarray(caps_w), kind="stable"):  # highest cap first: ties keep the milder cap
        cap = caps_w[k]
        dur = np.array([float(o.time_s[k]) for o in node_opts])
        en = np.array([float(o.energy_j[k]) for o in node_opts])
        sim = simulate(dag, dur, en, p_blocked_w, gpus_per_stage)
        plans.append(
            PowerCapPlan(
                choice=np.full(dag.n, k, dtype=np.int64),
                time_s=float(sim.time_s),
                energy_j=float(sim.energy_j),
                power_limit_w=float(cap),
            )
        )
    return plans

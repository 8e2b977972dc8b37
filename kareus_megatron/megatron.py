"""Python API for code that calls megatron-core's schedule itself (NeMo, Megatron-Bridge, custom loops).

    import kareus_megatron.megatron as kareus
    session = kareus.install("plan.json", log_path="kareus-run")   # a directory: rank-NNNNN.jsonl
    spec = kareus.transformer_layer_spec(config)   # the partitioned layer if the plan runs 2 nanobatches
    ...  # build the model with GPTModel(config, transformer_layer_spec=spec, ...), call
    ...  # get_forward_backward_func()(...) as usual
    session.close()   # on every rank: writes the last iteration, resets clocks

``install("auto", workload="plan-dir", log_path="kareus-run", objective="iso-time")`` runs the closed loop
instead (runtime/closed_loop/auto.py): the job profiles itself, calibrates, plans and switches while it trains.
``install`` must run before the schedule is first called. Backend, GPU preset and clock log come from
KAREUS_GPU_BACKEND, KAREUS_GPU and KAREUS_CLOCK_LOG unless given.
"""

from __future__ import annotations

import os
from typing import Any

from kareus_megatron.errors import ConfigError
from kareus_megatron.plan.schema import Plan
from kareus_megatron.runtime.frameworks.megatron_lm_hook import megatron_lm_hook
from kareus_megatron.runtime.session import Controller, OnError, RuntimeSession
from kareus_megatron.runtime.session_slot import MEGATRON_SESSIONS

# megatron_lm_hook: the native patches' hook
__all__ = ["current_session", "install", "megatron_lm_hook", "transformer_layer_spec", "uninstall"]

_slot = MEGATRON_SESSIONS


def install(
    plan: Plan | str | os.PathLike[str],
    *,
    log_path: str | os.PathLike[str] | None = None,
    on_error: OnError = "fail",
    backend: str | None = None,
    gpu: str | None = None,
    local_rank: int | None = None,
    controller: Controller = "process",
    source: str | None = None,
    log_mode: str = "new",
    workload: Plan | str | os.PathLike[str] | None = None,
    objective: str = "iso-time",
    point: str | None = None,
    robust: bool = False,
) -> RuntimeSession:
    """Run `plan` (a Plan, a plan file or a `kareus plan` directory) in this process; return the started session.

    For a directory, `point` picks the plan (plan/points.py's syntax; default iso-time: the least predicted
    energy no slower than Megatron's max-clock plan). `log_path` is a directory (each rank appends to its own
    rank-NNNNN.jsonl there); `log_mode`: new (refuse an existing rank log), append or overwrite. `robust`: the
    directory's iso-time / min-energy point met across the prediction bands (plan/points.py), as --kareus-robust."""
    if robust and (isinstance(plan, Plan) or plan == "auto"):
        what = "install('auto') re-plans while training" if plan == "auto" else "a Plan object is one plan"
        raise ConfigError(f"robust chooses among a plan directory's points, but {what}; drop robust=True")
    if isinstance(plan, str) and plan == "auto":
        from kareus_megatron.plan.objective import parse_objective
        from kareus_megatron.plan.points import load_point_plan
        from kareus_megatron.runtime.closed_loop.auto import install_auto

        if workload is None:
            raise ConfigError("install('auto') needs workload=: a plan of this job that says what to re-plan")
        base, src = (
            (workload, "workload")
            if isinstance(workload, Plan)
            else load_point_plan(workload, None, flag="point", path_flag="workload")
        )
        return install_auto(
            _slot,
            base,
            source or src,
            parse_objective(objective, "objective"),
            log_path=os.fspath(log_path) if log_path else None,
            backend=backend,
            gpu=gpu,
            local_rank=local_rank,
            on_error=on_error,
            controller=controller,
            log_mode=log_mode,
        )
    source = source or "the plan"
    if not isinstance(plan, Plan):
        from kareus_megatron.plan.points import load_point_plan

        plan, source = load_point_plan(plan, point, flag="point", path_flag="plan", robust=robust)
    return _slot.install(
        plan,
        source=source,
        backend=backend,
        gpu=gpu,
        local_rank=local_rank,
        log_path=log_path,
        on_error=on_error,
        controller=controller,
        log_mode=log_mode,
        robust=robust,
    )


def transformer_layer_spec(
    config: Any, plan: Plan | None = None, vp_stage: int | None = None, pp_rank: int | None = None
) -> Any:
    """The layer spec for ``GPTModel`` that runs the installed plan (or `plan`): kareus's partitioned layer when
    it runs 2-nanobatch instructions (or ``install("auto")`` may switch to such plans), megatron-core's local
    layer otherwise, from `config` (megatron_spec.transformer_layer_spec; rank 0 says which in one line)."""
    from kareus_megatron.megatron_spec import transformer_layer_spec as spec_for

    session = _slot.session
    if plan is None:
        if session is None or session.plan is None:
            raise ConfigError("transformer_layer_spec() needs a plan: call install() first or pass plan=")
        plan = session.plan
    auto = session is not None and getattr(session, "auto", None) is not None and plan is session.plan
    return spec_for(config, plan, vp_stage=vp_stage, pp_rank=pp_rank, auto=auto)


def uninstall() -> None:
    """Close the installed session (writes this rank's last iterations); no-op when none is installed."""
    _slot.uninstall()


def current_session() -> RuntimeSession | None:
    """The session installed by `install`, if any."""
    return _slot.session

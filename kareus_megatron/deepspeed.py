"""Run a kareus plan in a DeepSpeed pipeline-parallel script (PipelineModule + PipelineEngine, 0.18.x, 0.19.x).

Without touching the script, launch it through this module (as ``kareus_megatron.launch`` does for
megatron-core): the plan is installed before the script runs as ``__main__``, and closed when it returns
(the last step is logged); a kareus error (e.g. a plan that does not fit the engine, refused before step 1)
prints one line and exits with status 2:

    torchrun --nproc-per-node 2 -m kareus_megatron.deepspeed --kareus-plan DIR --kareus-point kareus-01 \
        --kareus-log runs/kareus-01 -- train.py --deepspeed_config ds_config.json -p 2

Or one line in the script, before ``deepspeed.initialize``, in one of three forms:

    import kareus_megatron.deepspeed as kareus
    kareus.install("plans/kareus-03.json", log_path="runs/kareus-03/measurement")
    config = kareus.from_config("ds_config.json")   # reads and removes the config's "kareus" section
    kareus.install_from_env()                       # KAREUS_PLAN, KAREUS_LOG (set by `kareus launch`)

The config section: ``"kareus": {"plan": PATH, "log": PATH, "on_error": "fail"|"warn"}``; a
``"plan"`` that is a ``kareus plan`` output directory takes ``"point"`` (plan/points.py's syntax: NN,
METHOD-NN, iso-time, fastest, min-energy, METHOD-iso-time, METHOD-fastest, METHOD-min-energy; default
iso-time: the least predicted energy no slower than Megatron's max-clock plan) and ``"method"``
(default kareus), as ``install(DIR, point=..., method=...)`` does; ``"robust": true`` meets iso-time or
min-energy across the prediction bands (95th percentiles), as ``install(..., robust=True)`` and
``--kareus-robust`` do. DeepSpeed 0.19.8 ignores unknown top-level keys, but
``from_config`` returns the config without the section, so no DeepSpeed version can reject it. Without
a plan (``install(None, log_path=...)``) the run is only measured, at the driver's default clocks.

Each step (``train_batch``) is one measured iteration; every rank appends it to its own file in the log
directory (``runtime.measurement``), which ``kareus report`` and ``kareus compare`` read. Call
``uninstall()`` (or ``session.close()``) on every rank at the end: it writes the last step and resets
clocks; at interpreter exit clocks are reset anyway.

``kareus plan --framework deepspeed`` plans 1 nanobatch per instruction (DeepSpeed has no nanobatch
overlap engine, so ``kareus`` plans clocks only); DeepSpeed's DualPipeV engine is refused (see
runtime/frameworks/deepspeed_patch.py).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kareus_megatron.environment import kareus_settings
from kareus_megatron.errors import ConfigError
from kareus_megatron.plan.points import load_point_plan
from kareus_megatron.plan.schema import Plan
from kareus_megatron.runtime.frameworks import deepspeed_patch
from kareus_megatron.runtime.session import Controller, OnError, RuntimeSession
from kareus_megatron.runtime.session_slot import SessionSlot

CONFIG_KEYS = ("plan", "log", "log_mode", "on_error", "point", "method", "robust")


class DeepSpeedSession(RuntimeSession):
    """`plan` running in this DeepSpeed process: clock client, per-step meter, PipelineEngine patch.

    A RuntimeSession on runtime.deepspeed_patch; ``plan=None`` measures the run at default clocks.
    """

    def __init__(self, plan: Plan | None, **kwargs: Any) -> None:
        """Configure (RuntimeSession's keyword arguments); nothing starts until `start()`."""
        super().__init__(plan, framework_patch=deepspeed_patch, **kwargs)


_slot = SessionSlot(DeepSpeedSession)


def _resolve_plan(
    plan: Plan | str | os.PathLike[str], point: str | int | None = None, method: str | None = None, robust: bool = False
) -> tuple[Plan, str]:
    """The Plan itself, a plan file, or the plan `point`/`method` (and `robust`) names in a plan directory
    (plan/points.py)."""
    if isinstance(plan, Plan):
        if robust:
            raise ConfigError("robust chooses among a plan directory's points; pass the directory, not a Plan")
        return plan, "the plan"
    return load_point_plan(plan, point, method=method, flag="point", path_flag="plan", robust=robust)


def install(
    plan: Plan | str | os.PathLike[str] | None,
    *,
    log_path: str | os.PathLike[str] | None = None,
    on_error: OnError = "fail",
    backend: str | None = None,
    gpu: str | None = None,
    local_rank: int | None = None,
    controller: Controller = "process",
    clock_log: str | None = None,
    point: str | int | None = None,
    method: str | None = None,
    log_mode: str = "new",
    robust: bool = False,
) -> DeepSpeedSession:
    """Run `plan` (a Plan, plan file or `kareus plan` directory; None = measure only); return the session.

    For a directory, `point` and `method` pick the plan in plan/points.py's syntax (default: iso-time of
    the kareus method, the least predicted energy no slower than Megatron's max-clock plan). `log_path` is a
    directory of per-rank logs; `log_mode`: new (refuse an existing rank log), append or overwrite. `robust`:
    iso-time / min-energy met across the prediction bands (plan/points.py), recorded in the log header."""
    if plan is None and robust:
        raise ConfigError("robust chooses among a plan directory's points, but no plan was given")
    resolved, source = (None, "no plan") if plan is None else _resolve_plan(plan, point, method, robust)
    return _slot.install(
        resolved,
        source=source,
        backend=backend,
        gpu=gpu,
        local_rank=local_rank,
        log_path=log_path,
        on_error=on_error,
        controller=controller,
        clock_log=clock_log,
        log_mode=log_mode,
        robust=robust,
    )


def uninstall() -> None:
    """Close the installed session (writes this rank's last iterations); no-op when none is installed."""
    _slot.uninstall()


def current_session() -> DeepSpeedSession | None:
    """The session installed by `install`, `from_config` or `install_from_env`, if any."""
    return _slot.session


def from_config(config: dict[str, Any] | str | os.PathLike[str], **kwargs: Any) -> dict[str, Any]:
    """Install from the config's "kareus" section (if any) and return the DeepSpeed config without it."""
    if not isinstance(config, dict):
        p = Path(config)
        try:
            config = json.loads(p.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot read DeepSpeed config {p}: {e}") from None
        if not isinstance(config, dict):
            raise ConfigError(f"DeepSpeed config {p} is not a JSON object")
    cleaned = {k: v for k, v in config.items() if k != "kareus"}
    section = config.get("kareus")
    if section is None:
        return cleaned
    if not isinstance(section, dict):
        raise ConfigError(f'the "kareus" config section must be an object with keys {", ".join(CONFIG_KEYS)}')
    unknown = sorted(set(section) - set(CONFIG_KEYS))
    if unknown:
        raise ConfigError(
            f'unknown key(s) {", ".join(unknown)} in the "kareus" config section; allowed: {", ".join(CONFIG_KEYS)}'
        )
    install(
        section.get("plan"),
        log_path=section.get("log"),
        on_error=section.get("on_error", "fail"),
        log_mode=section.get("log_mode", "new"),
        point=section.get("point"),
        method=section.get("method"),
        robust=_robust_key(section.get("robust", False)),
        **kwargs,
    )
    return cleaned


def _robust_key(value: Any) -> bool:
    """The config section's "robust" (a JSON boolean); ConfigError otherwise."""
    if not isinstance(value, bool):
        raise ConfigError(f'the "kareus" config section\'s "robust" must be true or false, not {value!r}')
    return value


def install_from_env(**kwargs: Any) -> DeepSpeedSession | None:
    """Install from KAREUS_PLAN / KAREUS_LOG / KAREUS_LOG_MODE / KAREUS_ON_ERROR; None when neither
    KAREUS_PLAN nor KAREUS_LOG is set."""
    env = kareus_settings()
    plan, log_path = env.plan or None, env.log or None
    if plan is None and log_path is None:
        return None
    return install(
        plan,
        log_path=log_path,
        on_error=env.on_error or "fail",  # type: ignore[arg-type]
        log_mode=env.log_mode or "new",
        **kwargs,
    )


PROG = "python -m kareus_megatron.deepspeed"


def main(argv: Sequence[str] | None = None) -> int:
    """``-m kareus_megatron.deepspeed --kareus-plan PLAN [--kareus-* ...] -- train.py ARGS``: run an unmodified
    DeepSpeed script under `PLAN` (the --kareus-* flags of runtime/frameworks/entry.py); return the exit status."""
    from kareus_megatron.runtime.frameworks import entry

    try:
        return entry.launch_script(
            PROG,
            list(sys.argv[1:] if argv is None else argv),
            (__doc__ or "").split("\n\n")[1],
            slot=_slot,
            allow_module=False,
        )
    finally:
        _slot.session = None  # closed or aborted by then


if __name__ == "__main__":
    from kareus_megatron.deepspeed import main as _main  # the importable module's session slot, not __main__'s

    raise SystemExit(_main())

"""Megatron-LM's own entry: the hook its native --kareus-plan patch (patches/megatron-lm) calls with the parsed
arguments, and the layer choice it and launch/pretrain_gpt.py make before the model is built (layer_choice.py).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from kareus_megatron.errors import ConfigError, KareusError, print_error
from kareus_megatron.plan.points import load_point_plan
from kareus_megatron.runtime.closed_loop.auto import AUTO
from kareus_megatron.runtime.frameworks.cuda_graphs import cuda_graph_problem
from kareus_megatron.runtime.frameworks.entry import (
    ending_session,
    refuse_robust_auto,
    resolve_plan,
    run_guarded,
    start_auto_session,
)
from kareus_megatron.runtime.frameworks.layer_choice import LayerChoice, choose_layer


def choose_megatron_layer(ns: Any, megatron_args: Any) -> LayerChoice:
    """The layer Megatron-LM builds for the plan the --kareus-* flags `ns` name (with --kareus-plan auto, the
    workload), from Megatron-LM's flags `megatron_args` (layer_choice.py); rank 0 prints its one line."""
    auto = ns.kareus_plan == AUTO
    robust = bool(getattr(ns, "kareus_robust", False))
    if auto:
        refuse_robust_auto(robust)
        if not getattr(ns, "kareus_workload", None):
            raise ConfigError(
                "--kareus-plan auto needs --kareus-workload PLAN: a plan of this job (e.g. from kareus "
                "plan) that says what to re-plan"
            )
        plan, _ = load_point_plan(
            ns.kareus_workload, getattr(ns, "kareus_point", None), flag="--kareus-point", path_flag="--kareus-workload"
        )
    else:
        plan, _ = resolve_plan(ns.kareus_plan, getattr(ns, "kareus_point", None), robust)
    choice = choose_layer(plan, megatron_args, auto=auto)
    if os.environ.get("RANK", "0") == "0":
        print(choice.line, flush=True)
    return choice


def install_from_megatron_args(args: Any) -> Any:
    """Start a session from Megatron-LM's parsed arguments (the native --kareus-plan patch calls this)."""
    from kareus_megatron.runtime.session_slot import MEGATRON_SESSIONS

    local_rank = getattr(args, "local_rank", None)
    if args.kareus_plan == AUTO:
        ns = argparse.Namespace(
            **{
                k: getattr(args, k, d)
                for k, d in (
                    ("kareus_workload", None),
                    ("kareus_objective", "iso-time"),
                    ("kareus_point", None),
                    ("kareus_robust", False),
                    ("kareus_log", None),
                    ("kareus_on_error", "fail"),
                    ("kareus_log_mode", "new"),
                )
            }
        )
        return start_auto_session(ns, MEGATRON_SESSIONS, local_rank=local_rank if isinstance(local_rank, int) else None)
    robust = bool(getattr(args, "kareus_robust", False))
    plan, source = resolve_plan(args.kareus_plan, getattr(args, "kareus_point", None), robust)
    return MEGATRON_SESSIONS.install(
        plan,
        source=source,
        robust=robust,
        log_path=getattr(args, "kareus_log", None),
        on_error=getattr(args, "kareus_on_error", "fail"),
        log_mode=getattr(args, "kareus_log_mode", "new"),
        local_rank=local_rank if isinstance(local_rank, int) else None,
    )


def megatron_lm_hook(args: Any, cfg_container: Any = None) -> Any:
    """For patches/megatron-lm: install when --kareus-plan is set; a kareus error exits 2 with one line.

    The session closes on every rank when Megatron-LM's ``train()`` returns (or exits through
    ``--exit-interval``/``--exit-duration-in-mins``: a SystemExit), so the run log holds every iteration;
    an exception out of ``train()`` aborts it (no collective: the other ranks may be elsewhere). A kareus
    error inside ``train()`` (the plan checked against the live run at the first step) is one line on
    stderr and exit status 2, as at install.

    Before the model is built, the layer is chosen from the plan (``choose_megatron_layer``): ``args.spec``
    names it, and so does ``cfg_container.model.transformer_layer_spec`` where Megatron-LM (core_v0.19.0)
    read ``--spec`` into its model config before ``pretrain()``.
    """
    if not getattr(args, "kareus_plan", None):
        return None
    code_or_session: list[Any] = []

    def body() -> int:
        problem = cuda_graph_problem(args)  # Megatron-LM's checked arguments: graphs would skip every hook
        if problem:
            raise ConfigError(problem)
        choice = choose_megatron_layer(args, args)
        if choice.spec is not None and not choice.given:
            _use_spec(args, cfg_container, choice.spec)
        code_or_session.append(install_from_megatron_args(args))
        return 0

    if run_guarded("megatron-lm (kareus)", bool(getattr(args, "kareus_debug", False)), body) != 0:
        raise SystemExit(2)
    session = code_or_session[0]
    _close_after_train(session, bool(getattr(args, "kareus_debug", False)))
    return session


def _use_spec(args: Any, cfg_container: Any, spec: tuple[str, str]) -> None:
    """Make Megatron-LM build its model with the layer spec `spec` (MODULE, NAME), as ``--spec`` would."""
    args.spec = list(spec)
    model_cfg = getattr(cfg_container, "model", None)
    if model_cfg is not None and hasattr(model_cfg, "transformer_layer_spec"):
        from megatron.core.transformer.spec_utils import import_module

        model_cfg.transformer_layer_spec = import_module(spec)


def _close_after_train(session: Any, debug: bool = False) -> None:
    """Wrap ``megatron.training.training.train`` (looked up by name in pretrain()) to end `session` after it.

    Without Megatron-LM's training package (megatron-core alone) there is no train() to wrap: the caller
    closes the session itself, as with the Python API.
    """
    try:
        from megatron.training import training
    except ImportError:
        return

    train = training.train
    if getattr(train, "_kareus_wrapped", False):
        train = train.__wrapped__

    def train_then_close(*a: Any, **kw: Any) -> Any:
        try:
            with ending_session(session):
                return train(*a, **kw)
        except KareusError as e:  # the session is aborted already
            if debug:
                raise
            print_error("megatron-lm (kareus)", e)
            raise SystemExit(2) from None

    train_then_close.__wrapped__ = train  # type: ignore[attr-defined]
    train_then_close._kareus_wrapped = True  # type: ignore[attr-defined]
    training.train = train_then_close

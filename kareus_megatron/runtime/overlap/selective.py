"""Megatron's selective activation recompute (``recompute_granularity="selective"``) in the partitioned layer.

Megatron recomputes the core attention (module ``core_attn``, its default ``recompute_modules``) with its own
reentrant checkpoint (``tensor_parallel.checkpoint``), which refuses ``torch.autograd.grad``; the engine's
backward drives every piece with it (schedule.py). So the partitioned layer turns megatron's off
(``SelfAttention.checkpoint_core_attention``) and gives its core attention a forward that runs under torch's
non-reentrant checkpoint instead (``recompute_core_attention``): the forward keeps only the attention's
inputs; the attention's backward recomputes it first, inside the piece that holds it, so beside the collective
that piece's partition overlaps (search/partition.py ``schedule_ops`` costs it there). Megatron's
model-parallel RNG tracker states are saved at the forward and restored for the recompute, as megatron's
checkpoint does, so attention dropout draws the same mask (torch's checkpoint restores the default generators).

Other recompute modules that change a dense layer (``layernorm``, ``mlp``) are refused: the planner models
core attention only. The MoE and MLA ones do nothing to a dense layer (and those layers are refused anyway).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

RECOMPUTED = "core_attn"
NOT_DENSE = ("moe", "moe_act", "shared_experts", "mla_up_proj")  # recompute modules of MoE / MLA layers only


def selective_problems(config: Any) -> list[str]:
    """Selective-recompute settings the partitioned layer does not run (none outside selective recompute)."""
    if getattr(config, "recompute_granularity", None) != "selective":
        return []
    modules = getattr(config, "recompute_modules", None) or [RECOMPUTED]
    other = [m for m in modules if m != RECOMPUTED and m not in NOT_DENSE]
    if other:
        return [f"selective recompute of {', '.join(other)} (only {RECOMPUTED!r})"]
    return []


_CLASSES: dict[type, type] = {}


def recompute_core_attention(attention: Any) -> None:
    """Make `attention`'s core attention recompute in the backward (module docstring), if the config asks."""
    cfg = attention.config
    if getattr(cfg, "recompute_granularity", None) != "selective":
        return
    if RECOMPUTED not in (getattr(cfg, "recompute_modules", None) or [RECOMPUTED]):
        return
    attention.checkpoint_core_attention = False
    core = attention.core_attention
    core.__class__ = _recomputed(type(core))


def _recomputed(cls: type[Any]) -> type:
    """`cls` with a forward that runs under torch's non-reentrant checkpoint while training with grad."""
    if cls not in _CLASSES:

        def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
            plain = types.MethodType(cls.forward, self)  # the forward `sub` overrides, bound
            if not (self.training and torch.is_grad_enabled()):
                return plain(*args, **kwargs)
            return checkpoint(plain, *args, use_reentrant=False, context_fn=_tracker_contexts, **kwargs)

        sub = type(
            f"Recomputed{cls.__name__}",
            (cls,),
            {
                "forward": forward,
                "__doc__": f"{cls.__name__} recomputed in the backward (selective recompute).",
                "__module__": __name__,
            },
        )
        _CLASSES[cls] = sub
    return _CLASSES[cls]


def _tracker_contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """(forward, recompute) contexts: the recompute runs with the RNG tracker states the forward had."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    saved: dict[str, Any] = {}

    @contextlib.contextmanager
    def forward() -> Iterator[None]:
        saved.update(tracker.get_states())
        yield

    @contextlib.contextmanager
    def recompute() -> Iterator[None]:
        now = tracker.get_states()
        tracker.set_states(dict(saved))
        try:
            yield
        finally:
            tracker.set_states(now)

    return forward(), recompute()

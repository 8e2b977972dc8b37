"""A torch LayerNorm / RMSNorm for megatron-core layer specs that also runs with sequence parallelism.

Without Transformer Engine or Apex (a CPU machine, a plain pip install) megatron-core's local spec builds its
norms as ``WrappedTorchNorm``, which returns torch's own ``LayerNorm`` / ``RMSNorm`` but asserts
``not config.sequence_parallel`` (megatron/core/transformer/torch_norm.py, core 0.16.1). The reason is only
bookkeeping: with sequence parallelism each TP rank normalises its own part of the sequence, so a norm's
weight and bias gradients are partial sums that megatron's ``finalize_model_grads`` all-reduces over the TP
group for the parameters marked ``sequence_parallel=True`` (distributed/finalize_model_grads.py); Apex's
``FusedLayerNorm`` marks them (fusions/fused_layer_norm.py), torch's norm does not.

``SPTorchNorm`` takes ``WrappedTorchNorm``'s constructor arguments and returns the same torch module
(``torch.nn.LayerNorm`` or ``torch.nn.RMSNorm`` over the last dimension, so the numerics, parameter names and
state-dict keys, ``weight`` and ``bias`` / ``weight``, are torch's, as with megatron's fallback), with its
parameters marked ``sequence_parallel = config.sequence_parallel``. ``sp_capable_norms(spec)`` swaps it into
a layer spec wherever the spec holds ``WrappedTorchNorm``; Apex and TE norms are left alone.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from megatron.core.transformer.spec_utils import ModuleSpec

from kareus_megatron.errors import InfeasibleConfigError

NORM_FIELDS = ("input_layernorm", "pre_mlp_layernorm")  # TransformerLayerSubmodules
QK_NORM_FIELDS = ("q_layernorm", "k_layernorm")  # SelfAttentionSubmodules


class SPTorchNorm:
    """megatron-core norm factory (WrappedTorchNorm's arguments) returning torch's norm, SP-marked."""

    def __new__(  # type: ignore[misc]
        cls,
        config: Any,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "LayerNorm",
    ) -> torch.nn.Module:
        problems = [
            name
            for name in ("layernorm_zero_centered_gamma", "persist_layer_norm", "memory_efficient_layer_norm")
            if getattr(config, name, False)
        ]
        if problems:
            raise InfeasibleConfigError(
                f"the torch norm does not support {', '.join(problems)}; install Apex or Transformer Engine "
                "or switch them off"
            )
        kind = getattr(config, "normalization", normalization)
        norm_cls = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}.get(kind)
        if norm_cls is None:
            raise InfeasibleConfigError(f"normalization={kind!r}; the torch norm supports LayerNorm and RMSNorm")
        norm = norm_cls(normalized_shape=hidden_size, eps=eps)
        marked = bool(getattr(config, "sequence_parallel", False))
        for p in norm.parameters():
            p.sequence_parallel = marked
        return norm


def _megatron_torch_norm() -> type | None:
    """megatron-core's WrappedTorchNorm (None if this megatron has none)."""
    try:
        from megatron.core.transformer.torch_norm import WrappedTorchNorm
    except ImportError:  # pragma: no cover - every supported release has it
        return None
    return WrappedTorchNorm


def _swap(sub: Any, fields: tuple[str, ...], old: type) -> Any:
    changes = {f: SPTorchNorm for f in fields if getattr(sub, f, None) is old}
    return dataclasses.replace(sub, **changes) if changes else sub


def sp_capable_norms(spec: ModuleSpec) -> ModuleSpec:
    """A copy of a GPT layer spec whose megatron torch norms (layer and QK norms) are ``SPTorchNorm``."""
    old = _megatron_torch_norm()
    if old is None:
        return spec
    sub = _swap(spec.submodules, NORM_FIELDS, old)
    attn = getattr(sub, "self_attention", None)
    if isinstance(attn, ModuleSpec) and attn.submodules is not None:
        attn_sub = _swap(attn.submodules, QK_NORM_FIELDS, old)
        if attn_sub is not attn.submodules:
            sub = dataclasses.replace(
                sub, self_attention=ModuleSpec(module=attn.module, params=dict(attn.params), submodules=attn_sub)
            )
    if sub is spec.submodules:
        return spec
    return ModuleSpec(module=spec.module, params=dict(spec.params), submodules=sub)

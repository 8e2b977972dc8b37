"""Which transformer layer Megatron-LM's model is built with for a kareus plan (no torch, no megatron here).

The entry points (launch/pretrain_gpt.py, the native --kareus-plan patches, ``kareus launch``'s commands)
ask ``choose_layer(plan, args)`` before Megatron-LM builds its model. ``args`` is Megatron-LM's parsed
namespace, or the drop-in's reading of the same flags from the command line (``megatron_layer_flags``).

- The plan runs some instruction as 2 nanobatches (or, with ``--kareus-plan auto``, the workload has TP or CP
  collectives that a re-plan may overlap): the model needs kareus's partitioned layer, which the entry point
  names to Megatron-LM as ``--spec kareus_megatron.megatron_spec NAME`` (``SPEC_MODULE``; NAME one of
  ``SPEC_SDPA`` / ``SPEC_LOCAL_ATTENTION``). The layer is built from the model's own config: normalization,
  activation, biases, GQA, QK-norm and recompute are Megatron-LM's flags as given.
- Otherwise Megatron-LM builds its own layer, unchanged.
- A ``--spec`` the user gave is kept (the runtime refuses it at the first step if it has no partitioned layer).

Flags the partitioned layer cannot honour are refused in one line naming the flag (ConfigError, exit 2).
``--transformer-impl transformer_engine`` (Megatron-LM's default): the layers are built with megatron-core's
local modules and the line says which Transformer Engine features the run gives up; FP8 and TE's
userbuffer comm overlap, which the local modules cannot run, are refused (docs/layer_choice.md).
"""

from __future__ import annotations

import argparse
import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kareus_megatron.errors import ConfigError
from kareus_megatron.plan.schema import Plan

SPEC_MODULE = "kareus_megatron.megatron_spec"
SPEC_SDPA = "partitioned_layer_spec"  # core attention on torch's scaled_dot_product_attention
SPEC_LOCAL_ATTENTION = "partitioned_layer_spec_local_attention"  # megatron's DotProductAttention (any mask)
BLOCK_SPECS = {SPEC_SDPA: "partitioned_block_spec", SPEC_LOCAL_ATTENTION: "partitioned_block_spec_local_attention"}
TE = "transformer_engine"
TE_GIVEN_UP = ("fused layernorm-linear", "TE attention kernels", "TE's own comm overlap")
WHY_1NB = "use a 1-nanobatch plan point (e.g. --kareus-point perseus-fastest) to keep it"

# Megatron-LM's flags that decide the layer, with Megatron-LM's defaults (core_v0.16.1 and core_v0.19.0,
# megatron/training/arguments.py): (flag, dest, argparse keywords).
_FLAGS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("--spec", "spec", {"nargs": "*", "default": None}),
    ("--transformer-impl", "transformer_impl", {"default": TE}),
    ("--reset-attention-mask", "reset_attention_mask", {"action": "store_true"}),
    ("--sequence-parallel", "sequence_parallel", {"action": "store_true"}),
    ("--context-parallel-size", "context_parallel_size", {"type": int, "default": 1}),
    ("--num-experts", "num_experts", {"type": int, "default": None}),
    ("--multi-latent-attention", "multi_latent_attention", {"action": "store_true"}),
    ("--experimental-attention-variant", "experimental_attention_variant", {"default": None}),
    ("--heterogeneous-layers-config-path", "heterogeneous_layers_config_path", {"default": None}),
    ("--use-legacy-models", "use_legacy_models", {"action": "store_true"}),
    ("--attention-backend", "attention_backend", {"default": "auto"}),
    ("--fp8-format", "fp8", {"default": None}),
    ("--fp4-format", "fp4", {"default": None}),
    ("--tp-comm-overlap", "tp_comm_overlap", {"action": "store_true"}),
)

# Flags the partitioned layer refuses whatever the implementation: (dest, flag, what it would need).
_REFUSED = (
    ("num_experts", "--num-experts", "MoE layers"),
    ("multi_latent_attention", "--multi-latent-attention", "multi-latent attention"),
    ("experimental_attention_variant", "--experimental-attention-variant", "another attention module"),
    ("heterogeneous_layers_config_path", "--heterogeneous-layers-config-path", "per-layer configs"),
    ("use_legacy_models", "--use-legacy-models", "megatron-core's layers"),
)
# Transformer-Engine-only features the local modules cannot run.
_TE_ONLY = (
    ("fp8", "--fp8-format", "FP8"),
    ("fp4", "--fp4-format", "FP4"),
    ("tp_comm_overlap", "--tp-comm-overlap", "TE's userbuffer comm overlap"),
)


@dataclass(frozen=True)
class LayerChoice:
    """The layer the model is built with: ``spec`` = (module, name) for Megatron-LM's ``--spec``, or None
    for Megatron-LM's own layer; ``given`` whether that --spec was the user's; ``line``: what rank 0 says."""

    spec: tuple[str, str] | None
    line: str
    given: bool = False

    @property
    def partitioned(self) -> bool:
        """Whether this choice builds kareus's partitioned layer."""
        return self.spec is not None and self.spec[0] == SPEC_MODULE


def megatron_layer_flags(argv: Sequence[str]) -> argparse.Namespace:
    """The layer-deciding Megatron-LM flags of the training command `argv`, with Megatron-LM's defaults
    (Megatron-LM's own parser takes no abbreviations, nor does this one)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for flag, dest, kw in _FLAGS:
        parser.add_argument(flag, dest=dest, **kw)
    try:
        ns, _ = parser.parse_known_args(list(argv))
    except SystemExit:  # argparse already printed the usage line; a bad value is Megatron-LM's to explain
        raise ConfigError("Megatron-LM's arguments do not parse (see the line above)") from None
    return ns


def two_nanobatch_count(plan: Plan) -> int:
    """Number of `plan`'s instructions that run 2 nanobatches."""
    return sum(1 for st in plan.stages for i in st.instructions if i.nanobatches > 1)


def partitioned_reason(plan: Plan, auto: bool = False) -> str | None:
    """Why `plan` needs the partitioned layer, or None when Megatron-LM's own layer runs it."""
    n = two_nanobatch_count(plan)
    if n:
        return f"the plan ({plan.method}) runs {n} instructions with 2 nanobatches"
    if auto and (plan.parallel.tp > 1 or plan.parallel.cp > 1):
        return (
            "--kareus-plan auto may switch to plans that overlap the TP/CP collectives with 2 nanobatches "
            f"(tp={plan.parallel.tp}, cp={plan.parallel.cp})"
        )
    return None


def choose_layer(plan: Plan, args: Any, auto: bool = False) -> LayerChoice:
    """The layer Megatron-LM builds for `plan` from its flags `args`; ConfigError for a flag it cannot honour."""
    why = partitioned_reason(plan, auto)
    user_spec = getattr(args, "spec", None)
    if why is None:
        return LayerChoice(
            tuple(user_spec) if user_spec else None,
            "kareus: model built with Megatron-LM's own layer"
            + (f" (--spec {' '.join(user_spec)})" if user_spec else "")
            + ": every instruction of the plan runs 1 nanobatch",
            given=bool(user_spec),
        )
    if user_spec:
        spec = tuple(user_spec)
        if len(spec) != 2:
            raise ConfigError(f"--spec {' '.join(spec)}: give MODULE NAME, e.g. --spec {SPEC_MODULE} {SPEC_SDPA}")
        return LayerChoice(spec, f"kareus: model built with --spec {' '.join(spec)} as given ({why})", given=True)
    for dest, flag, what in _REFUSED:
        if getattr(args, dest, None):
            raise ConfigError(
                f"{flag}: kareus's partitioned layer has no {what}, and {why}; drop the flag or {WHY_1NB}"
            )
    te = getattr(args, "transformer_impl", TE) == TE
    for dest, flag, what in _TE_ONLY:
        if getattr(args, dest, None):
            raise ConfigError(
                f"{flag}: {what} needs Transformer Engine's modules, but {why}, which kareus's "
                f"partitioned layer runs on megatron-core's local modules; drop {flag}, or "
                f"{WHY_1NB} with --transformer-impl {TE}"
            )
    cp = int(getattr(args, "context_parallel_size", 1) or 1)
    local_attention = bool(getattr(args, "reset_attention_mask", False)) or getattr(
        args, "attention_backend", "auto"
    ) in ("local", "AttnBackend.local")
    if local_attention and cp > 1:
        flag = "--reset-attention-mask" if getattr(args, "reset_attention_mask", False) else "--attention-backend local"
        raise ConfigError(
            f"{flag} with --context-parallel-size {cp}: the partitioned layer's context-parallel "
            f"attention is causal SDPA only, and {why}; drop the flag or {WHY_1NB}"
        )
    name = SPEC_LOCAL_ATTENTION if local_attention else SPEC_SDPA
    block = bool(getattr(args, "sequence_parallel", False)) and torch_norm_fallback()
    if block:
        name = BLOCK_SPECS[name]
    attention = (
        "megatron's DotProductAttention, which applies the dataloader's mask" if local_attention else "torch SDPA"
    )
    te_note = (
        (f"; --transformer-impl {TE}: built on megatron-core's local modules, giving up {', '.join(TE_GIVEN_UP)}")
        if te
        else ""
    )
    return LayerChoice(
        (SPEC_MODULE, name),
        f"kareus: model built with kareus's partitioned layer "
        f"(--spec {SPEC_MODULE} {name}; core attention {attention}"
        + ("; final norm: SP-capable torch norm" if block else "")
        + f"): {why}{te_note}",
    )


def torch_norm_fallback() -> bool:
    """Whether megatron-core builds its norms with the torch fallback, which refuses sequence parallelism:
    neither Transformer Engine nor Apex is installed (megatron/core/transformer/transformer_block.py's
    ``LayerNormImpl`` choice, core_v0.16.1 and core_v0.19.0)."""
    return all(importlib.util.find_spec(m) is None for m in ("transformer_engine", "apex"))

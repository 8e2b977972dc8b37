"""Overlap engine: megatron-core transformer layers run as 2 nanobatches with TP collectives overlapped.

Public API:

- ``get_partitioned_gpt_layer_spec(core_attention="sdpa", **local_spec_kwargs)``: layer spec for ``GPTModel``
  (needs megatron-core); core attention "sdpa" (``SDPAttention``) or "local" (megatron's DotProductAttention).
- ``get_partitioned_gpt_block_spec(config, vp_stage=None, **layer_spec_kwargs)``: this stage's block of those
  layers with an SP-capable final norm, for ``GPTModel`` (block.py; docs/megatron_core.md).
- ``get_sdpa_gpt_layer_spec(**local_spec_kwargs)``: megatron's local spec with only ``SDPAttention`` swapped in
  (no nanobatching; needs no overlap engine).
- ``setup_overlap(plan, ...)``: per-rank set-up (plan check, NCCL SM-limited communicators, hooks listener).
- ``comm_probe.probe_sm_limited_comms(device, sm_counts)``: what those communicators cost on one rank (GPU check).
- ``validate_plan_for_layer(plan, ...)``: raise PlanError if the plan's knobs do not fit the layer.
- ``check_model_for_plan(model, plan)``: PlanMismatchError if a 2-nanobatch plan meets a standard model.
- ``get_engine()`` / ``set_engine()``, ``LayerSettings`` / ``Knobs``: settings for tests and benchmarks.
- ``overlap_violations(events)``: check a trace for the planned overlap structure.

``PartitionedTransformerLayer``, ``SDPAttention`` and the specs are loaded lazily so that plan checks need no megatron.
"""

from __future__ import annotations

from typing import Any

from kareus_megatron.runtime.overlap.config import (
    Knobs,
    LayerSettings,
    OverlapState,
    comm_sms_values,
    settings_from_instruction,
    validate_plan_for_layer,
)
from kareus_megatron.runtime.overlap.trace import overlap_violations

__all__ = [
    "Knobs",
    "check_model_for_plan",
    "LayerSettings",
    "OverlapState",
    "PartitionedTransformerLayer",
    "SDPAttention",
    "comm_sms_values",
    "get_engine",
    "get_partitioned_gpt_block_spec",
    "get_partitioned_gpt_layer_spec",
    "get_sdpa_gpt_layer_spec",
    "overlap_violations",
    "set_engine",
    "settings_from_instruction",
    "setup_overlap",
    "validate_plan_for_layer",
]

_LAZY = {
    "PartitionedTransformerLayer": "kareus_megatron.runtime.overlap.layer",
    "check_model_for_plan": "kareus_megatron.runtime.overlap.layer",
    "get_partitioned_gpt_layer_spec": "kareus_megatron.runtime.overlap.layer",
    "get_partitioned_gpt_block_spec": "kareus_megatron.runtime.overlap.block",
    "SDPAttention": "kareus_megatron.runtime.overlap.attention",
    "get_sdpa_gpt_layer_spec": "kareus_megatron.runtime.overlap.attention",
    "get_engine": "kareus_megatron.runtime.overlap.engine",
    "set_engine": "kareus_megatron.runtime.overlap.engine",
    "setup_overlap": "kareus_megatron.runtime.overlap.engine",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""The partitioned layer as a whole block spec for ``GPTModel``: the layers plus a final norm that works with SP.

Given a bare layer spec, megatron-core's ``TransformerBlock`` builds its final norm from its own fallback
(``LayerNormImpl``: TE, else Apex, else ``WrappedTorchNorm``, which refuses sequence parallelism), so a
``GPTModel`` built from ``get_partitioned_gpt_layer_spec()`` fails with SP on a machine without TE or Apex.
``get_partitioned_gpt_block_spec`` returns this pipeline stage's block instead: its layers and, as the final
norm, the layer spec's own (SP-capable, norm.SPTorchNorm where megatron would fall back to torch).
"""

from __future__ import annotations

from typing import Any

from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlock,
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)

from kareus_megatron.runtime.overlap.layer import get_partitioned_gpt_layer_spec


def get_partitioned_gpt_block_spec(config: Any, vp_stage: int | None = None, **layer_spec_kwargs: Any) -> ModuleSpec:
    """This stage's (and virtual stage `vp_stage`'s) block of partitioned layers for ``GPTModel``'s
    ``transformer_layer_spec``; `layer_spec_kwargs` go to get_partitioned_gpt_layer_spec (e.g.
    ``normalization="RMSNorm"``). Call after megatron's parallel state is initialised (it counts this stage's
    layers)."""
    layer = get_partitioned_gpt_layer_spec(**layer_spec_kwargs)
    n = get_num_layers_to_build(config, vp_stage=vp_stage)
    sub = TransformerBlockSubmodules(layer_specs=[layer] * n, layer_norm=layer.submodules.input_layernorm)
    return ModuleSpec(module=TransformerBlock, submodules=sub)

"""Test-only: the layer spec of the stock Megatron-LM runs that the TP=2+SP kareus runs are compared with.

On a CPU neither Apex nor Transformer Engine is installed, so Megatron-LM's own layer (``--transformer-impl
local``) builds its norms with megatron-core's torch fallback, which refuses ``--sequence-parallel``. The stock
SP baseline therefore runs megatron's local layer spec unchanged except for those norms: torch's LayerNorm
marked for SP gradient reduction (kareus_megatron.runtime.overlap.norm.SPTorchNorm), in the layers and as the
block's final norm (kareus_megatron.megatron_spec.StageBlockSubmodules). Used as
``--spec mlm_stock_specs local_sp_block_spec`` (this directory on PYTHONPATH).
"""

from __future__ import annotations

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlock

from kareus_megatron.megatron_spec import StageBlockSubmodules
from kareus_megatron.runtime.overlap.norm import sp_capable_norms

local_sp_block_spec = ModuleSpec(
    module=TransformerBlock, submodules=StageBlockSubmodules(sp_capable_norms(get_gpt_layer_local_spec()))
)

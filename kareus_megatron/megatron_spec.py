"""Layer specs for Megatron-LM's ``--spec MODULE NAME``: kareus's partitioned layer, built from the model's config.

    python pretrain_gpt.py ... --spec kareus_megatron.megatron_spec partitioned_layer_spec

Megatron-LM reads ``--spec`` with ``import_module`` (``vars(module)[NAME]``), so each name here is a spec
*object*, not a function. The entry points (launch/pretrain_gpt.py, the native --kareus-plan patches, the
commands ``kareus launch`` writes) choose one themselves when the plan needs the partitioned layer
(runtime/frameworks/layer_choice.py); users who pass specs can name one directly.

- ``partitioned_layer_spec``: a layer spec whose layer (``ConfiguredPartitionedLayer``) reads the model's
  ``TransformerConfig`` when it is built: normalization (LayerNorm/RMSNorm), QK-norm (layer norm or L2),
  and through the config as megatron's own layer does activation, biases, GQA, rotary or learned positions
  and recompute. Core attention: torch SDPA (``SDPAttention``).
- ``partitioned_layer_spec_local_attention``: the same with megatron's ``DotProductAttention``, which applies
  the dataloader's attention mask (``--reset-attention-mask``); no context parallelism.
- ``partitioned_block_spec`` / ``partitioned_block_spec_local_attention``: the block of this rank's layers
  with a final norm that also runs with sequence parallelism. Megatron's block builds its final norm from
  its torch-norm fallback when neither Apex nor Transformer Engine is installed, and that fallback refuses
  ``--sequence-parallel``; the entry points pick these then. The number of layers comes from Megatron-LM's
  parsed arguments (``megatron.training.get_args``) on first use, so these serve Megatron-LM's scripts only.

``transformer_layer_spec(config, plan)`` gives code that builds megatron-core's GPTModel itself (the Python API,
``kareus_megatron.megatron.transformer_layer_spec``) the same choice.

A core attention set in the spec (e.g. Megatron-LM 0.19's ``--attention-backend local`` override) is kept.
State dicts are those of megatron's local layer spec (runtime/overlap/layer.py).
"""

from __future__ import annotations

from typing import Any

from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlock

from kareus_megatron.errors import InfeasibleConfigError
from kareus_megatron.runtime.overlap.attention import CORE_ATTENTION_SDPA, swap_core_attention
from kareus_megatron.runtime.overlap.layer import PartitionedTransformerLayer, get_partitioned_gpt_layer_spec
from kareus_megatron.runtime.overlap.norm import SPTorchNorm

__all__ = [
    "ConfiguredPartitionedLayer",
    "partitioned_block_spec",
    "partitioned_block_spec_local_attention",
    "partitioned_layer_spec",
    "partitioned_layer_spec_local_attention",
    "spec_for_config",
    "transformer_layer_spec",
]


def spec_for_config(config: Any, core_attention: str = CORE_ATTENTION_SDPA) -> ModuleSpec:
    """The partitioned layer spec for `config` (a megatron-core TransformerConfig): its norms and QK-norm."""
    return get_partitioned_gpt_layer_spec(
        core_attention=core_attention,
        qk_layernorm=bool(getattr(config, "qk_layernorm", False)),
        normalization=getattr(config, "normalization", "LayerNorm"),
        qk_l2_norm=bool(getattr(config, "qk_l2_norm", False)),
    )


class ConfiguredPartitionedLayer(PartitionedTransformerLayer):
    """The partitioned layer with its submodules chosen from the config it is built with.

    The spec's own submodules give only the core attention (they are the default partitioned spec's,
    unless Megatron-LM replaced its core attention); everything else follows ``config``."""

    def __init__(self, config: Any, submodules: Any = None, *args: Any, **kwargs: Any) -> None:
        spec = spec_for_config(config)
        core = getattr(getattr(getattr(submodules, "self_attention", None), "submodules", None), "core_attention", None)
        if core is not None:
            spec = swap_core_attention(spec, core)
        super().__init__(config, spec.submodules, *args, **{**spec.params, **kwargs})


def _layer_spec(core_attention: str) -> ModuleSpec:
    base = get_partitioned_gpt_layer_spec(core_attention=core_attention)  # its core attention, its submodules
    return ModuleSpec(module=ConfiguredPartitionedLayer, submodules=base.submodules)


partitioned_layer_spec = _layer_spec(CORE_ATTENTION_SDPA)
partitioned_layer_spec_local_attention = _layer_spec("local")


class StageBlockSubmodules:
    """TransformerBlockSubmodules of this rank's layers (``layer_specs``, sized on first use from Megatron-LM's
    arguments) and an SP-capable final norm (``layer_norm``: ``norm.SPTorchNorm``)."""

    layer_norm = SPTorchNorm

    def __init__(self, layer: ModuleSpec) -> None:
        self.layer = layer
        self._count: int | None = None

    @property
    def layer_specs(self) -> list[ModuleSpec]:
        """This pipeline rank's layers (the same count in every virtual stage)."""
        if self._count is None:
            self._count = _layers_per_stage()
        return [self.layer] * self._count


def _layers_per_stage() -> int:
    """Transformer layers per virtual stage of this pipeline rank, from Megatron-LM's parsed arguments."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.training import get_args
    from megatron.training.arguments import core_transformer_config_from_args

    args = get_args()
    config = core_transformer_config_from_args(args)
    vp = getattr(args, "virtual_pipeline_model_parallel_size", None)
    counts = {get_num_layers_to_build(config, vp_stage=v) for v in (range(vp) if vp else [None])}
    if len(counts) != 1:
        raise InfeasibleConfigError(
            f"this pipeline rank's virtual stages hold {sorted(counts)} layers; the block spec with an SP-capable "
            "torch norm needs the same number in each (install Apex or Transformer Engine for their SP norms, "
            f"then use --spec {__name__} partitioned_layer_spec)"
        )
    return counts.pop()


partitioned_block_spec = ModuleSpec(module=TransformerBlock, submodules=StageBlockSubmodules(partitioned_layer_spec))
partitioned_block_spec_local_attention = ModuleSpec(
    module=TransformerBlock, submodules=StageBlockSubmodules(partitioned_layer_spec_local_attention)
)


def transformer_layer_spec(
    config: Any,
    plan: Any,
    vp_stage: int | None = None,
    pp_rank: int | None = None,
    auto: bool = False,
    core_attention: str = CORE_ATTENTION_SDPA,
) -> Any:
    """``GPTModel(transformer_layer_spec=...)`` for code that builds megatron-core's model itself: kareus's
    partitioned layer when `plan` needs it (layer_choice.partitioned_reason), megatron's local layer spec
    otherwise, both from `config` (norms, QK-norm). With sequence parallelism and megatron's torch-norm
    fallback (no Apex, no TE) a ``TransformerBlockSubmodules`` of this stage's layers (`vp_stage`, `pp_rank`)
    whose final norm runs SP. Rank 0 prints which layer and why, in one line."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    from kareus_megatron.runtime.frameworks.layer_choice import partitioned_reason, torch_norm_fallback

    why = partitioned_reason(plan, auto)
    if why is None:
        spec = get_gpt_layer_local_spec(
            qk_layernorm=bool(getattr(config, "qk_layernorm", False)),
            normalization=getattr(config, "normalization", "LayerNorm"),
            qk_l2_norm=bool(getattr(config, "qk_l2_norm", False)),
        )
        line = "kareus: model built with megatron-core's local layer: every instruction of the plan runs 1 nanobatch"
    else:
        spec = spec_for_config(config, core_attention)
        line = f"kareus: model built with kareus's partitioned layer (core attention {core_attention}): {why}"
        if getattr(config, "sequence_parallel", False) and torch_norm_fallback():
            spec = TransformerBlockSubmodules(
                layer_specs=[spec] * get_num_layers_to_build(config, vp_stage, pp_rank), layer_norm=SPTorchNorm
            )
            line += "; final norm: SP-capable torch norm"
    if _rank() == 0 and not vp_stage:
        print(line, flush=True)
    return spec


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

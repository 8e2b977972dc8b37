"""How Megatron-LM and megatron-core spell a plan's model record (plan/schema.py ModelShape).

One table per field, in both directions: the Megatron-LM ``pretrain_gpt.py`` flags that build the model
(jobs/commands.py) and the live megatron-core values the runtime reads back (runtime/frameworks/megatron_patch.py).
Facts from Megatron-LM ``core_v0.16.1`` and ``core_v0.19.0`` (same in both):

- activation: ``--swiglu`` sets ``TransformerConfig.gated_linear_unit = True`` and ``activation_func =
  F.silu``; without it the MLP is ``F.gelu``, not gated (megatron/training/arguments.py
  ``core_transformer_config_from_args``; 0.19: megatron/training/argument_utils.py). ``--squared-relu``
  and ``--quick-geglu`` are activations the planner does not model.
- normalization: ``--normalization LayerNorm|RMSNorm`` (``TransformerConfig.normalization``, default
  LayerNorm).
- positions: ``--position-embedding-type learned_absolute|rope|mrope|relative|none`` (default
  learned_absolute), read back from ``GPTModel.position_embedding_type``; there is no ALiBi.
- head width: ``--kv-channels`` (``TransformerConfig.kv_channels``; hidden / heads when not given).
- biases: ``add_bias_linear`` defaults to True (``--disable-bias-linear`` turns it off) and then forces
  ``add_qkv_bias`` on; ``--add-qkv-bias`` adds the QKV bias alone. The QKV layer has a bias when either is
  set (megatron/core/transformer/attention.py).
- tied embeddings: the default; ``--untie-embeddings-and-output-weights`` unties them
  (``GPTModel.share_embeddings_and_output_weights``).
- QK norm: ``--qk-layernorm`` (``TransformerConfig.qk_layernorm``).
- precision: ``--bf16`` / ``--fp16`` (``TransformerConfig.bf16`` / ``fp16``, ``params_dtype``); FP8 is
  ``--fp8-format hybrid`` on top of ``--bf16`` (Transformer Engine; ``TransformerConfig.fp8``); no flag is
  fp32. Megatron-LM has no TF32 switch: its fp32 runs torch's matmul precision, "highest" by default.
"""

from __future__ import annotations

import functools
from typing import Any, Final

# our activation -> (gated_linear_unit, activation function __name__) and the flags that build it
ACTIVATION_CONFIG: Final[dict[str, tuple[bool, str]]] = {"swiglu": (True, "silu"), "gelu": (False, "gelu")}
ACTIVATION_FLAGS: Final[dict[str, tuple[str, ...]]] = {"swiglu": ("--swiglu",), "gelu": ()}
# our normalization -> TransformerConfig.normalization (= the --normalization value)
NORMALIZATION: Final[dict[str, str]] = {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"}
# our position embedding -> GPTModel.position_embedding_type (= the --position-embedding-type value)
POSITION_EMBEDDING: Final[dict[str, str]] = {"learned": "learned_absolute", "rope": "rope"}
# our precision -> Megatron-LM flags
PRECISION_FLAGS: Final[dict[str, tuple[str, ...]]] = {
    "bf16": ("--bf16",),
    "fp16": ("--fp16",),
    "fp32": (),
    "fp8": ("--bf16", "--fp8-format", "hybrid"),
}
FP8_RECIPE: Final = "hybrid"  # the fp8 format the generated command asks for (E4M3 forward, E5M2 gradients)


def _inverse(table: dict[str, str], value: Any) -> str:
    """Our spelling of megatron's `value`, or megatron's own spelling when we have none."""
    for ours, theirs in table.items():
        if value == theirs:
            return ours
    return str(value)


def live_activation(gated: bool, func: Any) -> str:
    """Our name of a live MLP activation (gated_linear_unit, activation_func), e.g. "swiglu"; an activation
    we do not know is named by megatron's function, with "gated " in front when gated."""
    name = getattr(func, "__name__", None) or getattr(getattr(func, "func", None), "__name__", None)
    name = name or type(func).__name__
    for ours, config in ACTIVATION_CONFIG.items():
        if config == (bool(gated), name):
            return ours
    return f"gated {name}" if gated else str(name)


def live_normalization(value: Any) -> str:
    """Our name of TransformerConfig.normalization ("RMSNorm" -> "rmsnorm")."""
    return _inverse(NORMALIZATION, value)


def live_position_embedding(value: Any) -> str:
    """Our name of GPTModel.position_embedding_type ("learned_absolute" -> "learned")."""
    return _inverse(POSITION_EMBEDDING, value)


def live_precision(*, fp8: Any, bf16: bool, fp16: bool, params_dtype: str, fp32_matmul: str) -> str:
    """The training precision of a live TransformerConfig: `params_dtype` a torch dtype's name
    ("bfloat16"), `fp32_matmul` torch.get_float32_matmul_precision() ("highest" = no TF32)."""
    if fp8:
        return "fp8"
    if bf16 or params_dtype.endswith("bfloat16"):
        return "bf16"
    if fp16 or params_dtype.endswith("float16"):
        return "fp16"
    return "fp32" if fp32_matmul == "highest" else "tf32"


def live_architecture(config: Any, gpt: Any, fp32_matmul: str) -> dict[str, Any]:
    """The ModelShape architecture fields of a live model: its TransformerConfig `config` (get_model_config),
    its unwrapped GPTModel `gpt` and torch.get_float32_matmul_precision() `fp32_matmul`; a value that cannot
    be read is left out (not checked).

    Attributes read (the same in megatron-core 0.16.1 and 0.19.0; see the module docstring):
    TransformerConfig gated_linear_unit, activation_func, normalization, kv_channels, add_bias_linear,
    add_qkv_bias, qk_layernorm, fp8, bf16, fp16, params_dtype; GPTModel position_embedding_type and
    share_embeddings_and_output_weights.
    """
    out: dict[str, Any] = {}
    has = functools.partial(hasattr, config)
    if has("gated_linear_unit") and has("activation_func"):
        out["activation"] = live_activation(bool(config.gated_linear_unit), config.activation_func)
    if isinstance(getattr(config, "normalization", None), str):
        out["normalization"] = live_normalization(config.normalization)
    if isinstance(getattr(config, "kv_channels", None), int):
        out["kv_channels"] = config.kv_channels
    bias = getattr(config, "add_bias_linear", None)
    if isinstance(bias, bool):
        out["bias_linear"] = bias
        out["qkv_bias"] = bias or bool(getattr(config, "add_qkv_bias", False))  # attention.py: either gives QKV one
    if isinstance(getattr(config, "qk_layernorm", None), bool):
        out["qk_norm"] = config.qk_layernorm
    if has("bf16") and has("fp16"):
        out["precision"] = live_precision(
            fp8=getattr(config, "fp8", None),
            bf16=bool(config.bf16),
            fp16=bool(config.fp16),
            params_dtype=str(getattr(config, "params_dtype", "")),
            fp32_matmul=fp32_matmul,
        )
    position = getattr(gpt, "position_embedding_type", None)
    if isinstance(position, str):
        out["position_embedding"] = live_position_embedding(position)
    tied = getattr(gpt, "share_embeddings_and_output_weights", None)
    if isinstance(tied, bool):
        out["tied_embeddings"] = tied
    return out

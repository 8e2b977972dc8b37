"""Core attention on ``torch.nn.functional.scaled_dot_product_attention`` (SDPA), for megatron-core layers.

``SDPAttention`` is a drop-in for megatron-core's unfused ``DotProductAttention`` (the core attention of
``get_gpt_layer_local_spec``): same constructor and forward contract, no parameters (so state dicts are
unchanged), but one SDPA call instead of baddbmm + masked softmax + bmm. On a GPU torch picks a flash,
memory-efficient or cuDNN kernel (O(s) memory); on a CPU it runs the math path. Terms (megatron's):
``sq``/``sk`` query/key length, ``b`` batch, ``np`` query heads and ``ng`` key/value groups per TP rank,
``hn`` head size. Inputs ``query [sq, b, np, hn]``, ``key``/``value [sk, b, ng, hn]``; output
``[sq, b, np * hn]``.

Numerics follow megatron-core's ``DotProductAttention`` and ``FusedScaleMaskSoftmax`` (read in
NVIDIA/Megatron-LM ``core_v0.16.1`` and ``core_v0.19.0``, ``megatron/core/transformer/dot_product_attention.py``
and ``megatron/core/fusions/fused_softmax.py``; the 0.15.3 wheel's is the same in what matters here):

- scale: ``config.softmax_scale`` (the ``softmax_scale`` argument) or ``1/sqrt(hn)``. Megatron divides it
  by the layer number under ``apply_query_key_layer_scaling`` and multiplies the scores back in fp32, so
  the net scale is unchanged; SDPA applies it once inside the kernel, whose softmax runs in fp32 on every
  GPU kernel (so ``attention_softmax_in_fp32=False`` in fp16/bf16 is, if anything, more precise here).
- mask: with the causal mask type, self-attention is causal and a square mask (``[.., s, s]``: megatron's
  default ``[b, 1, s, s]`` or ``[1, 1, s, s]``, or none) is not read: SDPA runs with ``is_causal=True`` and no
  mask, so flash kernels apply and the host never waits to look at the mask (reading it would be a host sync
  per layer call). That is megatron's own contract for the causal type: its fused softmax
  (``ScaledUpperTriangMaskedSoftmax``) and Transformer Engine's attention ignore the mask the same way; only
  its unfused torch-softmax fallback applies it, so a dataloader mask that is not causal (Megatron-LM's
  ``--reset-attention-mask``) needs a padding/arbitrary mask type or ``core_attention='local'``. For other
  mask types (and non-square masks) megatron's boolean mask (True = masked out) is inverted into SDPA's
  (True = attend) on the device. A query row masked out entirely (padding) attends to every key here;
  megatron gives it a uniform average instead (both are finite placeholders the loss ignores).
- GQA: ``enable_gqa=True`` (torch >= 2.5) or ``repeat_interleave`` of key/value, megatron's head order.
- dropout: ``attention_dropout`` (or ``config.attention_dropout``) as SDPA's ``dropout_p`` in training,
  0 in eval, under megatron's model-parallel RNG tracker (as megatron forks it) unless sequence parallel.
- ``attention_bias`` (megatron's local attention refuses it) is added to the scores, as SDPA's float mask.

Context parallelism (CP > 1): the partitioned layer all-gathers K/V over the CP group and this module
attends the local queries (megatron's load-balanced CP layout) to them (``cp_attention.cp_attend``);
elsewhere (K/V not gathered) it refuses in one line.

Refused in one line: packed sequences, sliding-window attention, softmax offsets
(``softmax_type`` other than vanilla), QK-clip. Transformer Engine: a TE variant would swap in
``TEDotProductAttention`` through the same spec seam (``swap_core_attention``); none is shipped here.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec

from kareus_megatron.errors import ConfigError, InfeasibleConfigError
from kareus_megatron.runtime.overlap.cp_attention import cp_attend

CORE_ATTENTION_SDPA = "sdpa"  # SDPAttention (this module)
CORE_ATTENTION_LOCAL = "local"  # megatron-core's DotProductAttention
CORE_ATTENTIONS = (CORE_ATTENTION_SDPA, CORE_ATTENTION_LOCAL)
_HAS_GQA = torch.torch_version.TorchVersion(torch.__version__) >= "2.5"  # SDPA's enable_gqa
_CAUSAL_TYPES = (AttnMaskType.causal,)


class SDPAttention(MegatronModule):
    """megatron-core core attention computed by one scaled_dot_product_attention call (no parameters)."""

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
    ) -> None:
        super().__init__(config=config)
        _refuse(_config_problems(config, layer_number))
        self.config = config
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.tp_group = getattr(pg_collection, "tp", None)  # as DotProductAttention keeps it; unused here
        self.cp_size = int(getattr(config, "context_parallel_size", 1) or 1)
        self.cp_group = getattr(pg_collection, "cp", None)
        if self.cp_size > 1 and self.cp_group is None:
            from megatron.core import parallel_state

            self.cp_group = parallel_state.get_context_parallel_group()
        hn = config.kv_channels
        self.softmax_scale = 1.0 / math.sqrt(hn) if softmax_scale is None else float(softmax_scale)
        self.dropout_p = float(config.attention_dropout if attention_dropout is None else attention_dropout)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        """Attention of query [sq, b, np, hn] over key/value [sk, b, ng, hn]; returns [sq, b, np * hn]."""
        if packed_seq_params is not None:
            raise InfeasibleConfigError(
                "SDPAttention does not support packed sequences (packed_seq_params); use unpacked batches "
                "or megatron-core's TE spec"
            )
        sq, b, n_heads, _ = query.shape
        sk = key.shape[0]
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        if self.cp_size > 1:
            return self._forward_cp(query, key, value, attention_mask, mask_type, attention_bias)
        is_causal, mask = sdpa_mask(attention_mask, mask_type, sq, sk)
        if attention_bias is not None:
            bias, neg = attention_bias.to(query.dtype), float("-inf")
            if is_causal:  # SDPA takes is_causal or a mask, not both
                is_causal, mask = False, causal_attend_mask(sq, sk, query.device)
            mask = bias if mask is None else torch.where(mask, bias, neg)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, hn] views
        dropout_p = self.dropout_p if self.training else 0.0
        if dropout_p > 0.0 and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                ctx = self._attend(q, k, v, mask, is_causal, dropout_p)
        else:
            ctx = self._attend(q, k, v, mask, is_causal, dropout_p)
        # [b, np, sq, hv] -> [sq, b, np * hv]
        return ctx.permute(2, 0, 1, 3).reshape(sq, b, n_heads * ctx.shape[-1])

    def _forward_cp(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: torch.Tensor | None,
        mask_type: AttnMaskType,
        attention_bias: torch.Tensor | None,
    ) -> torch.Tensor:
        """Context parallelism: local queries over every CP rank's gathered K/V (cp_attention.cp_attend)."""
        if mask_type not in _CAUSAL_TYPES or attention_bias is not None:
            raise InfeasibleConfigError(
                "SDPAttention with context parallelism supports causal self-attention without attention_bias only"
            )
        sq, b, n_heads, _ = query.shape
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        dropout_p = self.dropout_p if self.training else 0.0
        rank = torch.distributed.get_rank(self.cp_group)
        if dropout_p > 0.0 and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                ctx = cp_attend(self._attend, q, k, v, mask, self.cp_size, rank, dropout_p)
        else:
            ctx = cp_attend(self._attend, q, k, v, mask, self.cp_size, rank, dropout_p)
        return ctx.permute(2, 0, 1, 3).reshape(sq, b, n_heads * ctx.shape[-1])

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        is_causal: bool,
        dropout_p: float,
    ) -> torch.Tensor:
        """SDPA on [b, heads, s, hn] tensors (key/value may have fewer heads: GQA)."""
        group = q.shape[1] // k.shape[1]
        kw: dict[str, Any] = {}
        if group > 1:
            if _HAS_GQA:
                kw["enable_gqa"] = True
            else:
                k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, scale=self.softmax_scale, **kw
        )


@functools.lru_cache(maxsize=4)  # [s, s] bools each: a model uses one or two shapes
def causal_attend_mask(sq: int, sk: int, device: torch.device) -> torch.Tensor:
    """SDPA's causal mask [sq, sk] (True = attend: keys up to the query), built once per shape and device."""
    return torch.ones(sq, sk, dtype=torch.bool, device=device).tril_()


def sdpa_mask(mask: torch.Tensor | None, mask_type: AttnMaskType, sq: int, sk: int) -> tuple[bool, torch.Tensor | None]:
    """(is_causal, SDPA boolean mask: True = attend) for megatron's mask (True = masked out) and mask type.

    Reads only the mask's dtype and shape (no device value: no host sync); see the module doc for the rules.
    """
    causal_type = mask_type in _CAUSAL_TYPES
    if mask is None or (causal_type and sq == sk and tuple(mask.shape[-2:]) == (sq, sk)):
        if mask is not None and mask.dtype != torch.bool:
            raise InfeasibleConfigError(f"attention_mask must be boolean (True = masked out), got {mask.dtype}")
        if causal_type and sq > 1 and sq != sk:
            raise InfeasibleConfigError(f"causal attention needs equal query and key lengths, got {sq} and {sk}")
        return causal_type and sq > 1, None
    if mask.dtype != torch.bool:
        raise InfeasibleConfigError(f"attention_mask must be boolean (True = masked out), got {mask.dtype}")
    return False, ~mask | mask.all(dim=-1, keepdim=True)  # a fully masked row attends to every key


def _config_problems(config: Any, layer_number: int) -> list[str]:
    """Settings SDPAttention does not implement."""
    problems = []
    if getattr(config, "window_size", None) is not None:
        problems.append(f"sliding-window attention (window_size={config.window_size})")
    if getattr(config, "softmax_type", "vanilla") != "vanilla":
        problems.append(f"softmax_type={config.softmax_type!r}")
    if getattr(config, "qk_clip", False):
        problems.append("qk_clip=True")
    return problems


def _refuse(problems: list[str]) -> None:
    if problems:
        raise InfeasibleConfigError(
            "SDPAttention does not support "
            + ", ".join(problems)
            + "; build the layer with core_attention='local' (megatron's DotProductAttention)"
        )


def swap_core_attention(spec: ModuleSpec, core_attention: type) -> ModuleSpec:
    """A copy of a GPT layer spec whose self-attention uses `core_attention` (the TE seam swaps here too)."""
    sub = spec.submodules
    attn = sub.self_attention
    attn_sub = dataclasses.replace(attn.submodules, core_attention=core_attention)
    new_attn = ModuleSpec(module=attn.module, params=dict(attn.params), submodules=attn_sub)
    return ModuleSpec(
        module=spec.module, params=dict(spec.params), submodules=dataclasses.replace(sub, self_attention=new_attn)
    )


def core_attention_class(name: str) -> type | None:
    """The core-attention class for `name` ("sdpa" | "local"); None: keep the spec's own (local)."""
    if name not in CORE_ATTENTIONS:
        raise ConfigError(f"core_attention={name!r}; use one of: {', '.join(CORE_ATTENTIONS)}")
    return SDPAttention if name == CORE_ATTENTION_SDPA else None


def get_sdpa_gpt_layer_spec(**local_spec_kwargs: Any) -> ModuleSpec:
    """megatron-core's local GPT layer spec with only the core attention swapped for SDPAttention.

    Arguments are those of ``get_gpt_layer_local_spec`` (e.g. ``normalization="RMSNorm"``); dense layers.
    Where megatron would build its torch-norm fallback (no Apex/TE), the norms are ``norm.SPTorchNorm``
    (the same torch modules, also usable with sequence parallelism).
    """
    from kareus_megatron.runtime.overlap.norm import sp_capable_norms

    if local_spec_kwargs.get("num_experts") or local_spec_kwargs.get("multi_latent_attention"):
        raise InfeasibleConfigError("get_sdpa_gpt_layer_spec supports dense GPT layers only (no MoE, no MLA)")
    return sp_capable_norms(swap_core_attention(get_gpt_layer_local_spec(**local_spec_kwargs), SDPAttention))

"""Spawned 2-process worker (gloo) for test_no_host_syncs.py: host syncs of the partitioned layer, per layout.

Each rank writes ``rank{r}.json``: a list of cases ``{"case", "syncs", "ok", "linked", ...}``, each one forward and
one backward of a megatron-core TransformerBlock of partitioned layers under a forward and a backward plan
instruction sent through the hooks listener (runtime/selfcheck/syncs.py ``block_syncs``, which counts with
runtime/selfcheck/sync_count.py), for every attention mask megatron gives a GPT layer (none, [1, 1, s, s],
[b, 1, s, s]; with CP megatron's own CP slice of them, [.., s/cp, s]), 1 and 2 nanobatches (2: every partition at
its last launch slot), full recompute off and on:

- ``tp``: TP=2 (GPT: LayerNorm, GELU, biases; and Llama-like: RMSNorm, SwiGLU, RoPE, GQA, QK-norm);
- ``sp``: TP=2 with sequence parallelism;
- ``cross``: cross-layer overlap, 3 layers, TP=2 (recompute off, and on in groups of 3) and TP=2+SP;
- ``cp``: CP=2 (GPT, and Llama-like with RoPE).
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.distributed as dist

HIDDEN, HEADS, SEQ, MBS = 32, 4, 16, 4
MASKS = ("none", "1x1", "bx1")


def _config(
    tp: int, recompute: bool, layers: int = 2, sp: bool = False, cp: int = 1, llama: bool = False, group: int = 1
) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    extra: dict[str, Any] = (
        dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=group) if recompute else {}
    )
    if llama:
        import torch.nn.functional as F

        extra.update(
            gated_linear_unit=True,
            activation_func=F.silu,
            normalization="RMSNorm",
            num_query_groups=2,
            qk_layernorm=True,
            add_bias_linear=False,
            bias_activation_fusion=False,
        )
    return TransformerConfig(
        num_layers=layers,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        context_parallel_size=cp,
        sequence_parallel=sp,
        pipeline_dtype=torch.float32,
        **extra,
    )


def _masks(cp: int) -> dict[str, torch.Tensor | None]:
    """Megatron's masks by kind; with CP, megatron's own slice for this rank (get_batch_on_this_cp_rank)."""
    from kareus_megatron.runtime.selfcheck.syncs import causal_mask

    out = {kind: causal_mask(kind, MBS, SEQ, "cpu") for kind in MASKS}
    if cp > 1:
        from megatron.core.utils import get_batch_on_this_cp_rank

        out = {
            k: None if m is None else get_batch_on_this_cp_rank({"attention_mask": m})["attention_mask"]
            for k, m in out.items()
        }
    return out


def _rope(cfg: Any) -> torch.Tensor:
    """RoPE frequencies for the sequence, as GPTModel makes them (with CP, this rank's chunks)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    return RotaryEmbedding(kv_channels=cfg.kv_channels, rotary_percent=1.0)(SEQ)


def _cases(
    res: list[dict[str, Any]],
    layout: str,
    slots: dict[str, tuple[str, ...]],
    *,
    tp: int,
    sp: bool = False,
    cp: int = 1,
    llama: bool = False,
    recomputes: tuple[bool, ...] = (False, True),
    nanobatches=(1, 2),
    layers: int = 2,
    cross: bool = False,
    group: int = 1,
) -> None:
    from kareus_megatron.runtime.selfcheck.syncs import block_syncs, instructions, partitioned_block

    spec_kw = dict(normalization="RMSNorm", qk_layernorm=True) if llama else {}
    local = SEQ // cp // (tp if sp else 1)
    x = torch.randn(local, MBS, HIDDEN, generator=torch.Generator().manual_seed(3 + dist.get_rank()))
    masks = _masks(cp)
    for recompute in recomputes:
        cfg = _config(tp, recompute, layers=layers, sp=sp, cp=cp, llama=llama, group=group)
        block = partitioned_block(cfg, "cpu", **spec_kw)
        rope = _rope(cfg) if llama else None
        for n in nanobatches:
            for kind, mask in masks.items():
                r = block_syncs(block, x, mask, instructions(n, slots), rotary_pos_emb=rope, cross_layer=cross)
                rc = f"on{f'.group{group}' if cross else ''}" if recompute else "off"
                name = f"{layout}{'.llama' if llama else ''}.nb{n}.mask_{kind}.recompute_{rc}"
                res.append({"case": name, "mask_shape": None if mask is None else list(mask.shape), **r})


def _init(tp: int, cp: int) -> None:
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)


def worker(rank: int, world: int, port: int, outdir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from kareus_megatron.runtime.frameworks import cpu_shim

    cpu_shim.apply()
    from cp_worker import _cpu_rope_cp_slice
    from megatron.core.tensor_parallel import random as mrandom

    from kareus_megatron.runtime.overlap.config import cp_engine_slots
    from kareus_megatron.vocab import SP_PARTITION_SLOTS, TP_PARTITION_SLOTS

    mrandom._get_cuda_rng_state = lambda *a, **k: None  # full recompute saves the CUDA RNG state: none on CPU
    mrandom._set_cuda_rng_state = lambda *a, **k: None
    _cpu_rope_cp_slice()  # megatron's RoPE CP slice pins host memory: a CPU stand-in taking the same chunks
    res: list[dict[str, Any]] = []
    _init(2, 1)
    _cases(res, "tp", TP_PARTITION_SLOTS, tp=2)
    _cases(res, "tp", TP_PARTITION_SLOTS, tp=2, llama=True, recomputes=(False,), nanobatches=(2,))
    _cases(res, "sp", SP_PARTITION_SLOTS, tp=2, sp=True)
    _cases(res, "cross", TP_PARTITION_SLOTS, tp=2, layers=3, cross=True, nanobatches=(2,), recomputes=(False,))
    _cases(res, "cross", TP_PARTITION_SLOTS, tp=2, layers=3, cross=True, nanobatches=(2,), recomputes=(True,), group=3)
    _cases(
        res, "cross.sp", SP_PARTITION_SLOTS, tp=2, sp=True, layers=3, cross=True, nanobatches=(2,), recomputes=(False,)
    )
    _init(1, 2)
    _cases(res, "cp", cp_engine_slots(), tp=1, cp=2)
    _cases(res, "cp", cp_engine_slots(), tp=1, cp=2, llama=True, recomputes=(False,), nanobatches=(2,))
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.barrier()
    dist.destroy_process_group()

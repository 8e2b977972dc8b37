"""The selfcheck's partitioned-layer check: 1 vs 2 nanobatches on one device against the standard layer.

TP=1 (one device, so no collective runs; the engine's schedule, nanobatch split and merge, hooks and
custom backward still do): a GPTModel built with ``get_partitioned_gpt_layer_spec()`` and one with
megatron-core's ``get_gpt_layer_local_spec()`` share weights; logits and every parameter gradient of one
forward+backward are compared (max abs and max relative difference), with megatron's unfused
``DotProductAttention`` (``core_attention="local"``) and with the partitioned spec's default, ``SDPAttention``
(runtime/overlap/attention.py: torch's ``scaled_dot_product_attention``, flash / memory-efficient kernels on a
GPU), the reference then being megatron's local spec with that core attention (``get_sdpa_gpt_layer_spec``).
"""

from __future__ import annotations

from typing import Any

import torch

from kareus_megatron.runtime.selfcheck.model import Sizes, config

# fp32, sums in another order (per nanobatch, then merged): a few ulps; the limits leave room for TF32-free
# GPU GEMMs over a hidden size of 512 and bf16-free SDPA kernels
MAX_REL = {"cpu": 1e-4, "cuda": 2e-3}


def _models(s: Sizes, device: str, sdpa: bool) -> tuple[Any, Any]:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from kareus_megatron.runtime.overlap import get_partitioned_gpt_layer_spec, get_sdpa_gpt_layer_spec

    if sdpa:  # the partitioned spec's default core attention, on both sides
        ref_spec, part_spec = get_sdpa_gpt_layer_spec(), get_partitioned_gpt_layer_spec(core_attention="sdpa")
    else:
        ref_spec, part_spec = get_gpt_layer_local_spec(), get_partitioned_gpt_layer_spec(core_attention="local")
    cfg = config(torch, s)
    torch.manual_seed(4321)
    ref = GPTModel(cfg, ref_spec, vocab_size=s.vocab, max_sequence_length=s.seq).to(device)
    part = GPTModel(cfg, part_spec, vocab_size=s.vocab, max_sequence_length=s.seq).to(device)
    part.load_state_dict(ref.state_dict())
    return ref, part


def _fwd_bwd(model: Any, s: Sizes, device: str, mask: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, s.vocab, (s.mbs, s.seq), generator=g).to(device)
    pos = torch.arange(s.seq, device=device).expand(s.mbs, s.seq)
    m = torch.triu(torch.ones(s.seq, s.seq, dtype=torch.bool, device=device), 1).view(1, 1, s.seq, s.seq)
    model.zero_grad(set_to_none=True)
    logits = model(tokens, pos, m if mask else None)
    w = torch.linspace(-1.0, 1.0, logits.numel(), device=device).view_as(logits)
    (logits * w).sum().backward()
    return logits.detach(), {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}


def _diff(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(max |a-b|, max |a-b| / max |b|)."""
    d = float((a.double() - b.double()).abs().max())
    return d, d / (float(b.double().abs().max()) + 1e-30)


def _compare(s: Sizes, device: str, sdpa: bool, limit: float) -> dict[str, Any]:
    from kareus_megatron.runtime.overlap import LayerSettings, PartitionedTransformerLayer, get_engine

    ref, part = _models(s, device, sdpa)
    layers = [m for m in part.modules() if isinstance(m, PartitionedTransformerLayer)]
    cores = sorted({type(m.self_attention.core_attention).__name__ for m in layers})
    out_ref, g_ref = _fwd_bwd(ref, s, device, mask=not sdpa)
    state = get_engine().state
    res: dict[str, Any] = {}
    try:
        for n in (1, 2):
            state.set(LayerSettings(nanobatches=n))
            out, g = _fwd_bwd(part, s, device, mask=not sdpa)
            o_abs, o_rel = _diff(out, out_ref)
            worst = max(((k, *_diff(g[k], g_ref[k])) for k in g_ref), key=lambda r: r[2])
            res[f"nanobatches_{n}"] = {
                "out_max_abs": o_abs,
                "out_max_rel": o_rel,
                "grad_max_abs": max(_diff(g[k], g_ref[k])[0] for k in g_ref),
                "grad_max_rel": worst[2],
                "worst_grad": worst[0],
                "grads_compared": len(g_ref),
                "grad_keys_equal": sorted(g) == sorted(g_ref),
            }
    finally:
        state.set(LayerSettings())
    ok = len(layers) == s.layers and all(
        r["out_max_rel"] <= limit and r["grad_max_rel"] <= limit and r["grad_keys_equal"] and r["grads_compared"]
        for r in res.values()
    )
    return {"status": "ok" if ok else "failed", "partitioned_layers": len(layers), "core_attention": cores, **res}


def check_partitioned_layer(torch_module: Any, s: Sizes, device: str) -> dict[str, Any]:
    """Partitioned vs standard layer, 1 and 2 nanobatches, megatron's attention and torch SDPA."""
    limit = MAX_REL["cuda" if device.startswith("cuda") else "cpu"]
    local = _compare(s, device, sdpa=False, limit=limit)
    fast = _compare(s, device, sdpa=True, limit=limit)
    ok = local["status"] == "ok" and fast["status"] == "ok"
    return {
        "status": "ok" if ok else "failed",
        "tp": 1,
        "max_rel_limit": limit,
        "note": "TP=1 on one device: no collective runs; split, merge, schedule and backward do",
        "local_attention": local,
        "sdpa_attention": fast,
    }

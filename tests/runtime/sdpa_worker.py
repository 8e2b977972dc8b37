"""Spawned 2-process worker (gloo, TP=2, fp32) for tests/runtime/test_sdpa_attention.py.

Each rank writes ``rank{r}.json``: per scenario the largest relative difference (<= 1: allclose with
rtol 1e-5) between SDPAttention and megatron-core's DotProductAttention (outputs and gradients), for
the core attention alone, a TransformerLayer and a GPTModel, and the partitioned layer; the test asserts.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.distributed as dist

HIDDEN, HEADS, VOCAB, SEQ, MBS = 64, 8, 128, 16, 4


def _rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a-b| / (1e-5 |b| + 1e-5 max|b|): <= 1 means allclose(a, b, rtol=1e-5, atol=1e-5 max|b|)."""
    atol = 1e-5 * float(b.abs().max()) + 1e-12
    return float(((a - b).abs() / (1e-5 * b.abs() + atol)).max())


def _config(**kw: Any):
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(
        num_layers=2,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=2,
        pipeline_dtype=torch.float32,
    )
    return TransformerConfig(**{**base, **kw})


def _core_pair(cfg, layer_number: int = 1, mask_type=None, **kw):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from kareus_megatron.runtime.overlap.attention import SDPAttention

    args = dict(
        config=cfg,
        layer_number=layer_number,
        attn_mask_type=mask_type or AttnMaskType.causal,
        attention_type="self",
        **kw,
    )
    return DotProductAttention(**args), SDPAttention(**args)


def _qkv(cfg, seed: int, sq: int = SEQ):
    g = torch.Generator().manual_seed(seed)
    np_, ng, hn = cfg.num_attention_heads // 2, cfg.num_query_groups // 2, cfg.kv_channels
    q = torch.randn(sq, MBS, np_, hn, generator=g)
    k = torch.randn(sq, MBS, ng, hn, generator=g)
    v = torch.randn(sq, MBS, ng, hn, generator=g)
    return q, k, v


def _run_core(mod, q, k, v, mask, **kw):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = mod(q, k, v, mask, **kw)
    w = torch.linspace(-1.0, 1.0, out.numel()).view_as(out)
    (out * w).sum().backward()
    return out.detach(), [q.grad, k.grad, v.grad]


def _cmp_core(ref, sdpa, q, k, v, mask, **kw) -> dict[str, Any]:
    o0, g0 = _run_core(ref, q, k, v, mask, **kw)
    o1, g1 = _run_core(sdpa, q, k, v, mask, **kw)
    return {
        "out": _rel_diff(o1, o0),
        "grads": max(_rel_diff(a, b) for a, b in zip(g1, g0)),
        "shape": list(o1.shape),
        "ref_shape": list(o0.shape),
    }


def _core_scenarios(res: dict[str, Any]) -> None:
    from megatron.core.transformer.enums import AttnMaskType

    causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1).view(1, 1, SEQ, SEQ)
    g = torch.Generator().manual_seed(5)
    padding = torch.rand(MBS, 1, SEQ, SEQ, generator=g) < 0.3
    padding[..., 0] = False  # every query attends to at least one key
    cases = {
        "mha.causal.nomask": (dict(), {}, None, AttnMaskType.causal),
        "mha.causal.mask": (dict(), {}, causal, AttnMaskType.causal),
        "mha.padding.mask": (dict(), {}, padding, AttnMaskType.padding),
        "mha.nomask": (dict(), {}, None, AttnMaskType.no_mask),
        "gqa.causal.nomask": (dict(num_query_groups=2), {}, None, AttnMaskType.causal),
        "gqa.causal.mask": (dict(num_query_groups=4), {}, causal, AttnMaskType.causal),
        "gqa.padding.mask": (dict(num_query_groups=2), {}, padding, AttnMaskType.padding),
        "scale.causal": (dict(), dict(softmax_scale=0.37), None, AttnMaskType.causal),
        "qk_layer_scaling": (
            dict(apply_query_key_layer_scaling=True, attention_softmax_in_fp32=True),
            dict(layer_number=3),
            causal,
            AttnMaskType.causal,
        ),
        "kv_channels": (dict(kv_channels=12), {}, causal, AttnMaskType.causal),
    }
    for i, (name, (cfg_kw, mod_kw, mask, mtype)) in enumerate(cases.items()):
        cfg = _config(**cfg_kw)
        ref, sdpa = _core_pair(cfg, mask_type=mtype, **mod_kw)
        res[f"core.{name}"] = _cmp_core(ref, sdpa, *_qkv(cfg, 10 + i), mask, attn_mask_type=mtype)

    # attention_bias (megatron's local attention refuses it): against a hand-written reference
    cfg = _config()
    _, sdpa = _core_pair(cfg)
    q, k, v = _qkv(cfg, 40)
    bias = torch.randn(1, q.shape[2], SEQ, SEQ, generator=g)
    got = sdpa(q, k, v, causal, attention_bias=bias)
    s = torch.einsum("qbhd,kbhd->bhqk", q, k) / cfg.kv_channels**0.5 + bias
    want = torch.einsum("bhqk,kbhd->qbhd", s.masked_fill(causal, float("-inf")).softmax(-1), v).flatten(2)
    res["core.bias"] = {"out": _rel_diff(got, want)}

    # dropout: equal in eval; in training finite, with the planned fraction of probabilities dropped
    p = 0.25
    cfg = _config(attention_dropout=p)
    ref, sdpa = _core_pair(cfg, mask_type=AttnMaskType.no_mask)
    ref.eval()
    sdpa.eval()
    res["core.dropout.eval"] = _cmp_core(ref, sdpa, *_qkv(cfg, 50), causal)
    sdpa.train()
    n_heads, sk = q.shape[2], 64  # uniform attention (q = 0) over one-hot values: output = dropped probs
    q0 = torch.zeros(sk, MBS, n_heads, sk)
    v1 = torch.eye(sk).view(sk, 1, 1, sk).expand(sk, MBS, n_heads, sk).contiguous()
    out = sdpa(q0, q0.clone(), v1, None, attn_mask_type=AttnMaskType.no_mask)
    kept = out[out != 0]
    res["core.dropout.train"] = {
        "finite": bool(torch.isfinite(out).all()),
        "dropped": float((out == 0).float().mean()),
        "kept_value": float(kept.mean()),
        "kept_spread": float(kept.max() - kept.min()),
        "want": 1 / (sk * (1 - p)),
    }

    # refusals: one line each
    from megatron.core.packed_seq_params import PackedSeqParams

    from kareus_megatron.errors import InfeasibleConfigError

    try:
        sdpa(q, k, v, None, packed_seq_params=PackedSeqParams(qkv_format="thd"))
        res["refuse.packed"] = None
    except InfeasibleConfigError as e:
        res["refuse.packed"] = str(e)
    from kareus_megatron.runtime.overlap.attention import SDPAttention

    try:  # (megatron's own DotProductAttention wants a CUDA device for the offset)
        SDPAttention(_config(softmax_type="off-by-one"), 1, AttnMaskType.causal, "self")
        res["refuse.softmax_type"] = None
    except InfeasibleConfigError as e:
        res["refuse.softmax_type"] = str(e)


def _fwd_bwd(model, inputs: tuple, weight_seed: int = 0):
    model.zero_grad(set_to_none=True)
    out = model(*inputs)
    out = out[0] if isinstance(out, tuple) else out
    w = torch.linspace(-1.0, 1.0, out.numel()).view_as(out)
    (out * w).sum().backward()
    return out.detach(), {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}


def _cmp_models(a, b, inputs: tuple) -> dict[str, Any]:
    (o0, g0), (o1, g1) = _fwd_bwd(a, inputs), _fwd_bwd(b, inputs)
    grads = {k: _rel_diff(g1[k], g0[k]) for k in g0}
    return {
        "out": _rel_diff(o1, o0),
        "grads": max(grads.values()),
        "n_grads": len(grads),
        "same_keys": sorted(a.state_dict()) == sorted(b.state_dict()) and set(g0) == set(g1),
        "n_params": len(list(a.parameters())),
    }


def _layer_and_model_scenarios(res: dict[str, Any]) -> None:
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    from kareus_megatron.runtime.overlap import SDPAttention, get_sdpa_gpt_layer_spec

    causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1).view(1, 1, SEQ, SEQ)
    x = torch.randn(SEQ, MBS, HIDDEN, generator=torch.Generator().manual_seed(3))
    cfg = _config(num_layers=1)
    torch.manual_seed(7)
    ref = build_module(get_gpt_layer_local_spec(), config=cfg, layer_number=1)
    torch.manual_seed(7)
    sdpa = build_module(get_sdpa_gpt_layer_spec(), config=cfg, layer_number=1)
    res["layer.same_init"] = all(torch.equal(p, q) for p, q in zip(ref.parameters(), sdpa.parameters()))
    res["layer.core_type"] = type(sdpa.self_attention.core_attention).__name__
    for tag, mask in (("mask", causal), ("nomask", None)):
        res[f"layer.{tag}"] = _cmp_models(ref, sdpa, (x.clone().requires_grad_(), mask))

    llama = dict(
        gated_linear_unit=True,
        activation_func=F.silu,
        normalization="RMSNorm",
        num_query_groups=2,
        qk_layernorm=True,
        add_bias_linear=False,
        bias_activation_fusion=False,
    )
    for tag, cfg_kw, spec_kw, model_kw in (
        ("gpt", {}, {}, {}),
        ("llama", llama, dict(normalization="RMSNorm", qk_layernorm=True), dict(position_embedding_type="rope")),
    ):
        cfg = _config(**cfg_kw)
        torch.manual_seed(11)
        a = GPTModel(cfg, get_gpt_layer_local_spec(**spec_kw), vocab_size=VOCAB, max_sequence_length=SEQ, **model_kw)
        b = GPTModel(cfg, get_sdpa_gpt_layer_spec(**spec_kw), vocab_size=VOCAB, max_sequence_length=SEQ, **model_kw)
        b.load_state_dict(a.state_dict())  # same keys, both ways
        a.load_state_dict(b.state_dict())
        tokens = torch.randint(0, VOCAB, (MBS, SEQ), generator=torch.Generator().manual_seed(4))
        pos = torch.arange(SEQ).expand(MBS, SEQ)
        res[f"model.{tag}"] = _cmp_models(a, b, (tokens, pos, causal))
        res[f"model.{tag}"]["n_sdpa"] = sum(isinstance(m, SDPAttention) for m in b.modules())


def _partitioned_scenarios(res: dict[str, Any]) -> None:
    """The partitioned layer (sdpa and local core attention) equals the standard local layer, 1 and 2 nanobatches."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from kareus_megatron.runtime.overlap import LayerSettings, get_partitioned_gpt_layer_spec, set_engine, setup_overlap

    causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1).view(1, 1, SEQ, SEQ)
    cfg = _config()
    torch.manual_seed(13)
    ref = GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=SEQ)
    tokens = torch.randint(0, VOCAB, (MBS, SEQ), generator=torch.Generator().manual_seed(6))
    pos = torch.arange(SEQ).expand(MBS, SEQ)
    for core in ("sdpa", "local"):
        part = GPTModel(
            cfg, get_partitioned_gpt_layer_spec(core_attention=core), vocab_size=VOCAB, max_sequence_length=SEQ
        )
        part.load_state_dict(ref.state_dict())
        for n in (1, 2):
            engine = setup_overlap(trace=True, settings=LayerSettings(nanobatches=n))
            r = _cmp_models(ref, part, (tokens, pos, causal))
            r["ops"] = sorted({(e["phase"], e["op"]) for e in engine.tracer.events if e["kind"] == "op"})
            r["core_type"] = type(part.decoder.layers[0].self_attention.core_attention).__name__
            res[f"part.{core}.nb{n}"] = r
            set_engine(None)
    try:
        get_partitioned_gpt_layer_spec(core_attention="flash")
        res["refuse.core_name"] = None
    except Exception as e:  # noqa: BLE001
        res["refuse.core_name"] = f"{type(e).__name__}: {e}"


def worker(rank: int, world: int, port: int, outdir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from kareus_megatron.runtime.frameworks import cpu_shim

    cpu_shim.apply()
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    from megatron.core.fusions import fused_softmax

    # the reference's torch softmax path builds its default causal mask (no mask given) on "cuda"
    fused_softmax.get_default_causal_mask = lambda sq: torch.ones(sq, sq, dtype=torch.bool).triu(1)
    from kareus_megatron.runtime.frameworks.megatron_patch import megatron_core_version

    res: dict[str, Any] = {"megatron_core": megatron_core_version()}
    _core_scenarios(res)
    _layer_and_model_scenarios(res)
    _partitioned_scenarios(res)
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.barrier()
    dist.destroy_process_group()

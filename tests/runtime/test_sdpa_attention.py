"""SDPAttention (runtime/overlap/attention.py) against megatron-core's DotProductAttention, fp32 on CPU.

One spawned 2-rank worker (gloo, TP=2; sdpa_worker.py) runs every scenario: the core attention alone
(causal MHA, GQA, with and without an explicit mask, padding mask, softmax_scale, query-key layer
scaling, dropout), a TransformerLayer and GPTModels (GPT and Llama-like) built with the local spec and
with ``get_sdpa_gpt_layer_spec``, and the partitioned layer with either core attention; outputs and
gradients must agree within rtol 1e-5. tests/runtime/test_framework_versions.py reruns this file
against the other supported megatron-core series.
"""

from __future__ import annotations

import os

import pytest
from _dist import MEGATRON_CORE, read_ranks, spawn

from kareus_megatron.vocab import TP_PARTITION_SLOTS


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    import sdpa_worker

    out = tmp_path_factory.mktemp("sdpa")
    spawn(sdpa_worker.worker, 2, str(out), preload=MEGATRON_CORE)
    return read_ranks(out, "rank{rank}.json", 2)


def test_runs_against_the_requested_megatron_core(ranks):
    want = os.environ.get("KAREUS_TEST_MEGATRON_CORE", "0.16.1")
    assert all(rk["megatron_core"] == want for rk in ranks)


def test_core_attention_equals_dot_product_attention(ranks):
    names = [k for k in ranks[0] if k.startswith("core.") and "out" in ranks[0][k] and "grads" in ranks[0][k]]
    assert len(names) == 11  # 10 mask/GQA/scale cases + dropout in eval
    for rk in ranks:
        for name in names:
            r = rk[name]
            assert r["shape"] == r["ref_shape"], name
            assert r["out"] <= 1.0 and r["grads"] <= 1.0, (name, r)


def test_attention_bias_is_added_to_the_scores(ranks):
    for rk in ranks:
        assert rk["core.bias"]["out"] <= 1.0


def test_dropout_in_training_drops_the_configured_fraction(ranks):
    for rk in ranks:
        r = rk["core.dropout.train"]
        assert r["finite"]
        assert abs(r["dropped"] - 0.25) < 0.03, r  # 64 x 4 x 4 x 64 Bernoulli draws per rank
        assert abs(r["kept_value"] - r["want"]) < 1e-6 and r["kept_spread"] < 1e-6  # kept ones scaled 1/(1-p)


def test_unsupported_inputs_refused_in_one_line(ranks):
    for key, words in (("refuse.packed", "packed"), ("refuse.softmax_type", "softmax_type")):
        msg = ranks[0][key]
        assert msg and words in msg and "\n" not in msg, key
    assert "core_attention='flash'" in ranks[0]["refuse.core_name"] and "sdpa, local" in ranks[0]["refuse.core_name"]


def test_layer_and_models_equal_the_local_spec(ranks):
    for rk in ranks:
        assert rk["layer.same_init"] and rk["layer.core_type"] == "SDPAttention"
        for name in ("layer.mask", "layer.nomask", "model.gpt", "model.llama"):
            r = rk[name]
            assert r["same_keys"] and r["n_grads"] == r["n_params"] >= 6, (name, r)
            assert r["out"] <= 1.0 and r["grads"] <= 1.0, (name, r)
        assert rk["model.gpt"]["n_sdpa"] == rk["model.llama"]["n_sdpa"] == 2


def test_partitioned_layer_with_either_core_attention_equals_the_standard_layer(ranks):
    fwd_ops = {"input_norm", "qkv", "rope", "attention", "proj", "pre_mlp_norm", "fc1", "activation", "fc2", "bda"}
    slots = {s for v in TP_PARTITION_SLOTS.values() for s in v}
    for rk in ranks:
        for core, cls in (("sdpa", "SDPAttention"), ("local", "DotProductAttention")):
            for n in (1, 2):
                r = rk[f"part.{core}.nb{n}"]
                assert r["core_type"] == cls
                assert r["same_keys"] and r["out"] <= 1.0 and r["grads"] <= 1.0, (core, n, r)
                ops = {tuple(o) for o in r["ops"]}
                assert {op for ph, op in ops if ph == "forward"} == fwd_ops, (core, n)
                # the core attention's hooks still mark q/k for the backward's "rope" slot
                bwd = {op for ph, op in ops if ph == "backward"}
                assert {"rope", "attention", "qkv"} <= bwd and bwd <= slots | fwd_ops, (core, n, bwd)


def test_mask_conversion_reads_shape_and_dtype_only():
    import torch
    from megatron.core.transformer.enums import AttnMaskType

    from kareus_megatron.errors import InfeasibleConfigError
    from kareus_megatron.runtime.overlap import attention as a
    from kareus_megatron.runtime.selfcheck.sync_count import SyncCount

    s, b = 8, 3
    causal = torch.ones(s, s, dtype=torch.bool).triu(1)
    padding = torch.rand(b, 1, s, s, generator=torch.Generator().manual_seed(1)) < 0.3
    with SyncCount() as sc:  # megatron's masks for a GPT layer: None, [1, 1, s, s], [b, 1, s, s]; none is read
        for mask in (None, causal.view(1, 1, s, s), causal.expand(b, 1, s, s).contiguous()):
            assert a.sdpa_mask(mask, AttnMaskType.causal, s, s) == (True, None)  # flash-eligible: no mask
            for half in mask.chunk(2, dim=0) if mask is not None and mask.shape[0] > 1 else ():  # nanobatches
                assert a.sdpa_mask(half, AttnMaskType.causal, s, s) == (True, None)
        # the causal type's contract (megatron's fused softmax and TE): a square mask is not looked at
        assert a.sdpa_mask(padding, AttnMaskType.causal, s, s) == (True, None)
        is_causal, m = a.sdpa_mask(padding, AttnMaskType.padding, s, s)  # other types: the mask as given
        assert not is_causal and m.shape == padding.shape
        rect = causal[: s // 2]
        is_causal, m2 = a.sdpa_mask(rect, AttnMaskType.causal, s // 2, s)  # not square: as given
        assert not is_causal and m2.shape == rect.shape
    assert sc.total == 0, sc.report()
    assert torch.equal(m, ~padding | padding.all(dim=-1, keepdim=True))  # a fully masked row attends to all
    assert a.sdpa_mask(None, AttnMaskType.causal, 1, s) == (False, None)  # one query (decoding): nothing to mask
    assert a.sdpa_mask(None, AttnMaskType.padding, s, s) == (False, None)
    cached = a.causal_attend_mask(s, s, torch.device("cpu"))  # the bias path's causal mask: once per shape, device
    assert cached is a.causal_attend_mask(s, s, torch.device("cpu")) and torch.equal(cached, ~causal)
    for bad, sq, kind in (
        (torch.zeros(1, 1, s, s), s, AttnMaskType.causal),
        (None, s - 1, AttnMaskType.causal),
        (torch.zeros(1, 1, s, s), s, AttnMaskType.padding),
    ):
        with pytest.raises(InfeasibleConfigError):
            a.sdpa_mask(bad, kind, sq, s)

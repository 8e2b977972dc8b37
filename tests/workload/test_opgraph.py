"""Per-layer op graph (workload/opgraph.py): order, FLOP and byte counts, collectives and links."""

from __future__ import annotations

import pytest

from kareus_megatron.vocab import BACKWARD_SEGMENTS, BACKWARD_TAIL, FORWARD_SEGMENTS
from kareus_megatron.workload.models import model_spec
from kareus_megatron.workload.opgraph import (
    dp_grad_ops,
    group_link,
    layer_ops,
    p2p_op,
    pp_boundary_link,
    stage_extra_ops,
)
from kareus_megatron.workload.parallel import make_parallel

LLAMA = model_spec("llama3.2-3b")


def _par(**kw):
    base = dict(
        tp=8,
        pp=2,
        micro_batch_size=8,
        seq_length=4096,
        num_microbatches=8,
        recompute="full",
        nodes=2,
        gpus_per_node=8,
        first_stage_layers=15,
        last_stage_layers=13,
    )
    base.update(kw)
    return make_parallel(LLAMA, **base)


def _compute_by_segment(ops):
    out: dict[str, list[str]] = {}
    for op in ops:
        if op.kind not in ("collective", "p2p"):
            out.setdefault(op.segment, []).append(op.name)
    return out


def test_forward_follows_the_vocabulary():
    ops = layer_ops(LLAMA, _par(), "forward")
    assert _compute_by_segment(ops) == {k: list(v) for k, v in FORWARD_SEGMENTS.items()}
    # each segment ends with its TP all-reduce
    colls = [(i, op) for i, op in enumerate(ops) if op.kind == "collective"]
    assert [op.collective for _, op in colls] == ["tp_all_reduce", "tp_all_reduce"]
    assert [ops[i - 1].name for i, _ in colls] == ["proj", "fc2"]
    assert [op.segment for _, op in colls] == ["attn", "mlp"]


def test_backward_follows_the_vocabulary():
    ops = layer_ops(LLAMA, _par(), "backward")
    seg = _compute_by_segment(ops)
    assert seg["mlp"] == list(BACKWARD_SEGMENTS["mlp"]) and seg["attn"] == list(BACKWARD_SEGMENTS["attn"])
    assert seg["tail"] == list(BACKWARD_TAIL)
    names = [op.name for op in ops]
    assert names.index("mlp_tp_all_reduce") == names.index("fc1") + 1
    assert names[-2:] == ["attn_tp_all_reduce", "input_norm"]


def test_gemm_flops_match_parameter_count():
    par = _par()
    t = par.micro_batch_size * par.seq_length
    fwd = layer_ops(LLAMA, par, "forward")
    gemm = sum(op.flops for op in fwd if op.kind == "gemm")
    weights = LLAMA.layer_params - 2 * LLAMA.hidden_size  # norms have no GEMM
    assert gemm == pytest.approx(2 * t * weights / par.tp, rel=1e-9)
    bwd = layer_ops(LLAMA, par, "backward")
    assert sum(op.flops for op in bwd if op.kind == "gemm") == pytest.approx(2 * gemm)
    # causal attention: 4·s²·d·heads / 2 per sample, per TP rank
    att = next(op for op in fwd if op.name == "attention")
    assert att.flops == pytest.approx(par.micro_batch_size * 4 * 4096**2 * 128 * 24 / 2 / 8)
    # all-reduce payload: the layer output of the microbatch in bf16
    ar = next(op for op in fwd if op.kind == "collective")
    assert ar.comm_bytes == t * LLAMA.hidden_size * 2 and ar.group_size == 8 and ar.link == "nvlink"


def test_nanobatch_halves_work():
    par = _par()
    one = layer_ops(LLAMA, par, "forward", nanobatches=1)
    two = layer_ops(LLAMA, par, "forward", nanobatches=2)
    assert [o.name for o in one] == [o.name for o in two]
    for a, b in zip(one, two):
        assert b.flops == pytest.approx(a.flops / 2) and b.comm_bytes == pytest.approx(a.comm_bytes / 2)
    with pytest.raises(Exception, match="nanobatches"):
        layer_ops(LLAMA, _par(micro_batch_size=3), "forward", nanobatches=2)


def test_recompute_variants():
    assert layer_ops(LLAMA, _par(recompute="none"), "recompute") == ()
    full = layer_ops(LLAMA, _par(), "recompute")
    assert [o.name for o in full] == [o.name for o in layer_ops(LLAMA, _par(), "forward")]
    assert all(o.phase == "recompute" for o in full)
    assert [o.name for o in layer_ops(LLAMA, _par(recompute="selective"), "recompute")] == ["attention"]


def test_sequence_parallel_uses_gather_and_scatter():
    par = _par(sequence_parallel=True)
    fwd = layer_ops(LLAMA, par, "forward")
    kinds = [o.collective for o in fwd if o.kind == "collective"]
    assert kinds == ["tp_all_gather", "tp_reduce_scatter", "tp_all_gather", "tp_reduce_scatter"]
    norm_sp = next(o for o in fwd if o.name == "input_norm")
    norm = next(o for o in layer_ops(LLAMA, _par(), "forward") if o.name == "input_norm")
    assert norm_sp.hbm_bytes == pytest.approx(norm.hbm_bytes / 8)


def test_context_parallel_kv_collectives():
    par = make_parallel(
        LLAMA,
        tp=4,
        cp=2,
        pp=2,
        micro_batch_size=8,
        seq_length=4096,
        nodes=2,
        gpus_per_node=8,
        first_stage_layers=15,
        last_stage_layers=13,
    )
    fwd = [o.name for o in layer_ops(LLAMA, par, "forward")]
    assert fwd.index("attn_cp_all_gather") == fwd.index("rope") + 1 == fwd.index("attention") - 1
    bwd = [o.name for o in layer_ops(LLAMA, par, "backward")]
    assert bwd.index("attn_cp_reduce_scatter") == bwd.index("attention") + 1
    ag = next(o for o in layer_ops(LLAMA, par, "forward") if o.collective == "cp_all_gather")
    # gathered K and V of the whole sequence for 8 KV heads over TP=4: 8·4096·2·(8·128/4)·2 bytes
    assert ag.comm_bytes == 8 * 4096 * 2 * (8 * 128 / 4) * 2 and ag.group_size == 2 and ag.link == "nvlink"
    qkv = next(o for o in layer_ops(LLAMA, par, "forward") if o.name == "qkv")
    assert qkv.gemm_mnk[0] == 8 * 4096 // 2  # local tokens


def test_links_follow_rank_order():
    par = _par()
    assert group_link(par, "tp") == "nvlink" and group_link(par, "pp") == "network"
    assert pp_boundary_link(par, 0) == "network" and p2p_op(LLAMA, par).link == "network"
    # 4 GPUs a node: a TP group of 8 spans two nodes
    wide = make_parallel(LLAMA, tp=8, pp=2, nodes=4, gpus_per_node=4, first_stage_layers=15, last_stage_layers=13)
    assert group_link(wide, "tp") == "network"
    one_node = make_parallel(LLAMA, tp=2, pp=2, dp=2, nodes=1, gpus_per_node=8)
    assert {group_link(one_node, g) for g in ("tp", "dp", "pp")} == {"nvlink"}
    assert pp_boundary_link(one_node, 0) == "nvlink"


def test_stage_extras_and_dp():
    par = _par()
    first = [o.name for o in stage_extra_ops(LLAMA, par, 0, "forward")]
    last = [o.name for o in stage_extra_ops(LLAMA, par, 1, "forward")]
    assert first == ["embedding", "embedding_tp_all_reduce"]
    assert last[:3] == ["final_norm", "output", "loss"]
    out = next(o for o in stage_extra_ops(LLAMA, par, 1, "forward") if o.name == "output")
    assert out.gemm_mnk == (8 * 4096, 128256 // 8, 3072)
    assert stage_extra_ops(LLAMA, par, 1, "recompute") == ()
    assert p2p_op(LLAMA, par).comm_bytes == 8 * 4096 * 3072 * 2
    assert dp_grad_ops(LLAMA, par, 0) == ()
    dp = make_parallel(LLAMA, tp=2, pp=2, dp=2, nodes=1, gpus_per_node=8)
    (rs,) = dp_grad_ops(LLAMA, dp, 0)
    assert rs.collective == "dp_reduce_scatter" and rs.group_size == 2
    assert rs.comm_bytes == pytest.approx((14 * LLAMA.layer_params + LLAMA.embedding_params) / 2 * 4)

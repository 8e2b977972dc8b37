"""The per-GPU memory model (cost/memory.py) against Korthikanti et al. and Megatron's memory formula.

The reference numbers are written out here from the published formulas (docs/sources.md#memory-model),
not from the module: Korthikanti et al. (MLSys 2023) Table 2, and Megatron-LM's
`megatron/training/theoretical_memory_usage.py` (18 bytes per parameter, 6 + 12/DP with the distributed
optimizer; activations (18 + 4 ffn/h) sbh / t per layer with SP + selective recompute, times the
layers of stage 0's in-flight microbatches).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from kareus_megatron.cost.memory import (
    check_fits,
    chunk_microbatches_in_flight,
    job_memory,
    layer_activation_bytes,
    stage_memory,
)
from kareus_megatron.errors import InfeasibleConfigError
from kareus_megatron.hardware.gpus import gpu_spec
from kareus_megatron.workload.models import model_from_dict, model_spec
from kareus_megatron.workload.parallel import make_parallel

# GPT-style model with the paper's assumptions: MHA, GeLU MLP of 4h, LayerNorm
GPT = model_from_dict(
    {
        "num_layers": 24,
        "hidden_size": 2048,
        "num_attention_heads": 16,
        "ffn_hidden_size": 8192,
        "vocab_size": 51200,
        "activation": "gelu",
        "norm": "layernorm",
        "position": "learned",
    },
    "gpt",
)


def test_layer_activations_are_korthikanti_34sbh_plus_5as2b():
    s, b, h, a = 2048, 4, GPT.hidden_size, GPT.num_attention_heads
    par = make_parallel(GPT, micro_batch_size=b, seq_length=s)
    got = layer_activation_bytes(GPT, par, "none", flash_attention=False, dropout=True)
    assert got == pytest.approx(s * b * h * 34 + 5 * a * s * s * b, rel=1e-12)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_layer_activations_with_tp_sp_and_selective_match_table_2(tp):
    s, b, h, a = 2048, 4, GPT.hidden_size, GPT.num_attention_heads
    kw = dict(tp=tp, micro_batch_size=b, seq_length=s)
    tp_only = layer_activation_bytes(GPT, make_parallel(GPT, **kw), "none", flash_attention=False, dropout=True)
    assert tp_only == pytest.approx(s * b * h * (10 + 24 / tp + 5 * a * s / (h * tp)), rel=1e-12)
    sp = make_parallel(GPT, sequence_parallel=True, **kw)
    assert layer_activation_bytes(GPT, sp, "selective", dropout=True) == pytest.approx(s * b * h * 34 / tp, rel=1e-12)
    assert layer_activation_bytes(GPT, sp, "full") == pytest.approx(2 * s * b * h / tp, rel=1e-12)


def _megatron_formula(model, par, distributed_optimizer):
    """Megatron-LM theoretical_memory_usage.py, SP + selective branch, for stage 0 (bytes)."""
    h, L, t, p = model.hidden_size, model.num_layers, par.tp, par.pp
    layer = 2 * h * (model.ffn_hidden_size + 2) + 2 * h * h * 2  # MLP, two LayerNorms (w+b), MHA
    block = layer * L + 2 * h
    shard = (block / p + model.vocab_size * h) / t
    per_param = 6 + 12 / par.dp if distributed_optimizer else 18
    sbh = par.seq_length * par.micro_batch_size * h
    act = sbh * (18 + 4 * model.ffn_hidden_size / h) * L
    act += 8 * par.seq_length * par.micro_batch_size * p + sbh * p
    if par.vp > 1:
        act *= 1 + (p - 1) / (p * par.vp)
    elif p > 1:
        act *= min(1, par.num_microbatches / p)
    return shard * per_param, act / t


@pytest.mark.parametrize(
    "tp,pp,vp,dp,dist", [(2, 2, 1, 1, False), (4, 4, 1, 2, True), (8, 2, 1, 4, True), (2, 4, 2, 1, False)]
)
def test_stage_0_matches_megatron_formula(tp, pp, vp, dp, dist):
    par = make_parallel(
        GPT,
        tp=tp,
        pp=pp,
        vp=vp,
        dp=dp,
        sequence_parallel=True,
        micro_batch_size=2,
        seq_length=2048,
        num_microbatches=8,
        recompute="selective",
    )
    m = stage_memory(GPT, par, 0, distributed_optimizer=dist, dropout=True)
    ref_state, ref_act = _megatron_formula(GPT, par, dist)
    # state: Megatron counts LayerNorm biases and 1/PP of the final norm, this model neither (< 0.01%)
    assert m.weights_bytes + m.grads_bytes + m.optimizer_bytes == pytest.approx(ref_state, rel=1e-3)
    # activations: Megatron divides token ids by TP and splits nothing by stage layer counts (< 0.1%)
    assert m.activations_bytes == pytest.approx(ref_act, rel=1e-3)


def test_in_flight_microbatches():
    par = make_parallel(GPT, pp=4, num_microbatches=8)
    assert [chunk_microbatches_in_flight(par, s) for s in range(4)] == [4, 3, 2, 1]
    few = make_parallel(GPT, pp=4, num_microbatches=2)
    assert chunk_microbatches_in_flight(few, 0) == 2
    inter = make_parallel(GPT, pp=4, vp=2, num_microbatches=8)
    # Megatron's interleaved warm-up: 2 (pp - s - 1) + (vp - 1) pp forwards, then one more in 1F1B
    assert [chunk_microbatches_in_flight(inter, s) for s in range(4)] == [11, 9, 7, 5]


def _peak(model, **kw):
    return max(m.total_bytes for m in job_memory(model, make_parallel(model, **kw)))


def test_more_tp_or_pp_means_less_per_gpu():
    llama = model_spec("llama3.2-3b")
    kw = dict(micro_batch_size=4, seq_length=4096, num_microbatches=8, recompute="selective")
    assert _peak(llama, tp=8, pp=1, **kw) < _peak(llama, tp=4, pp=1, **kw) < _peak(llama, tp=2, pp=1, **kw)
    assert _peak(llama, tp=2, pp=4, **kw) < _peak(llama, tp=2, pp=2, **kw) < _peak(llama, tp=2, pp=1, **kw)


def test_full_recompute_holds_less_activation_memory_than_selective_than_none():
    llama = model_spec("llama3.2-3b")
    act = {
        r: stage_memory(
            llama,
            make_parallel(llama, tp=8, pp=2, micro_batch_size=8, seq_length=4096, num_microbatches=8, recompute=r),
            0,
        ).activations_bytes
        for r in ("none", "selective", "full")
    }
    assert act["full"] < act["selective"] < act["none"]


def test_distributed_optimizer_shards_optimizer_state_over_dp():
    llama = model_spec("llama3.2-3b")
    par = make_parallel(llama, tp=8, pp=2, dp=4)
    plain, dist = stage_memory(llama, par, 0), stage_memory(llama, par, 0, distributed_optimizer=True)
    assert dist.optimizer_bytes == pytest.approx(plain.optimizer_bytes / 4)
    assert dist.weights_bytes == plain.weights_bytes and dist.grads_bytes == plain.grads_bytes


def test_default_job_fits_and_70b_on_one_gpu_does_not():
    gpu = gpu_spec("a100-sxm4-40gb")
    llama = model_spec("llama3.2-3b")
    par = make_parallel(
        llama,
        tp=8,
        pp=2,
        micro_batch_size=8,
        seq_length=4096,
        num_microbatches=8,
        recompute="full",
        first_stage_layers=15,
        last_stage_layers=13,
    )
    assert max(m.total_bytes for m in check_fits(gpu, llama, par)) < gpu.memory_bytes
    big = model_spec("llama3.3-70b")
    with pytest.raises(InfeasibleConfigError, match=r"needs [\d.]+ GB per GPU on stage 0 \(weights"):
        check_fits(gpu, big, make_parallel(big, micro_batch_size=1, seq_length=4096))


def test_cli_refuses_70b_on_one_a100_40gb_with_one_line_exit_2(tmp_path):
    argv = [
        "--gpu",
        "a100-sxm4-40gb",
        "--model",
        "llama3.3-70b",
        "--tp",
        "1",
        "--pp",
        "1",
        "--mbs",
        "1",
        "--gpus-per-node",
        "1",
    ]
    for cmd in (["plan", "--out", str(tmp_path / "out")], ["predict"]):
        r = subprocess.run(
            [sys.executable, "-m", "kareus_megatron.cli.main", *cmd, *argv], capture_output=True, text=True, timeout=120
        )
        assert r.returncode == 2, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
        assert "needs" in lines[0] and "GB per GPU" in lines[0] and "a100-sxm4-40gb has 40.0 GB" in lines[0]
        assert r.stdout == ""
    assert not (tmp_path / "out").exists()


def test_full_recompute_keeps_layer_inputs_plus_one_rematerialised_layer_and_the_logits():
    llama = model_spec("llama3.2-3b")
    par = make_parallel(
        llama,
        tp=8,
        pp=2,
        micro_batch_size=8,
        seq_length=4096,
        num_microbatches=8,
        recompute="full",
        first_stage_layers=15,
        last_stage_layers=13,
    )
    tokens, h = 8 * 4096, llama.hidden_size
    one_layer = layer_activation_bytes(llama, par, "none")
    # stage 0: 2 microbatches in flight × 15 layer inputs (bf16), one layer recomputed, int64 token ids
    first = stage_memory(llama, par, 0).activations_bytes
    assert first == pytest.approx(2 * 15 * 2 * tokens * h + one_layer + 2 * 8 * tokens, rel=1e-12)
    # last stage: 1 in flight × 13 inputs, one layer, final-norm and output inputs, fp32 softmax over vocab / TP
    last = stage_memory(llama, par, 1).activations_bytes
    assert last == pytest.approx(
        13 * 2 * tokens * h + one_layer + 4 * tokens * h + 4 * tokens * llama.vocab_size / 8, rel=1e-12
    )

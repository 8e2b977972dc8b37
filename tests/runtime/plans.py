"""Test plans for the tiny GPT used by the runtime tests (built directly; the planner is not involved).

``megatron_order`` writes down megatron-core 0.16.1's per-rank instruction order independently of the
runtime: 1F1B runs min(P - r - 1, M) warm-up forwards, then alternates forward/backward, then drains
backwards; the interleaved schedule walks microbatch groups of size P, every chunk in turn (backward
with chunks reversed), with (P - r - 1) * 2 + (V - 1) * P warm-up forwards.
"""

from __future__ import annotations

from kareus_megatron.plan.schema import Instruction, ModelShape, ParallelLayout, Plan, Predicted, StagePlan

HIDDEN = 32
HEADS = 4
VOCAB = 128
SEQ = 16
MBS = 2
GPU = "a100-sxm4-40gb"
# tiny_gpt.py's model: megatron-core's defaults with the local layer spec (GELU, LayerNorm, learned
# positions, biases; GPTModel unties the output layer unless asked), fp32.
TINY_GPT_ARCH = dict(
    activation="gelu",
    normalization="layernorm",
    position_embedding="learned",
    kv_channels=HIDDEN // HEADS,
    bias_linear=True,
    qkv_bias=True,
    tied_embeddings=False,
    qk_norm=False,
    precision="fp32",
)
# Lockable on the A100 preset (15 MHz grid); repeated values exercise "unchanged" skips.
CLOCK_CYCLE = (1410, 1200, 1200, 1005, 1305, 990, 1095, 1410, 1155)


def megatron_order(pp: int, rank: int, m: int, vp: int = 1) -> list[tuple[str, int, int]]:
    """(kind, chunk, microbatch) in the order megatron-core runs them on pipeline rank `rank`."""
    if vp == 1:
        warm = min(pp - rank - 1, m)
        out = [("forward", 0, i) for i in range(warm)]
        for i in range(m - warm):
            out += [("forward", 0, warm + i), ("backward", 0, i)]
        out += [("backward", 0, i) for i in range(m - warm, m)]
        return out
    table = [(mb, c) for g in range(0, m, pp) for c in range(vp) for mb in range(g, min(g + pp, m))]
    total = m * vp
    warm = min((pp - rank - 1) * 2 + (vp - 1) * pp, total)

    def fwd(k: int) -> tuple[str, int, int]:
        mb, c = table[k]
        return ("forward", c, mb)

    def bwd(k: int) -> tuple[str, int, int]:
        mb, c = table[k]
        return ("backward", vp - 1 - c, mb)

    out = [fwd(k) for k in range(warm)]
    for i in range(total - warm):
        out += [fwd(warm + i), bwd(i)]
    out += [bwd(k) for k in range(total - warm, total)]
    return out


def tiny_plan(
    pp: int = 2,
    vp: int = 1,
    m: int = 4,
    *,
    layers_per_chunk: int = 1,
    seed: int = 0,
    clocks: tuple[int, ...] = CLOCK_CYCLE,
    **parallel_overrides: object,
) -> Plan:
    """A valid plan for the tiny GPT on `pp` ranks × `vp` chunks with `m` microbatches."""
    num_layers = pp * vp * layers_per_chunk
    stages = []
    for r in range(pp):
        instrs = []
        for k, (kind, chunk, mb) in enumerate(megatron_order(pp, r, m, vp)):
            mhz = clocks[(k + 3 * r + seed) % len(clocks)]
            instrs.append(
                Instruction(
                    kind=kind,
                    microbatch=mb,
                    chunk=chunk,
                    sm_clock_mhz=mhz,
                    predicted_time_s=0.002 if kind == "forward" else 0.004,
                    predicted_energy_j=0.5 if kind == "forward" else 1.0,
                )
            )
        stages.append(StagePlan(pp_rank=r, instructions=tuple(instrs)))
    layout = dict(
        tp=1,
        cp=1,
        pp=pp,
        vp=vp,
        dp=1,
        micro_batch_size=MBS,
        seq_length=SEQ,
        num_microbatches=m,
        layers_per_stage=tuple([vp * layers_per_chunk] * pp),
        nodes=1,
        gpus_per_node=pp,
        schedule="interleaved-1f1b" if vp > 1 else "1f1b",
    )
    layout.update(parallel_overrides)
    return Plan(
        format="kareus-plan/1",
        method="kareus",
        gpu=GPU,
        model=ModelShape(
            name="tiny-gpt",
            num_layers=num_layers,
            hidden_size=HIDDEN,
            num_attention_heads=HEADS,
            num_query_groups=HEADS,
            ffn_hidden_size=4 * HIDDEN,
            vocab_size=VOCAB,
            **TINY_GPT_ARCH,
        ),
        parallel=ParallelLayout(**layout),
        predicted=Predicted(iteration_time_s=0.05, iteration_energy_j=40.0),
        stages=tuple(stages),
    )

"""The selfcheck's tiny megatron-core GPT (PP=1, TP=1), its training loop and its kareus plan.

megatron-core's defaults with the local layer spec (GELU, LayerNorm, learned positions, biases, untied
output layer), fp32, no dropout; data deterministic per (iteration, microbatch), so two runs from the same
seed see the same tokens and weights. ``forward_backward_no_pipelining`` (megatron-core 0.16.1,
pipeline_parallel/schedules.py) runs forward then backward of each microbatch in turn: the plan's order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any

from kareus_megatron.plan.schema import Instruction, ModelShape, ParallelLayout, Plan, Predicted, StagePlan
from kareus_megatron.vocab import SCHEDULE_1F1B, InstructionKind

KINDS: tuple[InstructionKind, ...] = ("forward", "backward")  # per microbatch, in the no-pipelining order

ARCH: dict[str, Any] = dict(
    activation="gelu",
    normalization="layernorm",
    position_embedding="learned",
    bias_linear=True,
    qkv_bias=True,
    tied_embeddings=False,
    qk_norm=False,
    precision="fp32",
)


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Model and run sizes: hidden size, heads, layers, vocabulary, sequence (tokens), micro-batch."""

    hidden: int
    heads: int
    layers: int
    vocab: int
    seq: int
    mbs: int
    microbatches: int
    iterations: int

    @classmethod
    def tiny(cls) -> Sizes:
        """CPU dry run: seconds."""
        return cls(hidden=32, heads=4, layers=1, vocab=128, seq=16, mbs=2, microbatches=2, iterations=4)

    @classmethod
    def gpu(cls) -> Sizes:
        """One GPU: big enough that an iteration is a few ms of kernels, small enough for seconds."""
        return cls(hidden=512, heads=8, layers=4, vocab=4096, seq=256, mbs=4, microbatches=4, iterations=12)

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


def config(torch: Any, s: Sizes, **extra: Any) -> Any:
    """The megatron TransformerConfig of the selfcheck's GPT."""
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=s.layers,
        hidden_size=s.hidden,
        num_attention_heads=s.heads,
        use_cpu_initialization=True,
        pipeline_dtype=torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        **extra,
    )


def build_gpt(torch: Any, s: Sizes, device: str, seed: int = 1234) -> Any:
    """The GPTModel with weights fixed by `seed`, on `device`."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    torch.manual_seed(seed)
    model = GPTModel(
        config=config(torch, s),
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=s.vocab,
        max_sequence_length=s.seq,
        pre_process=True,
        post_process=True,
    )
    return model.to(device)


def _batches(torch: Any, s: Sizes, iteration: int, device: str):
    for mb in range(s.microbatches):
        g = torch.Generator().manual_seed(10_000 * iteration + mb)
        tokens = torch.randint(0, s.vocab, (s.mbs, s.seq + 1), generator=g).to(device)
        yield tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def train(model: Any, s: Sizes, device: str, times_s: list[float], around_schedule: Any = None) -> list[float]:
    """`s.iterations` steps (schedule + SGD, lr 0.05); per-iteration mean loss; wall times (s) to `times_s`.

    Timing synchronises the device after each step, outside `around_schedule` (entered around the
    schedule call only: the hot path)."""
    import torch
    from megatron.core.pipeline_parallel import get_forward_backward_func

    cuda = device.startswith("cuda")
    positions = torch.arange(s.seq, device=device).unsqueeze(0).expand(s.mbs, s.seq)
    mask = torch.triu(torch.ones(s.seq, s.seq, dtype=torch.bool, device=device), 1).view(1, 1, s.seq, s.seq)

    def loss_fn(output: Any) -> tuple[Any, dict[str, Any]]:
        loss = output.float().mean()
        return loss, {"lm loss": loss.detach().clone()}

    def forward_step(data: Any, m: Any) -> tuple[Any, Any]:
        tokens, labels = next(data)
        return m(tokens, positions, mask, labels=labels), loss_fn

    params = list(model.parameters())
    losses = []
    for it in range(s.iterations):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for p in params:
            p.grad = None
        with around_schedule if around_schedule is not None else contextlib.nullcontext():
            out = get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=_batches(torch, s, it, device),
                model=model,
                num_microbatches=s.microbatches,
                seq_length=s.seq,
                micro_batch_size=s.mbs,
                forward_only=False,
            )
            with torch.no_grad():
                for p in params:
                    if p.grad is not None:
                        p -= 0.05 * p.grad
        if cuda:
            torch.cuda.synchronize()
        times_s.append(time.perf_counter() - t0)
        losses.append(float(torch.stack([o["lm loss"] for o in out]).mean()))
    return losses


def gpt_plan(s: Sizes, gpu: str, clocks_mhz: tuple[int, ...]) -> Plan:
    """A kareus plan for the GPT on one GPU: f/b per microbatch, cycling over a few supported clocks."""
    pick = sorted(set(clocks_mhz))
    cycle = [pick[len(pick) * k // 4] for k in (3, 1, 2, 0)] if len(pick) >= 4 else pick
    instrs = []
    for mb in range(s.microbatches):
        for j, kind in enumerate(KINDS):
            instrs.append(
                Instruction(
                    kind=kind,
                    microbatch=mb,
                    chunk=0,
                    sm_clock_mhz=cycle[(2 * mb + j) % len(cycle)],
                    predicted_time_s=0.002,
                    predicted_energy_j=0.5,
                )
            )
    return Plan(
        format="kareus-plan/1",
        method="kareus",
        gpu=gpu,
        model=ModelShape(
            name="selfcheck-gpt",
            num_layers=s.layers,
            hidden_size=s.hidden,
            num_attention_heads=s.heads,
            num_query_groups=s.heads,
            ffn_hidden_size=4 * s.hidden,
            vocab_size=s.vocab,
            kv_channels=s.hidden // s.heads,
            **ARCH,
        ),
        parallel=ParallelLayout(
            tp=1,
            cp=1,
            pp=1,
            vp=1,
            dp=1,
            micro_batch_size=s.mbs,
            seq_length=s.seq,
            num_microbatches=s.microbatches,
            layers_per_stage=(s.layers,),
            nodes=1,
            gpus_per_node=1,
            schedule=SCHEDULE_1F1B,
        ),
        predicted=Predicted(iteration_time_s=0.05, iteration_energy_j=40.0),
        stages=(StagePlan(pp_rank=0, instructions=tuple(instrs)),),
    )

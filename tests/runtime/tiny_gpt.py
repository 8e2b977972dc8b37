"""A tiny megatron-core GPTModel trained with the real pipeline schedule on CPU/gloo (tests, benchmark).

Shape: hidden 32, 4 heads, vocab 128, sequence 16, micro-batch 2, one transformer layer per virtual
chunk. Data is deterministic per (iteration, microbatch), so two runs with the same seed see the same
tokens and weights. Import only inside a process that has set up torch.distributed (see ``setup``).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
from plans import HEADS, HIDDEN, MBS, SEQ, VOCAB  # noqa: E402  (tests/runtime on sys.path)

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")


def setup(rank: int, world: int, port: int) -> None:
    """Join a gloo process group on 127.0.0.1:`port` and apply the CPU shim."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=rank, world_size=world)
    from kareus_megatron.runtime.frameworks import cpu_shim

    cpu_shim.apply()


def init_parallel(pp: int, vp: int | None) -> None:
    """(Re)initialise megatron's parallel state for PP=`pp` (and VP=`vp` chunks when given)."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=1, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp
    )


def build_chunks(pp: int, vp: int | None, seed: int = 1234) -> list[torch.nn.Module]:
    """The model chunks of this pipeline rank, with weights fixed by `seed`."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    n_chunks = vp or 1
    cfg = TransformerConfig(
        num_layers=pp * n_chunks,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        use_cpu_initialization=True,
        pipeline_dtype=torch.float32,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp,
        batch_p2p_comm=vp is None,  # notes A.4: VP needs False
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    torch.manual_seed(seed + ps.get_pipeline_model_parallel_rank())
    return [
        GPTModel(
            config=cfg,
            transformer_layer_spec=get_gpt_layer_local_spec(),
            vocab_size=VOCAB,
            max_sequence_length=SEQ,
            vp_stage=c if vp else None,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=c if vp else None),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=c if vp else None),
        )
        for c in range(n_chunks)
    ]


def _batches(iteration: int, m: int):
    for mb in range(m):
        g = torch.Generator().manual_seed(10_000 * iteration + mb)
        tokens = torch.randint(0, VOCAB, (MBS, SEQ + 1), generator=g)
        yield tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _loss(output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = output.float().mean()
    return loss, {"lm loss": loss.detach().clone()}  # the schedule scales `loss` in place


def _forward_step(data_iterator: Any, model: torch.nn.Module) -> tuple[torch.Tensor, Any]:
    tokens, labels = next(data_iterator)
    FORWARD_CALLS[0] += 1
    positions = torch.arange(SEQ).unsqueeze(0).expand(MBS, SEQ)
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1).view(1, 1, SEQ, SEQ)
    return model(tokens, positions, mask, labels=labels), _loss


FORWARD_CALLS = [0]


def train(
    chunks: list[torch.nn.Module],
    m: int,
    iterations: int,
    lr: float = 0.1,
    forward_only_every: int = 0,
    times_s: list[float] | None = None,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Run `iterations` training steps (schedule + SGD); return per-iteration mean loss (last stage; else
    NaN) and the final gradients by parameter name. With `forward_only_every` = k, an evaluation
    (forward-only) pass runs after every k-th step. Each step's wall time (s) is appended to `times_s`."""
    import time

    from megatron.core.pipeline_parallel import get_forward_backward_func

    vp = len(chunks) > 1
    params = [p for c in chunks for p in c.parameters()]
    losses = []
    grads: dict[str, torch.Tensor] = {}
    for it in range(iterations):
        t0 = time.perf_counter()
        for p in params:
            p.grad = None
        data = [_batches(it, m) for _ in chunks] if vp else _batches(it, m)
        out = get_forward_backward_func()(
            forward_step_func=_forward_step,
            data_iterator=data,
            model=chunks if vp else chunks[0],
            num_microbatches=m,
            seq_length=SEQ,
            micro_batch_size=MBS,
            forward_only=False,
        )
        losses.append(float(torch.stack([o["lm loss"] for o in out]).mean()) if out else float("nan"))
        grads = {
            f"{ci}.{n}": p.grad.detach().clone()
            for ci, c in enumerate(chunks)
            for n, p in c.named_parameters()
            if p.grad is not None
        }
        with torch.no_grad():
            for p in params:
                if p.grad is not None:
                    p -= lr * p.grad
        if times_s is not None:
            times_s.append(time.perf_counter() - t0)
        if forward_only_every and (it + 1) % forward_only_every == 0:
            evaluate(chunks, m)
    return losses, grads


def evaluate(chunks: list[torch.nn.Module], m: int) -> list[Any]:
    """One forward-only pass over `m` microbatches (evaluation)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    vp = len(chunks) > 1
    data = [_batches(999, m) for _ in chunks] if vp else _batches(999, m)
    with torch.no_grad():
        return get_forward_backward_func()(
            forward_step_func=_forward_step,
            data_iterator=data,
            model=chunks if vp else chunks[0],
            num_microbatches=m,
            seq_length=SEQ,
            micro_batch_size=MBS,
            forward_only=True,
        )

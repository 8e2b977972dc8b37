"""Train a tiny megatron-core GPT on CPU with gloo, on the real pipeline schedule; mock data.

Run it under torchrun, with or without a kareus plan (``make try-runtime`` does the first):

    python -m torch.distributed.run --nproc-per-node 2 examples/tiny_train.py --iterations 6
    KAREUS_GPU_BACKEND=simulated python -m torch.distributed.run --nproc-per-node 2 \\
        -m kareus_megatron.launch --kareus-plan try-out/plan --kareus-point kareus-00 --kareus-log try-out/run \\
        -- examples/tiny_train.py --iterations 6

The script knows nothing about kareus: it builds megatron-core's ``GPTModel`` (local layer spec), calls
``get_forward_backward_func()`` once per iteration and steps an SGD optimizer. The model shape is read
from ``--model`` (default: tiny-gpt.yaml beside this script), the same file ``kareus plan --model`` reads,
so the plan and the run agree. Needs torch (CPU build) and megatron-core 0.16.1.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|full scope is deprecated).*")
HERE = Path(__file__).resolve().parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iterations", type=int, default=6, help="training iterations (default 6)")
    p.add_argument("--microbatches", type=int, default=4, help="microbatches per iteration (default 4)")
    p.add_argument("--mbs", type=int, default=2, help="micro-batch size, sequences (default 2)")
    p.add_argument("--seq", type=int, default=16, help="sequence length, tokens (default 16)")
    p.add_argument("--pp", type=int, default=2, help="pipeline stages (default 2)")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size (default 1)")
    p.add_argument("--vp", type=int, default=1, help="virtual pipeline chunks per stage (default 1)")
    p.add_argument("--lr", type=float, default=0.5, help="SGD learning rate (default 0.5)")
    p.add_argument("--seed", type=int, default=1234, help="weights and data seed (default 1234)")
    p.add_argument("--model", type=Path, default=HERE / "tiny-gpt.yaml", help="model shape file (YAML)")
    return p.parse_args(argv)


def build_model(args: argparse.Namespace, shape: dict[str, Any]) -> list[torch.nn.Module]:
    """This rank's model chunks (one per virtual stage)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    vp = args.vp if args.vp > 1 else None
    cfg = TransformerConfig(
        num_layers=shape["num_layers"], hidden_size=shape["hidden_size"],
        num_attention_heads=shape["num_attention_heads"], num_query_groups=shape.get("num_query_groups"),
        ffn_hidden_size=shape["ffn_hidden_size"], use_cpu_initialization=True, pipeline_dtype=torch.float32,
        tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
        virtual_pipeline_model_parallel_size=vp,
        batch_p2p_comm=vp is None,  # the interleaved schedule on gloo needs unbatched p2p
        hidden_dropout=0.0, attention_dropout=0.0,
    )
    torch.manual_seed(args.seed + ps.get_pipeline_model_parallel_rank())
    chunks = []
    for c in range(args.vp):
        stage = c if vp else None
        chunks.append(GPTModel(
            config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=shape["vocab_size"],
            max_sequence_length=args.seq, vp_stage=stage,
            share_embeddings_and_output_weights=False,  # tied weights on two stages need megatron's grad sync
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage)))
    return chunks


def mock_batches(args: argparse.Namespace, vocab: int) -> Iterator[tuple[torch.Tensor, ...]]:
    """One iteration's (tokens, labels) per microbatch: random sequences, fixed by the seed and the
    microbatch index, so every rank and every iteration sees the same data and the loss goes down."""
    for mb in range(args.microbatches):
        g = torch.Generator().manual_seed(args.seed * 1_000 + mb)
        tokens = torch.randint(0, vocab, (args.mbs, args.seq + 1), generator=g)
        yield tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def make_forward_step(args: argparse.Namespace) -> Any:
    positions = torch.arange(args.seq).unsqueeze(0).expand(args.mbs, args.seq)
    causal_mask = torch.triu(torch.ones(args.seq, args.seq, dtype=torch.bool), 1).view(1, 1, args.seq, args.seq)

    def loss_func(per_token_loss: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss = per_token_loss.float().mean()
        return loss, {"lm loss": loss.detach().clone()}

    def forward_step(data_iterator: Any, model: torch.nn.Module) -> tuple[torch.Tensor, Any]:
        tokens, labels = next(data_iterator)
        return model(tokens, positions, causal_mask, labels=labels), loss_func

    return forward_step


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    shape = yaml.safe_load(args.model.read_text())
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from kareus_megatron.runtime import cpu_shim

    cpu_shim.apply()  # megatron-core's CUDA-only calls -> CPU (nothing when CUDA is available)
    ps.initialize_model_parallel(tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
                                 virtual_pipeline_model_parallel_size=args.vp if args.vp > 1 else None)
    chunks = build_model(args, shape)
    params = [p for c in chunks for p in c.parameters()]
    optimizer = torch.optim.SGD(params, lr=args.lr)
    forward_step = make_forward_step(args)
    reports = (ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_tensor_model_parallel_rank() == 0
               and ps.get_data_parallel_rank() == 0)
    for it in range(1, args.iterations + 1):
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        data: Any = [mock_batches(args, shape["vocab_size"]) for _ in chunks]
        losses = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=data if len(chunks) > 1 else data[0],
            model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=args.microbatches,
            seq_length=args.seq, micro_batch_size=args.mbs, forward_only=False)
        optimizer.step()
        if reports:
            loss = float(torch.stack([x["lm loss"] for x in losses]).mean())
            print(f"iteration {it}/{args.iterations}  loss {loss:.4f}  time {time.perf_counter() - t0:.3f} s",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Train a tiny megatron-core GPT on CPU with gloo, on the real pipeline schedule; mock data.

Run it under torchrun, with or without a kareus plan (``make try-runtime`` does the first):

    python -m torch.distributed.run --nproc-per-node 2 examples/tiny_train.py --iterations 6
    KAREUS_GPU_BACKEND=simulated python -m torch.distributed.run --nproc-per-node 2 \\
        -m kareus_megatron.launch --kareus-plan try-out/plan --kareus-point kareus-00 --kareus-log try-out/run \\
        -- examples/tiny_train.py --iterations 6

The script knows nothing about kareus but one optional layer spec: it builds megatron-core's ``GPTModel``,
calls ``get_forward_backward_func()`` once per iteration and steps an SGD optimizer. ``--layer-spec`` picks
the transformer layer: ``local`` (default; megatron's ``get_gpt_layer_local_spec``), ``sdpa``
(``kareus_megatron.runtime.overlap.get_sdpa_gpt_layer_spec``: the same layer on torch's
scaled_dot_product_attention) or ``partitioned`` (``get_partitioned_gpt_layer_spec``: the layer a plan with
2-nanobatch instructions needs). The two kareus specs use an SP-capable torch norm where megatron's torch-norm
fallback (no Apex/TE) refuses ``--sp``; the block's final norm is the layer spec's norm class (for the
partitioned layer, the package's ``get_partitioned_gpt_block_spec``).

Layouts: ``--tp``, ``--pp``, ``--vp``, ``--cp``, ``--sp`` as megatron's flags; data parallelism is what is left
of the world size. The script does by hand what megatron's DDP and ``finalize_model_grads`` would: it
all-reduces the gradients of the norms marked ``sequence_parallel`` over the TP group and averages every
gradient over the DP×CP group. Each DP rank trains on its own mock data; with ``--cp`` every sequence is
split megatron's way (``megatron.core.utils.get_batch_on_this_cp_rank``: 2·CP load-balanced chunks).

The model shape is read from ``--model`` (default: tiny-gpt.yaml beside this script), the same file
``kareus plan --model`` reads, so the plan and the run agree. Needs torch (CPU build) and megatron-core 0.16.1.
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
LAYER_SPECS = ("local", "sdpa", "partitioned")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iterations", type=int, default=6, help="training iterations (default 6)")
    p.add_argument("--microbatches", type=int, default=4, help="microbatches per iteration (default 4)")
    p.add_argument("--mbs", type=int, default=2, help="micro-batch size, sequences (default 2)")
    p.add_argument("--seq", type=int, default=16, help="sequence length, tokens (default 16)")
    p.add_argument("--pp", type=int, default=2, help="pipeline stages (default 2)")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size (default 1)")
    p.add_argument("--vp", type=int, default=1, help="virtual pipeline chunks per stage (default 1)")
    p.add_argument("--cp", type=int, default=1, help="context parallel size (default 1)")
    p.add_argument("--dp", type=int, default=None, help="data parallel size (default: the world size left)")
    p.add_argument("--sp", "--sequence-parallel", action="store_true", help="sequence parallelism (needs --tp > 1)")
    p.add_argument(
        "--layer-spec",
        choices=LAYER_SPECS,
        default="local",
        help="transformer layer: megatron's local spec, kareus's sdpa or partitioned spec (default local)",
    )
    p.add_argument("--lr", type=float, default=0.5, help="SGD learning rate (default 0.5)")
    p.add_argument("--seed", type=int, default=1234, help="weights and data seed (default 1234)")
    p.add_argument("--model", type=Path, default=HERE / "tiny-gpt.yaml", help="model shape file (YAML)")
    return p.parse_args(argv)


def model_config(args: argparse.Namespace, shape: dict[str, Any]) -> Any:
    """megatron-core TransformerConfig of the model and layout."""
    from megatron.core.transformer import TransformerConfig

    vp = args.vp if args.vp > 1 else None
    return TransformerConfig(
        num_layers=shape["num_layers"],
        hidden_size=shape["hidden_size"],
        num_attention_heads=shape["num_attention_heads"],
        num_query_groups=shape.get("num_query_groups"),
        ffn_hidden_size=shape["ffn_hidden_size"],
        use_cpu_initialization=True,
        pipeline_dtype=torch.float32,
        tensor_model_parallel_size=args.tp,
        pipeline_model_parallel_size=args.pp,
        virtual_pipeline_model_parallel_size=vp,
        context_parallel_size=args.cp,
        sequence_parallel=args.sp,
        batch_p2p_comm=vp is None,  # the interleaved schedule on gloo needs unbatched p2p
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )


def layer_spec(name: str) -> Any:
    """The transformer layer spec `name` (one of LAYER_SPECS)."""
    if name == "local":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        return get_gpt_layer_local_spec()
    from kareus_megatron.runtime import overlap  # the only kareus imports: an optional layer or block spec

    return overlap.get_sdpa_gpt_layer_spec() if name == "sdpa" else overlap.get_partitioned_gpt_layer_spec()


def block_spec(cfg: Any, layer: Any, stage: int | None, name: str) -> Any:
    """This stage's block of `layer`s, its final norm of the layer's own norm class (megatron's default for
    a bare layer spec is its torch-norm fallback, which refuses sequence parallelism). The partitioned
    layer's block is the package's own (kareus_megatron.runtime.overlap.get_partitioned_gpt_block_spec)."""
    if name == "partitioned":
        from kareus_megatron.runtime import overlap

        return overlap.get_partitioned_gpt_block_spec(cfg, vp_stage=stage)
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import (
        TransformerBlock,
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    n = get_num_layers_to_build(cfg, vp_stage=stage)
    sub = TransformerBlockSubmodules(layer_specs=[layer] * n, layer_norm=layer.submodules.input_layernorm)
    return ModuleSpec(module=TransformerBlock, submodules=sub)


def build_model(args: argparse.Namespace, shape: dict[str, Any]) -> list[torch.nn.Module]:
    """This rank's model chunks (one per virtual stage)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    vp = args.vp if args.vp > 1 else None
    cfg = model_config(args, shape)
    layer = layer_spec(args.layer_spec)
    torch.manual_seed(args.seed + ps.get_pipeline_model_parallel_rank())
    chunks = []
    for c in range(args.vp):
        stage = c if vp else None
        chunks.append(
            GPTModel(
                config=cfg,
                transformer_layer_spec=block_spec(cfg, layer, stage, args.layer_spec),
                vocab_size=shape["vocab_size"],
                max_sequence_length=args.seq,
                vp_stage=stage,
                share_embeddings_and_output_weights=False,  # tied weights on two stages need megatron's grad sync
                pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
                post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            )
        )
    return chunks


def mock_batches(args: argparse.Namespace, vocab: int, dp_rank: int) -> Iterator[dict[str, torch.Tensor]]:
    """One iteration's batch per microbatch (tokens, labels, positions; with CP this rank's chunks): random
    sequences fixed by the seed, the DP rank and the microbatch index, so every iteration sees the same data
    and the loss goes down."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    positions = torch.arange(args.seq).unsqueeze(0).expand(args.mbs, args.seq)
    for mb in range(args.microbatches):
        g = torch.Generator().manual_seed(args.seed * 1_000 + dp_rank * 100_000 + mb)
        tokens = torch.randint(0, vocab, (args.mbs, args.seq + 1), generator=g)
        batch = {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(), "position_ids": positions}
        yield get_batch_on_this_cp_rank(batch) if args.cp > 1 else batch


def make_forward_step(args: argparse.Namespace) -> Any:
    # with CP the mask is None (causal mask type): each rank's queries are two chunks of the sequence
    causal_mask = (
        None
        if args.cp > 1
        else torch.triu(torch.ones(args.seq, args.seq, dtype=torch.bool), 1).view(1, 1, args.seq, args.seq)
    )

    def loss_func(per_token_loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        # (sum, tokens, report): megatron divides by the tokens, so a CP rank's loss is its own tokens' mean
        loss = per_token_loss.float()
        return loss.sum(), torch.tensor(loss.numel(), dtype=torch.int), {"lm loss": loss.detach().mean()}

    def forward_step(data_iterator: Any, model: torch.nn.Module) -> tuple[torch.Tensor, Any]:
        b = next(data_iterator)
        return model(b["tokens"], b["position_ids"], causal_mask, labels=b["labels"]), loss_func

    return forward_step


def sync_grads(params: list[torch.nn.Parameter]) -> None:
    """What megatron's DDP and finalize_model_grads do for this script's bare parameters: sum the SP-marked
    (norm) gradients over the TP group, then average every gradient over the DP×CP group."""
    from megatron.core import parallel_state as ps

    grads = [p.grad for p in params if p.grad is not None]
    if ps.get_tensor_model_parallel_world_size() > 1:
        tp = ps.get_tensor_model_parallel_group()
        for p in params:
            if p.grad is not None and getattr(p, "sequence_parallel", False):
                dist.all_reduce(p.grad, group=tp)
    dp_cp = ps.get_data_parallel_group(with_context_parallel=True)
    n = dist.get_world_size(dp_cp)
    if n > 1:
        for grad in grads:
            dist.all_reduce(grad, group=dp_cp)
            grad.div_(n)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    shape = yaml.safe_load(args.model.read_text())
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    from kareus_megatron.runtime.frameworks import cpu_shim

    cpu_shim.apply()  # megatron-core's CUDA-only calls -> CPU (nothing when CUDA is available); before megatron loads
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    world, dp = dist.get_world_size(), args.dp or 1
    if args.dp is not None and world != args.tp * args.pp * args.cp * dp:
        if dist.get_rank() == 0:
            print(
                f"tiny_train.py: --tp {args.tp} × --pp {args.pp} × --cp {args.cp} × --dp {dp} is not the "
                f"world size {world}",
                file=sys.stderr,
            )
        return 2
    ps.initialize_model_parallel(
        tensor_model_parallel_size=args.tp,
        pipeline_model_parallel_size=args.pp,
        virtual_pipeline_model_parallel_size=args.vp if args.vp > 1 else None,
        context_parallel_size=args.cp,
    )
    chunks = build_model(args, shape)
    params = [p for c in chunks for p in c.parameters()]
    optimizer = torch.optim.SGD(params, lr=args.lr)
    forward_step = make_forward_step(args)
    last = ps.is_pipeline_last_stage(ignore_virtual=True)
    reports = (
        last
        and ps.get_tensor_model_parallel_rank() == 0
        and ps.get_data_parallel_rank() == 0
        and ps.get_context_parallel_rank() == 0
    )
    dp_rank = ps.get_data_parallel_rank()
    for it in range(1, args.iterations + 1):
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        data: Any = [mock_batches(args, shape["vocab_size"], dp_rank) for _ in chunks]
        losses = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=data if len(chunks) > 1 else data[0],
            model=chunks if len(chunks) > 1 else chunks[0],
            num_microbatches=args.microbatches,
            seq_length=args.seq,
            micro_batch_size=args.mbs,
            forward_only=False,
        )
        sync_grads(params)
        optimizer.step()
        if last:  # the mean over the DP×CP group (every rank of that group is on the last stage)
            loss = torch.stack([x["lm loss"] for x in losses]).mean()
            dist.all_reduce(loss, group=ps.get_data_parallel_group(with_context_parallel=True))
            loss /= ps.get_data_parallel_world_size(with_context_parallel=True)
            if reports:
                print(
                    f"iteration {it}/{args.iterations}  loss {float(loss):.4f}  time {time.perf_counter() - t0:.3f} s",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())

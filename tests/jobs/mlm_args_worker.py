"""Read Megatron-LM flag lists (JSON on stdin) the way Megatron-LM's pretrain_gpt.py does; print what it builds.

Run with a Megatron-LM tree first on PYTHONPATH. For each flag list: Megatron-LM's own parser,
``validate_args`` and ``core_transformer_config_from_args`` (megatron/training/arguments.py), then the
runtime's reading of the result (plan/megatron_model.py live_architecture). The GPTModel's position
embedding and tied output layer come from the arguments as Megatron-LM's gpt_builders.py passes them.
Megatron's import-time triton kernels are stubbed (no triton on CPU); nothing else is.
"""

from __future__ import annotations

import argparse
import json
import sys
from types import SimpleNamespace
from unittest import mock

for _name in (
    "megatron.core.transformer.custom_layers.batch_invariant_kernels",
    "megatron.core.transformer.moe.ops.paged_stash",
    "megatron.core.transformer.moe.paged_stash",
):
    sys.modules[_name] = mock.MagicMock()  # they import triton at module level; nothing here calls them


def main() -> None:
    import torch
    from megatron.training.arguments import add_megatron_arguments, core_transformer_config_from_args, validate_args

    from kareus_megatron.plan.megatron_model import live_architecture

    flag_lists = json.loads(sys.stdin.read())
    out, sys.stdout = sys.stdout, sys.stderr  # validate_args prints every argument
    built = []
    for flags in flag_lists:
        args = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)).parse_args(flags)
        args.rank, args.world_size = 0, args.tensor_model_parallel_size * args.pipeline_model_parallel_size
        validate_args(args)
        gpt = SimpleNamespace(
            position_embedding_type=args.position_embedding_type,
            share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        )
        built.append(
            live_architecture(core_transformer_config_from_args(args), gpt, torch.get_float32_matmul_precision())
        )
    out.write(json.dumps(built))


if __name__ == "__main__":
    main()

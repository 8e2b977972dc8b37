"""A DeepSpeed pipeline training script as a user writes it, plus the one kareus line (CPU/gloo test).

    torchrun --nproc-per-node 2 tests/runtime/deepspeed/ds_train.py --steps 3

The plan and log come from KAREUS_PLAN / KAREUS_LOG (`kareus launch ... --script` sets them).
"""

from __future__ import annotations

import argparse
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)  # ds_worker
sys.path.insert(1, os.path.join(_HERE, "..", ".."))  # tests/: _dist


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    import torch

    torch.set_num_threads(1)
    import deepspeed

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # CPU test: skip the ~55 s JIT build
    deepspeed.init_distributed(dist_backend="gloo")
    import ds_worker

    import kareus_megatron.deepspeed as kareus

    kareus.install_from_env(controller="thread")  # the one line (thread: fewer processes for the CPU test)
    engine = ds_worker._engine()
    it = iter(ds_worker._data(args.steps * ds_worker.MICRO_BATCHES))
    for _ in range(args.steps):
        engine.train_batch(it)
    kareus.uninstall()  # every rank: writes the last step, resets clocks
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    import _dist

    _dist.exit_process(0)  # a gloo worker may still hold DeepSpeed's loss broadcast (see there)


if __name__ == "__main__":
    main()

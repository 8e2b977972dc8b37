"""One rank of the durable-log tests (tests/runtime/test_durable_log.py), started by the test itself.

    python durable_train.py LOG_DIR ITERATIONS END [LOG_MODE]

RANK, WORLD_SIZE and MASTER_PORT come from the environment. Trains the tiny GPT (PP=2) under a plan,
logging to LOG_DIR, then ends as END says: ``uninstall`` (kareus.uninstall(), the documented end),
``destroy`` (torch.distributed.destroy_process_group() and a plain exit, no uninstall: atexit writes) or
``raise`` (an exception leaves the script).
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys

import plans
import tiny_gpt
import torch.distributed as dist

import kareus_megatron.megatron as kareus

M = 4


def main() -> None:
    log_dir, iterations, end = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    mode = sys.argv[4] if len(sys.argv) > 4 else "new"
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test dumps the stacks of a rank that hangs
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    tiny_gpt.setup(rank, world, int(os.environ["MASTER_PORT"]))
    tiny_gpt.init_parallel(2, None)
    chunks = tiny_gpt.build_chunks(2, None)
    kareus.install(plans.tiny_plan(pp=2, vp=1, m=M), log_path=log_dir, log_mode=mode)
    print("kareus-installed", flush=True)
    tiny_gpt.train(chunks, M, iterations)
    if end == "uninstall":
        kareus.uninstall()
        dist.barrier()
        dist.destroy_process_group()
    elif end == "destroy":
        dist.barrier()
        dist.destroy_process_group()
    elif end == "raise":
        raise RuntimeError("the training script failed")


if __name__ == "__main__":
    main()

"""Test-only: run a Megatron-LM training script on the CPU behind mlm_cpu_shim, as ``__main__``.

    python -m torch.distributed.run --nproc-per-node 2 tests/megatron_lm/run_on_cpu.py \\
        MEGATRON_LM_DIR SCRIPT [SCRIPT ARGUMENTS ...]

MEGATRON_LM_DIR goes first on sys.path (its megatron/ package, not an installed megatron-core, is the
one the shim patches and the script imports); SCRIPT is Megatron-LM's pretrain_gpt.py (the patched
tree's native --kareus-plan path) or launch/pretrain_gpt.py (the drop-in, which takes
--megatron-lm-dir MEGATRON_LM_DIR itself). sys.argv and sys.path[0] are what ``python SCRIPT ...``
would give the script.
"""

from __future__ import annotations

import os
import runpy
import sys

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # read when torch is first imported


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit("usage: run_on_cpu.py MEGATRON_LM_DIR SCRIPT [ARGS ...]")
    tree, script = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
    import mlm_cpu_shim  # beside this file (sys.path[0] for now)

    sys.path[0] = tree
    mlm_cpu_shim.apply()
    sys.path.insert(0, os.path.dirname(script))
    sys.argv = [script, *sys.argv[3:]]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()

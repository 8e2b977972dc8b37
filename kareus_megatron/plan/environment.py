"""Environment variables a plan's framework requires of the job, and who sets them.

Megatron-LM asserts ``CUDA_DEVICE_MAX_CONNECTIONS=1`` in ``validate_args`` whenever tensor or context
parallelism is on (TP > 1 or CP > 1) on a GPU older than Blackwell (compute capability < 10), unless
Torch-FSDP2, Megatron-FSDP or ``--overlap-moe-expert-parallel-comm`` is in use, where it only warns
(``megatron/training/arguments.py`` of Megatron-LM ``core_v0.16.1`` and ``core_v0.19.0``). One hardware
work queue keeps the tensor-parallel collectives in issue order with the GEMMs they overlap. CUDA reads
the variable when it creates a context, so it must be in the environment before the first CUDA call. On
Blackwell the requirement is gone and ``1`` is still accepted.

The launch commands ``kareus launch`` writes carry it (jobs/commands.py), and the drop-in and generic
launcher set it in-process when the user has not (runtime/frameworks/entry.py). A value the user set is never changed.
"""

from __future__ import annotations

from kareus_megatron.plan.schema import Plan
from kareus_megatron.vocab import FRAMEWORK_MEGATRON

MAX_CONNECTIONS_VAR = "CUDA_DEVICE_MAX_CONNECTIONS"
MAX_CONNECTIONS_WHY = "Megatron-LM requires it for TP>1 or CP>1 on GPUs before Blackwell"


def required_environment(plan: Plan) -> dict[str, str]:
    """Variables (name -> value) the job of `plan` needs set before its first CUDA call."""
    par = plan.parallel
    if plan.framework == FRAMEWORK_MEGATRON and (par.tp > 1 or par.cp > 1):
        return {MAX_CONNECTIONS_VAR: "1"}
    return {}

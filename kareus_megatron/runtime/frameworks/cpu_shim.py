"""Run megatron-core pipeline schedules (0.15, 0.16, 0.19) on a CPU-only torch with gloo (no NVIDIA GPU needed).

    import torch.distributed as dist
    from kareus_megatron.runtime.frameworks import cpu_shim
    dist.init_process_group("gloo")
    cpu_shim.apply()          # then initialize_model_parallel(...), build the model, run the schedule

Three CUDA calls sit on the schedule path (a ``device="cuda"`` literal in schedules.py, receive buffers
on ``torch.cuda.current_device()`` in p2p_communication.py, ``torch.cuda.synchronize()`` after batched
p2p) and attention forks the CUDA RNG tracker. ``apply()`` redirects each of them to the CPU; it does
nothing when CUDA is available. Apply it in each rank after ``init_process_group("gloo")``. Build models
with ``TransformerConfig(use_cpu_initialization=True)``, and with interleaved schedules (VP > 1) pass
``batch_p2p_comm=False``. torch and megatron-core are imported only when ``apply()`` runs; call it before
anything imports megatron: megatron-core 0.19 imports Triton unguarded at import time
(``megatron/core/transformer/moe/ops/paged_stash.py``, reached from the schedules), and the CPU build of
torch comes without Triton, so ``apply()`` first installs the import hooks of ``cpu_imports.py``: an inert stand-in
for ``triton`` (only where Triton is not installed; its kernels are never launched on a CPU), and megatron's fused
functions run eagerly (no ``torch.compile``, whose import costs each rank about 1.3 s of CPU).

Sources: NVIDIA/Megatron-LM at tag ``core_v0.16.1`` (the megatron-core 0.16.1 wheel), under
``megatron/core/``: ``pipeline_parallel/schedules.py`` (``total_num_tokens = torch.zeros([], ...,
device="cuda")``, lines 596, 983, 2138), ``pipeline_parallel/p2p_communication.py``
(``device=torch.cuda.current_device()`` for the shape and receive buffers, lines 190-202 and 313-321;
``torch.cuda.synchronize()`` after ``batch_isend_irecv``, lines 242 and 398) and
``tensor_parallel/random.py`` (``initialize_rng_tracker(inference_rng_tracker=True)`` installs a tracker
whose ``fork`` is ``contextlib.nullcontext()``, lines 321-336).
"""

from __future__ import annotations

import types
from typing import Any

from kareus_megatron.runtime.frameworks.cpu_imports import install_cpu_import_hooks, stub_missing_triton

__all__ = ["apply", "is_cuda_device", "stub_missing_triton"]

_applied = False


def is_cuda_device(device: object) -> bool:
    """Whether `device` (an int, a string or a torch.device) names a CUDA device."""
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return getattr(device, "type", None) == "cuda"


def _cpu_torch(torch: Any) -> types.ModuleType:
    """A stand-in for ``torch`` inside megatron's schedules module; only ``zeros`` differs."""

    class _CpuTorch(types.ModuleType):
        def __getattr__(self, name: str) -> object:
            return getattr(torch, name)

        @staticmethod
        def zeros(*args: object, device: object = None, **kwargs: object) -> Any:
            return torch.zeros(*args, device="cpu" if is_cuda_device(device) else device, **kwargs)

    return _CpuTorch("torch")


def apply() -> None:
    """Redirect megatron-core's CUDA-only calls to the CPU (idempotent; no-op when CUDA exists)."""
    global _applied
    import torch

    if _applied or torch.cuda.is_available():
        return
    install_cpu_import_hooks()
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as mcore_random

    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment,return-value]  # p2p buffers
    torch.cuda.synchronize = lambda *a, **k: None  # after batched p2p
    mcore_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)  # fork() is a no-op
    schedules.torch = _cpu_torch(torch)  # the device="cuda" literal for the token counter
    _applied = True

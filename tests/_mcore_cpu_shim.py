"""Test-only shim so megatron-core 0.16.1 pipeline schedules run on a CPU-only torch with gloo.

Three CUDA calls sit on the schedule path (a ``device="cuda"`` literal in schedules.py, receive buffers
on ``torch.cuda.current_device()`` in p2p_communication.py, ``torch.cuda.synchronize()`` after batched
p2p) and attention forks the CUDA RNG tracker. This module redirects each of them to the CPU. It never
ships in the package; apply it in each worker after ``init_process_group("gloo")``. Sources: NVIDIA/Megatron-LM
at tag ``core_v0.16.1`` (the megatron-core 0.16.1 wheel), under ``megatron/core/``:
``pipeline_parallel/schedules.py`` (``total_num_tokens = torch.zeros([], ..., device="cuda")``, lines 596,
983, 2138), ``pipeline_parallel/p2p_communication.py`` (``device=torch.cuda.current_device()`` for the
shape and receive buffers, lines 190-202 and 313-321; ``torch.cuda.synchronize()`` after
``batch_isend_irecv``, lines 242 and 398) and ``tensor_parallel/random.py`` (``initialize_rng_tracker(
inference_rng_tracker=True)`` installs a tracker whose ``fork`` is ``contextlib.nullcontext()``, lines 321-336).
"""

from __future__ import annotations

import types

import torch

_applied = False


def _is_cuda_device(device: object) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class _CpuTorch(types.ModuleType):
    """Stands in for ``torch`` inside megatron's schedules module; only ``zeros`` differs."""

    def __getattr__(self, name: str) -> object:
        return getattr(torch, name)

    @staticmethod
    def zeros(*args: object, device: object = None, **kwargs: object) -> torch.Tensor:
        return torch.zeros(*args, device="cpu" if _is_cuda_device(device) else device, **kwargs)


def apply() -> None:
    """Redirect megatron-core's CUDA-only calls to the CPU (idempotent; no-op when CUDA exists)."""
    global _applied
    if _applied or torch.cuda.is_available():
        return
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as mcore_random

    torch.cuda.current_device = lambda: torch.device("cpu")  # p2p receive buffers
    torch.cuda.synchronize = lambda *a, **k: None  # after batched p2p
    mcore_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)  # fork() is a no-op
    schedules.torch = _CpuTorch("torch")  # the device="cuda" literal for the token counter
    _applied = True

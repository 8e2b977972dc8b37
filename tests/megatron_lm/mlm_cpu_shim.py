"""Test-only: run Megatron-LM's own training scripts (pretrain_gpt.py) on a CPU-only torch with gloo.

    sys.path.insert(0, MEGATRON_LM_DIR)   # its megatron/ package, not the installed megatron-core
    mlm_cpu_shim.apply()                  # before the script runs; then runpy.run_path(script, "__main__")

Nothing of Megatron-LM is edited; every piece is an in-process redirect. Each piece names the upstream
line that needs it (NVIDIA/Megatron-LM at ``core_v0.16.1`` and ``core_v0.19.0``, ../shared/vendor/):

- ``TORCHDYNAMO_DISABLE=1``: megatron/core/fusions/*.py wrap their eager fallbacks in ``torch.compile``
  (jit_fuser); on a CPU build dynamo would try inductor, which needs a C++/triton toolchain.
- a stub ``triton`` module (kareus_megatron/runtime/frameworks/cpu_imports.py ``stub_missing_triton``, which
  megatron-core 0.19's schedules need on a CPU too): ``megatron/training/initialize.py`` (0.16.1 line 25, 0.19.0 line
  26) imports ``megatron/core/transformer/custom_layers/batch_invariant_kernels.py``, which imports triton
  unguarded (lines 15-16); CPU torch wheels do not ship triton. torch itself probes for triton
  (``torch._inductor.utils``), so those modules are imported before the stub exists (here at once, ``now=True``),
  so the probe still says "no triton".
- ``typing.override`` from typing_extensions: 0.19.0's ``megatron/training/models/gpt.py`` line 5 imports
  it from ``typing`` (Python >= 3.12); the project runs 3.11.
- ``torch.cuda`` runtime stand-ins: ``initialize.py`` calls ``torch.cuda.device_count()`` (0.16.1 line
  319, 0.19.0 line 270) and with 0 skips ``initialize_model_parallel``, so it returns 1; then
  ``set_device``, ``synchronize`` (timers, p2p), ``empty_cache``, streams, CUDA RNG state and memory
  statistics are no-ops. ``get_device_properties`` answers a Hopper-class GPU (major 9), so
  ``megatron/training/arguments.py``'s pre-Blackwell ``CUDA_DEVICE_MAX_CONNECTIONS=1`` assert for TP>1
  or CP>1 (0.16.1 line 927, 0.19.0 line 1413, via ``get_device_arch_version()``) stays active.
- a ``TorchFunctionMode`` that maps ``device="cuda"``/``cuda:N``/int devices, ``Tensor.cuda()`` and
  ``Tensor.to("cuda")`` to the CPU: about 50 distinct call sites in megatron/training and megatron/core
  (e.g. ``schedules.py``'s ``torch.zeros(..., device="cuda")``, ``p2p_communication.py``'s receive
  buffers on ``torch.cuda.current_device()``), too many to patch one by one.
- megatron's no-op RNG tracker (``tensor_parallel/random.py: initialize_rng_tracker(inference_rng_tracker=
  True)``): attention forks the CUDA RNG tracker, whose real states need ``torch.cuda.get_rng_state``.
- ``megatron.legacy.fused_kernels.load`` is a no-op (0.16.1 ``initialize.py`` lines 224/228 build the
  fused softmax kernels with nvcc; 0.19.0 has no such step).
- ``initialize_megatron(allow_no_cuda=True)``: ``initialize.py`` asserts ``torch.cuda.is_available()``
  otherwise (0.16.1 line 60, 0.19.0 line 64); it is wrapped where ``training.py`` looks it up.
- gloo-safe point-to-point (``p2p_communication.py: P2PCommunicator``): the storage of an overlapped send is kept
  until the send completes, since the schedule pseudo-frees a sent tensor right away and gloo, unlike
  NCCL's stream order, may still be reading it (NaN losses in PP=2 x VP=2 runs without this); and the
  gloo trap of ../shared/notes/megatron_deepspeed_cpu.md A.4 (interleaved, 2 pipeline ranks,
  ``batch_p2p_comm=True``: activations and gradients swapped silently) raises instead of training.

Megatron-LM arguments the tests pass for the CPU (not shim pieces): ``--transformer-impl local``,
``--distributed-backend gloo``, the ``--no-*-fusion`` flags, ``--clip-grad 0``
(``megatron/core/optimizer/clip_grads.py`` asserts ``torch.cuda.FloatTensor`` grads) and
``--eval-iters 0 --eval-interval N`` (``training.py`` divides by ``eval_interval``).
"""

from __future__ import annotations

import contextlib
import os
import sys
import types
from typing import Any

from kareus_megatron.runtime.frameworks.cpu_shim import is_cuda_device, stub_missing_triton

_applied = False
HOPPER_MAJOR = 9  # compute capability major of the faked GPU: pre-Blackwell (< 10)


def backfill_typing_override() -> None:
    """Give Python < 3.12's ``typing`` the ``override`` decorator (from typing_extensions)."""
    import typing

    if not hasattr(typing, "override"):
        import typing_extensions

        typing.override = typing_extensions.override  # type: ignore[attr-defined]


class _FakeStream:
    """A CUDA stream that does nothing (everything runs in order on the CPU)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def wait_stream(self, *args: object, **kwargs: object) -> None:
        pass

    def wait_event(self, *args: object, **kwargs: object) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, *args: object, **kwargs: object) -> None:
        return None

    def query(self) -> bool:
        return True

    def __enter__(self) -> _FakeStream:
        return self

    def __exit__(self, *exc: object) -> bool:
        return False


def fake_cuda_runtime() -> None:
    """Answer the torch.cuda calls of Megatron-LM's start-up and training loop as one Hopper-class GPU."""
    import torch

    c = torch.cuda
    props = types.SimpleNamespace(
        major=HOPPER_MAJOR,
        minor=0,
        name="CPU (test shim: Hopper-class)",
        total_memory=24 << 30,
        multi_processor_count=132,
    )
    none = lambda *a, **k: None  # noqa: E731
    zero = lambda *a, **k: 0  # noqa: E731
    stand_ins: dict[str, Any] = {
        "device_count": lambda: 1,
        "current_device": lambda: 0,
        "set_device": none,
        "synchronize": none,
        "empty_cache": none,
        "Stream": _FakeStream,
        "stream": lambda s=None: contextlib.nullcontext(),
        "current_stream": lambda *a, **k: _FakeStream(),
        "default_stream": lambda *a, **k: _FakeStream(),
        "get_device_properties": lambda *a, **k: props,
        "get_device_capability": lambda *a, **k: (HOPPER_MAJOR, 0),
        "get_rng_state": lambda *a, **k: torch.ByteTensor(),
        "set_rng_state": none,
        "manual_seed": none,
        "manual_seed_all": none,
        "memory_allocated": zero,
        "max_memory_allocated": zero,
        "memory_reserved": zero,
        "max_memory_reserved": zero,
    }
    for name, value in stand_ins.items():
        setattr(c, name, value)


def cpu_device_mode() -> Any:
    """A TorchFunctionMode (not yet entered) that puts every tensor asked for on a CUDA device on the CPU."""
    import torch
    from torch.overrides import TorchFunctionMode

    class CpuDeviceMode(TorchFunctionMode):
        def __torch_function__(
            self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
        ) -> Any:
            kwargs = kwargs or {}
            if is_cuda_device(kwargs.get("device")):
                kwargs["device"] = "cpu"
            if func is torch.Tensor.cuda:
                return args[0]
            if func is torch.Tensor.to:
                args = tuple("cpu" if is_cuda_device(a) else a for a in args)
            return func(*args, **kwargs)

    return CpuDeviceMode()


def gloo_safe_p2p() -> None:
    """Make P2PCommunicator safe on gloo: sent tensors outlive their sends; no batched p2p when interleaved on 2 ranks.

    With ``overlap_p2p_comm`` (Megatron-LM's default for interleaved schedules) ``_communicate`` returns
    without waiting, and the schedule then pseudo-frees the sent output (``schedules.py:
    deallocate_output_tensor`` swaps ``out.data`` for a 1-element tensor; Megatron-LM sets
    ``deallocate_pipeline_outputs=True``). NCCL has read the data in stream order by then; gloo's
    ``isend`` reads it later from its own thread, from storage that may be freed (PP=2 x VP=2 runs gave NaN
    or run-to-run different losses). So each send's storage is kept until its request completes. (Waiting for
    the sends instead deadlocks: the peer posts the matching receive only later in its schedule.)
    """
    from megatron.core.pipeline_parallel import p2p_communication as p2p

    communicate = p2p.P2PCommunicator._communicate
    in_flight: list[tuple[Any, Any]] = []  # (send request, storage of the tensor it sends)

    def communicate_keeping_sent_storage(self: Any, **kwargs: Any) -> Any:
        in_flight[:] = [(req, st) for req, st in in_flight if not req.is_completed()]
        recv_prev, recv_next, reqs = communicate(self, **kwargs)
        if isinstance(reqs, dict):  # not waited: the unbatched path (batch_p2p_comm=False) with overlap
            for key, tensor in (
                ("send_next", kwargs.get("tensor_send_next")),
                ("send_prev", kwargs.get("tensor_send_prev")),
            ):
                if key in reqs and tensor is not None:
                    in_flight.append((reqs[key], tensor.untyped_storage()))
        return recv_prev, recv_next, reqs

    p2p.P2PCommunicator._communicate = communicate_keeping_sent_storage
    init = p2p.P2PCommunicator.__init__

    def guarded_init(self: Any, pp_group: Any, config: Any) -> None:
        init(self, pp_group, config)
        vp = getattr(config, "virtual_pipeline_model_parallel_size", None)
        if getattr(config, "batch_p2p_comm", False) and vp and pp_group.size() == 2:
            raise RuntimeError(
                "test shim: interleaved schedule with PP=2 and batch_p2p_comm=True swaps "
                "activations and gradients on gloo (notes A.4); make batch_p2p_comm False"
            )

    p2p.P2PCommunicator.__init__ = guarded_init


def patch_megatron_start_up() -> None:
    """No-op RNG tracker, no fused-kernel build, ``initialize_megatron(allow_no_cuda=True)``."""
    from megatron.core.tensor_parallel import random as megatron_random

    megatron_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    try:
        import megatron.legacy.fused_kernels as fused_kernels  # 0.16.1 only
    except ImportError:
        pass
    else:
        fused_kernels.load = lambda *a, **k: None
    import megatron.training.initialize as initialize
    import megatron.training.training as training

    original = initialize.initialize_megatron

    def initialize_megatron(*args: Any, **kwargs: Any) -> Any:
        kwargs["allow_no_cuda"] = True
        return original(*args, **kwargs)

    initialize.initialize_megatron = initialize_megatron
    training.initialize_megatron = initialize_megatron  # pretrain() calls the name it imported


TENSORBOARD_LOG_ENV = "KAREUS_TEST_TENSORBOARD_LOG"  # a directory: record Megatron's TensorBoard calls there


def recording_tensorboard(directory: str) -> None:
    """A ``torch.utils.tensorboard`` whose SummaryWriter records every call as a JSON line (no tensorboard here).

    Megatron-LM makes its writer with ``from torch.utils.tensorboard import SummaryWriter`` when
    ``--tensorboard-dir`` is given (``megatron/training/global_vars.py``), which needs the tensorboard
    package; the recording stands in for it. One file per global rank: DIRECTORY/tb-rank-N.jsonl.
    """
    import json

    path = os.path.join(directory, f"tb-rank-{os.environ.get('RANK', '0')}.jsonl")

    class SummaryWriter:
        def __init__(self, log_dir: object = None, **kwargs: object) -> None:
            os.makedirs(directory, exist_ok=True)

        def __getattr__(self, name: str) -> Any:
            def record(*args: Any, **kwargs: Any) -> None:
                row = {"call": name, "args": [a if isinstance(a, (int, float, str)) else repr(a) for a in args]}
                with open(path, "a") as f:
                    f.write(json.dumps(row) + "\n")

            return record

    module = types.ModuleType("torch.utils.tensorboard")
    module.SummaryWriter = SummaryWriter  # type: ignore[attr-defined]
    sys.modules["torch.utils.tensorboard"] = module


def apply() -> None:
    """Apply every piece (idempotent); Megatron-LM's megatron/ package must be first on sys.path."""
    global _applied
    if _applied:
        return
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    backfill_typing_override()
    # Megatron-LM's training package imports Triton unguarded, so torch's compiler stack loads anyway: at once, before
    # fake_cuda_runtime's stand-ins (dynamo's trace rules refuse one function object under two torch.cuda names)
    stub_missing_triton(now=True)
    fake_cuda_runtime()
    cpu_device_mode().__enter__()  # for the whole process: Megatron-LM runs in this thread
    patch_megatron_start_up()
    gloo_safe_p2p()
    if os.environ.get(TENSORBOARD_LOG_ENV):
        recording_tensorboard(os.environ[TENSORBOARD_LOG_ENV])
    _applied = True

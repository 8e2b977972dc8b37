"""Counting host syncs: operations that make the training thread wait for the device, counted on any device.

A *host sync* is a call after which the host cannot go on before the device has caught up: reading a
device value (``.item()``, ``.tolist()``, ``bool(t)``, ``int(t)``, printing a tensor, ``torch.equal``,
``torch.allclose``), an output whose size depends on device values (``nonzero``, boolean-mask indexing,
``masked_select``, ``unique``, ``repeat_interleave`` by a tensor without ``output_size``), a blocking copy
between host and device (``torch.tensor(data, device=...)`` from Python data, ``.cpu()``, ``.numpy()``,
``.to(device)`` without ``non_blocking``), and explicit waits (``torch.cuda.synchronize``,
``Event.synchronize``, ``Stream.synchronize``, ``torch.distributed.barrier``).

``SyncCount`` counts these *operations* by replacing them, while it is entered, with counting wrappers
(module and class attributes of torch; the tensor methods are those of ``torch.Tensor``, so forward and
backward, custom autograd functions included, are both seen). It does not ask the device whether it
waited, so on a CPU, where "device" tensors are CPU tensors and nothing waits, it counts what would
wait on a GPU; CUDA's own detector (``torch.cuda.set_sync_debug_mode``) is the GPU-side complement
(``CudaSyncCounter``). Only the thread that entered is counted (the training thread: helper threads may
wait by design), and an operation inside a counted one is not counted again (``repr`` reads with
``tolist``). ``paused()`` and ``counting()`` narrow the count to the code of interest, e.g. a patch's
hooks and not the model step they wrap. Every count keeps its caller's file and line (``sites``).

Conservative on a CPU (``SyncCount(device="cpu")``): ``.to(d)`` with an explicit device (and no
``non_blocking``) counts even where it is a no-op, because on a GPU the same call either copies between host
and device or is a same-device no-op, and the CPU cannot tell which; with ``device="cuda"`` only copies that
cross between host and device count. ``torch.tensor(data, device=d)`` of Python data counts unless it asks
for a host tensor by name (``device="cpu"``, or ``pin_memory=True``: megatron's pattern before a
``non_blocking`` copy).
"""

from __future__ import annotations

import collections
import contextlib
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

Predicate = Callable[[tuple[Any, ...], dict[str, Any]], bool]

# Tensor methods that always read device memory on the host (or size an output by device values).
_TENSOR_READS = (
    "item",
    "tolist",
    "numpy",
    "cpu",
    "__bool__",
    "__int__",
    "__float__",
    "__index__",
    "__complex__",
    "__repr__",
    "__format__",
    "__array__",
    "__contains__",
    "nonzero",
    "argwhere",
    "masked_select",
    "unique",
    "unique_consecutive",
    "equal",
    "allclose",
    "is_nonzero",
)
# torch functions that always do.
_TORCH_READS = (
    "equal",
    "allclose",
    "nonzero",
    "argwhere",
    "masked_select",
    "unique",
    "unique_consecutive",
    "is_nonzero",
)


def _is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def _device_arg(x: Any) -> bool:
    return isinstance(x, (str, torch.device)) or (isinstance(x, int) and not isinstance(x, bool))


def _target_device(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device | None:
    """The destination device of ``Tensor.to(...)`` (None: not given, a dtype-only conversion)."""
    target = kwargs.get("device")
    if target is None and len(args) > 1 and (_device_arg(args[1]) or _is_tensor(args[1])):
        target = args[1]
    if target is None and _is_tensor(kwargs.get("other")):
        target = kwargs["other"]
    if target is None:
        return None
    if _is_tensor(target):
        return target.device
    return torch.device("cuda", target) if isinstance(target, int) else torch.device(target)


def _to_crosses(simulated: bool) -> Predicate:
    """``Tensor.to(device)`` without ``non_blocking`` that copies between host and device (`simulated`, i.e. on
    a CPU standing in for the device: any explicit device, see the module doc)."""

    def crosses(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        if kwargs.get("non_blocking") or any(a is True for a in args[2:4]):
            return False
        target = _target_device(args, kwargs)
        if target is None:
            return False
        return simulated or (target.type == "cpu") != (args[0].device.type == "cpu")

    return crosses


def _cuda_blocking(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """``Tensor.cuda()`` without ``non_blocking``."""
    return not (kwargs.get("non_blocking") or (len(args) > 2 and args[2] is True))


def _from_python_data(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """``torch.tensor``/``as_tensor``/``asarray`` of Python data onto a device (a blocking copy from pageable
    host memory); a host tensor asked for by name (``device="cpu"``, or pinned) is not counted."""
    data = args[0] if args else kwargs.get("data", kwargs.get("obj"))
    device = kwargs.get("device")
    if device is None or _is_tensor(data) or kwargs.get("pin_memory"):
        return False
    return not (isinstance(device, str) and device == "cpu")


def _bool_index(index: Any) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(_is_tensor(p) and p.dtype == torch.bool for p in parts)


def _indexes_by_mask(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """``t[mask]`` / ``t[mask] = v`` with a boolean tensor index (a nonzero inside)."""
    return len(args) > 1 and _bool_index(args[1])


def _unsized_repeat(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """``repeat_interleave`` by a tensor of repeats without ``output_size`` (the size is a device sum)."""
    repeats = args[1] if len(args) > 1 else kwargs.get("repeats", args[0] if args else None)
    return _is_tensor(repeats) and kwargs.get("output_size") is None


def _where_one_arg(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """``torch.where(cond)``: nonzero."""
    return len(args) + len(kwargs) == 1


def _operations(simulated: bool) -> list[tuple[Any, str, str, Predicate | None]]:
    """(owner, attribute, name in the counts, predicate or None = always) of every counted operation."""
    ops: list[tuple[Any, str, str, Predicate | None]] = []
    ops += [(torch.Tensor, a, f"Tensor.{a}", None) for a in _TENSOR_READS]
    ops += [(torch, a, f"torch.{a}", None) for a in _TORCH_READS]
    ops += [
        (torch.Tensor, "to", "Tensor.to(device)", _to_crosses(simulated)),
        (torch.Tensor, "cuda", "Tensor.cuda", _cuda_blocking),
        (torch.Tensor, "__getitem__", "Tensor[bool mask]", _indexes_by_mask),
        (torch.Tensor, "__setitem__", "Tensor[bool mask]=", _indexes_by_mask),
        (torch.Tensor, "repeat_interleave", "Tensor.repeat_interleave(tensor)", _unsized_repeat),
        (torch, "repeat_interleave", "torch.repeat_interleave(tensor)", _unsized_repeat),
        (torch, "where", "torch.where(cond)", _where_one_arg),
    ]
    ops += [(torch, a, f"torch.{a}(data, device)", _from_python_data) for a in ("tensor", "as_tensor", "asarray")]
    ops += [
        (torch.cuda, "synchronize", "torch.cuda.synchronize", None),
        (torch.cuda.Event, "synchronize", "Event.synchronize", None),
        (torch.cuda.Stream, "synchronize", "Stream.synchronize", None),
    ]
    if torch.distributed.is_available():
        ops.append((torch.distributed, "barrier", "torch.distributed.barrier", None))
    return ops


class SyncCount:
    """Counts host-sync operations on the entering thread while entered (see the module doc).

    ``counts``: operation -> calls; ``sites``: (operation, "file:line") of each, in order; ``total``."""

    def __init__(self, device: str = "cpu", active: bool = True) -> None:
        """`device`: the training device ("cpu": a CPU standing in for one, "cuda..."); `active` False: count
        nothing until inside ``counting()`` (or a ``counting_call`` wrapper)."""
        self._simulated = not str(device).startswith("cuda")
        self.counts: collections.Counter[str] = collections.Counter()
        self.sites: list[tuple[str, str]] = []
        self._active = active
        self._inside = False  # in a counted operation (the training thread only)
        self._thread = 0
        self._saved: list[tuple[Any, str, Any]] = []  # (owner, attribute, its own value; None: inherited)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __enter__(self) -> SyncCount:
        self._thread = threading.get_ident()
        try:
            for owner, attr, name, pred in _operations(self._simulated):
                own = not isinstance(owner, type) or attr in owner.__dict__  # else inherited: deleted again
                self._saved.append((owner, attr, owner.__dict__[attr] if own else None))
                setattr(owner, attr, self._counted(name, getattr(owner, attr), pred))
        except BaseException:
            self._restore()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._restore()

    def _restore(self) -> None:
        for owner, attr, original in reversed(self._saved):
            if original is None:
                delattr(owner, attr)
            else:
                setattr(owner, attr, original)
        self._saved.clear()

    def _counted(self, name: str, fn: Callable[..., Any], pred: Predicate | None) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if not self._active or self._inside or threading.get_ident() != self._thread:
                return fn(*args, **kwargs)
            if pred is not None and not pred(args, kwargs):
                return fn(*args, **kwargs)
            self._record(name, depth=1)
            self._inside = True
            try:
                return fn(*args, **kwargs)
            finally:
                self._inside = False

        counted.__name__ = getattr(fn, "__name__", name)
        counted.__doc__ = getattr(fn, "__doc__", None)
        return counted

    def note(self, name: str) -> None:
        """Count one `name` called by the caller's caller, on the same terms as a counted operation (stand-ins for
        device objects, e.g. a test's CUDA events, report here)."""
        if self._active and not self._inside and threading.get_ident() == self._thread:
            self._record(name, depth=2)

    def _record(self, name: str, depth: int) -> None:
        """Count `name`; its site is the frame `depth` levels above the caller."""
        frame = sys._getframe(depth + 1)
        self.counts[name] += 1
        self.sites.append((name, f"{frame.f_code.co_filename}:{frame.f_lineno}"))

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Nothing is counted inside (e.g. the model step a hook wraps)."""
        was, self._active = self._active, False
        try:
            yield
        finally:
            self._active = was

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        """Counted inside, also when made with active=False."""
        was, self._active = self._active, True
        try:
            yield
        finally:
            self._active = was

    def paused_call(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """`fn`, with nothing counted during its calls."""

        def call(*args: Any, **kwargs: Any) -> Any:
            with self.paused():
                return fn(*args, **kwargs)

        return call

    def counting_call(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """`fn`, counted during its calls (except where paused inside)."""

        def call(*args: Any, **kwargs: Any) -> Any:
            with self.counting():
                return fn(*args, **kwargs)

        return call

    def report(self) -> dict[str, Any]:
        """JSON-ready: total, counts by operation, and the first 20 sites."""
        return {
            "syncs": self.total,
            "by_operation": dict(self.counts),
            "sites": [f"{n} at {s}" for n, s in self.sites[:20]],
        }


class CudaSyncCounter:
    """Within: ``torch.cuda.synchronize`` calls (still synchronising) and the synchronisations CUDA's sync debug
    mode reports (``torch.cuda.set_sync_debug_mode("warn")``: each a warning), counted on a GPU."""

    def __init__(self, torch_module: Any = torch) -> None:
        self._cuda = torch_module.cuda
        self.explicit = 0
        self.implicit = 0

    def __enter__(self) -> CudaSyncCounter:
        import warnings

        self._orig = self._cuda.synchronize

        def counted(*a: Any, **k: Any) -> Any:
            self.explicit += 1
            return self._orig(*a, **k)

        self._cuda.synchronize = counted
        self._debug = self._cuda.get_sync_debug_mode()
        self._warnings = warnings.catch_warnings(record=True)
        self._seen = self._warnings.__enter__()
        warnings.simplefilter("always")
        self._cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: object) -> None:
        self._cuda.set_sync_debug_mode(self._debug)
        self._warnings.__exit__(None, None, None)
        self.implicit += sum("synchroniz" in str(w.message) for w in self._seen)
        self._cuda.synchronize = self._orig

    @property
    def total(self) -> int:
        return self.explicit + self.implicit

    @property
    def messages(self) -> list[str]:
        """The sync warnings' texts (where in the source: the warning's file and line)."""
        return [f"{w.message} at {w.filename}:{w.lineno}" for w in self._seen if "synchroniz" in str(w.message)]

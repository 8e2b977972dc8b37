"""Import hooks for megatron-core on a CPU-only torch: a Triton stand-in, and megatron's fused functions eager.

Both act when a module is first imported, so install them (``install_cpu_import_hooks``) before anything imports
megatron. On a CPU-only torch, megatron-core's import decorates its fused functions with ``torch.compile``
(``megatron/core/jit.py``: ``jit_fuser``), which imports torch's compiler stack, inductor's compiler included, for
kernels a CPU run does not compile; the hook calls megatron's own ``disable_jit_fuser()`` as ``megatron.core.jit``
loads, so those functions run their eager code (what ``TORCHDYNAMO_DISABLE=1`` also gives). (A training rank still
imports dynamo when it builds its first torch optimizer: ``torch/optim/optimizer.py`` through ``torch/_compile.py``.)
megatron-core 0.19 and Megatron-LM's training package import Triton where a missing one is an error
(``UNGUARDED_IMPORTERS``); CPU torch wheels ship none. The stand-in is made at the first import from one of those
modules: torch's compiler stack is imported first, with no Triton to find (so torch's import-time probes keep seeing
none), then the inert modules are served. Every other import of Triton (torch's probes, megatron's guarded ones, as in
megatron-core 0.16's ``utils.py``) finds none, as it would without the hook.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

TRITON_MODULES = ("triton", "triton.language")
# Modules that import Triton at module level, on the import paths of a training run that does not catch the error:
# Megatron-LM's training/initialize.py imports the first (core_v0.16.1 line 25, core_v0.19.0 line 26; its lines 15-16
# import triton), megatron-core 0.19's schedules reach the second. The other module-level Triton imports of 0.15-0.19
# (inference kernels, fused_kv_append_kernel, ssm/ops) are imported under a try that handles its absence, and get none.
UNGUARDED_IMPORTERS = frozenset(
    {"megatron.core.transformer.custom_layers.batch_invariant_kernels", "megatron.core.transformer.moe.ops.paged_stash"}
)
# torch modules that probe for Triton when imported (torch 2.13): imported before the stand-in exists
TORCH_TRITON_PROBES = (
    "torch._dynamo",
    "torch._inductor.output_code",
    "torch._inductor.runtime.triton_compat",
    "torch._inductor.utils",
)


class _Inert:
    """Anything Triton-shaped: decorators return their function, everything else another _Inert."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def __call__(self, *args: object, **kwargs: object) -> Any:
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]  # @triton.jit, @triton.autotune(...)(fn)
        return _Inert()

    def __getattr__(self, name: str) -> Any:
        return _Inert()

    def __getitem__(self, key: object) -> Any:
        return _Inert()


class _InertModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Inert()


class _Served(importlib.abc.Loader):
    """Loads a module object made beforehand."""

    def __init__(self, module: types.ModuleType) -> None:
        self.module = module

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return self.module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def _importer() -> str:
    """The name of the module whose code runs the import being resolved (import machinery frames skipped)."""
    frame = sys._getframe(1)
    while frame is not None:
        name = str(frame.f_globals.get("__name__", ""))
        if name != __name__ and not name.startswith(("importlib", "_frozen_importlib")):
            return name
        frame = frame.f_back  # type: ignore[assignment]
    return ""


class TritonStandIn(importlib.abc.MetaPathFinder):
    """Serves inert ``triton`` and ``triton.language`` to UNGUARDED_IMPORTERS (see the module docstring)."""

    def __init__(self, version: str) -> None:
        self.version = version
        self.modules: dict[str, types.ModuleType] = {}

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in TRITON_MODULES:
            return None
        if _importer() not in UNGUARDED_IMPORTERS:
            return None  # torch's probes, and megatron's guarded imports (they handle a missing Triton): none here
        if not self.modules:
            self._make()
        return importlib.util.spec_from_loader(fullname, _Served(self.modules[fullname]), is_package=True)

    def _make(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)  # while torch probes: nothing to find
        try:
            for name in TORCH_TRITON_PROBES:
                importlib.import_module(name)
        finally:
            sys.meta_path.insert(0, self)
        triton, language = _InertModule("triton"), _InertModule("triton.language")
        triton.language = language  # type: ignore[attr-defined]
        triton.__version__ = self.version  # type: ignore[attr-defined]  # megatron-core 0.19 compares it
        self.modules = {"triton": triton, "triton.language": language}


def triton_missing() -> bool:
    """Whether no Triton is installed (and none is imported or stood in for yet)."""
    if "triton" in sys.modules or any(isinstance(f, TritonStandIn) for f in sys.meta_path):
        return False
    return importlib.util.find_spec("triton") is None


class _AfterLoad(importlib.abc.MetaPathFinder):
    """Runs `then(module)` right after module `name` has executed (found on the path as usual)."""

    def __init__(self, name: str, then: Callable[[types.ModuleType], None]) -> None:
        self.name, self.then = name, then

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _ThenLoader(spec.loader, self.then)
        return spec


class _ThenLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader, then: Callable[[types.ModuleType], None]) -> None:
        self.loader, self.then = loader, then

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self.loader.exec_module(module)
        self.then(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ... for tracebacks and inspect
        return getattr(self.loader, name)


def _fusions_off(jit: types.ModuleType) -> None:
    disable = getattr(jit, "disable_jit_fuser", None)
    if callable(disable):
        disable()


def eager_megatron_fusions() -> bool:
    """Have megatron-core's fused functions run their eager code (``disable_jit_fuser`` as ``megatron.core.jit``
    loads); returns False if megatron is already imported (its functions are decorated by then)."""
    if "megatron.core.jit" in sys.modules:
        return False
    if not any(isinstance(f, _AfterLoad) and f.name == "megatron.core.jit" for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterLoad("megatron.core.jit", _fusions_off))
    return True


def stub_missing_triton(version: str = "3.4.0", now: bool = False) -> bool:
    """Where Triton is not installed, serve an inert stand-in to UNGUARDED_IMPORTERS; returns whether the stand-in was
    installed. `now`: make it (and import torch's compiler stack) at once rather than at the first such import."""
    if not triton_missing():
        return False
    stand_in = TritonStandIn(version)
    sys.meta_path.insert(0, stand_in)
    if now:
        stand_in._make()
    return True


def install_cpu_import_hooks() -> None:
    """Both hooks, on a CPU-only torch (nothing when CUDA is available); idempotent."""
    import torch

    if torch.cuda.is_available():
        return
    stub_missing_triton()
    eager_megatron_fusions()

"""CUDA graphs are refused: a plan cannot run under them.

A captured CUDA graph replays its kernels without running the Python around them, so the per-instruction
hooks that lock clocks and switch the overlap engine's nanobatch count, comm SMs and launch slots run once,
at capture, and never again; megatron-core's full-iteration graph even replays without calling the
patched schedule; and CUDA events recorded during capture may not be queried. So a plan runs only with
CUDA graphs off. The settings, by megatron-core release (TransformerConfig fields; Megatron-LM builds
them from flags of the same names):

- ``cuda_graph_impl``: "local" (megatron-core's CudaGraphManager per layer, or with ``cuda_graph_scope``
  "full_iteration" the whole forward-backward), "transformer_engine" (TE's ``make_graphed_callables``),
  and in 0.19 "full_iteration"; "none" is off. Flag ``--cuda-graph-impl``.
- ``enable_cuda_graph`` / ``external_cuda_graph``: deprecated spellings of "local" / "transformer_engine"
  (flags ``--enable-cuda-graph`` / ``--external-cuda-graph``); ``__post_init__`` turns them into
  ``cuda_graph_impl``, Megatron-LM's argument check does the same and deletes them.

``cuda_graph_problem(config)`` names the setting in one line (None when graphs are off); the megatron-core
patch's plan check and the overlap engine's model check raise it (exit status 2 through every entry
point, before the first instruction); ``cuda_graph_flag_in_argv`` finds the flags in a Megatron-LM
command line before Megatron-LM starts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

OFF = ("none", "", None)
_DEPRECATED = (
    ("enable_cuda_graph", "--enable-cuda-graph", "local"),
    ("external_cuda_graph", "--external-cuda-graph", "transformer_engine"),
)
WHY = (
    "a replayed graph skips the per-instruction clock and overlap hooks, so the plan would not run; "
    "turn CUDA graphs off (--cuda-graph-impl none)"
)


def _scopes(config: Any) -> list[str]:
    raw = getattr(config, "cuda_graph_scope", None)
    items = raw if isinstance(raw, (list, tuple)) else [raw]
    return [str(getattr(s, "name", s)) for s in items if s is not None]


def cuda_graph_problem(config: Any) -> str | None:
    """One line naming the CUDA-graph setting of a megatron-core TransformerConfig (or Megatron-LM args), or
    None when CUDA graphs are off."""
    impl = getattr(config, "cuda_graph_impl", "none")
    impl = None if impl is None else str(getattr(impl, "value", impl))
    setting = None
    for field, flag, meaning in _DEPRECATED:
        if getattr(config, field, False):
            setting = f"{field}=True ({flag}, i.e. cuda_graph_impl {meaning})"
    if setting is None and impl not in OFF:
        setting = f"cuda_graph_impl={impl!r} (--cuda-graph-impl {impl})"
        if impl == "local" and "full_iteration" in _scopes(config):
            setting = (
                "cuda_graph_impl='local' with cuda_graph_scope full_iteration (--cuda-graph-impl local "
                "--cuda-graph-scope full_iteration)"
            )
    if setting is None:
        return None
    return f"CUDA graphs are on: {setting}; {WHY}"


def cuda_graph_flag_in_argv(argv: Sequence[str]) -> str | None:
    """One line naming a Megatron-LM flag in `argv` that turns CUDA graphs on, or None."""
    args = list(argv)
    for i, a in enumerate(args):
        name, eq, value = a.partition("=")
        if name in ("--enable-cuda-graph", "--external-cuda-graph"):
            return f"CUDA graphs are on: {name}; {WHY}"
        if name == "--cuda-graph-impl":
            value = value if eq else (args[i + 1] if i + 1 < len(args) else "")
            if value not in ("none", ""):
                return f"CUDA graphs are on: --cuda-graph-impl {value}; {WHY}"
    return None

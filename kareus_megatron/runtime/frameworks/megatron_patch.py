"""The megatron-core patch: every planned pipeline instruction is announced before it runs.

Wrapped (module attributes of ``megatron.core.pipeline_parallel.schedules``): the three schedule
functions (``forward_backward_no_pipelining``, ``..._pipelining_without_interleaving``,
``..._pipelining_with_interleaving``), ``forward_step`` and ``backward_step``. An *instruction* is
(pipeline rank, virtual chunk, forward/backward, microbatch). ``forward_step`` gets its microbatch and
chunk from megatron (``current_microbatch``, ``vp_stage``); ``backward_step`` gets none, so the
forward wrapper remembers the identity of the output tensor it returned and the backward wrapper,
which receives that same object, looks it up. Forward-only (evaluation) calls pass through untouched.

Before the first instruction of the first training call the plan is checked against the live run
(``validate_plan``); every mismatch is listed in one PlanMismatchError. A model under CUDA graphs is
refused there first, in one line naming the setting (cuda_graphs.py).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kareus_megatron.errors import ConfigError, UnsupportedVersionError
from kareus_megatron.plan.megatron_model import live_architecture
from kareus_megatron.plan.schema import Plan
from kareus_megatron.runtime.frameworks.cuda_graphs import cuda_graph_problem
from kareus_megatron.runtime.frameworks.patch_common import (
    BasePatchState,
    PatchSlot,
    compare,
    device_mismatches,
    raise_mismatches,
)
from kareus_megatron.versions import is_supported, supported_series, unsupported_message
from kareus_megatron.vocab import FRAMEWORK_MEGATRON, schedule_for

log = logging.getLogger(__name__)

FRAMEWORK = FRAMEWORK_MEGATRON  # the plan's framework this patch runs
VOCAB_PADDING = 1024  # largest vocabulary padding (per TP rank) accepted as the same vocabulary
SCHEDULE_FUNCTIONS = (
    "forward_backward_no_pipelining",
    "forward_backward_pipelining_without_interleaving",
    "forward_backward_pipelining_with_interleaving",
)


def _version_from_package_info(text: str) -> str | None:
    """`MAJOR.MINOR.PATCH[PRE_RELEASE]` from the constants of megatron/core/package_info.py, or None."""
    import ast

    consts: dict[str, Any] = {}
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return None
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if isinstance(node.value, ast.Constant):
                consts[node.targets[0].id] = node.value.value
    try:
        return f"{int(consts['MAJOR'])}.{int(consts['MINOR'])}.{int(consts['PATCH'])}{consts.get('PRE_RELEASE') or ''}"
    except (KeyError, TypeError, ValueError):
        return None


def megatron_core_version() -> str:
    """The version of the importable megatron.core (a Megatron-LM checkout or the PyPI package).

    Read from megatron/core/package_info.py without importing megatron.core (a slow, noisy import),
    so a bad setup is reported before anything else happens.
    """
    import importlib.util
    from pathlib import Path

    try:
        spec = importlib.util.find_spec("megatron")
    except (ImportError, ValueError):
        spec = None
    for loc in (spec.submodule_search_locations or []) if spec is not None else []:
        info = Path(loc) / "core" / "package_info.py"
        if info.is_file():
            v = _version_from_package_info(info.read_text())
            if v:
                return v
    try:
        from megatron.core import package_info

        return str(package_info.__version__)
    except ImportError:
        raise UnsupportedVersionError(
            f"megatron.core is not importable; install megatron-core=={supported_series('megatron-core')[-1].tested} "
            "or put Megatron-LM on PYTHONPATH"
        ) from None


def check_megatron_core_version() -> str:
    """Return the megatron-core version, or raise UnsupportedVersionError naming the supported ones."""
    v = megatron_core_version()
    if not is_supported("megatron-core", v):
        raise UnsupportedVersionError(unsupported_message("megatron-core", v, "the kareus runtime patch"))
    return v


def check_version() -> str:
    """The framework check a runtime session runs before it starts anything (megatron-core's version)."""
    return check_megatron_core_version()


# ---- live run facts and validation ------------------------------------------------------------


@dataclass
class LiveRun:
    """What the running job looks like; None = not known here."""

    pp: int
    pp_rank: int
    vp: int
    num_microbatches: int
    seq_length: int | None = None
    micro_batch_size: int | None = None
    tp: int | None = None
    cp: int | None = None
    dp: int | None = None
    sequence_parallel: bool | None = None
    layers_on_rank: int | None = None
    model: dict[str, Any] = field(default_factory=dict)  # ModelShape field -> live value (our spelling)
    unsupported: list[str] = field(default_factory=list)
    cuda_graphs: str | None = None  # cuda_graphs.cuda_graph_problem of the model's config: refused
    modules: list[Any] = field(default_factory=list, repr=False, compare=False)  # the model chunks

    def layout(self) -> dict[str, int | None]:
        """Parallel sizes for the run log's header (None: not known)."""
        return {"pp": self.pp, "tp": self.tp, "cp": self.cp, "dp": self.dp}


def _group_size(group: Any) -> int | None:
    try:
        return int(group.size())
    except Exception:
        return None


def _unwrap(module: Any) -> Any:
    seen = 0
    while hasattr(module, "module") and seen < 8:
        module = module.module
        seen += 1
    return module


def live_run_from_call(kwargs: dict[str, Any]) -> LiveRun:
    """Collect the live facts from a schedule call's keyword arguments and megatron's parallel state."""
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_model_config

    model = kwargs["model"]
    chunks = list(model) if isinstance(model, list) else [model]
    pg = kwargs.get("pg_collection")
    if pg is not None and getattr(pg, "pp", None) is not None:
        pp, pp_rank = int(pg.pp.size()), int(pg.pp.rank())
        tp, cp = _group_size(getattr(pg, "tp", None)), _group_size(getattr(pg, "cp", None))
        dp = _group_size(getattr(pg, "dp", None))
    else:
        pp, pp_rank = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
        tp, cp = ps.get_tensor_model_parallel_world_size(), ps.get_context_parallel_world_size()
        dp = ps.get_data_parallel_world_size()
    config = get_model_config(chunks[0])
    live = LiveRun(
        pp=pp,
        pp_rank=pp_rank,
        vp=len(chunks),
        num_microbatches=int(kwargs["num_microbatches"]),
        seq_length=kwargs.get("seq_length"),
        micro_batch_size=kwargs.get("micro_batch_size"),
        tp=tp,
        cp=cp,
        dp=dp,
        sequence_parallel=bool(getattr(config, "sequence_parallel", False)),
        modules=chunks,
    )
    heads = getattr(config, "num_attention_heads", None)
    for name in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            live.model[name] = value
    groups = getattr(config, "num_query_groups", None)
    if isinstance(groups, int) or isinstance(heads, int):
        live.model["num_query_groups"] = groups if isinstance(groups, int) else heads
    vocab = getattr(_unwrap(chunks[0]), "vocab_size", None)
    if isinstance(vocab, int):
        live.model["vocab_size"] = vocab
    import torch

    live.model.update(live_architecture(config, _unwrap(chunks[0]), torch.get_float32_matmul_precision()))
    counts = [len(getattr(getattr(_unwrap(c), "decoder", None), "layers", None) or ()) for c in chunks]
    if all(hasattr(getattr(_unwrap(c), "decoder", None), "layers") for c in chunks):
        live.layers_on_rank = sum(counts)
    live.cuda_graphs = cuda_graph_problem(config)
    if getattr(config, "overlap_moe_expert_parallel_comm", False):
        live.unsupported.append("overlap_moe_expert_parallel_comm=True (combined 1F1B) is not supported")
    return live


def _spelled(value: Any) -> Any:
    """Booleans as a model file spells them (true/false); anything else unchanged."""
    return str(value).lower() if isinstance(value, bool) else value


def plan_mismatches(
    plan: Plan, live: LiveRun, supported_clocks_mhz: tuple[int, ...] | None = None, device_gpu: str | None = None
) -> list[str]:
    """Every way `plan` does not fit `live` (empty when it fits)."""
    par = plan.parallel
    out: list[str] = []
    cmp = functools.partial(compare, out)

    cmp("pipeline parallel size (pp)", par.pp, live.pp)
    cmp("virtual pipeline chunks (vp)", par.vp, live.vp)
    cmp("microbatches per iteration", par.num_microbatches, live.num_microbatches)
    cmp("tensor parallel size (tp)", par.tp, live.tp)
    cmp("context parallel size (cp)", par.cp, live.cp)
    cmp("data parallel size (dp)", par.dp, live.dp)
    cmp("sequence length", par.seq_length, live.seq_length)
    cmp("micro batch size", par.micro_batch_size, live.micro_batch_size)
    cmp("sequence parallel", par.sequence_parallel, live.sequence_parallel)
    if plan.framework != FRAMEWORK:
        out.append(f"framework: plan {plan.framework}, run {FRAMEWORK}")
    want_schedule = schedule_for(FRAMEWORK, live.vp)
    if par.schedule != want_schedule:
        out.append(f"schedule: plan {par.schedule}, run {want_schedule}")
    if plan.model is not None:
        for name, actual in live.model.items():
            planned = getattr(plan.model, name)
            if planned is None:
                continue  # a plan from before the field was recorded: unknown, not checked
            if name == "vocab_size" and planned <= actual < planned + VOCAB_PADDING * (live.tp or 1):
                continue  # megatron pads the vocabulary (--make-vocab-size-divisible-by x TP)
            cmp(f"model {name}", _spelled(planned), _spelled(actual))
    if live.pp_rank < len(par.layers_per_stage) and live.layers_on_rank is not None:
        cmp(
            f"transformer layers on pipeline rank {live.pp_rank}",
            par.layers_per_stage[live.pp_rank],
            live.layers_on_rank,
        )
    out.extend(device_mismatches(plan, live.pp_rank, supported_clocks_mhz, device_gpu))
    out.extend(live.unsupported)
    return out


def validate_plan(
    plan: Plan,
    live: LiveRun,
    supported_clocks_mhz: tuple[int, ...] | None = None,
    device_gpu: str | None = None,
    source: str = "the plan",
) -> None:
    """Raise one PlanMismatchError listing every mismatch between `plan` and the live run; a ConfigError
    first when the model runs under CUDA graphs (no plan can run there: cuda_graphs.py)."""
    if live.cuda_graphs:
        raise ConfigError(f"{source} cannot run on this model (pipeline rank {live.pp_rank}): {live.cuda_graphs}")
    raise_mismatches(
        plan_mismatches(plan, live, supported_clocks_mhz, device_gpu),
        f"{source} does not match this run (pipeline rank {live.pp_rank})",
        "Regenerate the plan for this configuration (kareus plan) or fix the launch arguments.",
    )


# ---- the patch ------------------------------------------------------------------------------


class PatchState(BasePatchState):
    """Per-process state of the installed patch; `session` receives instruction and iteration events."""

    plan: Plan

    def __init__(self, plan: Plan, session: Any, source: str = "the plan") -> None:
        super().__init__(plan, session, source)
        self.fwd_ids: dict[int, tuple[int, int]] = {}  # id of a forward output -> (chunk, microbatch)

    @property
    def pp_rank(self) -> int:
        return self.rank

    def bind(self, live: LiveRun) -> None:
        self.plan_entries(live.pp_rank, lambda i: (i.kind, i.chunk, i.microbatch))

    def warn_unplanned(self, kind: str, chunk: int, microbatch: int) -> None:
        """An instruction missing from the plan (cannot happen after validation) runs unplanned."""
        log.warning("kareus: %s of microbatch %d chunk %d is not in the plan", kind, microbatch, chunk)


def _tensor_key(t: Any) -> int:
    while isinstance(t, (list, tuple)) and t:
        t = t[0]
    return id(t)


_slot = PatchSlot()  # the installed state and the megatron-core functions it replaced


def installed_state() -> PatchState | None:
    """The live patch state, or None when the patch is not installed."""
    return _slot.state


def _wrap_schedule(name: str, fn: Any) -> Any:
    @functools.wraps(fn)
    def schedule(*args: Any, **kwargs: Any) -> Any:
        st = _slot.state
        if st is None or kwargs.get("forward_only", False) or st.active:
            return fn(*args, **kwargs)
        return st.run_iteration(lambda: live_run_from_call(kwargs), lambda: fn(*args, **kwargs))

    return schedule


def _wrap_forward(fn: Any) -> Any:
    """Wrap megatron-core's forward_step: announce the instruction megatron names (microbatch, chunk) and
    remember its output tensor for the backward (its backward_step gets the same object back).

    This runs at every instruction on the training thread, after megatron's own work has evicted it from the
    CPU caches, so it is written flat (no helper calls besides the patch state's)."""

    @functools.wraps(fn)
    def forward_step(*args: Any, **kwargs: Any) -> Any:
        st = _slot.state
        mb = kwargs.get("current_microbatch")
        if st is None or not st.active or mb is None:
            return fn(*args, **kwargs)
        chunk = kwargs.get("vp_stage") or 0
        if not st.announce(("forward", chunk, mb)):
            st.warn_unplanned("forward", chunk, mb)
        out = fn(*args, **kwargs)
        st.instruction_ends()
        t = out[0]
        st.fwd_ids[id(t) if not isinstance(t, (list, tuple)) else _tensor_key(t)] = (chunk, mb)
        return out

    return forward_step


def _wrap_backward(fn: Any) -> Any:
    """Wrap megatron-core's backward_step: announce the backward of the forward whose output it gets."""

    @functools.wraps(fn)
    def backward_step(*args: Any, **kwargs: Any) -> Any:
        st = _slot.state
        if st is None or not st.active:
            return fn(*args, **kwargs)
        t = args[1] if len(args) > 1 else kwargs.get("output_tensor")  # the forward's output
        ident = st.fwd_ids.pop(id(t) if not isinstance(t, (list, tuple)) else _tensor_key(t), None)
        if ident is None:
            return fn(*args, **kwargs)
        if not st.announce(("backward", ident[0], ident[1])):
            st.warn_unplanned("backward", ident[0], ident[1])
        out = fn(*args, **kwargs)
        st.instruction_ends()
        return out

    return backward_step


def install(plan: Plan, session: Any, source: str = "the plan") -> PatchState:
    """Patch megatron-core's schedules for `plan`; `session` gets validate/iteration/instruction calls."""
    check_megatron_core_version()
    from megatron.core.pipeline_parallel import schedules

    replacements: list[tuple[Any, str, Callable[[Any], Any]]] = [
        (schedules, name, functools.partial(_wrap_schedule, name)) for name in SCHEDULE_FUNCTIONS
    ]
    replacements += [(schedules, "forward_step", _wrap_forward), (schedules, "backward_step", _wrap_backward)]
    state: PatchState = _slot.install(replacements, lambda: PatchState(plan, session, source))
    return state


def uninstall() -> None:
    """Restore megatron-core's original functions (no-op when not installed)."""
    _slot.uninstall()

"""A megatron-core transformer layer that runs each microbatch as nanobatches with TP collectives overlapped.

``PartitionedTransformerLayer`` subclasses megatron-core's ``TransformerLayer`` and keeps its submodules
(input/pre-MLP norms, ``SelfAttention`` with ColumnParallelLinear qkv, a core attention (by default
``attention.SDPAttention`` on torch's scaled_dot_product_attention; ``core_attention="local"``: megatron's
unfused ``DotProductAttention``) and RowParallelLinear proj, ``MLP`` with fc1/fc2), parameters, state-dict
keys and initialisation, so a model built with ``get_partitioned_gpt_layer_spec()`` loads the same
checkpoints as one built with ``get_gpt_layer_local_spec()``. Only ``forward`` changes: the parallel linears
run with their own TP communication switched off (``explicit_expert_comm``, set only for the duration of the
call), and the engine's schedule (``schedule.py``) issues the all-reduces itself, asynchronously, at the
planned launch slots. Forward hooks on the submodules report op boundaries (qkv, rope, attention, proj, fc1,
activation, fc2) and place backward markers there.

Supported: TP all-reduce partitions (TP >= 1), 1 or 2 nanobatches, full activation recompute (megatron's
``recompute_granularity="full"``) and selective recompute of the core attention (``selective.py``), pipeline
parallelism (1F1B and interleaved), megatron DDP, dense GPT
and Llama-like layers (GELU/SwiGLU, LayerNorm/RMSNorm, RoPE, GQA, QK-norm), dropout (valid, but the
random draws differ from the unsplit layer's), sequence parallelism (all-gather / reduce-scatter
partitions, ``schedule_sp.py``), context parallelism with SDPAttention (K/V all-gather and dK/dV
reduce-scatter partitions over the CP group, ``schedule_cp.py``; TP × CP, and TP × CP with SP,
``schedule_cpsp.py``), cross-layer overlap with and without SP, not with CP (``cross_layer.py``; ``link_layers``
marks the layers that take part). Refused at build time: CP with an attention output gate, selective recompute
of modules other than the core attention, MoE.
Not yet: Transformer-Engine modules (a TE variant keeps this class and swaps the submodules: the
schedule needs only the linears' TP communication switched off and forward hooks at the op boundaries).
Calls with an inference context, cross attention or packed sequences fall back to the standard layer's
forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer

from kareus_megatron.errors import InfeasibleConfigError, PlanMismatchError
from kareus_megatron.runtime.frameworks.cuda_graphs import cuda_graph_problem
from kareus_megatron.runtime.overlap.attention import (
    CORE_ATTENTION_SDPA,
    SDPAttention,
    core_attention_class,
    swap_core_attention,
)
from kareus_megatron.runtime.overlap.engine import get_engine
from kareus_megatron.runtime.overlap.norm import sp_capable_norms
from kareus_megatron.runtime.overlap.schedule import LayerRun, PartitionedLayerFn
from kareus_megatron.runtime.overlap.schedule_cp import CPLayerRun
from kareus_megatron.runtime.overlap.schedule_cpsp import CPSPLayerRun
from kareus_megatron.runtime.overlap.schedule_sp import SPLayerRun
from kareus_megatron.runtime.overlap.selective import recompute_core_attention, selective_problems


class PartitionedTransformerLayer(TransformerLayer):
    """megatron-core TransformerLayer whose forward and backward run as overlapped nanobatch partitions."""

    feeds_next = False  # its output is the next partitioned layer's input in the same call (link_layers)

    def __init__(self, config: Any, submodules: Any, *args: Any, **kwargs: Any) -> None:
        _refuse(_config_problems(config))  # before megatron builds anything (its own asserts are less clear)
        super().__init__(config, submodules, *args, **kwargs)
        if not hasattr(self, "tp_group"):  # megatron-core 0.15 keeps it in pg_collection only
            self.tp_group = self.pg_collection.tp
        _refuse(_module_problems(self))
        recompute_core_attention(self.self_attention)  # selective recompute (selective.py)
        attn, mlp = self.self_attention, self.mlp
        self._linears = (attn.linear_qkv, attn.linear_proj, mlp.linear_fc1, mlp.linear_fc2)
        self._run: LayerRun | None = None
        self._install_hooks()

    # ------------------------------------------------------------------ engine plumbing
    @contextlib.contextmanager
    def local_comm(self) -> Iterator[None]:
        """Within: the four parallel linears skip their TP collectives (the engine issues them)."""
        saved = [lin.explicit_expert_comm for lin in self._linears]
        for lin in self._linears:
            lin.explicit_expert_comm = True
        try:
            yield
        finally:
            for lin, s in zip(self._linears, saved):
                lin.explicit_expert_comm = s

    @contextlib.contextmanager
    def active(self, run: LayerRun) -> Iterator[None]:
        """Within: submodule hooks report to `run`."""
        prev, self._run = self._run, run
        try:
            yield
        finally:
            self._run = prev

    def _install_hooks(self) -> None:
        attn, mlp = self.self_attention, self.mlp

        def pre(name: str, mark_input: str | None = None):
            def hook(_mod, args):
                run = self._run
                if run is None:
                    return None
                run.forward_op(name)
                if mark_input is None:
                    return None
                return (run.mark(args[0], mark_input), *args[1:])

            return hook

        def post(next_op: str | None, mark_output: str):
            def hook(_mod, _args, out):
                run = self._run
                if run is None:
                    return None
                if next_op is not None:
                    run.forward_op(next_op)
                if isinstance(out, tuple):
                    return (run.mark(out[0], mark_output), *out[1:])
                return run.mark(out, mark_output)

            return hook

        def core_pre(_mod, args, kwargs):
            run = self._run
            if run is None:
                return None
            cp_pre = getattr(run, "core_attention_pre", None)  # context parallelism: schedule_cp.CPLayerRun
            if cp_pre is not None:
                return cp_pre(args, kwargs)
            run.forward_op("attention")
            args = list(args)
            for i, key in ((0, "query"), (1, "key")):  # q and k after rope: backward slot "rope"
                if len(args) > i:
                    args[i] = run.mark(args[i], "rope")
                elif key in kwargs:
                    kwargs[key] = run.mark(kwargs[key], "rope")
            return tuple(args), kwargs

        attn.linear_qkv.register_forward_pre_hook(pre("qkv"))
        attn.linear_qkv.register_forward_hook(post("rope", "qkv"))
        attn.core_attention.register_forward_pre_hook(core_pre, with_kwargs=True)
        attn.core_attention.register_forward_hook(post(None, "attention"))
        attn.linear_proj.register_forward_pre_hook(pre("proj"))
        mlp.linear_fc1.register_forward_pre_hook(pre("fc1"))
        mlp.linear_fc1.register_forward_hook(post("activation", "fc1"))
        mlp.linear_fc2.register_forward_pre_hook(pre("fc2", mark_input="activation"))

    # ------------------------------------------------------------------ forward
    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs: Any):
        """Same contract as TransformerLayer.forward: returns (output [s, b, h], context)."""
        unsupported = (
            "context",
            "context_mask",
            "inference_context",
            "inference_params",
            "packed_seq_params",
            "sequence_len_offset",
            "rotary_pos_cos_sin",
        )
        if any(kwargs.get(k) is not None for k in unsupported):
            get_engine().take_carry(None)
            return super().forward(hidden_states, attention_mask=attention_mask, **kwargs)
        engine = get_engine()
        carry = engine.take_carry(hidden_states)  # cross-layer overlap: the previous layer's pending end
        state = engine.state
        settings = state.settings
        params = [p for p in self.parameters() if p.requires_grad]
        grad = torch.is_grad_enabled() and (hidden_states.requires_grad or bool(params))
        phase = state.forward_phase()
        halves = settings.halves(phase, grad)
        batch = hidden_states.shape[1]
        if batch % halves:
            raise InfeasibleConfigError(
                f"micro-batch size {batch} is not divisible by nanobatches={halves}; "
                "use an even micro-batch size or 1 nanobatch."
            )
        attn_kwargs = {
            "attention_mask": attention_mask,
            "rotary_pos_emb": kwargs.get("rotary_pos_emb"),
            "rotary_pos_cos": kwargs.get("rotary_pos_cos"),
            "rotary_pos_sin": kwargs.get("rotary_pos_sin"),
            "attention_bias": kwargs.get("attention_bias"),
        }
        cfg = self.config
        sp = getattr(cfg, "sequence_parallel", False) and getattr(cfg, "tensor_model_parallel_size", 1) > 1
        cp = getattr(cfg, "context_parallel_size", 1) > 1
        run_cls = (CPSPLayerRun if sp else CPLayerRun) if cp else SPLayerRun if sp else LayerRun
        run = run_cls(self, engine, settings, phase, grad=grad, halves=halves)
        if carry is not None and (not run.runs_cross_layer or run.n != carry.run.n):
            carry.complete()  # a run that takes no carry (cross_layer.py)
            carry = None
        run.carry = carry
        if grad:
            out = PartitionedLayerFn.apply(run, attn_kwargs, hidden_states, *params)
        else:
            out = run.forward(hidden_states, attn_kwargs)
        return out, None


def _config_problems(config: Any) -> list[str]:
    """Configuration settings the overlap engine does not run yet."""
    problems = []
    if getattr(config, "context_parallel_size", 1) > 1:
        if getattr(config, "attention_output_gate", False):
            problems.append("attention_output_gate with context parallelism")
    problems += selective_problems(config)
    if getattr(config, "num_moe_experts", None):
        problems.append("MoE layers")
    return problems


def _module_problems(layer: TransformerLayer) -> list[str]:
    """Submodules the schedule cannot drive (it needs the standard attention and MLP linears)."""
    mlp, attn = layer.mlp, layer.self_attention
    if not all(hasattr(mlp, a) for a in ("linear_fc1", "linear_fc2")) or not all(
        hasattr(attn, a) for a in ("linear_qkv", "core_attention", "linear_proj")
    ):
        return ["a non-standard attention/MLP module"]
    if getattr(layer.config, "context_parallel_size", 1) > 1 and not isinstance(attn.core_attention, SDPAttention):
        return [f"context parallelism with {type(attn.core_attention).__name__} (use core_attention='sdpa')"]
    return [
        f"{type(lin).__name__} without skip_bias_add"
        for lin in (attn.linear_proj, mlp.linear_fc2)
        if not getattr(lin, "skip_bias_add", False)
    ]


def _refuse(problems: list[str]) -> None:
    if problems:
        raise InfeasibleConfigError(
            "the partitioned (overlap) layer does not support "
            + ", ".join(problems)
            + "; use get_gpt_layer_local_spec() for this model or change the config."
        )


def check_model_for_plan(model: Any, plan: Any) -> int:
    """Number of partitioned layers in `model` (a module or list of chunks); PlanMismatchError if the
    plan runs 2 nanobatches somewhere but the model has none (it was built with the standard spec), or if its
    partitioned layers run under CUDA graphs (runtime/frameworks/cuda_graphs.py).
    With a ``cross_layer`` plan, also marks the layers that run cross-layer overlap (``link_layers``)."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    layers = [m for c in chunks for m in c.modules() if isinstance(m, PartitionedTransformerLayer)]
    count = len(layers)
    for layer in layers[:1] + [m for m in layers[1:] if m.config is not layers[0].config]:
        problem = cuda_graph_problem(layer.config)
        if problem:  # a captured layer replays without the engine's per-instruction settings
            raise PlanMismatchError(f"the overlap engine cannot run this model's partitioned layers: {problem}")
    if count == 0 and any(i.nanobatches > 1 for st in plan.stages for i in st.instructions):
        raise PlanMismatchError(
            "the plan runs instructions with 2 nanobatches but the model has no partitioned layers; build it with "
            "kareus's partitioned layer (Megatron-LM: drop your --spec, or pass --spec kareus_megatron.megatron_spec "
            "partitioned_layer_spec; megatron-core: kareus_megatron.megatron.transformer_layer_spec(config)) or run "
            "a 1-nanobatch plan point (e.g. perseus-fastest)."
        )
    cross = bool(getattr(plan, "cross_layer", False))
    if link_layers(model, enabled=cross) == 0 and cross and count > 1:
        import warnings

        warnings.warn(
            "kareus: the plan was made with --cross-layer but no two partitioned layers run back to back "
            "in one call (full recompute with recompute_num_layers=1?): every layer's last collective "
            "stays exposed and the plan's prediction is optimistic",
            stacklevel=2,
        )
    return count


def link_layers(model: Any, enabled: bool = True) -> int:
    """Mark each partitioned layer whose output feeds the next partitioned layer directly, within one call
    (cross_layer.py): consecutive layers of a megatron TransformerBlock (``layers``), with full recompute
    only inside one recompute group. `enabled` False clears the marks. Return the number of layers marked."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    marked = 0
    blocks = [m for c in chunks for m in c.modules() if isinstance(getattr(m, "layers", None), torch.nn.ModuleList)]
    for block in blocks:
        layers = list(block.layers)
        for layer in layers:
            if isinstance(layer, PartitionedTransformerLayer):
                layer.feeds_next = False
        cfg = getattr(block, "config", None)
        if not enabled or getattr(cfg, "cpu_offloading", False):  # offloading runs a step between layers
            continue
        for group in _call_groups(len(layers), cfg):
            for a, b in zip(group, group[1:]):
                if all(isinstance(layers[i], PartitionedTransformerLayer) for i in (a, b)):
                    layers[a].feeds_next = True
                    marked += 1
    return marked


def _call_groups(n: int, cfg: Any) -> list[list[int]]:
    """Runs of a block's layers called back to back, the output of one the input of the next (megatron-core's
    TransformerBlock: ``_checkpointed_forward`` under full recompute, one loop otherwise)."""
    if getattr(cfg, "recompute_granularity", None) != "full":
        return [list(range(n))]
    k = max(1, int(getattr(cfg, "recompute_num_layers", None) or 1))
    if getattr(cfg, "recompute_method", None) == "block":
        return [[i] for i in range(min(k, n))] + [list(range(k, n))]
    return [list(range(i, min(i + k, n))) for i in range(0, n, k)]


def get_partitioned_gpt_layer_spec(core_attention: str = CORE_ATTENTION_SDPA, **local_spec_kwargs: Any) -> ModuleSpec:
    """megatron-core's local GPT layer spec with the layer module swapped for the partitioned layer.

    ``core_attention``: "sdpa" (default; attention.SDPAttention on torch's scaled_dot_product_attention)
    or "local" (megatron's unfused DotProductAttention). Other arguments are those of
    ``get_gpt_layer_local_spec`` (e.g. ``normalization="RMSNorm"``). Both load the same state dicts.
    Where megatron would build its torch-norm fallback (no Apex/TE), the norms are ``norm.SPTorchNorm``:
    the same torch modules, also usable with sequence parallelism.
    """
    core_cls = core_attention_class(core_attention)
    spec = get_gpt_layer_local_spec(**local_spec_kwargs)
    if local_spec_kwargs.get("num_experts") or local_spec_kwargs.get("multi_latent_attention"):
        raise InfeasibleConfigError("the partitioned layer supports dense GPT layers only (no MoE, no MLA)")
    if core_cls is not None:
        spec = swap_core_attention(spec, core_cls)
    spec = sp_capable_norms(spec)  # megatron's torch-norm fallback refuses sequence parallelism
    return ModuleSpec(module=PartitionedTransformerLayer, params=dict(spec.params), submodules=spec.submodules)

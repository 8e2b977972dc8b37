"""The nanobatch schedule of one partitioned-layer call with context parallelism (CP), forward and backward.

With CP (megatron's ``context_parallel_size`` > 1) each rank holds 2 of the 2·CP load-balanced chunks of every
sequence (cp_attention.py); the attention needs the K and V of the whole sequence. The attn segment is cut
at the K/V collective (names from ``kareus_megatron.vocab``, as the planner's op graph cuts it,
``workload/opgraph.py``):

forward (and recompute), units in order, each one nanobatch at a time (nanobatch 0, then 1):

- ``cp_kv``: input_norm, qkv, rope; then the all-gather of this nanobatch's K and V (one tensor, K and V
  side by side) over the CP group, partition ``fwd_cp_kv`` (kind ``cp_all_gather``);
- ``attn``: waits that all-gather before the attention op; attention (SDPAttention on the local queries
  and the gathered K/V), proj; TP all-reduce of the proj output, partition ``fwd_attn`` (launch slots
  attention, proj only: the ops after the cut);
- ``mlp``: as without CP (``fwd_mlp``), then each output bias-dropout-add waits its own all-reduce.

Backward, units ``mlp`` (``bwd_mlp``), ``cp_kv`` (pre_mlp_norm, proj, attention: the attention backward
gives dQ and the dK/dV of every rank's gathered keys, reduce-scattered over the CP group back to their
owners, kind ``cp_reduce_scatter``, partition ``bwd_cp_kv``), ``attn`` (waits the reduce-scatter before
rope; rope, qkv; TP all-reduce of d qkv-input, ``bwd_attn``, slots rope and qkv) and the tail (input_norm).
As in schedule.py, each unit's collective is issued before the planned op of the next unit (the other
nanobatch's), or with 1 nanobatch at once; a planned slot that is not an op of the unit (a TP slot before
the cut) launches at the unit's first op. With TP = 1 the TP all-reduces move nothing and the units around
them run as one block (steps.py), as the planner cuts the layer only at the K/V collectives: forward
``cp_kv`` then attention, proj and the MLP beside the last K/V all-gather; backward the MLP, pre_mlp_norm,
proj and attention as one ``bwd_cp_kv`` unit, then rope, qkv and input_norm beside the last reduce-scatter.

The attention module is called in two steps so that the other nanobatch can run between them: megatron's
``SelfAttention.forward`` runs up to the core attention (qkv, rope: its own code, every version's rope
and QK-norm handling kept), where the layer's core-attention hook takes q, k, v and stops it (``_Captured``,
caught here); the attn unit then calls the core attention and ``linear_proj`` itself (what
``SelfAttention.forward`` does after the core attention for unpacked, ungated attention; output gates are
refused at build time). TP × CP: the TP collectives run on the layer's TP group, the K/V ones on the CP group.

The CP pieces (q/k/v capture, K/V all-gather, attention + proj, and their backward) are the mixin ``CPUnits``;
``CPLayerRun`` combines them with the TP all-reduce units, ``schedule_cpsp.CPSPLayerRun`` with sequence
parallelism's all-gather / reduce-scatter units (TP × CP with SP).
"""

from __future__ import annotations

from typing import Any

import torch

from kareus_megatron.runtime.overlap.config import cp_engine_slots
from kareus_megatron.runtime.overlap.pieces import _NB, Grads, _Coll, _leaf
from kareus_megatron.runtime.overlap.schedule import LayerRun
from kareus_megatron.runtime.overlap.steps import StepRun


class _Captured(Exception):  # noqa: N818 - control flow, not an error
    """Raised by the core-attention hook to stop SelfAttention.forward once q, k, v exist."""


def cp_group_of(layer: Any) -> Any:
    """The context-parallel group of `layer` (its attention's process groups, else megatron's global one)."""
    group = getattr(getattr(layer.self_attention, "pg_collection", None), "cp", None)
    if group is None:
        from megatron.core import parallel_state

        group = parallel_state.get_context_parallel_group()
    return group


class CPUnits(StepRun):
    """Context parallelism's pieces of a layer run (a mixin before LayerRun or schedule_sp.SPLayerRun): the CP
    group, q/k/v capture, the K/V all-gather, core attention + proj, and their backward. ``engine_slots``
    names the units' launch slots (a planned slot outside its unit launches at the unit's first op)."""

    engine_slots = staticmethod(cp_engine_slots)
    runs_cross_layer = False  # cross-layer overlap: TP all-reduce and SP layers only

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cp_group = cp_group_of(self.layer)
        self._unit_ops = self.engine_slots()
        self._capture = False
        self._captured: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def _schedule(self, c: _Coll, nb: int, partition: str, overlap: bool) -> None:
        super()._schedule(c, nb, partition, overlap)
        ops = self._unit_ops.get(partition, ())
        if self.partner is c and ops and c.slot not in ops:
            c.slot = ops[0]

    def core_attention_pre(self, args: tuple, kwargs: dict[str, Any]) -> Any:
        """Core-attention forward pre-hook (layer.py): capture q, k, v and stop, or report the attention op."""
        if not self._capture:
            self.op("attention")
            return None
        vals = list(args[:3]) + [kwargs[k] for k in ("query", "key", "value")[len(args) :] if k in kwargs]
        q, k, v = vals[:3]
        self._captured = (self.mark(q, "rope"), self.mark(k, "rope"), v)
        raise _Captured

    def _cp(self) -> int:
        return self.engine.comm.world(self.cp_group)

    def kv_gather(self, st: _NB, nb: int, name: str) -> _Coll:
        """Run the attention on ``st.ln1_in`` up to its core attention (qkv, rope); return the pending K/V
        all-gather named `name`."""
        lay = self.layer
        self._capture, self._captured = True, None
        try:
            with lay.local_comm(), lay.active(self):
                lay.self_attention(st.ln1_in, **st.kw)
        except _Captured:
            pass
        finally:
            self._capture = False
        if self._captured is None:
            raise RuntimeError("the core-attention hook did not run: not a standard SelfAttention")
        st.q, st.k, st.v = self._captured
        st.hn = st.k.shape[-1]
        src = torch.cat([st.k.detach(), st.v.detach()], dim=-1).contiguous()
        return _Coll(
            name, nb, src.new_empty((src.shape[0] * self._cp(), *src.shape[1:])), kind="cp_all_gather", src=src
        )

    def attend_proj(self, st: _NB) -> None:
        """Core attention of the local queries over the gathered K/V (waited at the attention op), then proj."""
        lay, attn = self.layer, self.layer.self_attention
        st.q_in = _leaf(st.q, self.grad)
        st.kv_in = _leaf(st.colls["fwd.cp_kv"].buf, self.grad)
        self._need = st.colls["fwd.cp_kv"]  # waited at the attention op (core_attention_pre)
        with lay.local_comm(), lay.active(self):
            ctx = attn.core_attention(
                st.q_in,
                st.kv_in[..., : st.hn],
                st.kv_in[..., st.hn :],
                st.kw.get("attention_mask"),
                attn_mask_type=None,
                attention_bias=st.kw.get("attention_bias"),
            )
            st.attn_partial, st.attn_bias = attn.linear_proj(ctx)

    def kv_scatter(self, grads: Grads, st: _NB, nb: int, d_attn: torch.Tensor, name: str) -> _Coll:
        """Backward of proj and the attention for `d_attn` (the proj output's gradient); return the pending dK/dV
        reduce-scatter named `name` (dQ kept in ``st.d_q``)."""
        self.op("proj")
        st.d_q, d_kv = grads([st.attn_partial], [d_attn], [st.q_in, st.kv_in])
        src = torch.zeros_like(st.kv_in) if d_kv is None else d_kv.contiguous()
        return _Coll(
            name, nb, src.new_empty((src.shape[0] // self._cp(), *src.shape[1:])), kind="cp_reduce_scatter", src=src
        )

    def qkv_backward(self, grads: Grads, st: _NB, nb: int) -> torch.Tensor:
        """Backward of rope and qkv once this nanobatch's dK/dV reduce-scatter is waited; return d ``ln1_in``."""
        self._need = st.colls["bwd.cp_kv"]
        self.backward_op(nb, "rope")
        d_kv = st.colls["bwd.cp_kv"].buf
        (d_ln1,) = grads([st.q, st.k, st.v], [st.d_q, d_kv[..., : st.hn], d_kv[..., st.hn :]], [st.ln1_in])
        return d_ln1


class CPLayerRun(CPUnits, LayerRun):
    """One call of a partitioned layer under context parallelism (see module docstring)."""

    fwd_units = ("cp_kv", "attn", "mlp")
    bwd_units = ("mlp", "cp_kv", "attn")

    def forward_unit(self, seg: str, st: _NB, nb: int) -> _Coll:
        """Forward unit `seg` of nanobatch `nb` (input [s/cp, b, h], megatron's CP layout); return its collective."""
        lay, name = self.layer, self.coll_name("fwd", seg, nb)
        if seg == "cp_kv":
            self.start_nb(st, nb)
            self.op("input_norm")
            st.ln1 = lay.input_layernorm(st.x)
            st.ln1_in = _leaf(st.ln1, self.grad)
            return self.kv_gather(st, nb, name)
        if seg == "attn":
            self.attend_proj(st)
            return _Coll(name, nb, st.attn_partial.detach())
        return self.mlp_unit(st, nb, name)

    def backward_unit(self, seg: str, grads: Grads, st: _NB, nb: int) -> _Coll:
        """Backward unit `seg` of nanobatch `nb`; return its pending collective."""
        name = self.coll_name("bwd", seg, nb)
        if seg == "mlp":
            return self._bwd_mlp(grads, nb, self._douts[nb])
        if seg == "cp_kv":
            self.op("pre_mlp_norm", needs=st.colls["bwd.mlp"])
            d_attn, d_x = grads([st.h1, st.ln2], [st.d_h1_res, st.colls["bwd.mlp"].buf], [st.attn_sum, st.x])
            grads.add_dx(nb, d_x)
            return self.kv_scatter(grads, st, nb, d_attn, name)
        return _Coll(name, nb, self.qkv_backward(grads, st, nb).contiguous())

"""The nanobatch schedule of one partitioned-layer call with sequence parallelism (SP), forward and backward.

With SP (megatron's ``sequence_parallel=True``, TP > 1) a layer's input and output are split along the
sequence (``[s/tp, b, h]``); the norms and bias-dropout-adds run on that split, and each TP block gathers
its input and reduce-scatters its output along dim 0 (names from ``kareus_megatron.vocab``):

forward (and recompute), units in order, each one nanobatch at a time (nanobatch 0, then 1):

- ``attn_norm``: input_norm, then the all-gather of its output (the qkv input), partition
  ``fwd_sp_attn_norm``;
- ``attn``: waits that all-gather before qkv; qkv, rope, attention, proj; reduce-scatter of the proj
  output, partition ``fwd_sp_attn``;
- ``mlp_norm``: waits the attention reduce-scatter; bias-dropout-add, pre_mlp_norm; all-gather,
  partition ``fwd_sp_mlp_norm``;
- ``mlp``: waits it before fc1; fc1, activation, fc2; reduce-scatter, partition ``fwd_sp_mlp``;
- the last reduce-scatter has no partner segment: issued at once, each output bias-dropout-add waits
  its own.

Each unit's collective is issued, as in schedule.py, before the planned op of the next unit (the other
nanobatch's, or with 1 nanobatch at once). Backward: each nanobatch's output bias-dropout-add backward,
then the all-gather of its output gradient (the layer's *leading* collective: no compute before it inside
the layer, so it is issued and waited at once: exposed, as search/partition.py models it); then units
``mlp`` (fc2, activation, fc1; reduce-scatter of d fc1-input, partition ``bwd_sp_mlp``), ``attn_norm``
(pre_mlp_norm and the attention bias-dropout-add backward; all-gather of d proj-output,
``bwd_sp_attn_norm``), ``attn`` (proj, attention, rope, qkv; reduce-scatter of d qkv-input,
``bwd_sp_attn``) and the tail (input_norm), the last reduce-scatter overlapping nanobatch 0's tail.

The parallel linears run with their own SP communication switched off (``layer.local_comm``): with
``explicit_expert_comm`` set, ColumnParallelLinear passes ``sequence_parallel=False`` to its autograd
function (no input all-gather, no input-gradient reduce-scatter; its weight gradient uses the gathered
input it was given) and RowParallelLinear skips its reduce-scatter (``megatron/core/tensor_parallel/
layers.py``, read at core_v0.16.1, the installed 0.16.1 wheel, and core_v0.19.0; 0.15 is not on this
machine and is assumed to match, as the all-reduce path already assumes). The norms' and the row
linears' bias gradients stay partial per rank as in the standard layer (their parameters carry
``sequence_parallel=True``; megatron's finalize_model_grads all-reduces them).
"""

from __future__ import annotations

from typing import Any

import torch

from kareus_megatron.runtime.overlap.pieces import _NB, Grads, _Coll, _leaf
from kareus_megatron.runtime.overlap.schedule import LayerRun


class SPLayerRun(LayerRun):
    """One call of a partitioned layer under sequence parallelism (see module docstring)."""

    def _tp(self) -> int:
        return self.engine.comm.world(self.layer.tp_group)

    def _gather(self, name: str, nb: int, t: torch.Tensor) -> _Coll:
        src = t.detach().contiguous()
        out = src.new_empty((src.shape[0] * self._tp(), *src.shape[1:]))
        return _Coll(name, nb, out, kind="all_gather", src=src)

    def _scatter(self, name: str, nb: int, t: torch.Tensor) -> _Coll:
        src = t.detach().contiguous()
        out = src.new_empty((src.shape[0] // self._tp(), *src.shape[1:]))
        return _Coll(name, nb, out, kind="reduce_scatter", src=src)

    fwd_units: tuple[str, ...] = ("attn_norm", "attn", "mlp_norm", "mlp")  # forward segments, in order
    bwd_units: tuple[str, ...] = ("mlp", "attn_norm", "attn")  # backward segments after the leading all-gather

    @staticmethod
    def partition(prefix: str, seg: str) -> str:
        """vocab partition name of unit `seg` in phase `prefix` ("fwd"/"bwd")."""
        return f"{prefix}_sp_{seg}"

    # ------------------------------------------------------------------ forward
    def forward_unit(self, seg: str, st: _NB, nb: int) -> _Coll:
        """Forward unit `seg` of nanobatch `nb`; return its pending collective."""
        lay, name = self.layer, self.coll_name("fwd", seg, nb)
        if seg == "attn_norm":
            self.start_nb(st, nb)
            self.op("input_norm")
            st.ln1 = lay.input_layernorm(st.x)
            return self._gather(name, nb, st.ln1)
        if seg == "attn":
            gathered = st.colls["fwd.attn_norm"]
            st.ln1_in = _leaf(gathered.buf, self.grad)  # filled once waited: the qkv hook waits
            self._need = gathered
            with lay.local_comm(), lay.active(self):
                st.attn_partial, st.attn_bias = lay.self_attention(st.ln1_in, **st.kw)
            return self._scatter(name, nb, st.attn_partial)
        if seg == "mlp_norm":
            self.op("pre_mlp_norm", needs=st.colls["fwd.attn"])
            st.attn_sum = _leaf(st.colls["fwd.attn"].buf, self.grad)
            with lay.bias_dropout_add_exec_handler():
                st.h1 = lay.self_attn_bda(lay.training, lay.config.bias_dropout_fusion)(
                    (st.attn_sum, st.attn_bias), st.x, lay.hidden_dropout
                )
            st.ln2 = lay.pre_mlp_layernorm(st.h1)
            return self._gather(name, nb, st.ln2)
        gathered = st.colls["fwd.mlp_norm"]
        st.ln2_in = _leaf(gathered.buf, self.grad)
        self._need = gathered  # waited by the fc1 hook
        with lay.local_comm(), lay.active(self):
            st.mlp_partial, st.mlp_bias = lay.mlp(st.ln2_in)
        return self._scatter(name, nb, st.mlp_partial)

    # ------------------------------------------------------------------ backward
    def backward_start(self, pre: Any, dout: torch.Tensor) -> tuple[Grads, _Coll | None, bool]:
        """(gradients, None, False) after the leading all-gather of each half's output gradient (exposed; merged:
        one over the whole microbatch), or with a prefetch (cross_layer.py) the gradients of the steps it ran."""
        if pre is not None:  # the leading all-gathers were issued inside the next layer's backward
            pre.check(dout, self._douts, self.layer.layer_number)
            return pre.grads, None, False
        grads = Grads(self.params, self.n)
        for nb in range(self.n):
            c = self._lead_gather(grads, nb, self._douts[nb])
            self._issue(c)
            if not self.merge or nb == self.n - 1:
                self._wait(c)
        return grads, None, False

    def _lead_gather(self, grads: Grads, nb: int, dout: torch.Tensor) -> _Coll:
        """Nanobatch `nb`'s output bias-dropout-add backward; return the all-gather of its gradient (not issued)."""
        st = self.nbs[nb]
        self._enter(nb, "")
        d_sum, st.d_h1_res = grads([st.out], [dout], [st.mlp_sum, st.h1_in])
        c = self._gather(self.coll_name("bwd", "out", nb), nb, d_sum)
        st.colls["bwd.out"] = c
        return c

    def prefetch_step(self, pre: Any, nb: int, dout: torch.Tensor) -> None:
        """With SP: nanobatch `nb`'s leading all-gather, issued at once for nanobatch 0 (beside the next layer's
        last collective and its nanobatch-1 tail), for nanobatch 1 at ``bwd_sp_mlp``'s slot of nanobatch 0's
        mlp unit (its comm SMs), as search/partition.py's cross-layer model runs them."""
        c = self._lead_gather(pre.grads, nb, dout)
        if nb == 0:
            self._issue(c)
        else:
            self._schedule(c, 0, self.partition("bwd", self.bwd_units[0]), overlap=True)

    def backward_unit(self, seg: str, grads: Grads, st: _NB, nb: int) -> _Coll:
        """Backward unit `seg` of nanobatch `nb`; return its pending collective."""
        name = self.coll_name("bwd", seg, nb)
        if seg == "mlp":
            self.op("fc2", needs=st.colls["bwd.out"])
            (d_ln2,) = grads([st.mlp_partial], [st.colls["bwd.out"].buf], [st.ln2_in])
            return self._scatter(name, nb, d_ln2)
        if seg == "attn_norm":
            self.op("pre_mlp_norm", needs=st.colls["bwd.mlp"])
            d_attn, d_x = grads([st.h1, st.ln2], [st.d_h1_res, st.colls["bwd.mlp"].buf], [st.attn_sum, st.x])
            grads.add_dx(nb, d_x)
            return self._gather(name, nb, d_attn)
        self.op("proj", needs=st.colls["bwd.attn_norm"])
        (d_ln1,) = grads([st.attn_partial], [st.colls["bwd.attn_norm"].buf], [st.ln1_in])
        return self._scatter(name, nb, d_ln1)

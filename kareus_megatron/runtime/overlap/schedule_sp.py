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

from kareus_megatron.runtime.overlap.pieces import Grads, _Coll, _leaf, _split_batch
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

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor, attn_kwargs: dict[str, Any]) -> torch.Tensor:
        """Run the layer on `x` ([s/tp, b, h]) as `n` nanobatches; return the output [s/tp, b, h]."""
        n, lay, tag = self.n, self.layer, f"L{self.layer.layer_number}.fwd"
        xs = x.chunk(n, dim=1)
        masks = _split_batch(attn_kwargs.get("attention_mask"), n, x.shape[1])
        units = [(nb, seg) for seg in ("attn_norm", "attn", "mlp_norm", "mlp") for nb in range(n)]
        prev: _Coll | None = None
        for nb, seg in units:
            part = f"fwd_sp_{seg}"
            if prev is not None:
                self._schedule(prev, nb, part, overlap=n > 1)
            self._enter(nb, part if self.partner is not None else "")
            st = self.nbs[nb]
            if seg == "attn_norm":
                st.x = _leaf(xs[nb], self.grad)
                self.op("input_norm")
                st.ln1 = lay.input_layernorm(st.x)
                c = self._gather(f"{tag}.attn_norm.nb{nb}", nb, st.ln1)
            elif seg == "attn":
                gathered = st.colls["fwd.attn_norm"]
                st.ln1_in = _leaf(gathered.buf, self.grad)  # filled once waited: the qkv hook waits
                self._need = gathered
                kw = dict(attn_kwargs, attention_mask=masks[nb])
                with lay.local_comm(), lay.active(self):
                    st.attn_partial, st.attn_bias = lay.self_attention(st.ln1_in, **kw)
                c = self._scatter(f"{tag}.attn.nb{nb}", nb, st.attn_partial)
            elif seg == "mlp_norm":
                self.op("pre_mlp_norm", needs=st.colls["fwd.attn"])
                st.attn_sum = _leaf(st.colls["fwd.attn"].buf, self.grad)
                with lay.bias_dropout_add_exec_handler():
                    st.h1 = lay.self_attn_bda(lay.training, lay.config.bias_dropout_fusion)(
                        (st.attn_sum, st.attn_bias), st.x, lay.hidden_dropout
                    )
                st.ln2 = lay.pre_mlp_layernorm(st.h1)
                c = self._gather(f"{tag}.mlp_norm.nb{nb}", nb, st.ln2)
            else:
                gathered = st.colls["fwd.mlp_norm"]
                st.ln2_in = _leaf(gathered.buf, self.grad)
                self._need = gathered  # waited by the fc1 hook
                with lay.local_comm(), lay.active(self):
                    st.mlp_partial, st.mlp_bias = lay.mlp(st.ln2_in)
                c = self._scatter(f"{tag}.mlp.nb{nb}", nb, st.mlp_partial)
            st.colls[f"fwd.{seg}"] = c
            self._leave()
            prev = c
        assert prev is not None
        return self.finish_forward(prev)

    # ------------------------------------------------------------------ backward
    def backward(self, dout: torch.Tensor, settings: Any) -> tuple[torch.Tensor, list]:
        """Run the planned backward for output gradient `dout` ([s/tp, b, h]); return (d input, param grads)."""
        self.settings, self.phase = settings, "backward"
        n, tag = self.n, f"L{self.layer.layer_number}.bwd"
        overlap = n > 1 and settings.nanobatches > 1
        grads = Grads(self.params, n)
        grad, add_dx = grads, grads.add_dx

        douts = [d.contiguous() for d in dout.chunk(n, dim=1)]
        for nb in range(n):  # the leading all-gather of each nanobatch's output gradient: exposed
            st = self.nbs[nb]
            self._enter(nb, "")
            d_sum, st.d_h1_res = grad([st.out], [douts[nb]], [st.mlp_sum, st.h1_in])
            c = self._gather(f"{tag}.out.nb{nb}", nb, d_sum)
            st.colls["bwd.out"] = c
            self._issue(c)
            self._wait(c)
        units = [(nb, seg) for seg in ("mlp", "attn_norm", "attn") for nb in range(n)]
        prev: _Coll | None = None
        for nb, seg in units:
            part = f"bwd_sp_{seg}"
            if prev is not None:
                self._schedule(prev, nb, part, overlap)
            self._enter(nb, part if self.partner is not None else "")
            st = self.nbs[nb]
            if seg == "mlp":
                self.op("fc2", needs=st.colls["bwd.out"])
                (d_ln2,) = grad([st.mlp_partial], [st.colls["bwd.out"].buf], [st.ln2_in])
                c = self._scatter(f"{tag}.mlp.nb{nb}", nb, d_ln2)
            elif seg == "attn_norm":
                self.op("pre_mlp_norm", needs=st.colls["bwd.mlp"])
                d_attn, d_x = grad([st.h1, st.ln2], [st.d_h1_res, st.colls["bwd.mlp"].buf], [st.attn_sum, st.x])
                add_dx(nb, d_x)
                c = self._gather(f"{tag}.attn_norm.nb{nb}", nb, d_attn)
            else:
                self.op("proj", needs=st.colls["bwd.attn_norm"])
                (d_ln1,) = grad([st.attn_partial], [st.colls["bwd.attn_norm"].buf], [st.ln1_in])
                c = self._scatter(f"{tag}.attn.nb{nb}", nb, d_ln1)
            st.colls[f"bwd.{seg}"] = c
            self._leave()
            prev = c
        assert prev is not None
        self._issue(prev)
        for nb in range(n):
            st = self.nbs[nb]
            self._enter(nb, "")
            self.op("input_norm", needs=st.colls["bwd.attn"])
            (d_x,) = grad([st.ln1], [st.colls["bwd.attn"].buf], [st.x])
            add_dx(nb, d_x)
        self.nbs = []  # free the graphs' tensors
        return grads.result()

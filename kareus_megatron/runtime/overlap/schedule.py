"""The nanobatch schedule of one partitioned-layer call, forward and backward, and its autograd functions.

Design (units, issue and wait points, the pieces' autograd graphs):
docs/concepts/overlap-engine.md#one-layers-call-step-by-step.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch

from kareus_megatron.runtime.overlap.cross_layer import ForwardCarry, Prefetched, own
from kareus_megatron.runtime.overlap.pieces import _NB, Grads, _Coll, _leaf, _split_batch
from kareus_megatron.runtime.overlap.steps import StepRun

if TYPE_CHECKING:
    from kareus_megatron.runtime.overlap.config import LayerSettings
    from kareus_megatron.runtime.overlap.engine import OverlapEngine


class LayerRun(StepRun):
    """One call of a partitioned layer: its schedule, pending collectives and trace context."""

    runs_cross_layer = True  # takes part in cross-layer overlap (cross_layer.py; not the CP runs)
    fwd_units: tuple[str, ...] = ("attn", "mlp")  # forward units, in order
    bwd_units: tuple[str, ...] = ("mlp", "attn")  # backward units (before the tail), in order

    def __init__(
        self,
        layer: Any,
        engine: OverlapEngine,
        settings: LayerSettings,
        phase: str,
        grad: bool,
        halves: int | None = None,
    ):
        super().__init__(layer, engine, settings, phase, grad, halves)
        # cross-layer overlap (cross_layer.py): the previous layer's pending end, taken by this call's forward;
        # that layer's run (weakly: for the backward prefetch); this run's first backward steps if prefetched
        self.carry: ForwardCarry | None = None
        self.lower: weakref.ref | None = None
        self.prefetched: Prefetched | None = None
        self._xs: tuple[torch.Tensor, ...] = ()
        self._masks: list[torch.Tensor | None] = []
        self._kwargs: dict[str, Any] = {}
        self._taken: ForwardCarry | None = None
        self._douts: list[torch.Tensor] = []

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor, attn_kwargs: dict[str, Any]) -> torch.Tensor:
        """Run the layer on `x` ([s, b, h]; SP: [s/tp, b, h]) as `n` halves; return the output, same shape."""
        self._xs = x.chunk(self.n, dim=1)
        self._masks = _split_batch(attn_kwargs.get("attention_mask"), self.n, x.shape[1])
        self._kwargs = attn_kwargs
        self._taken = carry = self.take_carry()
        prev = carry.coll if carry is not None else None  # the first unit runs beside it
        last = self.walk("fwd", self.fwd_units, prev, self.overlaps(), self.forward_unit)
        return self.finish_forward(last)

    def start_nb(self, st: _NB, nb: int) -> None:
        """Nanobatch `nb`'s input leaf and attention arguments (its first unit calls this)."""
        st.x = self.input_leaf(self._taken, self._xs, nb)
        st.kw = dict(self._kwargs, attention_mask=self._masks[nb])

    def forward_unit(self, seg: str, st: _NB, nb: int) -> _Coll:
        """Forward unit `seg` of nanobatch `nb`; return its (pending) collective."""
        if seg == "mlp":
            return self.mlp_unit(st, nb, self.coll_name("fwd", seg, nb))
        lay = self.layer
        self.start_nb(st, nb)
        self.op("input_norm")
        st.ln1 = lay.input_layernorm(st.x)
        st.ln1_in = _leaf(st.ln1, self.grad)
        with lay.local_comm(), lay.active(self):
            st.attn_partial, st.attn_bias = lay.self_attention(st.ln1_in, **st.kw)
        return _Coll(self.coll_name("fwd", seg, nb), nb, st.attn_partial.detach())

    def take_carry(self) -> ForwardCarry | None:
        """The previous layer's pending end handed to this call (cross_layer.py), remembering that layer."""
        carry, self.carry = self.carry, None
        if carry is not None:
            self.lower = weakref.ref(carry.run)
        return carry

    def input_leaf(self, carry: ForwardCarry | None, xs: tuple[torch.Tensor, ...], nb: int) -> torch.Tensor:
        """Nanobatch `nb`'s input leaf; with a carry, the previous layer's pending half is completed first."""
        if carry is None or carry.coll is None:
            return _leaf(xs[nb], self.grad)
        if nb == carry.nb:
            carry.complete(by=self)
        return _leaf(own(xs[nb]), self.grad)

    def finish_forward(self, last: _Coll | None) -> torch.Tensor:
        """Issue the layer's last collective `last` (no partner segment; None: issued already), then each
        nanobatch's output bias-dropout-add after its own MLP collective; return the output [s, b, h] (SP:
        [s/tp, b, h]).

        With cross-layer overlap (a 2-nanobatch instruction of a ``cross_layer`` plan, this layer's output
        feeding the next partitioned layer): `last` stays unissued and the output's last nanobatch unwritten;
        the next layer completes both (``cross_layer.ForwardCarry``). A forward of such a plan that runs merged
        (1 nanobatch, halves for a 2-nanobatch backward) hands the next layer a carry with nothing pending, so
        that its backward runs this layer's first step as cross-layer overlap does."""
        linked = (
            self.n > 1
            and self.runs_cross_layer
            and getattr(self.layer, "feeds_next", False)
            and (self.engine.state.cross_layer or self.settings.cross_layer)
        )
        defer = linked and self.settings.cross_layer and last is not None
        if not defer and last is not None:
            self._issue(last)
        outs = [self.finish_nb(nb) for nb in range(self.n - 1 if defer else self.n)]
        if not defer:
            out = outs[0] if self.n == 1 else torch.cat(outs, dim=1)
            if linked and self.grad:
                self.engine.carry = ForwardCarry(self, None, out, -1)
            return out
        width = outs[0].shape[1]
        buf = outs[0].new_empty((outs[0].shape[0], width * self.n, *outs[0].shape[2:]))
        with torch.no_grad():
            for nb, o in enumerate(outs):
                buf.narrow(1, nb * width, width).copy_(o)
        assert last is not None
        self.engine.carry = ForwardCarry(self, last, buf, self.n - 1)
        return buf

    def finish_nb(self, nb: int) -> torch.Tensor:
        """Nanobatch `nb`'s output bias-dropout-add, after its MLP collective; return its output."""
        lay, st = self.layer, self.nbs[nb]
        self._enter(nb, "")
        self.op("bda", needs=st.colls["fwd.mlp"])
        st.mlp_sum = _leaf(st.colls["fwd.mlp"].buf, self.grad)
        st.h1_in = _leaf(st.h1, self.grad)
        with lay.bias_dropout_add_exec_handler():
            st.out = lay.mlp_bda(lay.training, lay.config.bias_dropout_fusion)(
                (st.mlp_sum, st.mlp_bias), st.h1_in, lay.hidden_dropout
            )
        return st.out

    def mlp_unit(self, st: _NB, nb: int, name: str) -> _Coll:
        """The MLP unit without SP: wait the attention all-reduce, bias-dropout-add, pre_mlp_norm, MLP; return
        its (pending) output all-reduce named `name`."""
        lay = self.layer
        self.op("pre_mlp_norm", needs=st.colls["fwd.attn"])
        st.attn_sum = _leaf(st.colls["fwd.attn"].buf, self.grad)
        with lay.bias_dropout_add_exec_handler():
            st.h1 = lay.self_attn_bda(lay.training, lay.config.bias_dropout_fusion)(
                (st.attn_sum, st.attn_bias), st.x, lay.hidden_dropout
            )
        st.ln2 = lay.pre_mlp_layernorm(st.h1)
        st.ln2_in = _leaf(st.ln2, self.grad)
        with lay.local_comm(), lay.active(self):
            st.mlp_partial, st.mlp_bias = lay.mlp(st.ln2_in)
        return _Coll(name, nb, st.mlp_partial.detach())

    # ------------------------------------------------------------------ backward
    def backward(self, dout: torch.Tensor, settings: LayerSettings) -> tuple[torch.Tensor, list]:
        """Run the planned backward for output gradient `dout`; return (d input, parameter grads)."""
        overlap = self.start_backward(settings)
        self._douts = [d.contiguous() for d in dout.chunk(self.n, dim=1)]
        pre, self.prefetched = self.prefetched, None
        grads, prev, skip = self.backward_start(pre, dout)
        lower = self.lower() if self.lower is not None and overlap else None

        def tail(nb: int) -> None:
            self.tail_nb(grads, nb, lower, settings)

        self.walk(
            "bwd",
            self.bwd_units,
            prev,
            overlap,
            lambda seg, st, nb: self.backward_unit(seg, grads, st, nb),
            tail=tail,
            skip_first=skip,
        )
        self.nbs = []  # free the graphs' tensors
        dx, pgrads = grads.result()
        if lower is not None and lower.prefetched is not None:  # what the previous layer's backward is handed
            lower.prefetched.returned = dx
        return dx, pgrads

    def backward_start(self, pre: Prefetched | None, dout: torch.Tensor) -> tuple[Grads, _Coll | None, bool]:
        """(gradients, collective pending before the first unit, whether nanobatch 0's first unit ran already):
        with a prefetch (cross_layer.py), its gradients and nanobatch 0's mlp all-reduce."""
        if pre is None:
            return Grads(self.params, self.n), None, False
        pre.check(dout, self._douts, self.layer.layer_number)
        return pre.grads, pre.coll, True

    def backward_unit(self, seg: str, grads: Grads, st: _NB, nb: int) -> _Coll:
        """Backward unit `seg` of nanobatch `nb`; return its pending collective."""
        if seg == "mlp":
            return self._bwd_mlp(grads, nb, self._douts[nb])
        self.op("pre_mlp_norm", needs=st.colls["bwd.mlp"])
        d_attn, d_x = grads([st.h1, st.ln2], [st.d_h1_res, st.colls["bwd.mlp"].buf], [st.attn_sum, st.x])
        grads.add_dx(nb, d_x)
        self.op("proj")
        (d_ln1,) = grads([st.attn_partial], [d_attn], [st.ln1_in])
        return _Coll(self.coll_name("bwd", seg, nb), nb, d_ln1.contiguous())

    def tail_nb(self, grads: Grads, nb: int, lower: LayerRun | None, settings: LayerSettings) -> None:
        """Nanobatch `nb`'s tail (input_norm backward) after its attn collective; with cross-layer overlap, then
        the previous layer's first backward step of that nanobatch (``prefetch``)."""
        st = self.nbs[nb]
        self.op("input_norm", needs=st.colls["bwd.attn"])
        (d_x,) = grads([st.ln1], [st.colls["bwd.attn"].buf], [st.x])
        grads.add_dx(nb, d_x)
        if lower is not None:
            lower.prefetch(nb, grads.dx[nb], settings)  # type: ignore[arg-type]

    def _bwd_mlp(self, grads: Grads, nb: int, dout: torch.Tensor) -> _Coll:
        """Backward mlp unit of nanobatch `nb` for its output gradient `dout`; return its pending all-reduce."""
        st = self.nbs[nb]
        self.op("fc2")
        d_sum, st.d_h1_res = grads([st.out], [dout], [st.mlp_sum, st.h1_in])
        (d_ln2,) = grads([st.mlp_partial], [d_sum], [st.ln2_in])
        c = _Coll(self.coll_name("bwd", "mlp", nb), nb, d_ln2.contiguous())
        st.colls["bwd.mlp"] = c
        return c

    def prefetch(self, nb: int, dout: torch.Tensor, settings: LayerSettings) -> None:
        """Cross-layer overlap: run this layer's first backward step of nanobatch `nb` now, inside the next
        layer's backward, on that nanobatch's input gradient `dout` there (cross_layer.py)."""
        if nb == 0:
            self.start_backward(settings)
            self.prefetched = Prefetched(Grads(self.params, self.n), None, [])
        pre = self.prefetched
        assert pre is not None  # nanobatch 0 comes first
        pre.used.append(dout)
        self.prefetch_step(pre, nb, dout)

    def prefetch_step(self, pre: Prefetched, nb: int, dout: torch.Tensor) -> None:
        """Without SP: nanobatch 0's mlp unit (its all-reduce then partners nanobatch 1's); nanobatch 1 waits."""
        if nb == 0:
            self._enter(0, "")
            pre.coll = self._bwd_mlp(pre.grads, 0, dout)
            self._leave()


class PartitionedLayerFn(torch.autograd.Function):
    """Outer autograd function of one layer call: forward builds the pieces, backward drives them."""

    @staticmethod
    def forward(ctx, run, attn_kwargs, x, *params):  # noqa: D102
        with torch.enable_grad():
            out = run.forward(x, attn_kwargs)
        ctx.run = run
        return out.detach()

    @staticmethod
    def backward(ctx, dout):  # noqa: D102
        run, ctx.run = ctx.run, None
        dx, pgrads = run.backward(dout, run.engine.state.settings)
        return (None, None, dx, *pgrads)

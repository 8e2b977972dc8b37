"""The nanobatch schedule of one partitioned-layer call, forward and backward, and its autograd functions.

Semantics (names from ``kareus_megatron.vocab``; nanobatches 0 and 1 are halves of the microbatch along
the batch dimension). A *unit* is one nanobatch's compute segment; each unit ends in a TP all-reduce.

Forward (and recompute), units in order ``attn0, attn1, mlp0, mlp1``:

1. attn0 runs (input_norm, qkv, rope, attention, proj); its all-reduce C(attn,0) is then pending.
2. attn1 runs under partition ``fwd_attn``: C(attn,0) is issued (``async_op=True``) just before attn1's op
   named by fwd_attn's ``launch_slot``, on the communicator for its ``comm_sms``.
3. mlp0 runs under ``fwd_mlp``: C(attn,1) is issued before the planned op; C(attn,0) is waited just
   before mlp0's first op (pre_mlp_norm, which needs it).
4. mlp1 runs under ``fwd_mlp``: C(mlp,0) is issued before the planned op; C(attn,1) is waited first.
5. C(mlp,1), the layer's last collective, is issued at once (no partner segment); each nanobatch's
   output bias-dropout-add waits for its own C(mlp,*).

Backward, units ``mlp0, mlp1, attn0, attn1`` then the tail, symmetrically: the all-reduce of one
nanobatch's input gradient of fc1 (``bwd.mlp``) is issued before the planned op of the other nanobatch's
next unit (partition ``bwd_mlp`` for mlp1, ``bwd_attn`` for attn0/attn1); the all-reduce of the input
gradient of qkv (``bwd.attn``) likewise; the last one overlaps nanobatch 0's tail (input_norm).

With 1 nanobatch every collective is issued as soon as it is produced and waited before its consumer.
Each piece of a unit is a separate autograd graph on detached leaf inputs, so the backward can run
the pieces of both nanobatches in the planned order: ``PartitionedLayerFn`` is the outer autograd
function; its backward drives the pieces with ``torch.autograd.grad``, and ``_Marker`` functions on op
boundaries report, from inside a piece's backward, when a backward op is about to start (the launch
slots inside a piece). Parameter gradients of all pieces are summed and returned once per call, so
gradient hooks (megatron DDP) see one accumulation per parameter per microbatch, as with the
standard layer. The nanobatch structure of the backward is that of its forward (the graph is built
then); with a 1-nanobatch backward instruction after a 2-nanobatch forward the pieces run serially.
With sequence parallelism the layer runs ``schedule_sp.SPLayerRun`` instead (all-gather / reduce-scatter
units on the same partner, launch-slot and wait machinery), with context parallelism
``schedule_cp.CPLayerRun`` (K/V all-gather and dK/dV reduce-scatter units), with both
``schedule_cpsp.CPSPLayerRun``. With cross-layer overlap
(cross_layer.py) step 5's collective is left to the next layer's call, and the backward's last all-reduce
runs beside the previous layer's first unit too (``prefetch``).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch

from kareus_megatron.runtime.overlap.cross_layer import ForwardCarry, Prefetched, own
from kareus_megatron.runtime.overlap.pieces import _NB, Grads, _Coll, _leaf, _Marker, _split_batch

if TYPE_CHECKING:
    from kareus_megatron.runtime.overlap.config import LayerSettings
    from kareus_megatron.runtime.overlap.engine import OverlapEngine


class LayerRun:
    """One call of a partitioned layer: its schedule, pending collectives and trace context."""

    cp_group: Any = None  # the context-parallel group (schedule_cp.CPLayerRun)
    runs_cross_layer = True  # takes part in cross-layer overlap (cross_layer.py; not the CP runs)

    def __init__(self, layer: Any, engine: OverlapEngine, settings: LayerSettings, phase: str, grad: bool):
        self.layer = layer
        self.engine = engine
        self.settings = settings
        self.phase = phase
        self.grad = grad
        self.n = settings.nanobatches
        self.call = engine.next_call_id()
        self.nbs = [_NB() for _ in range(self.n)]
        self.cur_nb = 0
        self.cur_partition = ""
        self.partner: _Coll | None = None
        self._seen: set[tuple[int, str]] = set()
        self._need: _Coll | None = None  # waited just before the next op (after its partner is issued)
        # cross-layer overlap (cross_layer.py): the previous layer's pending end, taken by this call's forward;
        # that layer's run (weakly: for the backward prefetch); this run's first backward steps if prefetched
        self.carry: ForwardCarry | None = None
        self.lower: weakref.ref | None = None
        self.prefetched: Prefetched | None = None

    # ------------------------------------------------------------------ trace and collectives
    def _emit(self, kind: str, **fields: Any) -> None:
        s = self.settings
        self.engine.tracer.emit(
            kind, phase=self.phase, layer=self.layer.layer_number, call=self.call, mb=s.microbatch,
            instr=s.index, **fields,
        )

    def _issue(self, c: _Coll) -> None:
        comm, group = self.engine.comm, self.layer.tp_group
        if c.kind == "all_reduce":
            c.pending, applied = comm.all_reduce(c.buf, c.comm_sms, group)
        elif c.kind == "all_gather":
            c.pending, applied = comm.all_gather(c.buf, c.src, c.comm_sms, group)
        elif c.kind == "cp_all_gather":  # context parallelism's K/V (schedule_cp.py)
            c.pending, applied = comm.cp_all_gather(c.buf, c.src, c.comm_sms, self.cp_group)
        elif c.kind == "cp_reduce_scatter":
            c.pending, applied = comm.cp_reduce_scatter(c.buf, c.src, c.comm_sms, self.cp_group)
        else:
            c.pending, applied = comm.reduce_scatter(c.buf, c.src, c.comm_sms, group)
        self._emit(
            "issue", coll=c.name, nb=c.nb, partition=c.partition, slot=c.slot, comm_sms=c.comm_sms,
            sm_limit_requested=applied, collective=c.kind,
        )

    def _wait(self, c: _Coll) -> None:
        if c.waited:
            return
        if c.pending is None:  # never got a partner op (cannot happen with the vocabulary's segments)
            self._issue(c)
        c.pending.wait()
        c.waited = True
        self._emit("wait", coll=c.name, nb=c.nb, partition=c.partition)

    def _schedule(self, c: _Coll, nb: int, partition: str, overlap: bool) -> None:
        """Make `c` the collective issued during the next unit (nanobatch `nb`), or issue it now."""
        if overlap and nb != c.nb:
            k = self.settings.knobs_for(partition)
            c.partition, c.slot, c.comm_sms = partition, k.launch_slot, k.comm_sms
            self.partner = c
        else:
            self._issue(c)

    def op(self, name: str, needs: _Coll | None = None) -> None:
        """Compute op `name` of the current nanobatch starts: issue the partner at its slot, wait inputs."""
        if self.partner is not None and self.partner.slot == name:
            c, self.partner = self.partner, None
            self._issue(c)
        if needs is None:
            needs, self._need = self._need, None
        if needs is not None:
            self._wait(needs)
        self._emit("op", nb=self.cur_nb, op=name, partition=self.cur_partition)

    def _enter(self, nb: int, partition: str) -> None:
        self.cur_nb, self.cur_partition = nb, partition
        self._seen.clear()

    def _leave(self) -> None:
        if self.partner is not None:  # slot not reached: issue at the end of the unit
            c, self.partner = self.partner, None
            self._issue(c)

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor, attn_kwargs: dict[str, Any]) -> torch.Tensor:
        """Run the layer on `x` ([s, b, h]) as `n` nanobatches; return the output [s, b, h]."""
        n, lay = self.n, self.layer
        xs = x.chunk(n, dim=1)
        masks = _split_batch(attn_kwargs.get("attention_mask"), n, x.shape[1])
        units = [(nb, "attn") for nb in range(n)] + [(nb, "mlp") for nb in range(n)]
        carry = self.take_carry()
        prev: _Coll | None = carry.coll if carry is not None else None  # the first unit runs beside it
        for nb, seg in units:
            part = f"fwd_{seg}"
            if prev is not None:
                self._schedule(prev, nb, part, overlap=n > 1)
            self._enter(nb, part if self.partner is not None else "")
            st = self.nbs[nb]
            if seg == "attn":
                st.x = self.input_leaf(carry, xs, nb)
                self.op("input_norm")
                st.ln1 = lay.input_layernorm(st.x)
                st.ln1_in = _leaf(st.ln1, self.grad)
                kw = dict(attn_kwargs, attention_mask=masks[nb])
                with lay.local_comm(), lay.active(self):
                    st.attn_partial, st.attn_bias = lay.self_attention(st.ln1_in, **kw)
                c = _Coll(f"L{lay.layer_number}.fwd.attn.nb{nb}", nb, st.attn_partial.detach())
            else:
                c = self.mlp_unit(st, nb, f"L{lay.layer_number}.fwd.mlp.nb{nb}")
            st.colls[f"fwd.{seg}"] = c
            self._leave()
            prev = c
        assert prev is not None
        return self.finish_forward(prev)

    def take_carry(self) -> ForwardCarry | None:
        """The previous layer's pending end handed to this call (cross_layer.py), remembering that layer."""
        carry, self.carry = self.carry, None
        if carry is not None:
            self.lower = weakref.ref(carry.run)
        return carry

    def input_leaf(self, carry: ForwardCarry | None, xs: tuple[torch.Tensor, ...], nb: int) -> torch.Tensor:
        """Nanobatch `nb`'s input leaf; with a carry, the previous layer's pending half is completed first."""
        if carry is None:
            return _leaf(xs[nb], self.grad)
        if nb == carry.nb:
            carry.complete(by=self)
        return _leaf(own(xs[nb]), self.grad)

    def finish_forward(self, last: _Coll) -> torch.Tensor:
        """Issue the layer's last collective `last` (no partner segment), then each nanobatch's output
        bias-dropout-add after its own MLP collective; return the output [s, b, h] (SP: [s/tp, b, h]).

        With cross-layer overlap (a 2-nanobatch instruction of a ``cross_layer`` plan, this layer's output
        feeding the next partitioned layer): `last` stays unissued and the output's last nanobatch unwritten;
        the next layer completes both (``cross_layer.ForwardCarry``)."""
        defer = (self.n > 1 and self.runs_cross_layer and self.settings.cross_layer
                 and getattr(self.layer, "feeds_next", False))
        if not defer:
            self._issue(last)
        outs = [self.finish_nb(nb) for nb in range(self.n - 1 if defer else self.n)]
        if not defer:
            return outs[0] if self.n == 1 else torch.cat(outs, dim=1)
        width = outs[0].shape[1]
        buf = outs[0].new_empty((outs[0].shape[0], width * self.n, *outs[0].shape[2:]))
        with torch.no_grad():
            for nb, o in enumerate(outs):
                buf.narrow(1, nb * width, width).copy_(o)
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

    # Hooks on megatron submodules call these (forward only; markers for the backward).
    def forward_op(self, name: str) -> None:
        """A module hook saw forward op `name` of the current nanobatch start."""
        self.op(name)

    def mark(self, t: torch.Tensor, name: str) -> torch.Tensor:
        """Wrap `t` so that the backward reports op `name` of the current nanobatch before its grad flows on."""
        if not (self.grad and torch.is_grad_enabled() and t.requires_grad):
            return t
        return _Marker.apply(t, self, self.cur_nb, name)

    # ------------------------------------------------------------------ backward
    def backward_op(self, nb: int, name: str) -> None:
        """A marker saw backward op `name` of nanobatch `nb` about to start (first one of a name counts)."""
        if (nb, name) in self._seen:
            return
        self._seen.add((nb, name))
        self.op(name)

    def backward(self, dout: torch.Tensor, settings: LayerSettings) -> tuple[torch.Tensor, list]:
        """Run the planned backward for output gradient `dout`; return (d input, parameter grads)."""
        self.settings, self.phase = settings, "backward"
        n, lay = self.n, self.layer
        overlap = n > 1 and settings.nanobatches > 1
        douts = [d.contiguous() for d in dout.chunk(n, dim=1)]
        units = [(nb, "mlp") for nb in range(n)] + [(nb, "attn") for nb in range(n)]
        pre, self.prefetched = self.prefetched, None
        prev: _Coll | None = None
        if pre is not None:  # the first unit ran inside the next layer's backward (cross_layer.py)
            pre.check(dout, douts, lay.layer_number)
            grads, prev, units = pre.grads, pre.coll, units[1:]  # type: ignore[assignment]
        else:
            grads = Grads(self.params, n)
        grad, add_dx = grads, grads.add_dx
        for nb, seg in units:
            part = f"bwd_{seg}"
            if prev is not None:
                self._schedule(prev, nb, part, overlap)
            self._enter(nb, part if self.partner is not None else "")
            st = self.nbs[nb]
            if seg == "mlp":
                c = self._bwd_mlp(grads, nb, douts[nb])
            else:
                self.op("pre_mlp_norm", needs=st.colls["bwd.mlp"])
                d_attn, d_x = grad([st.h1, st.ln2], [st.d_h1_res, st.colls["bwd.mlp"].buf], [st.attn_sum, st.x])
                add_dx(nb, d_x)
                self.op("proj")
                (d_ln1,) = grad([st.attn_partial], [d_attn], [st.ln1_in])
                c = _Coll(f"L{lay.layer_number}.bwd.attn.nb{nb}", nb, d_ln1.contiguous())
            st.colls[f"bwd.{seg}"] = c
            self._leave()
            prev = c
        assert prev is not None
        return self.finish_backward(grads, prev, settings)

    def finish_backward(self, grads: Grads, last: _Coll, settings: LayerSettings) -> tuple[torch.Tensor, list]:
        """Issue the layer's last collective `last`, then each nanobatch's tail (input_norm backward) after its own
        attn collective; with cross-layer overlap, after each tail, the previous layer's first backward step of
        that nanobatch (``prefetch``). Return (d input, parameter grads)."""
        overlap = self.n > 1 and settings.nanobatches > 1
        lower = self.lower() if self.lower is not None and overlap else None
        self._issue(last)
        for nb in range(self.n):
            st = self.nbs[nb]
            self._enter(nb, "")
            self.op("input_norm", needs=st.colls["bwd.attn"])
            (d_x,) = grads([st.ln1], [st.colls["bwd.attn"].buf], [st.x])
            grads.add_dx(nb, d_x)
            if lower is not None:
                lower.prefetch(nb, grads.dx[nb], settings)
        self.nbs = []  # free the graphs' tensors
        dx, pgrads = grads.result()
        if lower is not None and lower.prefetched is not None:  # what the previous layer's backward is handed
            lower.prefetched.returned = dx
        return dx, pgrads

    def _bwd_mlp(self, grads: Grads, nb: int, dout: torch.Tensor) -> _Coll:
        """Backward mlp unit of nanobatch `nb` for its output gradient `dout`; return its pending all-reduce."""
        st = self.nbs[nb]
        self.op("fc2")
        d_sum, st.d_h1_res = grads([st.out], [dout], [st.mlp_sum, st.h1_in])
        (d_ln2,) = grads([st.mlp_partial], [d_sum], [st.ln2_in])
        c = _Coll(f"L{self.layer.layer_number}.bwd.mlp.nb{nb}", nb, d_ln2.contiguous())
        st.colls["bwd.mlp"] = c
        return c

    def prefetch(self, nb: int, dout: torch.Tensor, settings: LayerSettings) -> None:
        """Cross-layer overlap: run this layer's first backward step of nanobatch `nb` now, inside the next
        layer's backward, on that nanobatch's input gradient `dout` there (cross_layer.py)."""
        if nb == 0:
            self.settings, self.phase = settings, "backward"
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

    @property
    def params(self) -> list[torch.nn.Parameter]:
        """The layer's trainable parameters, in a fixed order."""
        return [p for p in self.layer.parameters() if p.requires_grad]


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

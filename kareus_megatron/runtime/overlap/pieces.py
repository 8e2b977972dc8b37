"""The pieces a nanobatch schedule is built from: collectives, per-nanobatch tensors, leaves, markers, gradients.

``_Coll`` is one collective of one nanobatch, ``_NB`` the tensors of one nanobatch's pieces (each piece a separate
autograd graph on detached leaves, ``_leaf``), ``_Marker`` the identity whose backward reports a backward op
boundary to the run, and ``Grads`` the per-call gradient accumulator; schedule.py (TP), schedule_sp.py (SP) and
schedule_cp.py (CP) drive them. ``merge_colls`` makes one collective over the whole microbatch of the halves'
collectives (steps.py issues them as one coalesced group).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from kareus_megatron.runtime.overlap.comm import Pending


@dataclass
class _Coll:
    """One collective of one nanobatch: a TP all-reduce in place on ``buf``, or from ``src`` into ``buf`` along
    dim 0 (``kind``: sequence parallelism's ``all_gather`` / ``reduce_scatter`` over the TP group, context
    parallelism's ``cp_all_gather`` / ``cp_reduce_scatter`` over the CP group)."""

    name: str
    nb: int
    buf: torch.Tensor
    kind: str = "all_reduce"
    src: torch.Tensor | None = None
    partition: str = ""
    slot: str | None = None
    comm_sms: int | None = None
    pending: Pending | AllOf | Any = None  # Any: torch's coalescing manager (a whole collective)
    waited: bool = False
    noop: bool = False  # over a group of one rank: nothing moves (not traced)
    whole: _Coll | None = None  # the collective over the whole microbatch that carries this half (merge_colls)
    parts: list[_Coll] = field(default_factory=list)  # of a whole: the halves it carries

    def message_bytes(self) -> int:
        """Message size (bytes, nccl-tests convention): all-reduce the buffer, all-gather the gathered output,
        reduce-scatter the input; of a whole collective, its halves' sum."""
        if self.parts:
            return sum(p.message_bytes() for p in self.parts)
        t = self.src if self.kind in ("reduce_scatter", "cp_reduce_scatter") else self.buf
        assert t is not None  # a reduce-scatter has its input
        return t.numel() * t.element_size()


def merge_colls(parts: list[_Coll]) -> _Coll:
    """The collective over the whole microbatch that carries the halves `parts` (same kind, in batch order): issued
    as one coalesced group of the halves' own collectives (steps.py), so each half's result lands in its own
    buffer."""
    first = parts[0]
    whole = _Coll(first.name.rsplit(".nb", 1)[0] + ".whole", -1, first.buf, kind=first.kind, parts=list(parts))
    for p in parts:
        p.whole = whole
    return whole


class AllOf:
    """Several pending collectives waited as one."""

    def __init__(self, pending: list[Any]) -> None:
        self.pending = pending

    def wait(self) -> None:
        """Wait every one of them."""
        for p in self.pending:
            p.wait()


@dataclass
class _NB:
    """Tensors of one nanobatch: graph outputs of each piece and the leaves that start the next one."""

    x: Any = None
    ln1: Any = None
    ln1_in: Any = None
    attn_partial: Any = None
    attn_bias: Any = None
    attn_sum: Any = None
    h1: Any = None
    ln2: Any = None
    ln2_in: Any = None
    mlp_partial: Any = None
    mlp_bias: Any = None
    mlp_sum: Any = None
    h1_in: Any = None
    out: Any = None
    colls: dict[str, _Coll] = field(default_factory=dict)
    d_h1_res: Any = None
    # context parallelism (schedule_cp.py): q, k, v after rope, their leaves, attention kwargs, K head size, dQ
    q: Any = None
    k: Any = None
    v: Any = None
    q_in: Any = None
    kv_in: Any = None
    kw: Any = None
    hn: Any = None
    d_q: Any = None


def _leaf(t: torch.Tensor, grad: bool) -> torch.Tensor:
    """A detached leaf sharing `t`'s storage (contiguous), requiring grad when `grad`."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.requires_grad_(grad)


class _Marker(torch.autograd.Function):
    """Identity; its backward tells the run that backward op `name` of nanobatch `nb` starts next.

    It holds the run weakly: the run holds the graph that holds this node, and a strong reference would
    make a cycle through C++ autograd nodes that Python's GC cannot see (a leak when no backward runs).
    The outer function's context keeps the run alive until its backward.
    """

    @staticmethod
    def forward(ctx, t, run, nb, name):  # noqa: D102
        ctx.run, ctx.nb, ctx.name = weakref.ref(run), nb, name
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        run = ctx.run()
        if run is not None:
            run.backward_op(ctx.nb, ctx.name)
        return grad, None, None, None


class Grads:
    """The gradients of one layer call's backward: each piece's parameter gradients summed (handed to autograd
    once per call), and each nanobatch's input gradient summed over the pieces that reach it."""

    def __init__(self, params: list[torch.nn.Parameter], nanobatches: int) -> None:
        self.params = params
        self.acc: list[torch.Tensor | None] = [None] * len(params)
        self.dx: list[torch.Tensor | None] = [None] * nanobatches

    def __call__(self, outputs: list[Any], grads: list[Any], leaves: list[torch.Tensor]) -> tuple[Any, ...]:
        """Backward of one piece: d `leaves` for output gradients `grads`; parameter gradients accumulate."""
        pairs = [(o, g) for o, g in zip(outputs, grads) if o is not None and o.requires_grad and g is not None]
        res = torch.autograd.grad(
            [o for o, _ in pairs], [*leaves, *self.params], [g for _, g in pairs], allow_unused=True
        )
        for i, g in enumerate(res[len(leaves) :]):
            if g is not None:
                acc = self.acc[i]
                self.acc[i] = g if acc is None else acc + g
        return res[: len(leaves)]

    def add_dx(self, nb: int, g: torch.Tensor | None) -> None:
        """Add `g` to nanobatch `nb`'s input gradient."""
        if g is not None:
            dx = self.dx[nb]
            self.dx[nb] = g if dx is None else dx + g

    def result(self) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """(d input, merged over nanobatches along the batch dimension; parameter gradients)."""
        dx = self.dx[0] if len(self.dx) == 1 else torch.cat(self.dx, dim=1)  # type: ignore[arg-type]
        return dx, self.acc  # type: ignore[return-value]


def _split_batch(mask: torch.Tensor | None, n: int, batch: int) -> list[torch.Tensor | None]:
    """Split a [b, ...] attention mask into `n` nanobatch masks (shared when its batch dim is 1)."""
    if mask is None or n == 1 or mask.dim() == 0 or mask.shape[0] != batch or batch == 1:
        return [mask] * n
    return list(mask.chunk(n, dim=0))

"""Cross-layer overlap: a layer's last collective runs beside the next layer's first segment (plan ``cross_layer``).

What the planner models (search/partition.py ``chunk_schedule``), run by the engine for TP layers with and
without sequence parallelism (not with context parallelism), 2 nanobatches. Without SP:

- **Forward** (and recompute). Layer L issues nothing at its end: nanobatch 0's output is complete, nanobatch
  1's MLP all-reduce is still to be issued. L returns its output with nanobatch 1's half not yet written and
  leaves a ``ForwardCarry`` on the engine. Layer L+1 takes it (its input is that very tensor) and issues the
  carried all-reduce as the partner of its nanobatch-0 attn unit, with the instruction's ``fwd_attn`` knobs
  (launch slot, comm SMs). Before its nanobatch-1 attn unit it waits the all-reduce, runs L's nanobatch-1
  bias-dropout-add in L's own graph, and writes that half.
- **Backward**, the mirror. Layer L+1's backward issues its last all-reduce (nanobatch 1's d input_norm) at once,
  as without cross-layer overlap, and runs nanobatch 0's tail (input_norm). Then, before nanobatch 1's tail,
  it runs L's first backward unit for nanobatch 0 (``LayerRun.prefetch``: fc2, activation, fc1 on L+1's
  nanobatch-0 input gradient); that unit's all-reduce becomes the partner of L's nanobatch-1 mlp unit
  (``bwd_mlp`` knobs), which runs when autograd calls L's backward. L checks that the output gradient it is
  handed is the one L+1 returned (the same tensor; else the same values) and raises a one-line error if a
  second consumer of L's output changed it.

With SP the last collective is the MLP reduce-scatter and L+1's first unit its ``attn_norm`` (input_norm,
``fwd_sp_attn_norm`` knobs). In backward L's first step is the leading all-gather of its output gradient
(exposed without cross-layer overlap): L+1 runs L's output bias-dropout-add backward after each of its own tails
and issues nanobatch 0's all-gather at once (beside L+1's last reduce-scatter and nanobatch-1 tail), nanobatch 1's
at ``bwd_sp_mlp``'s slot of L's nanobatch-0 mlp unit, with its comm SMs.

Only layers whose output feeds the next partitioned layer directly take part. ``link_layers`` (layer.py) marks
them per megatron ``TransformerBlock``: consecutive layers run in one call, i.e. all of a block's layers, or
with full recompute those inside one recompute group (``recompute_num_layers`` ≥ 2 with the ``uniform``
method; the un-checkpointed layers after the first ``recompute_num_layers`` with ``block``). A block's last
layer and a recompute group's last layer complete their output as without cross-layer overlap, so whatever
follows (the final norm, a pipeline send, a checkpoint boundary) sees a finished tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kareus_megatron.errors import KareusError


@dataclass
class ForwardCarry:
    """Layer L's pending end: nanobatch `nb`'s last collective `coll` (not yet issued) and its output `buf`
    ([s, b, h]; every other nanobatch's slice along dim 1 already written). With `coll` None nothing is pending:
    L's forward ran merged (1 nanobatch on halves) and only tells the next layer which layer it follows, for a
    2-nanobatch backward's prefetch."""

    run: Any  # schedule.LayerRun (not imported: schedule.py imports this module)
    coll: Any  # pieces._Coll, or None
    buf: torch.Tensor
    nb: int

    def matches(self, x: torch.Tensor | None) -> bool:
        """`x` is this carry's output (the next layer's input), not some other tensor."""
        return x is not None and x.data_ptr() == self.buf.data_ptr() and x.shape == self.buf.shape

    def complete(self, by: Any = None) -> None:
        """Wait the carried collective (issued, and waited, in `by`'s call; None: L's own call, issued now),
        run L's bias-dropout-add of the pending nanobatch and write its slice of the output."""
        if self.coll is None:
            return
        (by or self.run)._wait(self.coll)
        out = self.run.finish_nb(self.nb)
        width = out.shape[1]
        with torch.no_grad():
            self.buf.narrow(1, self.nb * width, width).copy_(out)


def own(t: torch.Tensor) -> torch.Tensor:
    """`t` in storage of its own (a contiguous slice of the carried output would share the version counter of a
    tensor written later in place; the leaf copies a non-contiguous one anyway)."""
    return t.clone() if t.is_contiguous() else t


@dataclass
class Prefetched:
    """Layer L's first backward steps, run inside layer L+1's backward (``LayerRun.prefetch``)."""

    grads: Any  # pieces.Grads
    coll: Any  # pieces._Coll or None: without SP, nanobatch 0's mlp all-reduce (nanobatch 1's mlp partner)
    used: list[torch.Tensor]  # the output gradient of each nanobatch it used, in order
    returned: torch.Tensor | None = None  # the input gradient layer L+1's backward returned (set at its end)

    def check(self, dout: torch.Tensor, douts: list[torch.Tensor], layer_number: Any) -> bool:
        """Raise if the output gradient L is handed is not the one the prefetched unit assumed; return whether it
        is the very tensor L+1 returned (checked without a compare, so without a host sync)."""
        ret, self.returned = self.returned, None
        if ret is not None and ret.data_ptr() == dout.data_ptr() and ret.shape == dout.shape:
            return True  # the common case: autograd hands L exactly what L+1 returned
        if not all(torch.equal(d, u) for d, u in zip(douts, self.used)):  # host sync, only off the common path
            raise KareusError(
                f"cross-layer overlap: layer {layer_number}'s output feeds more than the next layer (its gradient "
                "changed after the next layer's backward); re-plan without --cross-layer."
            )
        return False

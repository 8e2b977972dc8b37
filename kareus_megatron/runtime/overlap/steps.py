"""How a layer run issues, merges and waits its collectives, and walks the planner's steps over its units.

Terms (names from ``kareus_megatron.vocab``; the planner's side is search/partition.py ``chunk_schedule``):

- *unit*: one nanobatch's compute between two collectives of the layer's code (``attn``, ``mlp``; with SP the
  norms; with CP the K/V cut); it returns the collective that ends it.
- *block*: the units up to one whose collective moves data (a group of more than one rank). With TP = 1 (CP
  alone) the TP all-reduces move nothing: their units join the next one, as the planner's segments do
  (its op graph has no such collective to cut at). The units after the last moving collective form the
  *trailing* block.
- *walk*: the blocks in order, nanobatch by nanobatch. Each block's collective is the partner of the next block
  (the other nanobatch's): issued before its planned launch slot, on the communicator for its comm SMs. The
  last moving collective is issued at once on the default communicator; the trailing block and the tails
  (the backward's input_norm) run beside it, nanobatch by nanobatch.
- *halves* (``n``): the nanobatches the run's autograd graph has. The running instruction may run fewer: a
  1-nanobatch backward after a 2-nanobatch forward, or a 1-nanobatch forward recorded as halves because its
  microbatch's backward runs 2 (``LayerSettings.backward_nanobatches``). Such a run is *merged*: the halves'
  compute runs one after the other and each collective runs once over the whole microbatch (``merge_colls``):
  the halves' collectives as one coalesced group (one NCCL group launch, each half's result in its own buffer,
  no copies), issued when the last half has produced its part and waited before the first consumer, so exposed:
  the collectives, sizes and groups of Megatron's 1-nanobatch order, which the planner costs. Its compute runs as
  two half-batch kernels per op (the same work in twice the launches).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from kareus_megatron.runtime.overlap.pieces import _NB, AllOf, _Coll, _Marker, merge_colls

if TYPE_CHECKING:
    from kareus_megatron.runtime.overlap.config import LayerSettings
    from kareus_megatron.runtime.overlap.engine import OverlapEngine

Unit = Callable[[str, _NB, int], _Coll]  # (unit name, the nanobatch's tensors, nanobatch) -> its collective


class StepRun:
    """The collective machinery and the step walk of one partitioned-layer call (schedule.LayerRun builds on it)."""

    cp_group: Any = None  # the context-parallel group (schedule_cp.CPLayerRun)

    def __init__(
        self,
        layer: Any,
        engine: OverlapEngine,
        settings: LayerSettings,
        phase: str,
        grad: bool,
        halves: int | None = None,
    ):
        self.layer = layer
        self.engine = engine
        self.settings = settings
        self.phase = phase
        self.grad = grad
        self.n = halves or settings.nanobatches
        self.merge = self.n > 1 and settings.nanobatches == 1
        self._held: list[_Coll] = []  # merged run: halves of the next whole collective, not issued yet
        self.call = engine.next_call_id()
        self.nbs = [_NB() for _ in range(self.n)]
        self.cur_nb = 0
        self.cur_partition = ""
        self.partner: _Coll | None = None
        self._seen: set[tuple[int, str]] = set()
        self._need: _Coll | None = None  # waited just before the next op (after its partner is issued)

    def overlaps(self) -> bool:
        """The running instruction overlaps one half's collectives with the other's compute."""
        return self.n > 1 and self.settings.nanobatches > 1

    def start_backward(self, settings: LayerSettings) -> bool:
        """Switch to the backward instruction's `settings`; return whether it overlaps (else merged if halves)."""
        self.settings, self.phase = settings, "backward"
        self.merge = self.n > 1 and settings.nanobatches == 1
        self._held = []
        return self.overlaps()

    # ------------------------------------------------------------------ trace and collectives
    def _emit(self, kind: str, **fields: Any) -> None:
        s = self.settings
        self.engine.tracer.emit(
            kind,
            phase=self.phase,
            layer=self.layer.layer_number,
            call=self.call,
            mb=s.microbatch,
            instr=s.index,
            **fields,
        )

    def group_of(self, kind: str) -> Any:
        """The process group a collective of `kind` runs over (the layer's TP group, or the CP group)."""
        return self.cp_group if kind.startswith("cp_") else self.layer.tp_group

    def moves(self, seg: str) -> bool:
        """Unit `seg`'s collective runs over more than one rank (a ``cp_kv`` unit's over the CP group)."""
        return self.engine.comm.world(self.cp_group if seg == "cp_kv" else self.layer.tp_group) > 1

    def _issue(self, c: _Coll) -> None:
        group = self.group_of(c.kind)
        c.noop = self.engine.comm.world(group) == 1
        if self.merge and not c.noop:
            self._held.append(c)
            if len(self._held) < self.n:
                return
            c, self._held = merge_colls(self._held), []
            c.pending, applied = self._start_whole(c.parts, group), False
        else:
            c.pending, applied = self._start(c, group)
        if c.noop or not self.engine.tracer.enabled:
            return
        self._emit(
            "issue",
            coll=c.name,
            nb=None if c.parts else c.nb,
            partition=c.partition,
            slot=c.slot,
            comm_sms=c.comm_sms,
            sm_limit_requested=applied,
            collective=c.kind,
            bytes=c.message_bytes(),
            ranks=self.engine.tracer.ranks(group),
            whole=bool(c.parts),
        )

    def _start(self, c: _Coll, group: Any) -> tuple[Any, bool]:
        """Start `c` over `group` on the communicator for its comm SMs; (pending, whether SMs were limited)."""
        comm = self.engine.comm
        if c.kind == "all_reduce":
            return comm.all_reduce(c.buf, c.comm_sms, group)
        src = c.src
        if src is None:  # only an all-reduce runs in place
            raise RuntimeError(f"kareus: {c.name}: a {c.kind} needs a source tensor")
        if c.kind == "all_gather":
            return comm.all_gather(c.buf, src, c.comm_sms, group)
        if c.kind == "cp_all_gather":  # context parallelism's K/V (schedule_cp.py)
            return comm.cp_all_gather(c.buf, src, c.comm_sms, group)
        if c.kind == "cp_reduce_scatter":
            return comm.cp_reduce_scatter(c.buf, src, c.comm_sms, group)
        return comm.reduce_scatter(c.buf, src, c.comm_sms, group)

    def _start_whole(self, parts: list[_Coll], group: Any) -> Any:
        """Start the halves' collectives `parts` as one: a coalesced group over `group` (torch's coalescing manager,
        as megatron's DDP uses it; on NCCL one group launch), each half's result in its own buffer, no copies. With
        the CPU benchmarks' emulated slow link they run in issue order on its helper thread instead.

        torch has no public coalescing API: `_coalescing_manager` is the one megatron-core's own DDP calls, so a
        release that drops it breaks Megatron first; without it the halves are issued one by one (same results and
        partners, one NCCL launch each)."""
        comm = self.engine.comm
        coalescing = getattr(dist, "_coalescing_manager", None)
        if coalescing is None or comm.delay_s > 0 or comm.delay_s_per_byte > 0:
            return AllOf([self._start(p, group)[0] for p in parts])
        with coalescing(group=group, async_ops=True) as cm:
            for p in parts:
                self._start(p, group)
        return cm

    def _wait(self, c: _Coll) -> None:
        if c.waited:
            return
        whole = c.whole
        if whole is not None:  # a half of a whole collective: the first half waited waits it for all
            if not whole.waited:
                assert whole.pending is not None  # every half is issued before any is waited
                whole.pending.wait()
                whole.waited = True
                self._emit("wait", coll=whole.name, nb=None, partition=whole.partition)
            c.waited = True
            return
        assert all(h is not c for h in self._held), f"{c.name} waited before its whole collective was issued"
        if c.pending is None:  # never got a partner op (cannot happen with the vocabulary's segments)
            self._issue(c)
        assert c.pending is not None
        c.pending.wait()
        c.waited = True
        if not c.noop:
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

    # ------------------------------------------------------------------ the walk
    @staticmethod
    def partition(prefix: str, seg: str) -> str:
        """vocab partition name of unit `seg` in phase `prefix` ("fwd"/"bwd")."""
        return f"{prefix}_{seg}"

    def coll_name(self, prefix: str, seg: str, nb: int) -> str:
        """Trace name of unit `seg`'s collective of nanobatch `nb` (``L{layer}.{fwd|bwd}.{seg}.nb{nb}``)."""
        return f"L{self.layer.layer_number}.{prefix}.{seg}.nb{nb}"

    def walk(
        self,
        prefix: str,
        segs: Sequence[str],
        prev: _Coll | None,
        overlap: bool,
        unit: Unit,
        tail: Callable[[int], None] | None = None,
        skip_first: bool = False,
    ) -> _Coll | None:
        """Run units `segs` of every nanobatch as the planner's steps (module docstring); `prev` is a collective
        pending before the first unit (cross-layer overlap), `tail(nb)` runs after each nanobatch's trailing
        block, `skip_first` skips nanobatch 0's first block (run ahead: cross_layer.py). Return the last moving
        collective if it is still to be issued (no trailing block and no tail), else None."""
        blocks: list[list[str]] = []
        rest: list[str] = []
        for seg in segs:
            rest.append(seg)
            if self.moves(seg):
                blocks.append(rest)
                rest = []
        for b, block in enumerate(blocks):
            part = self.partition(prefix, block[-1])
            for nb in range(self.n):
                if skip_first and b == 0 and nb == 0:
                    continue
                if prev is not None:
                    self._schedule(prev, nb, part, overlap)
                self._enter(nb, part if self.partner is not None else "")
                prev = self._block(prefix, block, nb, unit)
                self._leave()
        if not rest and tail is None:
            return prev
        if prev is not None:  # the last moving collective: at once, beside the trailing blocks and tails
            self._issue(prev)
        for nb in range(self.n):
            self._enter(nb, "")
            self._block(prefix, rest, nb, unit)
            if tail is not None:
                tail(nb)
        return None

    def _block(self, prefix: str, segs: Sequence[str], nb: int, unit: Unit) -> _Coll | None:
        """Units `segs` of nanobatch `nb` back to back; the collectives that move nothing issued as produced."""
        st, c = self.nbs[nb], None
        for seg in segs:
            c = unit(seg, st, nb)
            st.colls[f"{prefix}.{seg}"] = c
            if not self.moves(seg):
                self._issue(c)
        return c

    # ------------------------------------------------------------------ hooks and markers
    def forward_op(self, name: str) -> None:
        """A module hook saw forward op `name` of the current nanobatch start."""
        self.op(name)

    def mark(self, t: torch.Tensor, name: str) -> torch.Tensor:
        """Wrap `t` so that the backward reports op `name` of the current nanobatch before its grad flows on."""
        if not (self.grad and torch.is_grad_enabled() and t.requires_grad):
            return t
        return _Marker.apply(t, self, self.cur_nb, name)

    def backward_op(self, nb: int, name: str) -> None:
        """A marker saw backward op `name` of nanobatch `nb` about to start (first one of a name counts)."""
        if (nb, name) in self._seen:
            return
        self._seen.add((nb, name))
        self.op(name)

    @property
    def params(self) -> list[torch.nn.Parameter]:
        """The layer's trainable parameters, in a fixed order."""
        return [p for p in self.layer.parameters() if p.requires_grad]

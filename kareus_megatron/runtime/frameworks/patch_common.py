"""What the framework patches (megatron_patch, deepspeed_patch) share: plan checks and step bookkeeping.

A *mismatch* is one line naming a way the plan does not fit the live run ("NAME: plan X, run Y");
every check collects them all and ``raise_mismatches`` turns them into ONE PlanMismatchError.
A *patch state* (``BasePatchState``) is a patch's per-process bookkeeping: the plan, the session that
gets validate/iteration/instruction calls, and the iteration counter; ``run_iteration`` runs one
wrapped training iteration (DeepSpeed: one ``train_batch`` step) around it. ``Replaced`` records the
framework functions a patch swapped for its wrappers, so uninstalling restores exactly those.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from kareus_megatron.errors import PlanMismatchError
from kareus_megatron.plan.schema import Instruction, Plan
from kareus_megatron.runtime import hooks

log = logging.getLogger("kareus_megatron.runtime")


class Replaced:
    """The framework attributes and mapping entries a patch replaced, with their originals."""

    def __init__(self) -> None:
        self._entries: list[tuple[Any, Any, Any]] = []  # (owner: object or dict, name or key, original)

    def attribute(self, owner: Any, name: str, wrap: Callable[[Any], Any]) -> None:
        """Set ``owner.name`` to ``wrap(owner.name)``; a class attribute is saved as defined on the class."""
        current = getattr(owner, name)
        original = owner.__dict__.get(name, current) if isinstance(owner, type) else current
        self._entries.append((owner, name, original))
        setattr(owner, name, wrap(current))

    def item(self, mapping: dict[Any, Any], key: Any, wrap: Callable[[Any], Any]) -> None:
        """Set ``mapping[key]`` to ``wrap(mapping[key])``."""
        self._entries.append((mapping, key, mapping[key]))
        mapping[key] = wrap(mapping[key])

    def originals(self) -> dict[Any, Any]:
        """Name (or key) -> the original it replaced, in the order replaced."""
        return {key: original for _, key, original in self._entries}

    def restore(self) -> None:
        """Put every original back (latest first); the record is empty afterwards."""
        for owner, key, original in reversed(self._entries):
            if isinstance(owner, dict):
                owner[key] = original
            else:
                setattr(owner, key, original)
        self._entries.clear()


class PatchSlot:
    """A framework patch's one installed state (None when not installed) and what it replaced."""

    def __init__(self) -> None:
        self.state: Any = None  # the patch's PatchState; its wrappers read it on every call
        self.replaced = Replaced()

    def install(
        self, replacements: Sequence[tuple[Any, Any, Callable[[Any], Any]]], make_state: Callable[[], Any]
    ) -> Any:
        """Uninstall any earlier state, swap in the wrappers, then hold `make_state()`. Each replacement
        is (owner, name, wrap): an attribute of an object or class, or (dict, key, wrap) an entry."""
        self.uninstall()
        try:
            for owner, key, wrap in replacements:
                if isinstance(owner, dict):
                    self.replaced.item(owner, key, wrap)
                else:
                    self.replaced.attribute(owner, key, wrap)
        except BaseException:
            self.replaced.restore()
            raise
        self.state = make_state()
        return self.state

    def uninstall(self) -> None:
        """Put the framework's originals back and drop the state (no-op when not installed)."""
        self.replaced.restore()
        self.state = None


def compare(out: list[str], name: str, planned: Any, actual: Any, side: str = "run") -> None:
    """Append "NAME: plan P, SIDE A" to `out` when `actual` is known (not None) and differs from `planned`."""
    if actual is not None and planned != actual:
        out.append(f"{name}: plan {planned}, {side} {actual}")


def device_mismatches(
    plan: Plan, stage: int, supported_clocks_mhz: tuple[int, ...] | None, device_gpu: str | None
) -> list[str]:
    """The GPU model and the lockable SM clocks (MHz) of pipeline stage `stage` against this device.

    None (not known, e.g. without clock control) skips a check.
    """
    out: list[str] = []
    if device_gpu is not None and plan.gpu != device_gpu:
        out.append(f"GPU: plan made for {plan.gpu}, this GPU is {device_gpu}")
    if supported_clocks_mhz and stage < len(plan.stages):
        ok = set(supported_clocks_mhz)
        bad = sorted({c for c in plan.clock_sequence(stage) if c not in ok})
        if bad:
            out.append(f"SM clocks {', '.join(map(str, bad))} MHz are not lockable on this GPU")
    return out


def raise_mismatches(problems: list[str], what: str, fix: str) -> None:
    """Raise one PlanMismatchError "WHAT: p1; p2; ... FIX" when `problems` is not empty."""
    if problems:
        raise PlanMismatchError(f"{what}: " + "; ".join(problems) + f". {fix}")


class BasePatchState:
    """Per-process state of an installed patch; `session` gets validate/iteration/instruction calls.

    ``active``: inside a training iteration; ``position``: instructions announced in it so far.
    Subclasses implement ``bind(live)``, which maps this rank's planned instructions by a key of the
    patch's choosing (``plan_entries``), and call ``announce(key)`` before and ``instruction_ends()``
    after every compute instruction. This path runs at every instruction, after the framework's own
    work has evicted it from the CPU caches, so it is kept to a few attribute reads: everything it
    needs is looked up once (``_entries``; the session's callables at validation).
    """

    def __init__(self, plan: Plan | None, session: Any, source: str = "the plan") -> None:
        self.plan = plan
        self.session = session
        self.source = source
        self.active = False
        self.validated = False
        self.iteration = 0
        self.position = 0
        self.rank = 0  # this pipeline rank (stage), set by bind
        self.live: Any = None  # the patch's view of the run, read at validation
        self.on_iteration_end: Callable[[int], None] | None = None  # the closed loop's hook (closed_loop/auto.py)
        self.order_deviations = 0
        # key -> (index in the rank's plan, Instruction, SM clock MHz, kind)
        self._entries: dict[Any, tuple[int, Instruction, int, str]] = {}
        # The session's per-instruction and per-iteration callables, bound once at validation.
        self._clock_begins: Callable[[int, int, int, str], None] | None = None
        self.instruction_ends: Callable[[], None] = session.instruction_ends
        self._iteration_begins: Callable[[int], None] = session.iteration_begins
        self._iteration_ends: Callable[[int], None] = session.iteration_ends
        self._listeners = hooks.listeners()

    def plan_entries(self, rank: int, key: Callable[[Instruction], Any]) -> None:
        """Map rank `rank`'s planned instructions by `key(instruction)` (called by ``bind``)."""
        self.rank = rank
        if self.plan is not None:
            self._entries = {
                key(i): (k, i, i.sm_clock_mhz, i.kind) for k, i in enumerate(self.plan.stages[rank].instructions)
            }

    def announce(self, key: Any) -> bool:
        """The planned instruction `key` begins: its clock, then the hooks' listeners. False when
        `key` is not in the plan (the caller decides what an unplanned instruction means)."""
        entry = self._entries.get(key)
        if entry is None:
            return False
        index, instr, mhz, kind = entry
        if index != self.position:
            self._out_of_order(key, index)
        self.position += 1
        begins = self._clock_begins
        if begins is not None:
            begins(self.iteration, index, mhz, kind)
        if self._listeners:
            hooks.notify_instruction(hooks.InstructionEvent(self.rank, index, self.iteration, instr))
        return True

    def _out_of_order(self, key: Any, index: int) -> None:
        self.order_deviations += 1
        if self.order_deviations == 1:
            log.warning(
                "kareus: live instruction order differs from the plan at position %d (%s is planned at "
                "%d); clocks follow each instruction's identity",
                self.position,
                key,
                index,
            )

    def bind(self, live: Any) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def begin_iteration(self) -> None:
        self.active, self.position = True, 0

    def run_iteration(self, read_live: Callable[[], Any], call: Callable[[], Any]) -> Any:
        """Validate once (before any instruction), then run `call` as one measured iteration."""
        if not self.validated:
            live = read_live()
            self.session.validate(self.plan, live, self.source)  # raises PlanMismatchError
            self.live = live
            self.bind(live)
            self._clock_begins, self.instruction_ends = self.session.instruction_callables()
            self._iteration_begins, self._iteration_ends = self.session.iteration_callables()
            self.validated = True
        self.begin_iteration()
        self._iteration_begins(self.iteration)
        try:
            result = call()
        except BaseException:
            self.active = False
            self.session.training_failed()
            raise
        self.active = False
        self._iteration_ends(self.iteration)
        self.iteration += 1
        if self.on_iteration_end is not None:
            self.on_iteration_end(self.iteration - 1)
        return result

    def switch_plan(self, plan: Plan) -> None:
        """Run `plan` (the same job's, checked by the caller) from the next iteration on; call between iterations."""
        self.plan = plan
        if self.validated:
            self.bind(self.live)

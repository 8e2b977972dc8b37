"""Per-instruction listeners: how runtime pieces learn which pipeline instruction runs next.

The framework patch (megatron-core or DeepSpeed) calls ``notify_instruction`` on the training thread
just before each planned forward or backward instruction starts, with the plan's ``Instruction`` for
it, right after it has handed the instruction's clock to the clock client (which it calls directly:
that path runs at every instruction and is kept short). Listeners (the overlap engine, user code)
must return quickly: they may only record state or enqueue work, never block on a device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kareus_megatron.plan.schema import Instruction


@dataclass(frozen=True, slots=True)
class InstructionEvent:
    """One instruction about to run on this rank: its plan entry and its position in the rank's order."""

    pp_rank: int
    index: int  # position in the rank's planned instruction list for this iteration
    iteration: int
    instruction: Instruction


Listener = Callable[[InstructionEvent], None]
_listeners: list[Listener] = []


def add_instruction_listener(fn: Listener) -> None:
    """Register `fn` to be called before every planned instruction (in registration order)."""
    if fn not in _listeners:
        _listeners.append(fn)


def remove_instruction_listener(fn: Listener) -> None:
    """Unregister `fn`; no error if it was not registered."""
    if fn in _listeners:
        _listeners.remove(fn)


def is_registered(fn: Listener) -> bool:
    """True when `fn` is a registered listener."""
    return fn in _listeners


def listeners() -> list[Listener]:
    """The live list of listeners (read-only for callers): empty means the patch builds no event."""
    return _listeners


def notify_instruction(event: InstructionEvent) -> None:
    """Call every listener with `event` (training thread; listeners must not block)."""
    for fn in tuple(_listeners):
        fn(event)

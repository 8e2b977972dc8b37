"""The one runtime session a framework API (kareus_megatron.megatron, kareus_megatron.deepspeed, the entry points)
has installed in this process: install replaces it, uninstall closes it.
"""

from __future__ import annotations

import os
from typing import Any, Generic, TypeVar

from kareus_megatron.plan.schema import Plan
from kareus_megatron.runtime.session import RuntimeSession

S = TypeVar("S", bound=RuntimeSession)


class SessionSlot(Generic[S]):
    """The one session a framework API has installed in this process (install replaces, uninstall closes)."""

    def __init__(self, session_class: type[S]) -> None:
        self.session_class = session_class
        self.session: S | None = None

    def install(self, plan: Plan | None, *, log_path: str | os.PathLike[str] | None = None, **kwargs: Any) -> S:
        """Close the installed session (if any), then start and hold a new one for `plan`."""
        self.uninstall()
        self.session = self.session_class(plan, log_path=os.fspath(log_path) if log_path else None, **kwargs).start()
        return self.session

    def uninstall(self) -> None:
        """Close the installed session (writes this rank's last iterations); no-op when none is installed."""
        session, self.session = self.session, None
        if session is not None:
            session.close()


MEGATRON_SESSIONS: SessionSlot[RuntimeSession] = SessionSlot(RuntimeSession)
"""The megatron-core session of this process: installed by kareus_megatron.megatron and the entry points."""

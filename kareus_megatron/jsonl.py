"""JSON Lines appending, shared by every layer (the simulated GPU's clock log, the clock controller's
decision log, the per-iteration measurement log); it imports nothing from the package."""

from __future__ import annotations

import json
import os
import threading
from typing import Any


class JsonlAppender:
    """Append one JSON object per line; each line is one O_APPEND write, safe across processes."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        """Open (create) `path` for appending."""
        self.path = os.fspath(path)
        parent = os.path.dirname(self.path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._lock = threading.Lock()

    def write(self, record: dict[str, Any]) -> None:
        """Append `record` as one line."""
        data = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        with self._lock:
            if self._fd is not None:
                os.write(self._fd, data)

    def close(self) -> None:
        """Close the file; later writes are dropped."""
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

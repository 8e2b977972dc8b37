"""User input and output files: read a text input, check an output location before the work starts.

Both raise the project's one-line errors (errors.py), so every reader and writer of user paths fails
the same way: naming the path, what is wrong and the fix.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from kareus_megatron.errors import ConfigError, KareusError


def read_input_text(path: str | Path, error: type[KareusError], what: str, *, not_text_fix: str) -> str:
    """The UTF-8 text of the input file `what` (e.g. "profile") at `path`; `error` (one line) when it cannot
    be read or is not UTF-8 text, with `not_text_fix` as the fix for the latter."""
    p = Path(path)
    try:
        return p.read_text(encoding="utf-8")
    except OSError as e:
        raise error(f"cannot read {what} {str(p)!r}: {e.strerror or e}.") from e
    except UnicodeDecodeError as e:
        raise error(f"{what} {str(p)!r} is not UTF-8 text; {not_text_fix}.") from e


def check_writable_location(path: str | Path, flag: str, *, directory: bool) -> None:
    """ConfigError, before any long step, when `path` (a file, or with `directory` a directory) cannot be written.

    The nearest existing ancestor must be a directory in which this user can create entries; that is
    tried for real (a temporary directory made and removed at once), so /proc, read-only mounts and
    missing permissions are found before the work, not after it. Nothing is left behind.
    """
    p = Path(path)
    if p.exists() and p.is_dir() != directory:
        kind = "a directory" if p.is_dir() else "not a directory"
        want = "directory" if directory else "file"
        raise ConfigError(f"{flag} {str(p)!r} exists and is {kind}; give a {want} path.")
    base = p.absolute().parent
    while not base.exists():
        base = base.parent
    if not base.is_dir():
        raise ConfigError(f"{flag} {str(p)!r}: {str(base)!r} is a file, not a directory; choose another {flag}.")
    try:
        os.rmdir(tempfile.mkdtemp(dir=base, prefix=".kareus-probe-"))
    except OSError as e:
        raise ConfigError(
            f"{flag} {str(p)!r}: cannot create files in {str(base)!r} ({e.strerror or e}); choose another {flag}."
        ) from None

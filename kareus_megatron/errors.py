"""Errors raised for bad user input or an unusable environment.

Every public error derives from KareusError. The CLI prints a KareusError as one line and exits with
status 2; the message names the bad value, what is allowed, and the fix.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any


class KareusError(Exception):
    """Base class; the CLI prints it as one line and exits with status 2."""


class UnknownPresetError(KareusError, LookupError):
    """A GPU or model preset name that is not shipped."""


class ConfigError(KareusError, ValueError):
    """A configuration value (CLI flag, model file, parallel layout) that is malformed."""


class InfeasibleConfigError(KareusError):
    """A configuration that is well formed but cannot run (e.g. heads not divisible by TP)."""


class ProfileError(KareusError, ValueError):
    """A measured profile (Perseus CSV) that is malformed: missing columns, NaN, duplicates."""


class CalibrationError(KareusError):
    """A calibration file that cannot be read or a fit that failed."""


class PlanError(KareusError, ValueError):
    """A plan or frontier file that fails validation, or a plan request that cannot be met."""


class PlanVersionError(PlanError):
    """A plan file written in a format version this build does not read."""


class PlanMismatchError(PlanError):
    """A plan that does not match the live training run (PP, microbatches, shapes, ...)."""


class DeviceUnavailableError(KareusError):
    """No GPU backend could be opened (no NVIDIA driver, NVML missing)."""


class ClockControlError(DeviceUnavailableError):
    """The driver refused a clock change (no permission, unsupported clock)."""


class UnsupportedVersionError(KareusError):
    """A framework version (megatron-core, DeepSpeed) that the runtime patch does not support."""


def print_error(prog: str, e: BaseException | str) -> int:
    """Write "PROG: error: MESSAGE" to stderr with the message folded onto one line; return 2."""
    msg = " ".join(str(e).split())
    sys.stderr.write(f"{prog}: error: {msg}\n")
    return 2


def describe_validation_error(e: Any, limit: int = 3) -> str:
    """One line naming the first `limit` bad fields of a pydantic ValidationError ("a.b: msg; ...")."""
    errs = e.errors()
    parts = [f"{'.'.join(str(x) for x in err.get('loc', ())) or '(top level)'}: {err.get('msg', 'invalid')}"
             for err in errs[:limit]]
    more = f" (and {len(errs) - limit} more)" if len(errs) > limit else ""
    return "; ".join(parts) + more


def read_input_text(path: str | Path, error: type[KareusError], what: str, *, not_text_fix: str | None = None) -> str:
    """The UTF-8 text of the input file `what` (e.g. "profile") at `path`; `error` when it cannot be read.

    With `not_text_fix` (the fix to suggest), a file that is not UTF-8 text raises `error` too; without it
    the UnicodeDecodeError propagates.
    """
    p = Path(path)
    try:
        return p.read_text(encoding="utf-8")
    except OSError as e:
        raise error(f"cannot read {what} {str(p)!r}: {e.strerror or e}.") from e
    except UnicodeDecodeError as e:
        if not_text_fix is None:
            raise
        raise error(f"{what} {str(p)!r} is not UTF-8 text; {not_text_fix}.") from e


def describe_os_error(e: OSError) -> str:
    """One line for an OSError: "PATH: REASON" (both paths of a rename), the reason as the OS words it."""
    reason = e.strerror or str(e) or type(e).__name__
    paths = [str(p) for p in (e.filename, e.filename2) if p is not None]
    return f"{' -> '.join(repr(p) for p in paths)}: {reason}" if paths else reason


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
        raise ConfigError(f"{flag} {str(p)!r}: cannot create files in {str(base)!r} "
                          f"({e.strerror or e}); choose another {flag}.") from None

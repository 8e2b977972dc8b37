"""Errors raised for bad user input or an unusable environment.

Every public error derives from KareusError. The CLI prints a KareusError as one line and exits with
status 2; the message names the bad value, what is allowed, and the fix.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from kareus_megatron.environment import kareus_settings


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


class Terminated(BaseException):
    """A SIGTERM (or SIGHUP) stopped a `kareus` command (jobs/children.py, hardware/device/stop_signals.py); not bad
    input: the CLI prints one line and exits 143. A BaseException, as KeyboardInterrupt is: no `except Exception`
    swallows it."""


ERROR_DIR_ENV = "KAREUS_ERROR_DIR"  # set by jobs/torchrun.py for the ranks it starts


def print_error(prog: str, e: BaseException | str) -> int:
    """Write "PROG: error: MESSAGE" to stderr with the message folded onto one line; return 2.

    Under ``kareus torchrun``/``kareus launch`` (KAREUS_ERROR_DIR set) the line also goes to this rank's file
    there, so the launcher can end the job with the ranks' first error (jobs/torchrun.py)."""
    msg = " ".join(str(e).split())
    line = f"{prog}: error: {msg}"
    sys.stderr.write(line + "\n")
    record_rank_error(line)
    return 2


def record_rank_error(line: str) -> None:
    """Append `line` (time s, rank) to DIR/rank-RANK.err where KAREUS_ERROR_DIR names DIR; never raises."""
    d = kareus_settings().error_dir
    if not d:
        return
    rank = os.environ.get("RANK", "0")
    try:
        with open(os.path.join(d, f"rank-{rank}.err"), "a", encoding="utf-8") as f:
            f.write(json.dumps({"t": time.time(), "rank": rank, "line": line}) + "\n")
    except OSError:
        pass


def describe_validation_error(e: Any, limit: int = 3) -> str:
    """One line naming the first `limit` bad fields of a pydantic ValidationError ("a.b: msg; ...")."""
    errs = e.errors()
    parts = [
        f"{'.'.join(str(x) for x in err.get('loc', ())) or '(top level)'}: {err.get('msg', 'invalid')}"
        for err in errs[:limit]
    ]
    more = f" (and {len(errs) - limit} more)" if len(errs) > limit else ""
    return "; ".join(parts) + more


def describe_os_error(e: OSError) -> str:
    """One line for an OSError: "PATH: REASON" (both paths of a rename), the reason as the OS words it."""
    reason = e.strerror or str(e) or type(e).__name__
    paths = [str(p) for p in (e.filename, e.filename2) if p is not None]
    return f"{' -> '.join(repr(p) for p in paths)}: {reason}" if paths else reason

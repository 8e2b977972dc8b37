"""Load and save plan files; JSON Schema export. Loading validates and names any bad field."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from kareus_megatron.errors import ConfigError, PlanError, PlanVersionError, describe_validation_error
from kareus_megatron.files import check_writable_location, read_input_text
from kareus_megatron.plan.schema import MODEL_RECORD_FIELDS, PLAN_FORMAT, Plan

SCHEMA_PATH = Path(__file__).with_name("plan.schema.json")


def plan_from_dict(data: Any, source: str = "plan") -> Plan:
    """Validate a decoded JSON object as a plan; raise PlanError naming the bad field."""
    if not isinstance(data, dict):
        raise PlanError(f"{source}: a plan is a JSON object, got {type(data).__name__}")
    fmt = data.get("format")
    if fmt != PLAN_FORMAT:
        if isinstance(fmt, str) and fmt.startswith("kareus-plan/"):
            raise PlanVersionError(
                f"{source} is {fmt}; this build reads {PLAN_FORMAT}. Regenerate it with kareus plan."
            )
        raise PlanError(f"{source}: 'format' must be {PLAN_FORMAT!r}, got {fmt!r}")
    try:
        return Plan.model_validate(data)
    except ValidationError as e:
        raise PlanError(f"{source}: {describe_validation_error(e)}") from None


def load_plan(path: str | os.PathLike[str]) -> Plan:
    """Read and validate a plan file."""
    p = Path(path)
    text = read_input_text(p, PlanError, "plan", not_text_fix="give a kareus-plan/1 JSON file from kareus plan")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise PlanError(f"{p} is not valid JSON: {e.msg} at line {e.lineno}") from None
    return plan_from_dict(data, source=str(p))


def plan_sha256(plan: Plan) -> str:
    """Content hash of a plan (hex), stable across key order."""
    data = plan.model_dump(mode="json")
    for key in (
        "p_blocked_w",
        "power_limit_w",
        "cross_layer",
        "power_floor_w",
        "clock_latency_s",
        "min_clock_segment_s",
    ):  # a plan without it hashes as
        if data.get(key) is None:  # before the field existed
            data.pop(key, None)
    if (data.get("predicted") or {}).get("power", 0) is None:  # likewise the predicted power metrics
        del data["predicted"]["power"]
    for key in ("iteration_time_s_band", "iteration_energy_j_band"):  # and the prediction bands
        if (data.get("predicted") or {}).get(key, 0) is None:
            del data["predicted"][key]
    model = data.get("model") or {}
    for key in MODEL_RECORD_FIELDS:  # likewise the model architecture fields
        if model.get(key, 0) is None:
            del model[key]
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_json_atomic(path: str | os.PathLike[str], obj: Any) -> None:
    """Write JSON to `path` through a temporary file and rename, so no reader sees half a file."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=1)
            f.write("\n")
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give the file the usual permissions
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_plan(plan: Plan, path: str | os.PathLike[str]) -> None:
    """Write a plan file atomically."""
    write_json_atomic(path, plan.model_dump(mode="json", exclude_none=True))


def plan_json_schema() -> dict[str, Any]:
    """The JSON Schema of kareus-plan/1 (the file shipped as plan/plan.schema.json)."""
    return Plan.model_json_schema()


def check_output_dir(out: Path) -> None:
    """Refuse an --out that replacing as a whole could damage; ConfigError naming the fix."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} exists and is not a directory; choose another --out.")
    check_writable_location(out, "--out", directory=True)  # under a file, in /proc, no permission
    here = Path.cwd().resolve()
    if out.resolve() == here or out.resolve() in here.parents:
        raise ConfigError(
            f"--out {out} is the current directory or above it; the output directory is "
            "replaced as a whole, so name a subdirectory (e.g. --out kareus-out)."
        )
    if out.is_dir() and any(out.iterdir()) and not (out / "frontier.json").is_file():
        raise ConfigError(
            f"--out {out} is a non-empty directory that is not a kareus output (no frontier.json); "
            "choose an empty or new directory."
        )


@contextlib.contextmanager
def replace_directory(out: Path) -> Iterator[Path]:
    """Yield a temporary directory next to `out`; when the block succeeds it replaces `out` as a whole.

    On any error the temporary directory is removed and `out` is left as it was: nothing half-written.
    """
    parent = out.resolve().parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=parent, prefix=f".{out.name}.tmp-"))
    try:
        yield tmp
        tmp.chmod(0o777 & ~_umask())  # mkdtemp makes 0700; files and subdirectories already have normal modes
        old = None
        if out.exists():
            old = Path(tempfile.mkdtemp(dir=parent, prefix=f".{out.name}.old-"))
            os.replace(out, old / "previous")
        os.replace(tmp, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already after a successful swap

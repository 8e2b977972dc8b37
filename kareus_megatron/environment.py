"""Every ``KAREUS_*`` environment variable kareus reads: one table (the docs' reference page is built from it)
and one reader, ``kareus_settings()``, whose fields the modules named in ``read_by`` use.

tests/test_environment.py keeps the table, the settings' fields and the package's spellings equal, and no
module but this one reads a ``KAREUS_*`` variable from the environment.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class EnvVar:
    """One variable: its values, its default (as it reads when unset) and what it does."""

    name: str
    values: str
    default: str
    meaning: str
    read_by: str


ENVIRONMENT: tuple[EnvVar, ...] = (
    EnvVar(
        "KAREUS_GPU_BACKEND",
        "`nvml` \\| `simulated`",
        "nvml when NVML initialises",
        "The GPU backend of the runtime and the GPU commands; `simulated` runs everything on a CPU.",
        "hardware/device/__init__.py",
    ),
    EnvVar(
        "KAREUS_GPU_READ_ONLY",
        "`1`",
        "unset",
        "Every device opens read-only: real readings, no clock, limit "
        "or reset call (wins over every flag; the guard for shared GPUs).",
        "hardware/device/base.py",
    ),
    EnvVar(
        "KAREUS_GPU",
        "a GPU preset name",
        "the plan's GPU",
        "The preset of the simulated GPU when no plan names one.",
        "runtime/session.py",
    ),
    EnvVar(
        "KAREUS_CLOCK_LOG",
        "a file path",
        "unset",
        "The clock controller appends every clock change it applies (or skips) to this JSONL file.",
        "runtime/session.py",
    ),
    EnvVar(
        "KAREUS_CLOCK_COALESCE_MS",
        "milliseconds",
        "the client's default",
        "How long the training thread's clock messages gather before one pipe write.",
        "runtime/clock/transport.py",
    ),
    EnvVar(
        "KAREUS_PLAN",
        "a plan file or directory",
        "unset",
        "The plan of a DeepSpeed job's `kareus_megatron.deepspeed.install_from_env()` (set by `kareus launch`).",
        "deepspeed.py",
    ),
    EnvVar(
        "KAREUS_LOG",
        "a directory",
        "unset",
        "The run log directory of that job (set by `kareus launch`).",
        "deepspeed.py",
    ),
    EnvVar(
        "KAREUS_LOG_MODE",
        "`new` \\| `append` \\| `overwrite`",
        "`new`",
        "What that job does with an existing run log (as `--kareus-log-mode`).",
        "deepspeed.py",
    ),
    EnvVar(
        "KAREUS_ON_ERROR",
        "`fail` \\| `warn`",
        "`fail`",
        "What that job does when clocks cannot be controlled (as `--kareus-on-error`).",
        "deepspeed.py",
    ),
    EnvVar(
        "KAREUS_LOG_INSTRUCTIONS",
        "`1` \\| `0`",
        "`1`",
        "Per-instruction times in the run log (CUDA events read off the training thread); `0` turns the columns off.",
        "runtime/measure/instruction_times.py",
    ),
    EnvVar(
        "KAREUS_OVERLAP_TRACE",
        "a directory",
        "unset",
        "Each rank writes the overlap engine's trace "
        "(collectives, partners, comm SMs, launch slot) as `overlap_trace.rankN.json`.",
        "runtime/overlap/engine.py",
    ),
    EnvVar(
        "KAREUS_DEBUG",
        "any non-empty value",
        "unset",
        "Tracebacks instead of the one-line errors (as `--debug` / `--kareus-debug`).",
        "cli/main.py, runtime/frameworks/entry.py",
    ),
    EnvVar(
        "KAREUS_ERROR_DIR",
        "a directory",
        "unset",
        "Each rank appends its one-line error to "
        "`rank-RANK.err` there, so `kareus torchrun` / `kareus launch` print the first failing rank's line "
        "last (they set it; set it yourself under another launcher).",
        "errors.py",
    ),
    EnvVar(
        "KAREUS_LAUNCH_DIR",
        "a directory",
        "launch/ of this checkout",
        "Where `kareus launch` finds the drop-in entry points (set in the container image).",
        "jobs/commands.py",
    ),
    EnvVar(
        "KAREUS_SIMULATED_TRUTH",
        "a truth or calibration JSON file",
        "unset",
        "The simulated GPU obeys these "
        "cost-model parameters (time_scale included) instead of the preset's; `make try-runtime` writes one.",
        "runtime/closed_loop/truth.py",
    ),
    EnvVar(
        "KAREUS_SIMULATED_LATENCY_MS",
        "milliseconds",
        "15",
        "The simulated NVML call latency of a clock change.",
        "hardware/device/sim_model.py",
    ),
    EnvVar(
        "KAREUS_SIMULATED_NO_PERMISSION",
        "`1`",
        "unset",
        "The simulated GPU refuses clock control as NVML does without permission.",
        "hardware/device/sim.py",
    ),
    EnvVar(
        "KAREUS_SIMULATED_LOG",
        "a file path",
        "unset",
        "The simulated GPU appends every clock change to this JSONL file.",
        "hardware/device/sim.py",
    ),
)


@dataclass(frozen=True)
class KareusSettings:
    """The ``KAREUS_*`` variables as this process sees them now: each field is its variable without the
    ``KAREUS_`` prefix, lower case, stripped ("" when unset). Values are parsed and checked where they are
    used (a bad one is a ConfigError naming the variable there)."""

    gpu_backend: str
    gpu_read_only: str
    gpu: str
    clock_log: str
    clock_coalesce_ms: str
    plan: str
    log: str
    log_mode: str
    on_error: str
    log_instructions: str
    overlap_trace: str
    debug: str
    error_dir: str
    launch_dir: str
    simulated_truth: str
    simulated_latency_ms: str
    simulated_no_permission: str
    simulated_log: str

    @staticmethod
    def field_of(name: str) -> str:
        """The field of variable `name` (``KAREUS_GPU_BACKEND`` -> ``gpu_backend``)."""
        return name.removeprefix("KAREUS_").lower()

    @staticmethod
    def flag(value: str) -> bool:
        """A yes/no variable's value: set to anything but "" or "0"."""
        return value not in ("", "0")


def kareus_settings(environ: Mapping[str, str] | None = None) -> KareusSettings:
    """Read every ``KAREUS_*`` variable of `environ` (os.environ when None) now: a launcher or a self-check may
    set one between two reads, so callers read when they act rather than caching at import."""
    env = os.environ if environ is None else environ
    return KareusSettings(**{f.name: env.get("KAREUS_" + f.name.upper(), "").strip() for f in fields(KareusSettings)})


def environment_table() -> str:
    """The variables as a Markdown table (docs/gen_reference.py)."""
    rows = ["| variable | values | default | what it does | read by |", "|---|---|---|---|---|"]
    rows += [f"| `{v.name}` | {v.values} | {v.default} | {v.meaning} | `{v.read_by}` |" for v in ENVIRONMENT]
    return "\n".join(rows) + "\n"

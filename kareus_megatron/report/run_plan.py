"""Which plan a run executed: found from its log's header, and refused when it is another job's (``kareus report``).

A run log's header (runtime/measure/measurement.py) records the plan's path as the run named it (``plan``) and
its content hash (``plan_sha256``, plan/io.py). ``plan_for_run`` returns the plan to report against:

- without ``--plan``: the recorded path if its hash still matches; else a plan with that hash *beside the log*
  (BESIDE_GLOBS under the log directory and its parent: a plan file, or a ``kareus plan`` directory's
  plans/NAME-NN.json), so a moved plan directory is still found; else one line asking for ``--plan``;
- ``--plan FILE``: that file;
- ``--plan DIR`` (a ``kareus plan`` output directory): the plan of DIR whose hash the log records, else the
  file of DIR with the recorded name (plans/NAME-NN.json: the log's point, regenerated since).

The plan must be this job's: ``job_mismatches`` lists what differs between the log's header and the plan (GPU
where the plan names a preset, world size, TP/PP/CP/DP, microbatches per iteration, microbatch size), each
only where the log records it;
``plan_for_run`` refuses a plan with any difference in one line (ConfigError), as a report with errors of
-97% against another job's prediction would mislead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kareus_megatron.errors import ConfigError, KareusError
from kareus_megatron.hardware.gpus import gpu_spec
from kareus_megatron.plan.io import load_plan, plan_sha256
from kareus_megatron.plan.points import FRONTIER_FILE
from kareus_megatron.plan.schema import Plan

BESIDE_GLOBS = ("*.json", "plans/*.json", "*/plans/*.json", "*/*.json")
MAX_CANDIDATES = 2000  # files hashed at most while looking beside the log


def _load(path: Path) -> Plan | None:
    try:
        return load_plan(path)
    except KareusError:
        return None


def _matches(path: Path, sha: str) -> Plan | None:
    plan = _load(path) if path.is_file() else None
    return plan if plan is not None and plan_sha256(plan) == sha else None


def _beside(log_path: Path, sha: str) -> tuple[Plan, Path] | None:
    """A plan file with hash `sha` under the log directory or its parent (BESIDE_GLOBS); None if none."""
    base = log_path if log_path.is_dir() else log_path.parent
    seen: set[Path] = set()
    for root in (base, base.parent):
        for pattern in BESIDE_GLOBS:
            for f in sorted(root.glob(pattern)):
                if f in seen or f.name == FRONTIER_FILE or f.parent == log_path:
                    continue
                seen.add(f)
                if len(seen) > MAX_CANDIDATES:
                    return None
                plan = _matches(f, sha)
                if plan is not None:
                    return plan, f
    return None


def _from_directory(directory: Path, recorded: str | None, sha: str | None) -> tuple[Plan, Path]:
    """The plan of a `kareus plan` directory that the log names (by hash, else by the recorded file name)."""
    if not (directory / FRONTIER_FILE).is_file():
        raise ConfigError(
            f"--plan {directory} is a directory without {FRONTIER_FILE}; pass a plan file or the "
            "--out directory of kareus plan"
        )
    files = sorted((directory / "plans").glob("*.json"))
    if sha:
        for f in files:
            plan = _matches(f, sha)
            if plan is not None:
                return plan, f
    if recorded:
        name = Path(recorded).name
        f = directory / "plans" / name
        if f.is_file():
            return load_plan(f), f
    raise ConfigError(
        f"--plan {directory} holds no plan the run executed (recorded: {recorded or 'none'}, sha256 "
        f"{(sha or 'none')[:12]}); pass the plan file, e.g. {directory}/plans/kareus-00.json"
    )


def _is_preset(gpu: str) -> bool:
    try:
        gpu_spec(gpu)
    except KareusError:
        return False
    return True


def job_mismatches(header: dict[str, Any], plan: Plan) -> list[str]:
    """What differs between the job a run log's header records and `plan`'s job ([] when nothing known differs)."""
    par = plan.parallel
    want = {
        "gpu": plan.gpu,
        "world": par.tp * par.cp * par.pp * par.dp,
        "tp": par.tp,
        "pp": par.pp,
        "cp": par.cp,
        "dp": par.dp,
        "num_microbatches": par.num_microbatches,
        "micro_batch_size": par.micro_batch_size,
    }
    names = {
        "gpu": "GPU",
        "world": "GPUs",
        "tp": "TP",
        "pp": "PP",
        "cp": "CP",
        "dp": "DP",
        "num_microbatches": "microbatches",
        "micro_batch_size": "microbatch size",
    }
    if not _is_preset(plan.gpu):  # e.g. "measured" (kareus solve from a profile): no GPU to compare with
        del want["gpu"]
    out = []
    for key, value in want.items():
        have = header.get(key)
        if have is None or isinstance(have, bool) or not isinstance(have, (int, str)):
            continue
        if have != value:
            out.append(f"{names[key]} {have} (run) vs {value} (plan)")
    return out


def plan_for_run(log: Any, plan_arg: str | None) -> tuple[Plan, Path, str]:
    """(plan, its path, how it was found) for run log `log` (report/runlog.RunLog); see the module doc."""
    header = log.header
    recorded = header.get("plan") if isinstance(header.get("plan"), str) else None
    sha = header.get("plan_sha256") if isinstance(header.get("plan_sha256"), str) else None
    if plan_arg is not None:
        p = Path(plan_arg)
        if p.is_dir():
            plan, path = _from_directory(p, recorded, sha)
            how = "the log's point of --plan"
        else:
            plan, path, how = load_plan(p), p, "--plan"
    elif recorded and sha and _matches(Path(recorded), sha) is not None:
        plan, path, how = load_plan(recorded), Path(recorded), "recorded in the log"
    else:
        found = _beside(Path(log.path), sha) if sha else None
        if found is None:
            where = f"{recorded} (sha256 {sha[:12]})" if recorded and sha else "not recorded in the log header"
            raise ConfigError(
                f"{log.path}: the plan the run executed is {where} and was not found there or beside "
                "the log; pass --plan PLAN (a plan file or a kareus plan directory)"
            )
        plan, path = found
        how = "found beside the log by its sha256"
    problems = job_mismatches(header, plan)
    if problems:
        raise ConfigError(
            f"plan {path} ({how}) is for another job than run log {log.path}: {'; '.join(problems)}; "
            "pass the plan the run executed"
        )
    return plan, path, how

"""The measured frontier of a log directory (``kareus compare``): one point per run, same layout as kareus plan.

A *log directory* holds one run directory per run, NAME-NN/ (as ``kareus launch`` writes them), each with its run
log directory (runlog.MEASUREMENT_FILE: rank-NNNNN.jsonl files) and optionally a manifest (runlog.MANIFEST_FILE:
method, plan, predicted figures). A run's point is its median iteration time (s) and mean GPU energy (J, all GPUs;
total over total) after the warm-up iterations (summary.summarize, the same figures ``kareus report`` prints); a run
directory from before rank logs holds one merged LEGACY_MEASUREMENT_FILE instead. The reductions are computed by
plan/frontier.py's formulas, against the measured megatron and perseus runs; every point and reduction carries
its measured band (report/measured_bands.py: iteration percentiles, a bootstrap over iterations)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kareus_megatron.errors import ConfigError
from kareus_megatron.plan.frontier import frontier_document
from kareus_megatron.report.measured_bands import RunIterations, add_bands
from kareus_megatron.report.runlog import (
    LEGACY_MEASUREMENT_FILE,
    MANIFEST_FILE,
    MEASUREMENT_FILE,
    RUN_FORMAT,
    read_run_log,
)
from kareus_megatron.report.summary import (
    DEFAULT_SKIP_ITERATIONS,
    ENERGY_STATISTIC,
    STATISTIC,
    RunSummary,
    check_skip,
    summarize,
)
from kareus_megatron.vocab import METHODS, REFERENCE_METHODS


@dataclass(frozen=True, kw_only=True, slots=True)
class MeasuredRun:
    """One run: its median iteration time (s) and mean GPU energy (J per iteration, all GPUs) after warm-up."""

    name: str
    method: str
    log: Path
    plan: str | None
    predicted: dict[str, float] | None
    iterations: int  # iterations the figures are taken over
    time_s: float  # median iteration time (s)
    energy_j: float  # mean iteration energy (J, all GPUs): total / iterations
    header: dict[str, Any]  # the run log's header ({} when it has none)
    summary: RunSummary

    @property
    def simulated(self) -> bool:
        """Whether the run used the simulated GPU (its log header's backend)."""
        return self.summary.log.simulated


def _run_method(run_dir: Path, manifest: dict[str, Any] | None) -> str:
    if manifest is not None and "method" in manifest:
        method = manifest["method"]
    else:
        method = run_dir.name.rsplit("-", 1)[0] if "-" in run_dir.name else run_dir.name
    if method not in METHODS:
        raise ConfigError(
            f"run {run_dir}: method {method!r} is not one of {', '.join(METHODS)} "
            "(name run directories NAME-NN or give run.json a 'method')"
        )
    return method


def read_manifest(run_dir: Path) -> dict[str, Any] | None:
    """The run directory's manifest (RUN_FORMAT), or None when it has none; ConfigError when it is bad."""
    path = run_dir / MANIFEST_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        raise ConfigError(f"{path} is not valid JSON") from None
    if not isinstance(data, dict) or data.get("format") != RUN_FORMAT:
        raise ConfigError(f"{path} is not a {RUN_FORMAT} manifest")
    return data


def collect_runs(log_dir: str | os.PathLike[str], skip_iterations: int = DEFAULT_SKIP_ITERATIONS) -> list[MeasuredRun]:
    """Every run under LOG_DIR (sub-directories with a manifest or a run log), sorted by name."""
    root = Path(log_dir)
    if not root.is_dir():
        raise ConfigError(f"log directory {root} does not exist or is not a directory")
    check_skip(skip_iterations)
    runs = []
    for d in sorted(p for p in root.iterdir() if p.is_dir()):
        data = read_manifest(d)
        default = (
            MEASUREMENT_FILE
            if (d / MEASUREMENT_FILE).exists() or not (d / LEGACY_MEASUREMENT_FILE).is_file()
            else LEGACY_MEASUREMENT_FILE
        )
        if data is None and not (d / default).exists():
            continue
        method = _run_method(d, data)
        log = d / str((data or {}).get("measurement") or default)
        if not log.exists():
            raise ConfigError(
                f"run {d.name} has no measurement log {log.name}; did the job fail? Rerun it or move {d} out of {root}"
            )
        summary = summarize(read_run_log(log), skip_iterations)
        header = summary.log.header
        predicted = header.get("predicted") if isinstance(header.get("predicted"), dict) else None
        if predicted is None and data is not None and isinstance(data.get("predicted"), dict):
            predicted = data["predicted"]
        runs.append(
            MeasuredRun(
                name=d.name,
                method=method,
                log=log,
                plan=(data or {}).get("plan") or header.get("plan"),
                predicted=predicted,
                iterations=summary.used,
                time_s=summary.time_s,
                energy_j=summary.energy_j,
                header=summary.log.header,
                summary=summary,
            )
        )
    if not runs:
        raise ConfigError(
            f"{root} holds no runs (sub-directories NAME-NN with {MEASUREMENT_FILE}); "
            "give the --log-dir of kareus launch"
        )
    return runs


def measured_frontier(
    log_dir: str | os.PathLike[str], skip_iterations: int = DEFAULT_SKIP_ITERATIONS
) -> tuple[dict[str, Any], list[MeasuredRun]]:
    """The kareus-frontier/1 document of the measured runs (same layout, reductions and bands as kareus plan)."""
    runs = collect_runs(log_dir, skip_iterations)
    missing = [m for m in REFERENCE_METHODS if not any(r.method == m for r in runs)]
    if missing:
        raise ConfigError(
            f"{log_dir} has no {' or '.join(missing)} runs; the reductions are measured against "
            "Megatron-LM and Perseus, so run those methods too"
        )
    methods: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        p: dict[str, Any] = {"time_s": r.time_s, "energy_j": r.energy_j, "run": r.name, "iterations": r.iterations}
        if r.plan:
            p["plan"] = r.plan
        methods.setdefault(r.method, []).append(p)
    gpus = sorted({str(r.header["gpu"]) for r in runs if r.header.get("gpu")})
    config = {
        "source": "measured",
        "simulated": any(r.simulated for r in runs),
        "log_dir": str(log_dir),
        "statistic": STATISTIC,
        "energy_statistic": ENERGY_STATISTIC,
        "skip_iterations": skip_iterations,
        "runs": len(runs),
        "gpu": gpus[0] if len(gpus) == 1 else gpus,
    }
    ordered: dict[str, list[dict[str, Any]]] = {m: methods[m] for m in METHODS if m in methods}
    doc = frontier_document(config, ordered)
    add_bands(doc, [RunIterations.of_records(r.name, r.summary.records) for r in runs])
    return doc, runs

"""Run logs: the one reader of the runtime's logs.

A *run log* is a directory of per-rank files (runtime/measure/measurement.py; ``--kareus-log DIR``, ``KAREUS_LOG``):
``rank-NNNNN.jsonl``, each a header (rank, world, pp_rank, pp, tp/cp/dp, plan_sha256, gpu, backend,
clock_control) and one line per iteration with that rank's time_s and energy_j. The reader merges them
into one record per iteration: time = the slowest rank, energy = the sum over ranks, per stage the same
over the ranks of that pp_rank, and under ``ranks`` each reporting rank's own line as written (with its
``rank`` and ``pp_rank``: the per-GPU figures; its optional keys, e.g. the per-instruction columns and tags,
are read by report/measurements.py); event lines (``{"kind": "event", ...}``) go to ``RunLog.events``, each
told its ``rank``; ``RunLog.gpus`` says which GPU each rank measured (its header's
gpu_index, gpu_uuid, gpu_name where present). An iteration is *complete* when every rank of the world
logged both figures, otherwise *partial* (``RunLog.partial`` names what is missing). A rank file holding several runs
(``--kareus-log-mode append``) counts its last run. A single merged JSONL file (the layout before rank
files) is still read: a header line ``{"kind": "header", "world": N, "plan": ..., "plan_sha256": ..., "gpu": ...}``,
then one line per iteration ``{"kind": "iteration", "iteration": i, "time_s": T, "energy_j": E,
"ranks_reporting": n, "stages": [{"pp_rank": r, "time_s": ..., "energy_j": ..., "gpus": g}, ...]}`` with T
the iteration time (s, the slowest rank), E the GPU energy (J, summed over every rank), each stage's the
same over its ranks, and null where a figure is unknown. A *run directory* (``kareus launch`` writes
LOG_DIR/NAME-NN/) holds the log directory (MEASUREMENT_FILE) and a manifest (MANIFEST_FILE, format RUN_FORMAT).

Reading: blank lines are skipped. A last line that is not JSON and has no newline is what a job killed
mid-write leaves: it is dropped and ``RunLog.truncated`` is set. Any other bad line is a ConfigError naming
the file and line; so is a second header (two runs appended to one log).

Summary (warm-up left out, median time, total-over-total energy): report/summary.py.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kareus_megatron.errors import ConfigError
from kareus_megatron.files import read_input_text

RUN_FORMAT = "kareus-run/1"
MEASUREMENT_FILE = "measurement"  # a directory of rank-NNNNN.jsonl files (runtime/measure/measurement.py)
LEGACY_MEASUREMENT_FILE = "measurement.jsonl"  # one merged log: run directories from before rank logs
RANK_FILE_RE = re.compile(r"rank-(\d+)\.jsonl")
MANIFEST_FILE = "run.json"
_HINT = "is this a kareus run log (--kareus-log)?"


@dataclass(frozen=True, kw_only=True, slots=True)
class RunLog:
    """A parsed run log: its header ({} when it has none) and its iteration records, by iteration."""

    path: Path
    header: dict[str, Any]
    iterations: list[dict[str, Any]]
    truncated: bool = False  # the last line was cut by a killed job and left out
    partial: dict[int, str] = field(default_factory=dict)  # iteration -> what is missing ("rank 1", "stage 1")
    earlier_runs: int = 0  # runs before the last one in appended rank files (left out)
    gpus: dict[int, dict[str, Any]] = field(default_factory=dict)  # rank -> which GPU (GPU_KEYS of its header)
    events: list[dict[str, Any]] = field(default_factory=list)  # event lines, each with its rank, by rank then line

    @property
    def simulated(self) -> bool:
        """Whether the run used the simulated GPU (the header's backend)."""
        return self.header.get("backend") == "simulated"


def _figure(v: Any) -> bool:
    """A time (s) or energy (J) field: null, or a finite number >= 0."""
    if v is None or isinstance(v, int) and not isinstance(v, bool):
        return v is None or v >= 0
    return isinstance(v, float) and v >= 0 and v != float("inf")  # NaN fails v >= 0


def _is_index(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


MAX_RANKS = 1 << 20  # bound on world, pp and ranks read from a header (a job has far fewer)
_HEADER_COUNTS = ("world", "pp", "tp", "cp", "dp")  # at least 1 when present
_HEADER_INDICES = ("rank", "pp_rank")  # at least 0 when present
GPU_KEYS = ("local_rank", "gpu_index", "gpu_uuid", "gpu_name")  # optional header keys naming a rank's GPU
_GPU_TEXT_MAX = 200  # characters kept of a header's gpu_uuid / gpu_name


def gpu_identity(header: dict[str, Any]) -> dict[str, Any]:
    """The GPU_KEYS of a rank header that are well formed (an index >= 0, a short string); others are left out."""
    out: dict[str, Any] = {}
    for key in GPU_KEYS:
        v = header.get(key)
        if key in ("local_rank", "gpu_index") and isinstance(v, int) and _is_index(v) and v <= MAX_RANKS:
            out[key] = v
        elif key in ("gpu_uuid", "gpu_name") and isinstance(v, str) and v:
            out[key] = v[:_GPU_TEXT_MAX]
    return out


def _header_problem(rec: dict[str, Any]) -> str | None:
    """What is wrong with a header's layout fields (each optional), or None."""
    for key in (*_HEADER_COUNTS, *_HEADER_INDICES):
        v = rec.get(key)
        low = 1 if key in _HEADER_COUNTS else 0
        if v is not None and not (_is_index(v) and low <= v <= MAX_RANKS):
            return f"header has {key} = {v!r}, not an integer in {low}..{MAX_RANKS}"
    if _is_index(rec.get("pp")) and _is_index(rec.get("pp_rank")) and rec["pp_rank"] >= rec["pp"]:
        return f"header has pp_rank {rec['pp_rank']} outside pp = {rec['pp']}"
    return None


def _iteration_problem(rec: dict[str, Any]) -> str | None:
    """What is wrong with a merged log's iteration record (with its stages), or None."""
    problem = _rank_iteration_problem(rec)
    if problem:
        return problem
    it = rec["iteration"]
    stages = rec.get("stages", [])
    if not isinstance(stages, list):
        return f"iteration {it}: 'stages' must be a list"
    for st in stages:
        if not (
            isinstance(st, dict)
            and _is_index(st.get("pp_rank"))
            and _figure(st.get("time_s"))
            and _figure(st.get("energy_j"))
        ):
            return f"iteration {it}: a stage entry needs an integer pp_rank and time_s, energy_j >= 0 or null"
    return None


def read_run_log(path: str | Path) -> RunLog:
    """Read a run log: a directory of rank files, or one merged file (see the module doc); ConfigError
    naming the file and line when it is malformed."""
    p = Path(path)
    if p.is_dir():
        return merge_rank_dir(p)
    header, its, truncated, events = read_jsonl_run(p, merged=True)
    for r in its.values():
        r.pop("ranks", None)  # per-rank lines exist only in a directory of rank files
    world = header.get("world")
    partial = {
        i: f"{world - r['ranks_reporting']} of {world} ranks missing"
        for i, r in its.items()
        if _is_index(world) and _is_index(r.get("ranks_reporting")) and r["ranks_reporting"] != world
    }
    return RunLog(
        path=p,
        header=header,
        iterations=[its[i] for i in sorted(its)],
        truncated=truncated,
        partial=partial,
        events=events,
    )


def read_jsonl_run(
    p: Path, merged: bool, last_run: bool = False
) -> tuple[dict[str, Any], dict[int, dict[str, Any]], bool, list[dict[str, Any]]]:
    """(header, iterations by index, truncated, event lines) of one JSONL file; `last_run`: several headers are runs
    appended one after another, keep the last (else a second header is a ConfigError). The header gets
    ``_runs``, the number of runs seen, when `last_run`."""
    text = read_input_text(p, ConfigError, "run log", not_text_fix="give the --kareus-log directory of a run")
    lines = text.splitlines()
    last = max((n for n, line in enumerate(lines, 1) if line.strip()), default=0)
    header: dict[str, Any] = {}
    header_lines: list[int] = []
    its: dict[int, dict[str, Any]] = {}
    events: list[dict[str, Any]] = []
    truncated = False
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            if n == last and not text.endswith("\n"):
                truncated = True  # the job was killed while writing its last line
                break
            raise ConfigError(f"{p}:{n} is not valid JSON ({e.msg}); {_HINT}") from None
        kind = rec.get("kind") if isinstance(rec, dict) else None
        if kind == "header":
            problem = _header_problem(rec)
            if problem:
                raise ConfigError(f"{p}:{n}: {problem}; {_HINT}")
            header_lines.append(n)
            if last_run:
                header, its, events = rec, {}, []
            else:
                header = header or rec
        elif kind == "iteration":
            problem = _iteration_problem(rec) if merged else _rank_iteration_problem(rec)
            if problem:
                raise ConfigError(f"{p}:{n}: {problem}; {_HINT}")
            if rec["iteration"] in its and (last_run or len(header_lines) < 2):
                raise ConfigError(f"{p}:{n}: iteration {rec['iteration']} is logged twice; {_HINT}")
            its.setdefault(rec["iteration"], rec)
        elif kind == "event":
            ev_it = rec.get("iteration")
            if not isinstance(rec.get("event"), str) or not (ev_it is None or _is_index(ev_it)):
                raise ConfigError(f"{p}:{n}: an event line needs an event name and an iteration >= 0 or null; {_HINT}")
            events.append(rec)
        else:
            raise ConfigError(f"{p}:{n}: unknown record kind {kind!r}; {_HINT}")
    if len(header_lines) > 1 and not last_run:
        raise ConfigError(
            f"{p} holds {len(header_lines)} runs (headers at lines "
            f"{', '.join(map(str, header_lines))}); keep one run per log file"
        )
    if last_run:
        header = {**header, "_runs": max(1, len(header_lines))}
    return header, its, truncated, events


def merge_rank_dir(d: Path) -> RunLog:
    """Merge the rank files of log directory `d` (see the module doc) into one RunLog."""
    files = {int(m.group(1)): f for f in d.iterdir() if (m := RANK_FILE_RE.fullmatch(f.name)) and f.is_file()}
    if not files:
        raise ConfigError(f"{d} holds no rank logs (rank-NNNNN.jsonl); {_HINT}")
    ranks: dict[int, tuple[dict[str, Any], dict[int, dict[str, Any]]]] = {}
    truncated, earlier, events = False, 0, []
    for r, f in sorted(files.items()):
        header, its, cut, evs = read_jsonl_run(f, merged=False, last_run=True)
        events += [{**e, "rank": r} for e in evs]
        truncated |= cut
        earlier = max(earlier, header.pop("_runs", 1) - 1)
        if header and header.get("rank", r) != r:
            raise ConfigError(f"{f} holds the log of rank {header.get('rank')!r}, not rank {r}; {_HINT}")
        ranks[r] = (header, its)
    headers = [h for h, _ in ranks.values() if h]
    worlds = {h.get("world") for h in headers}
    if len(worlds) > 1 or not all(_is_index(w) and w > 0 for w in worlds):  # type: ignore[operator]
        raise ConfigError(f"the rank logs in {d} disagree on (or lack) the world size: {sorted(map(str, worlds))}")
    world = int(worlds.pop()) if worlds else max(files) + 1  # type: ignore[arg-type]
    stage_of = {r: h.get("pp_rank", 0) for r, (h, _) in ranks.items() if h}
    pp_sizes = [int(h["pp"]) for h in headers if _is_index(h.get("pp"))]
    pp = max(pp_sizes) if pp_sizes else (max(stage_of.values(), default=0) + 1)
    stage_ranks = {s: sorted(r for r, st in stage_of.items() if st == s) for s in range(pp)}
    base = next((h for r, (h, _) in sorted(ranks.items()) if h), {})
    header = {k: v for k, v in base.items() if k not in ("rank", "pp_rank", "t_start", *GPU_KEYS)}
    header["world"], header["pp"] = world, pp
    indices = sorted({i for _, its in ranks.values() for i in its})
    merged, partial = [], {}
    for i in indices:
        got = {
            r: its[i]
            for r, (_, its) in ranks.items()
            if i in its and its[i].get("time_s") is not None and its[i].get("energy_j") is not None
        }
        missing = [r for r in range(world) if r not in got]
        stages = []
        for s in range(pp):
            rs = [r for r in stage_ranks.get(s, []) if r in got]
            stages.append(
                {
                    "pp_rank": s,
                    "gpus": len(rs),
                    "complete": bool(rs) and len(rs) == len(stage_ranks[s]),
                    "time_s": max((got[r]["time_s"] for r in rs), default=None),
                    "energy_j": sum(got[r]["energy_j"] for r in rs) if rs else None,
                }
            )
        empty = [st["pp_rank"] for st in stages if not st["gpus"]]
        if missing:
            what = [f"stage {s}" for s in empty] or [f"rank {r}" for r in missing[:3]]
            partial[i] = ", ".join(what) + " missing"
        for r, g in got.items():  # the rank's own line, told which rank and stage it is
            g["rank"], g["pp_rank"] = r, stage_of.get(r)
        merged.append(
            {
                "kind": "iteration",
                "iteration": i,
                "ranks_reporting": len(got),
                "time_s": max((g["time_s"] for g in got.values()), default=None),
                "energy_j": sum(g["energy_j"] for g in got.values()) if got else None,
                "stages": stages,
                "ranks": [got[r] for r in sorted(got)],
            }
        )
    gpus = {r: {"rank": r, "pp_rank": stage_of.get(r), **gpu_identity(h)} for r, (h, _) in sorted(ranks.items())}
    return RunLog(
        path=d,
        header=header,
        iterations=merged,
        truncated=truncated,
        partial=partial,
        earlier_runs=earlier,
        gpus=gpus,
        events=events,
    )


def _rank_iteration_problem(rec: dict[str, Any]) -> str | None:
    """What is wrong with one rank's iteration record, or None."""
    it = rec.get("iteration")
    if not _is_index(it):
        return f"iteration record has iteration = {it!r}, not a non-negative integer"
    for key in ("time_s", "energy_j"):
        if not _figure(rec.get(key)):
            return f"iteration {it}: {key} = {rec.get(key)!r} must be a finite non-negative number or null"
    cols = rec.get("instructions")
    return None if cols is None else _columns_problem(it, cols)


_INT_COLUMNS, _TIME_COLUMNS = ("index", "chunk", "microbatch", "sm_clock_mhz"), ("t_start_s", "time_s")


def _columns_problem(it: Any, cols: Any) -> str | None:
    """What is wrong with an iteration's ``instructions`` columns (runtime/measure/instruction_times.py), or None."""
    where = f"iteration {it}: 'instructions'"
    if not isinstance(cols, dict) or not isinstance(cols.get("kind"), str) or set(cols["kind"]) - {"F", "B"}:
        return f"{where} must be an object whose 'kind' is a string of F and B"
    n = len(cols["kind"])
    for key in (*_INT_COLUMNS, *_TIME_COLUMNS):
        col = cols.get(key)
        if not isinstance(col, list) or len(col) != n:
            return f"{where}: column {key!r} must be a list of {n} values, one per instruction (as 'kind')"
        ok, what = (_is_index, "an integer >= 0") if key in _INT_COLUMNS else (_figure, "a time >= 0 (s)")
        if not all(v is None or ok(v) for v in col):
            return f"{where}: column {key!r} holds a value that is not {what} or null"
    return None

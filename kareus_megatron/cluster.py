"""Cluster jobs for a ``kareus plan`` output directory: which plan a run uses and the exact commands.

Terms: a *plan directory* is what ``kareus plan --out DIR`` writes (DIR/frontier.json, format
``kareus-frontier/1``, and DIR/plans/NAME-NN.json). A *point* selects one plan of a method's frontier:
``fastest``, ``min-energy`` or its index NN. A *run* is one training job of one method at one point; it
writes its measured log under LOG_DIR/NAME-NN/ (``run.json``, the manifest, and ``measurement.jsonl``,
the runtime's per-iteration log) which ``kareus compare LOG_DIR`` reads. A *job* spans ``nodes`` ×
``gpus_per_node`` GPUs; torchrun starts one process per GPU with c10d rendezvous, so every node runs
the same command. Under Slurm, ``srun`` starts one torchrun per node; with ``--container-image``
(pyxis) the submit directory is mounted at the same path and is the container's working directory, so
relative plan and log paths below it resolve alike on the host and in the container.

Method semantics at run time: Megatron-LM jobs run every method's plan through
``launch/pretrain_gpt.py --kareus-plan`` (the ``megatron`` plan is the max clock everywhere; it adds
``--kareus-on-error warn``, so without clock permission it runs at the driver's default clocks and is
still measured). DeepSpeed jobs run the user's script with ``KAREUS_PLAN``/``KAREUS_LOG`` set (read by
``kareus_megatron.deepspeed.install_from_env``); there ``megatron`` gets no plan: measurement only.
"""

from __future__ import annotations

import json
import math
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kareus_megatron.errors import ConfigError, InfeasibleConfigError, PlanError
from kareus_megatron.plan.io import load_plan
from kareus_megatron.plan.schema import FRONTIER_FORMAT, METHODS, Plan

RUN_FORMAT = "kareus-run/1"
MEASUREMENT_FILE = "measurement.jsonl"
MANIFEST_FILE = "run.json"
DEFAULT_PORT = 29500


@dataclass(frozen=True, kw_only=True, slots=True)
class JobSpec:
    """Where and how a run starts: the job's size, rendezvous and container."""

    nodes: int = 2
    gpus_per_node: int = 8
    master_addr: str = "localhost"
    master_port: int = DEFAULT_PORT
    rdzv_id: str = "kareus"
    container_image: str | None = None  # Slurm + pyxis: srun --container-image
    container_mounts: str | None = None  # default: workdir mounted at the same path
    container_launch_dir: str = "/opt/kareus/src/launch"  # launch/ inside docker/Dockerfile's image
    workdir: str = "."  # the submit directory; the container's working directory
    launch_dir: Path = field(default_factory=lambda: default_launch_dir())
    python: str = "python"

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node", "master_port"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name} = {v!r} must be a positive integer")


@dataclass(frozen=True, kw_only=True, slots=True)
class Selected:
    """One point of one method's frontier: its index, plan file and predicted figures."""

    method: str
    index: int
    plan_path: Path
    time_s: float
    energy_j: float

    @property
    def run_name(self) -> str:
        """Directory name of the run under LOG_DIR: NAME-NN."""
        return f"{self.method}-{self.index:02d}"


def default_launch_dir() -> Path:
    """launch/ of this checkout, or $KAREUS_LAUNCH_DIR (set in the container image)."""
    env = os.environ.get("KAREUS_LAUNCH_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[1] / "launch"


def read_frontier(plan_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Read DIR/frontier.json (kareus-frontier/1); PlanError names what is wrong."""
    path = Path(plan_dir) / "frontier.json"
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise PlanError(f"{path} does not exist; give a `kareus plan --out DIR` directory") from None
    except (OSError, json.JSONDecodeError) as e:
        raise PlanError(f"cannot read {path}: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != FRONTIER_FORMAT:
        got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise PlanError(f"{path}: format is {got!r}, expected {FRONTIER_FORMAT!r}; regenerate it with kareus plan")
    if not isinstance(doc.get("methods"), dict):
        raise PlanError(f"{path}: 'methods' must be an object of method name -> {{points: [...]}}")
    return doc


def parse_point(text: str) -> str | int:
    """'fastest', 'min-energy' or a non-negative index NN (ConfigError otherwise)."""
    if text in ("fastest", "min-energy", "all"):
        return text
    if text.isascii() and text.isdigit():  # not '²', which isdigit() too
        return int(text)
    raise ConfigError(f"--point {text!r} is not valid; use fastest, min-energy, all or an index such as 03")


def select_points(plan_dir: str | os.PathLike[str], method: str, point: str | int) -> list[Selected]:
    """The frontier points of `method` that `point` selects ('all' gives every point, fastest first)."""
    if method not in METHODS:
        raise ConfigError(f"unknown method {method!r}; use one of {', '.join(METHODS)}")
    doc = read_frontier(plan_dir)
    entry = doc["methods"].get(method)
    if not entry or not entry.get("points"):
        have = ", ".join(m for m, e in doc["methods"].items() if e.get("points")) or "none"
        raise PlanError(f"{Path(plan_dir) / 'frontier.json'} has no points for method {method!r} (has: {have})")
    pts = entry["points"]
    if point == "all":
        chosen = list(range(len(pts)))
    elif point == "fastest":
        chosen = [min(range(len(pts)), key=lambda i: (pts[i]["time_s"], pts[i]["energy_j"]))]
    elif point == "min-energy":
        chosen = [min(range(len(pts)), key=lambda i: (pts[i]["energy_j"], pts[i]["time_s"]))]
    elif isinstance(point, int) and 0 <= point < len(pts):
        chosen = [point]
    else:
        raise ConfigError(f"point {point!r} does not exist for {method}; it has points 00..{len(pts) - 1:02d}")
    out = []
    for i in chosen:
        p = pts[i]
        rel = p.get("plan") or f"plans/{method}-{i:02d}.json"
        out.append(Selected(method=method, index=i, plan_path=Path(plan_dir) / rel,
                            time_s=float(p["time_s"]), energy_j=float(p["energy_j"])))
    return out


def _pipeline_layer_args(layers_per_stage: tuple[int, ...], num_layers: int) -> list[str]:
    """Megatron-LM flags for the plan's layers per stage (uneven first/last stages allowed)."""
    pp = len(layers_per_stage)
    if sum(layers_per_stage) != num_layers:
        raise PlanError(f"layers_per_stage {list(layers_per_stage)} does not add up to {num_layers} layers")
    if len(set(layers_per_stage)) == 1:
        return []
    middle = layers_per_stage[1:-1]
    if len(set(middle)) > 1:
        raise InfeasibleConfigError(
            f"layers_per_stage {list(layers_per_stage)}: Megatron-LM can make only the first and last stages "
            "uneven; plan with equal middle stages"
        )
    args = ["--decoder-first-pipeline-num-layers", str(layers_per_stage[0])]
    if pp > 1:
        args += ["--decoder-last-pipeline-num-layers", str(layers_per_stage[-1])]
    return args


def megatron_args(plan: Plan, *, train_iters: int) -> list[str]:
    """Megatron-LM pretrain_gpt.py arguments reproducing the plan's model, parallel layout and batch.

    Data is Megatron's mock dataset with the NullTokenizer (vocab = the plan's, exactly: NullTokenizer
    adds one EOD token, and padding is turned off); append your own data flags to override it.
    """
    from kareus_megatron.workload.models import model_names, model_spec

    if plan.model is None:
        raise PlanError("the plan has no model shape; regenerate it with kareus plan --model")
    m, par = plan.model, plan.parallel
    family = model_spec(m.name) if m.name in model_names() else None
    a = ["--tensor-model-parallel-size", str(par.tp), "--context-parallel-size", str(par.cp),
         "--pipeline-model-parallel-size", str(par.pp)]
    if par.vp > 1:
        a += ["--num-virtual-stages-per-pipeline-rank", str(par.vp)]
    a += _pipeline_layer_args(par.layers_per_stage, m.num_layers)
    if par.sequence_parallel:
        a += ["--sequence-parallel"]
    a += ["--num-layers", str(m.num_layers), "--hidden-size", str(m.hidden_size),
          "--num-attention-heads", str(m.num_attention_heads), "--ffn-hidden-size", str(m.ffn_hidden_size)]
    if m.num_query_groups != m.num_attention_heads:
        a += ["--group-query-attention", "--num-query-groups", str(m.num_query_groups)]
    if family is not None and family.head_dim:
        a += ["--kv-channels", str(family.head_dim)]
    activation, norm, position = (family.activation, family.norm, family.position) if family else ("swiglu", "rmsnorm", "rope")
    if position == "alibi":
        raise InfeasibleConfigError(f"model {m.name}: megatron-core has no ALiBi; use a rope or learned-position model")
    if activation == "swiglu":
        a += ["--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights"]
    if norm == "rmsnorm":
        a += ["--normalization", "RMSNorm"]
    a += ["--position-embedding-type", "rope" if position == "rope" else "learned_absolute"]
    if family is not None and family.qk_norm:
        a += ["--qk-layernorm"]
    a += ["--seq-length", str(par.seq_length), "--max-position-embeddings", str(par.seq_length),
          "--micro-batch-size", str(par.micro_batch_size),
          "--global-batch-size", str(par.micro_batch_size * par.num_microbatches * par.dp)]
    if par.recompute == "full":
        a += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    elif par.recompute == "selective":
        a += ["--recompute-granularity", "selective"]
    a += ["--bf16", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(m.vocab_size - 1),
          "--make-vocab-size-divisible-by", "1", "--train-iters", str(train_iters),
          "--lr", "1.0e-5", "--lr-decay-style", "constant", "--log-interval", "1",
          "--eval-iters", "0", "--eval-interval", str(train_iters + 1)]
    return a


def check_job_fits(plan: Plan, job: JobSpec) -> None:
    """The job must have exactly the GPUs the plan was made for (InfeasibleConfigError otherwise)."""
    par = plan.parallel
    if (par.nodes, par.gpus_per_node) != (job.nodes, job.gpus_per_node):
        raise InfeasibleConfigError(
            f"the plan is for {par.nodes} nodes x {par.gpus_per_node} GPUs but the job has "
            f"{job.nodes} x {job.gpus_per_node}; pass --nodes {par.nodes} --gpus-per-node {par.gpus_per_node}"
        )


def torchrun_prefix(job: JobSpec, run_name: str) -> list[str]:
    """torchrun with c10d rendezvous (one rendezvous id per run); the same command runs on every node."""
    return ["torchrun", "--nnodes", str(job.nodes), "--nproc-per-node", str(job.gpus_per_node),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{job.master_addr}:{job.master_port}",
            "--rdzv-id", f"{job.rdzv_id}-{run_name}"]


def srun_prefix(job: JobSpec) -> list[str]:
    """srun starting one torchrun per node of the allocation (pyxis container flags when set)."""
    cmd = ["srun", "--nodes", str(job.nodes), "--ntasks-per-node", "1", "--gpus-per-node", str(job.gpus_per_node),
           "--kill-on-bad-exit=1"]
    if job.container_image:
        cmd += ["--container-image", job.container_image,
                "--container-mounts", job.container_mounts or f"{job.workdir}:{job.workdir}",
                "--container-workdir", job.workdir]
    return cmd


@dataclass(frozen=True, kw_only=True, slots=True)
class RunCommand:
    """A run: the command line, the environment it adds, and where it logs."""

    argv: list[str]
    env: dict[str, str]
    log_dir: Path
    selected: Selected | None

    def shell(self) -> str:
        """The command as one shell line, environment first (what --dry-run prints)."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        return (env + " " if env else "") + shlex.join(self.argv)


def run_command(
    selected: Selected,
    job: JobSpec,
    log_root: str | os.PathLike[str],
    *,
    launcher: str = "torchrun",
    train_iters: int = 20,
    script: str | None = None,
    extra_args: tuple[str, ...] = (),
) -> RunCommand:
    """The command of one run of `selected` (launcher 'torchrun' or 'slurm'), logging to LOG_ROOT/NAME-NN."""
    if launcher not in ("torchrun", "slurm"):
        raise ConfigError(f"launcher {launcher!r} is not known; use torchrun or slurm")
    plan = load_plan(selected.plan_path)
    check_job_fits(plan, job)
    log_dir = Path(log_root) / selected.run_name
    log_file = log_dir / MEASUREMENT_FILE
    controlled = selected.method != "megatron"  # the baseline: see the module docstring
    env: dict[str, str] = {}
    if plan.framework == "deepspeed":
        if script is None:
            raise ConfigError("a DeepSpeed plan needs --script: your DeepSpeed training script "
                              "(it calls kareus_megatron.deepspeed.install_from_env() or reads a 'kareus' config section)")
        env["KAREUS_LOG"] = str(log_file)
        if controlled:
            env["KAREUS_PLAN"] = str(selected.plan_path)
        program = [script, *extra_args]
    else:
        # The megatron plan holds the max clock everywhere; with --kareus-on-error warn a job without clock
        # permission still runs (at the driver's default clocks) and is measured.
        kareus = ["--kareus-plan", str(selected.plan_path), *([] if controlled else ["--kareus-on-error", "warn"]),
                  "--kareus-log", str(log_file)]
        in_container = launcher == "slurm" and job.container_image
        launch_dir = Path(job.container_launch_dir) if in_container else job.launch_dir
        if script is None:
            program = [str(launch_dir / "pretrain_gpt.py"), *megatron_args(plan, train_iters=train_iters),
                       *kareus, *extra_args]
        else:  # any megatron-core script, through the runtime's generic launcher
            program = ["-m", "kareus_megatron.launch", *kareus, "--", script, *extra_args]
    argv = torchrun_prefix(job, selected.run_name) + program
    if launcher == "slurm":
        argv = srun_prefix(job) + argv
    return RunCommand(argv=argv, env=env, log_dir=log_dir, selected=selected)


def manifest(cmd: RunCommand, job: JobSpec) -> dict[str, Any]:
    """The run.json written beside a run's measurement log (read by kareus compare)."""
    s = cmd.selected
    assert s is not None
    return {
        "format": RUN_FORMAT,
        "method": s.method,
        "point": s.index,
        "plan": str(s.plan_path),
        "predicted": {"iteration_time_s": s.time_s, "iteration_energy_j": s.energy_j},
        "nodes": job.nodes,
        "gpus_per_node": job.gpus_per_node,
        "measurement": MEASUREMENT_FILE,
        "command": cmd.argv,
        "env": cmd.env,
    }


# ---- measured logs -> frontier (kareus compare) ----------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class MeasuredRun:
    """One run's measured iteration time (s, mean) and GPU energy (J per iteration, mean) after warm-up."""

    name: str
    method: str
    log: Path
    plan: str | None
    iterations: int
    time_s: float
    energy_j: float
    predicted: dict[str, float] | None
    header: dict[str, Any]


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read measurement log {path}: {e.strerror}") from None
    lines = text.splitlines()
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if n == len(lines) and not text.endswith("\n"):
                break  # the job was killed while writing its last line
            raise ConfigError(f"{path}:{n} is not valid JSON; is this a kareus measurement log?") from None
        if not isinstance(rec, dict):
            raise ConfigError(f"{path}:{n} is not a JSON object; is this a kareus measurement log?")
        out.append(rec)
    return out


def _number(rec: dict[str, Any], key: str, where: str) -> float | None:
    v = rec.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v >= 0):
        raise ConfigError(f"{where}: {key} = {v!r} must be a finite non-negative number or null")
    return float(v)


def summarize_log(path: Path, skip_iterations: int) -> tuple[dict[str, Any], int, float, float]:
    """(header, iterations used, mean time s, mean energy J) of a measurement log, after skipping warm-up."""
    records = _read_jsonl(path)
    headers = [r for r in records if r.get("kind") == "header"]
    if len(headers) > 1:
        raise ConfigError(f"{path} holds {len(headers)} runs (one header each); keep one run per log file")
    rows: dict[int, tuple[float | None, float | None]] = {}
    for r in records:
        if r.get("kind") != "iteration":
            continue
        it = r.get("iteration")
        if not isinstance(it, int) or isinstance(it, bool) or it in rows:
            raise ConfigError(f"{path}: iteration {it!r} is missing, not an integer or repeated")
        rows[it] = (_number(r, "time_s", f"{path} iteration {it}"), _number(r, "energy_j", f"{path} iteration {it}"))
    kept = [rows[i] for i in sorted(rows)][skip_iterations:]
    valid = [(t, e) for t, e in kept if t is not None and e is not None]
    if not valid:
        raise ConfigError(
            f"{path} has {len(rows)} iteration(s) and none with both time and energy after skipping "
            f"{skip_iterations} warm-up iteration(s); run longer or pass a smaller --skip-iterations"
        )
    n = len(valid)
    return (headers[0] if headers else {}), n, sum(t for t, _ in valid) / n, sum(e for _, e in valid) / n


def _run_method(run_dir: Path, manifest_data: dict[str, Any] | None) -> str:
    if manifest_data is not None and "method" in manifest_data:
        method = manifest_data["method"]
    else:
        method = run_dir.name.rsplit("-", 1)[0] if "-" in run_dir.name else run_dir.name
    if method not in METHODS:
        raise ConfigError(f"run {run_dir}: method {method!r} is not one of {', '.join(METHODS)} "
                          "(name run directories NAME-NN or give run.json a 'method')")
    return method


def collect_runs(log_dir: str | os.PathLike[str], skip_iterations: int = 2) -> list[MeasuredRun]:
    """Every run under LOG_DIR (sub-directories with run.json or measurement.jsonl), sorted by name."""
    root = Path(log_dir)
    if not root.is_dir():
        raise ConfigError(f"log directory {root} does not exist or is not a directory")
    if isinstance(skip_iterations, bool) or not isinstance(skip_iterations, int) or skip_iterations < 0:
        raise ConfigError(f"--skip-iterations {skip_iterations!r} must be a non-negative integer")
    runs = []
    for d in sorted(p for p in root.iterdir() if p.is_dir()):
        has_manifest = (d / MANIFEST_FILE).is_file()
        if not has_manifest and not (d / MEASUREMENT_FILE).is_file():
            continue
        data = None
        if has_manifest:
            try:
                data = json.loads((d / MANIFEST_FILE).read_text())
            except (OSError, json.JSONDecodeError):
                raise ConfigError(f"{d / MANIFEST_FILE} is not valid JSON") from None
            if not isinstance(data, dict) or data.get("format") != RUN_FORMAT:
                raise ConfigError(f"{d / MANIFEST_FILE} is not a {RUN_FORMAT} manifest")
        method = _run_method(d, data)
        log = d / str((data or {}).get("measurement") or MEASUREMENT_FILE)
        if not log.is_file():
            raise ConfigError(f"run {d.name} has no measurement log {log.name}; did the job fail? "
                              f"Rerun it or move {d} out of {root}")
        header, n, t, e = summarize_log(log, skip_iterations)
        predicted = header.get("predicted") if isinstance(header.get("predicted"), dict) else None
        if predicted is None and data is not None and isinstance(data.get("predicted"), dict):
            predicted = data["predicted"]
        runs.append(MeasuredRun(name=d.name, method=method, log=log, plan=(data or {}).get("plan") or header.get("plan"),
                                iterations=n, time_s=t, energy_j=e, predicted=predicted, header=header))
    if not runs:
        raise ConfigError(f"{root} holds no runs (sub-directories NAME-NN with {MEASUREMENT_FILE}); "
                          "give the --log-dir of launch/kareus_launch.py")
    return runs


def measured_frontier(log_dir: str | os.PathLike[str], skip_iterations: int = 2) -> tuple[dict[str, Any], list[MeasuredRun]]:
    """The kareus-frontier/1 document of the measured runs (same layout and reductions as kareus plan)."""
    from kareus_megatron.plan.frontier import frontier_document

    runs = collect_runs(log_dir, skip_iterations)
    missing = [m for m in ("megatron", "perseus") if not any(r.method == m for r in runs)]
    if missing:
        raise ConfigError(f"{log_dir} has no {' or '.join(missing)} runs; the reductions are measured against "
                          "Megatron-LM and Perseus, so run those methods too")
    methods: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        p: dict[str, Any] = {"time_s": r.time_s, "energy_j": r.energy_j, "run": r.name, "iterations": r.iterations}
        if r.plan:
            p["plan"] = r.plan
        methods.setdefault(r.method, []).append(p)
    gpus = sorted({str(r.header["gpu"]) for r in runs if r.header.get("gpu")})
    config = {"source": "measured", "log_dir": str(log_dir), "skip_iterations": skip_iterations,
              "runs": len(runs), "gpu": gpus[0] if len(gpus) == 1 else gpus}
    ordered = {m: methods[m] for m in METHODS if m in methods}
    return frontier_document(config, ordered), runs

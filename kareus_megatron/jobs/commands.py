"""The exact command of each run of a plan directory's points: torchrun, under Slurm srun + torchrun.

Terms: a *point* (plan/points.py) selects one plan of a method's frontier. A *run* is one training job
of one method at one point; it writes its measured log under LOG_DIR/NAME-NN/ (the manifest
report.runlog.MANIFEST_FILE and the runtime's per-rank log directory report.runlog.MEASUREMENT_FILE), which
``kareus compare LOG_DIR`` reads. A *job* spans ``nodes`` × ``gpus_per_node`` GPUs; torchrun starts one
process per GPU with c10d rendezvous, so every node runs the same command. Under Slurm, ``srun`` starts
one torchrun per node; with ``--container-image`` (pyxis) the submit directory is mounted at the same path
and is the container's working directory, so relative plan and log paths below it resolve alike on the
host and in the container.

Method semantics at run time: Megatron-LM jobs run every method's plan through
``launch/pretrain_gpt.py --kareus-plan`` (the ``megatron`` plan is the max clock everywhere; it adds
``--kareus-on-error warn``, so without clock permission it runs at the driver's default clocks and is
still measured). DeepSpeed jobs run the user's script with ``KAREUS_PLAN``/``KAREUS_LOG`` set (read by
``kareus_megatron.deepspeed.install_from_env``); there ``megatron`` gets no plan: measurement only.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kareus_megatron.environment import kareus_settings
from kareus_megatron.errors import ConfigError, InfeasibleConfigError, PlanError
from kareus_megatron.plan.environment import required_environment
from kareus_megatron.plan.io import load_plan
from kareus_megatron.plan.megatron_model import ACTIVATION_FLAGS, NORMALIZATION, POSITION_EMBEDDING, PRECISION_FLAGS
from kareus_megatron.plan.objective import FrontierPoint
from kareus_megatron.plan.schema import ModelShape, Plan
from kareus_megatron.report.runlog import MEASUREMENT_FILE, RUN_FORMAT
from kareus_megatron.vocab import FRAMEWORK_DEEPSPEED, MEGATRON

DEFAULT_PORT = 29500
LAUNCHERS = ("torchrun", "slurm")


def default_launch_dir() -> Path:
    """launch/ of this checkout, or $KAREUS_LAUNCH_DIR (set in the container image)."""
    env = kareus_settings().launch_dir
    return Path(env) if env else Path(__file__).resolve().parents[2] / "launch"


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
    launch_dir: Path = field(default_factory=default_launch_dir)
    python: str = "python"

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node", "master_port"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name} = {v!r} must be a positive integer")


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


def model_args(m: ModelShape) -> list[str]:
    """Megatron-LM flags that build the plan's model and set its precision, all from the plan's record.

    Every model flag is written out, defaults included (megatron_model.py has the spellings). A record
    with unknown fields (a plan from before they were recorded) is a PlanError; a model Megatron-LM cannot
    build (ALiBi, an activation without a flag, TF32) an InfeasibleConfigError.
    """
    missing = m.unknown_fields()
    if missing:
        raise PlanError(
            f"the plan does not record the model's {', '.join(missing)} (written by an older kareus); "
            "regenerate it with kareus plan"
        )
    assert m.activation and m.normalization and m.position_embedding and m.precision and m.kv_channels  # known
    if m.activation not in ACTIVATION_FLAGS:
        raise InfeasibleConfigError(
            f"model {m.name}: Megatron-LM has no flag for the {m.activation} activation; "
            f"use one of {', '.join(ACTIVATION_FLAGS)}"
        )
    if m.position_embedding not in POSITION_EMBEDDING:
        raise InfeasibleConfigError(
            f"model {m.name}: megatron-core has no {m.position_embedding} position "
            f"embedding; use one of {', '.join(POSITION_EMBEDDING)}"
        )
    if m.precision not in PRECISION_FLAGS:
        raise InfeasibleConfigError(
            f"precision {m.precision}: Megatron-LM has no switch for it; plan with "
            f"--precision one of {', '.join(PRECISION_FLAGS)}"
        )
    a = [
        "--num-layers",
        str(m.num_layers),
        "--hidden-size",
        str(m.hidden_size),
        "--num-attention-heads",
        str(m.num_attention_heads),
        "--ffn-hidden-size",
        str(m.ffn_hidden_size),
    ]
    if m.num_query_groups != m.num_attention_heads:
        a += ["--group-query-attention", "--num-query-groups", str(m.num_query_groups)]
    a += ["--kv-channels", str(m.kv_channels), *ACTIVATION_FLAGS[m.activation]]
    if not m.bias_linear:
        a += ["--disable-bias-linear", *(["--add-qkv-bias"] if m.qkv_bias else [])]
    if not m.tied_embeddings:
        a += ["--untie-embeddings-and-output-weights"]
    a += [
        "--normalization",
        NORMALIZATION[m.normalization],
        "--position-embedding-type",
        POSITION_EMBEDDING[m.position_embedding],
    ]
    if m.qk_norm:
        a += ["--qk-layernorm"]
    return a + list(PRECISION_FLAGS[m.precision])


def megatron_args(plan: Plan, *, train_iters: int) -> list[str]:
    """Megatron-LM pretrain_gpt.py arguments reproducing the plan's model, precision, parallel layout and
    batch (model_args: from the plan's record only, never from a preset of the same name).

    Data is Megatron's mock dataset with the NullTokenizer (vocab = the plan's, exactly: NullTokenizer
    adds one EOD token, and padding is turned off); append your own data flags to override it.
    """
    if plan.model is None:
        raise PlanError("the plan has no model shape; regenerate it with kareus plan --model")
    m, par = plan.model, plan.parallel
    model = model_args(m)
    a = [
        "--tensor-model-parallel-size",
        str(par.tp),
        "--context-parallel-size",
        str(par.cp),
        "--pipeline-model-parallel-size",
        str(par.pp),
    ]
    if par.vp > 1:
        a += ["--num-virtual-stages-per-pipeline-rank", str(par.vp)]
    a += _pipeline_layer_args(par.layers_per_stage, m.num_layers)
    if par.sequence_parallel:
        a += ["--sequence-parallel"]
    a += model
    a += [
        "--seq-length",
        str(par.seq_length),
        "--max-position-embeddings",
        str(par.seq_length),
        "--micro-batch-size",
        str(par.micro_batch_size),
        "--global-batch-size",
        str(par.micro_batch_size * par.num_microbatches * par.dp),
    ]
    if par.recompute == "full":
        a += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    elif par.recompute == "selective":
        a += ["--recompute-granularity", "selective"]
    a += [
        "--mock-data",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        str(m.vocab_size - 1),
        "--make-vocab-size-divisible-by",
        "1",
        "--train-iters",
        str(train_iters),
        "--lr",
        "1.0e-5",
        "--lr-decay-style",
        "constant",
        "--log-interval",
        "1",
        "--eval-iters",
        "0",
        "--eval-interval",
        str(train_iters + 1),
    ]
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
    return [
        "torchrun",
        "--nnodes",
        str(job.nodes),
        "--nproc-per-node",
        str(job.gpus_per_node),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"{job.master_addr}:{job.master_port}",
        "--rdzv-id",
        f"{job.rdzv_id}-{run_name}",
    ]


def srun_prefix(job: JobSpec) -> list[str]:
    """srun starting one torchrun per node of the allocation (pyxis container flags when set)."""
    cmd = [
        "srun",
        "--nodes",
        str(job.nodes),
        "--ntasks-per-node",
        "1",
        "--gpus-per-node",
        str(job.gpus_per_node),
        "--kill-on-bad-exit=1",
    ]
    if job.container_image:
        cmd += [
            "--container-image",
            job.container_image,
            "--container-mounts",
            job.container_mounts or f"{job.workdir}:{job.workdir}",
            "--container-workdir",
            job.workdir,
        ]
    return cmd


@dataclass(frozen=True, kw_only=True, slots=True)
class RunCommand:
    """A run: the command line, the environment it adds, where it logs, and the host script it needs."""

    argv: list[str]
    env: dict[str, str]
    log_dir: Path
    point: FrontierPoint
    needs: Path | None = None  # a file on this host the command runs (launch/pretrain_gpt.py), if any

    def shell(self) -> str:
        """The command as one shell line, environment first (what --dry-run prints)."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        return (env + " " if env else "") + shlex.join(self.argv)


def run_command(
    point: FrontierPoint,
    job: JobSpec,
    log_root: str | os.PathLike[str],
    *,
    launcher: str = "torchrun",
    train_iters: int = 20,
    script: str | None = None,
    extra_args: tuple[str, ...] = (),
) -> RunCommand:
    """The command of one run of `point` (launcher 'torchrun' or 'slurm'), logging to LOG_ROOT/NAME-NN."""
    if launcher not in LAUNCHERS:
        raise ConfigError(f"launcher {launcher!r} is not known; use {' or '.join(LAUNCHERS)}")
    plan = load_plan(point.plan_path)
    check_job_fits(plan, job)
    log_dir = Path(log_root) / point.run_name
    log_file = log_dir / MEASUREMENT_FILE
    controlled = point.method != MEGATRON  # the baseline: see the module docstring
    env: dict[str, str] = {}
    needs = None
    if plan.framework == FRAMEWORK_DEEPSPEED:
        if script is None:
            raise ConfigError(
                "a DeepSpeed plan needs --script: your DeepSpeed training script "
                "(it calls kareus_megatron.deepspeed.install_from_env() or reads a 'kareus' "
                "config section)"
            )
        env["KAREUS_LOG"] = str(log_file)
        if controlled:
            env["KAREUS_PLAN"] = str(point.plan_path)
        program = [script, *extra_args]
    else:
        # The megatron plan holds the max clock everywhere; with --kareus-on-error warn a job without clock
        # permission still runs (at the driver's default clocks) and is measured.
        env.update(required_environment(plan))  # CUDA_DEVICE_MAX_CONNECTIONS=1 with TP or CP (plan/environment.py)
        kareus = [
            "--kareus-plan",
            str(point.plan_path),
            *([] if controlled else ["--kareus-on-error", "warn"]),
            "--kareus-log",
            str(log_file),
        ]
        in_container = launcher == "slurm" and job.container_image
        launch_dir = Path(job.container_launch_dir) if in_container else job.launch_dir
        if script is None:
            program = [
                str(launch_dir / "pretrain_gpt.py"),
                *megatron_args(plan, train_iters=train_iters),
                *kareus,
                *extra_args,
            ]
            needs = None if in_container else launch_dir / "pretrain_gpt.py"
        else:  # any megatron-core script, through the runtime's generic launcher
            program = ["-m", "kareus_megatron.launch", *kareus, "--", script, *extra_args]
    argv = torchrun_prefix(job, point.run_name) + program
    if launcher == "slurm":
        argv = srun_prefix(job) + argv
    return RunCommand(argv=argv, env=env, log_dir=log_dir, point=point, needs=needs)


def manifest(cmd: RunCommand, job: JobSpec) -> dict[str, Any]:
    """The run.json written beside a run's measurement log (read by kareus compare)."""
    s = cmd.point
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

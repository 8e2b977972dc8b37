"""What the Megatron-LM end-to-end tests run: the tiny GPT's layouts, commands and 2-rank launches.

A *config* is one parallel layout of the tiny GPT (tiny-mlm.yaml) on 2 ranks: its ``kareus plan`` flags
and the matching Megatron-LM flags. ``run_torchrun`` trains it under torchrun (2 gloo ranks, simulated
GPUs) behind run_on_cpu.py, ``run_kareus_torchrun`` under ``kareus torchrun``; ``run_ranks`` starts the 2 ranks
directly, to see each one's exit status and stderr.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kareus_megatron.jobs.commands import model_args
from kareus_megatron.plan.points import load_point_plan

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
VENDOR = ROOT.parent / "shared" / "vendor"
WRAPPER = HERE / "run_on_cpu.py"
DROP_IN = ROOT / "launch" / "pretrain_gpt.py"
MODEL_YAML = HERE / "tiny-mlm.yaml"
SLOW_LINKS = HERE / "slow-links.calib.json"  # collectives slow enough that kareus plans 2 nanobatches
TAGS = ("core_v0.16.1", "core_v0.19.0")
GPU = "a100-sxm4-40gb"
ITERS = 3
MBS, SEQ, MICROBATCHES = 2, 32, 4
RUN_TIMEOUT_S = 150

# The model's own flags (tiny-mlm.yaml: LayerNorm, GELU MLP, learned absolute positions, fp32) come from
# the plan's record (jobs/commands.py model_args, what `kareus launch` writes); these are the rest: data,
# learning rate and what the CPU needs (see mlm_cpu_shim's docstring for --clip-grad/--eval-*).
MLM_RUN_ARGS = (
    "--vocab-size 128 --max-position-embeddings 32 "
    f"--seq-length {SEQ} --micro-batch-size {MBS} --train-iters {ITERS} --lr 1e-4 --min-lr 1e-5 "
    "--mock-data --tokenizer-type NullTokenizer --transformer-impl local --distributed-backend gloo "
    "--no-gradient-accumulation-fusion --no-masked-softmax-fusion --no-bias-gelu-fusion "
    "--no-bias-dropout-fusion --no-rope-fusion --no-persist-layer-norm "
    "--clip-grad 0 --eval-iters 0 --eval-interval 1000 --log-interval 1"
).split()


@dataclass(frozen=True)
class Config:
    """One 2-rank layout: its `kareus plan` flags, Megatron-LM flags and the plan point it runs."""

    name: str
    plan_flags: tuple[str, ...]
    mlm_flags: tuple[str, ...]
    point: str = "perseus-05"  # 1 nanobatch, clocks that differ from instruction to instruction
    pp: int = 2
    extra_env: dict[str, str] = field(default_factory=dict)
    world: int = 2  # ranks (torchrun processes)


CONFIGS = {
    "pp2": Config("pp2", ("--tp", "1", "--pp", "2"), ("--pipeline-model-parallel-size", "2")),
    "tp2": Config("tp2", ("--tp", "2", "--pp", "1"), ("--tensor-model-parallel-size", "2"), pp=1),
    # Interleaved on 2 ranks needs batch_p2p_comm=False on gloo (notes A.4). No flag is needed for it:
    # in core_v0.16.1 and core_v0.19.0 alike, Megatron-LM's --no-overlap-p2p-communication (store_false)
    # leaves overlap_p2p_comm=True by default, core_transformer_config_from_args sets
    # batch_p2p_comm = not overlap_p2p_comm, and validate_args refuses --no-overlap-p2p-communication
    # with PP=2 (arguments.py, "pipeline-model-parallel size should be greater than 2"). mlm_cpu_shim's
    # P2PCommunicator guard fails the run should batched p2p ever be chosen here.
    "vp2": Config(
        "vp2",
        ("--tp", "1", "--pp", "2", "--vp", "2"),
        ("--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"),
    ),
    # 2-nanobatch points (test_mlm_overlap.py): kareus's plans under SLOW_LINKS run every TP/SP instruction as
    # 2 nanobatches; for CP=2 no kareus point does at this size, so the nanobatch_perseus point runs there.
    "tp2-nb": Config(
        "tp2-nb",
        ("--tp", "2", "--pp", "1", "--calibration", str(SLOW_LINKS)),
        ("--tensor-model-parallel-size", "2"),
        point="kareus-00",
        pp=1,
    ),
    "tp2sp-nb": Config(
        "tp2sp-nb",
        ("--tp", "2", "--pp", "1", "--sp", "--calibration", str(SLOW_LINKS)),
        ("--tensor-model-parallel-size", "2", "--sequence-parallel"),
        point="kareus-00",
        pp=1,
    ),
    "cp2-nb": Config(
        "cp2-nb",
        ("--tp", "1", "--cp", "2", "--pp", "1", "--calibration", str(SLOW_LINKS)),
        ("--context-parallel-size", "2"),
        point="nanobatch_perseus-00",
        pp=1,
    ),
    "pp2tp2-nb": Config(
        "pp2tp2-nb",
        ("--tp", "2", "--pp", "2", "--calibration", str(SLOW_LINKS)),
        ("--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"),
        point="kareus-00",
        world=4,
    ),
}


def plan_command(config: Config, out: Path, microbatches: int = MICROBATCHES) -> list[str]:
    """`kareus plan` arguments (without the program name) for `config`: no prediction bands and no figures, which the
    runs do not read (the points are the same; a plan took 3.8 s with them and 1.2 s without, 2026-12-07)."""
    return [
        "plan",
        "--band-samples",
        "0",
        "--no-figures",
        "--model",
        str(MODEL_YAML),
        "--gpu",
        GPU,
        *config.plan_flags,
        "--mbs",
        str(MBS),
        "--seq",
        str(SEQ),
        "--microbatches",
        str(microbatches),
        "--nodes",
        "1",
        "--gpus-per-node",
        str(config.world),
        "--precision",
        "fp32",
        "--recompute",
        "none",
        "--out",
        str(out),
    ]


def child_env(**extra: str) -> dict[str, str]:
    """Environment of a training run: simulated GPUs, venv first on PATH, no inherited launch settings."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("KAREUS_", "MASTER_", "SLURM_", "TORCHELASTIC_"))
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "CUDA_DEVICE_MAX_CONNECTIONS", "MEGATRON_LM_DIR")
    }
    # megatron/core/datasets/Makefile runs `python3 -m pybind11` and python3-config from PATH.
    env.update(
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
        KAREUS_GPU_BACKEND="simulated",
        KAREUS_SIMULATED_LATENCY_MS="1",
        OMP_NUM_THREADS="1",
        TORCHDYNAMO_DISABLE="1",
        PYTHONWARNINGS="ignore",
        **extra,
    )
    return env


def mlm_command(
    tree: Path,
    native: bool,
    config: Config,
    plan: Path,
    log: Path,
    global_batch: int = MBS * MICROBATCHES,
    extra: tuple[str, ...] = (),
) -> list[str]:
    """run_on_cpu.py's arguments: the drop-in (native=False) or the patched tree's own pretrain_gpt.py."""
    script = [str(tree / "pretrain_gpt.py")] if native else [str(DROP_IN), "--megatron-lm-dir", str(tree)]
    model = load_point_plan(str(plan), config.point)[0].model
    assert model is not None
    return [
        str(WRAPPER),
        str(tree),
        *script,
        "--kareus-plan",
        str(plan),
        "--kareus-point",
        config.point,
        "--kareus-log",
        str(log),
        *config.mlm_flags,
        *model_args(model),
        *MLM_RUN_ARGS,
        "--global-batch-size",
        str(global_batch),
        *extra,
    ]


# Megatron-LM's --mock-data index files (why they are cached: README.md). They depend on the release and the run's
# samples, seed and sequence length (Megatron-LM names them by the hash of that description), not on kareus.
MOCK_CACHE_AFFIXES = ("document_index.npy", "sample_index.npy", "shuffle_index.npy", "description.txt")


def _mock_data_cache(args: list[str], cwd: Path) -> tuple[list[str], Callable[[], None]]:
    """args with --data-cache-path cwd/mock-data-cache when they run a Megatron-LM tree (run_on_cpu.py TREE ...),
    and what to call after a successful run.

    The run's cache directory gets a link to each complete set of index files in its release's pool
    (<shared>/mock-data-cache-<tag>, shared by the tree and its patched copy: the patch changes no dataset code).
    After the run, the files its rank 0 wrote are linked into the pool, each by an atomic rename and the description
    last, so a run that starts meanwhile links only whole sets. Megatron-LM writes nothing on a cache hit, so a
    linked file is only read (memory-mapped); a set that is not linked is built and written in the run's own
    directory (rank 0 first, the other ranks then load it)."""
    if len(args) < 2 or args[0] != str(WRAPPER):
        return args, lambda: None
    made = Path(args[1]).parent  # conftest._made_once's directory, <shared>/<tag> or <shared>/<tag>-patched
    pool = made.parent / f"mock-data-cache-{made.name.removesuffix('-patched')}"  # the patch leaves datasets alone
    pool.mkdir(exist_ok=True)
    mine = cwd / "mock-data-cache"
    mine.mkdir(exist_ok=True)
    stems = {f.name[: -len(MOCK_CACHE_AFFIXES[-1])] for f in pool.glob(f"*{MOCK_CACHE_AFFIXES[-1]}")}
    for stem in stems:
        for affix in MOCK_CACHE_AFFIXES:
            link = mine / f"{stem}{affix}"
            if not os.path.lexists(link):  # a second run in the same cwd keeps what it has
                link.symlink_to(pool / f"{stem}{affix}")

    def publish() -> None:
        written = [f for f in mine.iterdir() if not f.is_symlink()]
        for f in sorted(written, key=lambda f: f.name.endswith(MOCK_CACHE_AFFIXES[-1])):
            tmp = pool / f".{f.name}.{os.getpid()}"
            tmp.unlink(missing_ok=True)
            os.link(f, tmp)  # the same file system (the session's basetemp): no copy
            os.replace(tmp, pool / f.name)

    return [*args, "--data-cache-path", str(mine)], publish


def run_torchrun(args: list[str], cwd: Path, env: dict[str, str], nproc: int = 2) -> subprocess.CompletedProcess:
    """torchrun --standalone, `nproc` processes; each rank's output goes to cwd/torchrun-logs. A Megatron-LM run
    reads and adds to the session's --mock-data index cache (_mock_data_cache).

    On timeout torchrun gets SIGTERM first, so that it stops its workers (each in its own session)."""
    args, publish = _mock_data_cache(args, cwd)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "--log-dir",
        str(cwd / "torchrun-logs"),
        "--redirects",
        "3",
        *args,
    ]
    p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = p.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        p.terminate()
        try:
            p.communicate(timeout=30)
        finally:
            p.kill()
        raise AssertionError(
            f"torchrun ran past {RUN_TIMEOUT_S} s\n{rank_output(cwd, 0)}\n{rank_output(cwd, 1)}"
        ) from None
    if p.returncode == 0:
        publish()
    return subprocess.CompletedProcess(cmd, p.returncode, stdout, stderr)


def run_kareus_torchrun(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """`kareus torchrun --standalone --nproc-per-node 2 ARGS` (each rank's output to cwd/torchrun-logs)."""
    cmd = [
        sys.executable,
        "-m",
        "kareus_megatron.cli.main",
        "torchrun",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--log-dir",
        str(cwd / "torchrun-logs"),
        "--redirects",
        "3",
        *args,
    ]
    p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = p.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        p.terminate()  # torchrun stops its workers on SIGTERM
        out, err = p.communicate(timeout=30)
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def rank_output(cwd: Path, rank: int) -> str:
    """Rank `rank`'s stdout and stderr tails from torchrun's --log-dir (for failure messages)."""
    text = []
    for name in ("stdout.log", "stderr.log"):
        for f in sorted((cwd / "torchrun-logs").glob(f"*/attempt_*/{rank}/{name}")):
            text.append(f"--- rank {rank} {name}:\n{f.read_text(errors='replace')[-3000:]}")
    return "\n".join(text)


def run_ranks(args: list[str], cwd: Path, env: dict[str, str]) -> list[subprocess.CompletedProcess]:
    """Start rank 0 and rank 1 of `python args...` directly (no torchrun); their exit statuses and output."""
    from _dist import free_port

    port = free_port()
    envs = [
        dict(
            env,
            RANK=str(r),
            LOCAL_RANK=str(r),
            WORLD_SIZE="2",
            LOCAL_WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        for r in range(2)
    ]
    procs = [
        subprocess.Popen(
            [sys.executable, *args],
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            env=e,
        )
        for e in envs
    ]
    out = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=RUN_TIMEOUT_S)
            out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)  # the rank and what it started (its clock process)
    return out


def megatron_losses(cwd: Path) -> list[float]:
    """The "lm loss" of every iteration Megatron-LM logged (on its last rank) in a torchrun run under cwd."""
    found: list[float] = []
    for f in sorted((cwd / "torchrun-logs").glob("*/attempt_*/*/stdout.log")):
        found += [float(x) for x in re.findall(r"\| lm loss: ([-+0-9.eEnaNif]+) \|", f.read_text(errors="replace"))]
    return found

"""`kareus launch` and launch/: the exact torchrun / srun / sbatch commands printed by --dry-run, plan-point
selection, the shell wrappers, and one-line errors for bad input.

The expected command lines are the ones the former launch/kareus_launch.py printed for the same
invocations (checked side by side before it was removed): the move to `kareus launch` changed no command."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kareus_megatron.errors import ConfigError, InfeasibleConfigError, PlanError
from kareus_megatron.jobs.commands import JobSpec, megatron_args
from kareus_megatron.plan.frontier import frontier_document
from kareus_megatron.plan.io import load_plan, save_plan, write_json_atomic
from kareus_megatron.plan.points import parse_point, select_frontier_points
from kareus_megatron.plan.schema import Plan
from kareus_megatron.search.schedules import instruction_order

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = ROOT / "launch"
PY = sys.executable

# Kareus evaluation configuration #1 (docs/sources.md#kareus-evaluation; benchmarks/paper_configs.py tag "1"):
# Llama 3.2 3B, TP=8, PP=2 (15+13 layers), 8 microbatches of MBS 8, sequence 4096.
LLAMA_ARGS = (
    "--tensor-model-parallel-size 8 --context-parallel-size 1 --pipeline-model-parallel-size 2 "
    "--decoder-first-pipeline-num-layers 15 --decoder-last-pipeline-num-layers 13 "
    "--num-layers 28 --hidden-size 3072 --num-attention-heads 24 --ffn-hidden-size 8192 "
    "--group-query-attention --num-query-groups 8 --kv-channels 128 "
    "--swiglu --disable-bias-linear --normalization RMSNorm --position-embedding-type rope --bf16 "
    "--seq-length 4096 --max-position-embeddings 4096 --micro-batch-size 8 --global-batch-size 64 "
    "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1 "
    "--mock-data --tokenizer-type NullTokenizer --vocab-size 128255 --make-vocab-size-divisible-by 1 "
    "--train-iters 20 --lr 1.0e-5 --lr-decay-style constant --log-interval 1 --eval-iters 0 --eval-interval 21"
)

# The architecture records (plan ModelShape) of llama3.2-3b as `kareus plan` writes it, and of a GPT-2 style model.
LLAMA_ARCH = dict(
    activation="swiglu",
    normalization="rmsnorm",
    position_embedding="rope",
    kv_channels=128,
    bias_linear=False,
    qkv_bias=False,
    tied_embeddings=True,
    qk_norm=False,
    precision="bf16",
)
GPT_ARCH = dict(
    activation="gelu",
    normalization="layernorm",
    position_embedding="learned",
    bias_linear=True,
    qkv_bias=True,
    tied_embeddings=True,
    qk_norm=False,
    precision="fp32",
)


def make_plan(
    method: str,
    clock: int,
    *,
    framework: str = "megatron",
    nodes: int = 2,
    gpn: int = 8,
    pp: int = 2,
    m: int = 8,
    time_s: float = 10.0,
    energy_j: float = 1e5,
) -> Plan:
    """A valid plan of the reference configuration #1 (or a small DeepSpeed one)."""
    order = instruction_order("deepspeed-train" if framework == "deepspeed" else "1f1b", pp, m)
    tp = nodes * gpn // pp
    layers = (15, 13) if pp == 2 and tp == 8 else tuple([2] * pp)
    model = (
        dict(
            name="llama3.2-3b",
            num_layers=28,
            hidden_size=3072,
            num_attention_heads=24,
            num_query_groups=8,
            ffn_hidden_size=8192,
            vocab_size=128256,
            **LLAMA_ARCH,
        )
        if layers == (15, 13)
        else dict(
            name="tiny",
            num_layers=2 * pp,
            hidden_size=8,
            num_attention_heads=1,
            num_query_groups=1,
            ffn_hidden_size=8,
            vocab_size=16,
            **GPT_ARCH,
            kv_channels=8,
        )
    )
    return Plan.model_validate(
        {
            "format": "kareus-plan/1",
            "method": method,
            "framework": framework,
            "gpu": "a100-sxm4-40gb",
            "model": model,
            "parallel": dict(
                tp=tp,
                cp=1,
                pp=pp,
                vp=1,
                dp=1,
                micro_batch_size=8,
                seq_length=4096,
                num_microbatches=m,
                recompute="full",
                layers_per_stage=layers,
                nodes=nodes,
                gpus_per_node=gpn,
                schedule="deepspeed-train" if framework == "deepspeed" else "1f1b",
            ),
            "predicted": {"iteration_time_s": time_s, "iteration_energy_j": energy_j},
            "stages": [
                {
                    "pp_rank": r,
                    "instructions": [
                        {"kind": k, "microbatch": mb, "chunk": c, "sm_clock_mhz": clock} for k, mb, c in order[r]
                    ],
                }
                for r in range(pp)
            ],
        }
    )


# method -> [(time_s, energy_j, clock)]; perseus has two points so --point fastest/min-energy/all differ.
POINTS = {
    "megatron": [(10.0, 100e3, 1410)],
    "perseus": [(10.5, 80e3, 1200), (10.0, 95e3, 1410)],
    "nanobatch_perseus": [(9.6, 90e3, 1300)],
    "kareus": [(9.5, 75e3, 1215)],
}


def make_plan_dir(d: Path, framework: str = "megatron", **kw) -> Path:
    methods = {}
    for name, pts in POINTS.items():
        ordered = sorted(pts)
        entries = []
        for i, (t, e, clk) in enumerate(ordered):
            rel = f"plans/{name}-{i:02d}.json"
            save_plan(make_plan(name, clk, framework=framework, time_s=t, energy_j=e, **kw), d / rel)
            entries.append({"time_s": t, "energy_j": e, "plan": rel})
        methods[name] = entries
    write_json_atomic(d / "frontier.json", frontier_document({"model": "llama3.2-3b"}, methods))
    return d


def launch(*args: str, env: dict[str, str] | None = None, script: str | None = None) -> subprocess.CompletedProcess:
    """`kareus launch ARGS` (script None), or one of launch/'s shell scripts with ARGS."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_", "KAREUS_"))}
    cmd = (
        [PY, "-m", "kareus_megatron.cli.main", "launch", *args]
        if script is None
        else ["bash", str(LAUNCH / script), *args]
    )
    return subprocess.run(
        cmd, env={**base, "PYTHON": PY, **(env or {})}, capture_output=True, text=True, cwd=ROOT, timeout=60
    )


@pytest.fixture(scope="module")
def plan_dir(tmp_path_factory) -> Path:
    return make_plan_dir(tmp_path_factory.mktemp("plans"))


def torchrun(run: str, master: str = "node0", rdzv: str = "kareus") -> str:
    return (
        f"torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint {master}:29500 "
        f"--rdzv-id {rdzv}-{run}"
    )


def test_torchrun_dry_run_prints_the_exact_command(plan_dir):
    r = launch(
        "run",
        "--method",
        "kareus",
        "--plan-dir",
        str(plan_dir),
        "--master-addr",
        "node0",
        "--log-dir",
        "runs",
        "--dry-run",
        "--",
        "--data-path",
        "/data/x",
    )
    assert r.returncode == 0, r.stderr
    want = (
        f"+ CUDA_DEVICE_MAX_CONNECTIONS=1 {torchrun('kareus-00')} {LAUNCH}/pretrain_gpt.py {LLAMA_ARGS} "
        f"--kareus-plan {plan_dir}/plans/kareus-00.json --kareus-log runs/kareus-00/measurement "
        "--data-path /data/x\n"
    )
    assert r.stdout == want
    assert not (ROOT / "runs").exists()  # dry run: nothing written


def test_megatron_baseline_tolerates_missing_clock_permission(plan_dir):
    r = launch(
        "run",
        "--method",
        "megatron",
        "--plan-dir",
        str(plan_dir),
        "--master-addr",
        "node0",
        "--log-dir",
        "/logs",
        "--dry-run",
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout == (
        f"+ CUDA_DEVICE_MAX_CONNECTIONS=1 {torchrun('megatron-00')} "
        f"{LAUNCH}/pretrain_gpt.py {LLAMA_ARGS} "
        f"--kareus-plan {plan_dir}/plans/megatron-00.json --kareus-on-error warn "
        "--kareus-log /logs/megatron-00/measurement\n"
    )


@pytest.mark.parametrize("point, want", [("fastest", [0]), ("min-energy", [1]), ("all", [0, 1]), ("1", [1])])
def test_point_selection(plan_dir, point, want):
    r = launch("run", "--method", "perseus", "--plan-dir", str(plan_dir), "--point", point, "--dry-run")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert [f"--kareus-plan {plan_dir}/plans/perseus-{i:02d}.json" in line for line, i in zip(lines, want)] == [
        True
    ] * len(want)
    assert len(lines) == len(want)


def test_slurm_inside_an_allocation_runs_srun_torchrun(plan_dir):
    env = {"SLURM_JOB_ID": "4242", "MASTER_ADDR": "gpu-a01"}
    r = launch(
        "run",
        "--launcher",
        "slurm",
        "--method",
        "perseus",
        "--plan-dir",
        str(plan_dir),
        "--container-image",
        "kareus-megatron.sqsh",
        "--dry-run",
        env=env,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout == (
        "+ CUDA_DEVICE_MAX_CONNECTIONS=1 srun --nodes 2 --ntasks-per-node 1 --gpus-per-node 8 --kill-on-bad-exit=1 "
        f"--container-image kareus-megatron.sqsh --container-mounts {ROOT}:{ROOT} --container-workdir {ROOT} "
        f"{torchrun('perseus-00', 'gpu-a01', '4242')} /opt/kareus/src/launch/pretrain_gpt.py {LLAMA_ARGS} "
        f"--kareus-plan {plan_dir}/plans/perseus-00.json "
        "--kareus-log runs/perseus-00/measurement\n"
    )


def test_slurm_outside_an_allocation_submits_itself_with_sbatch(plan_dir):
    args = ["run", "--launcher", "slurm", "--method", "kareus", "--plan-dir", str(plan_dir), "--dry-run"]
    r = launch(*args[3:], script="slurm.sh")  # the wrapper adds `run --launcher slurm`
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    passthrough = shlex.join([a for a in args if a != "--dry-run"])
    assert lines[0] == f"+ sbatch --nodes 2 --gpus-per-node 8 --job-name kareus-run {LAUNCH}/slurm.sbatch {passthrough}"
    assert lines[1] == "# inside the allocation, it runs:"
    assert lines[2].startswith(
        "+ CUDA_DEVICE_MAX_CONNECTIONS=1 srun --nodes 2 --ntasks-per-node 1 --gpus-per-node 8 "
        "--kill-on-bad-exit=1 torchrun"
    )


def test_sbatch_script_reenters_the_launcher_with_srun(plan_dir, tmp_path):
    """slurm.sbatch as Slurm runs it: MASTER_ADDR from the node list (scontrol stubbed on PATH)."""
    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "scontrol").write_text("#!/bin/sh\nprintf 'gpu-b07\\ngpu-b08\\n'\n")
    (stub / "scontrol").chmod(0o755)
    env = {
        "SLURM_JOB_ID": "77",
        "SLURM_JOB_NODELIST": "gpu-b[07-08]",
        "SLURM_SUBMIT_DIR": str(ROOT),
        "PATH": f"{stub}:{os.environ['PATH']}",
    }
    r = launch(
        "run",
        "--launcher",
        "slurm",
        "--method",
        "kareus",
        "--plan-dir",
        str(plan_dir),
        "--dry-run",
        env=env,
        script="slurm.sbatch",
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(
        "+ CUDA_DEVICE_MAX_CONNECTIONS=1 "
        f"srun --nodes 2 --ntasks-per-node 1 --gpus-per-node 8 --kill-on-bad-exit=1 "
        f"{torchrun('kareus-00', 'gpu-b07', '77')} "
    )


def test_torchrun_wrapper_matches_the_python_entry_point(plan_dir):
    args = ["--method", "nanobatch_perseus", "--plan-dir", str(plan_dir), "--dry-run"]
    a = launch(*args, script="torchrun.sh")
    b = launch("run", "--launcher", "torchrun", *args)
    assert a.returncode == b.returncode == 0 and a.stdout == b.stdout
    assert "--rdzv-endpoint localhost:29500" in a.stdout


def test_wrappers_run_the_kareus_console_script_when_no_python_is_named(plan_dir, tmp_path):
    """Without $PYTHON the wrappers exec `kareus launch` from PATH (a stub here records its arguments)."""
    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "kareus").write_text('#!/bin/sh\necho "kareus $*"\n')
    (stub / "kareus").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "PYTHON"}
    r = subprocess.run(
        ["bash", str(LAUNCH / "run_comparison.sh"), "--plan-dir", "P", "--dry-run"],
        env={**env, "PATH": f"{stub}:{env['PATH']}"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 0 and r.stdout == "kareus launch comparison --plan-dir P --dry-run\n", r.stderr


@pytest.mark.parametrize(
    "point, method, want",
    [
        ("perseus-01", None, "perseus-01"),
        ("perseus-min-energy", None, "perseus-01"),
        ("kareus-all", None, "kareus-00"),
        ("00", "perseus", "perseus-00"),
        (None, None, "kareus-00"),
    ],
)
def test_the_point_may_name_the_method(plan_dir, point, method, want):
    r = launch(
        "run",
        "--plan-dir",
        str(plan_dir),
        "--dry-run",
        *(["--point", point] if point else []),
        *(["--method", method] if method else []),
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("\n") == 1 and f"--kareus-plan {plan_dir}/plans/{want}.json" in r.stdout


def test_a_point_naming_another_method_than_method_is_refused(plan_dir):
    r = launch("run", "--plan-dir", str(plan_dir), "--method", "kareus", "--point", "perseus-01", "--dry-run")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "--point perseus-01 names method perseus but method kareus was asked for" in r.stderr


def test_a_real_run_needs_launch_pretrain_gpt(plan_dir, tmp_path):
    r = launch(
        "run",
        "--method",
        "kareus",
        "--plan-dir",
        str(plan_dir),
        "--log-dir",
        str(tmp_path / "L"),
        env={"KAREUS_LAUNCH_DIR": str(tmp_path / "nowhere")},
    )
    assert r.returncode == 2 and "nowhere/pretrain_gpt.py does not exist; set KAREUS_LAUNCH_DIR" in r.stderr
    assert r.stdout == "" and not (tmp_path / "L").exists()


def test_comparison_dry_run_lists_every_point_then_compare(plan_dir):
    r = launch("comparison", "--plan-dir", str(plan_dir), "--log-dir", "L", "--master-addr", "h", "--dry-run")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    runs = [line.split("--kareus-log ")[1].split()[0] for line in lines[:-1]]
    assert runs == [
        f"L/{n}/measurement" for n in ("megatron-00", "perseus-00", "perseus-01", "nanobatch_perseus-00", "kareus-00")
    ]
    assert lines[-1] == "+ kareus compare L --skip-iterations 2"


def test_comparison_without_a_frontier_plans_first(tmp_path):
    r = launch(
        "--plan-dir",
        str(tmp_path / "new"),
        "--plan-arg=--model",
        "--plan-arg=qwen3-1.7b",
        "--dry-run",
        script="run_comparison.sh",
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == f"+ kareus plan --out {tmp_path}/new --model qwen3-1.7b"


def test_deepspeed_plans_need_a_script_and_get_the_plan_through_the_environment(tmp_path):
    d = make_plan_dir(tmp_path / "ds", framework="deepspeed", nodes=1, gpn=2, m=4)
    r = launch("run", "--method", "kareus", "--plan-dir", str(d), "--nodes", "1", "--gpus-per-node", "2", "--dry-run")
    assert r.returncode == 2 and "needs --script" in r.stderr and len(r.stderr.splitlines()) == 1
    r = launch(
        "run",
        "--method",
        "kareus",
        "--plan-dir",
        str(d),
        "--nodes",
        "1",
        "--gpus-per-node",
        "2",
        "--script",
        "train_ds.py",
        "--dry-run",
        "--",
        "--deepspeed_config",
        "ds.json",
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout == (
        f"+ KAREUS_LOG=runs/kareus-00/measurement KAREUS_PLAN={d}/plans/kareus-00.json "
        "torchrun --nnodes 1 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint localhost:29500 "
        "--rdzv-id kareus-kareus-00 train_ds.py --deepspeed_config ds.json\n"
    )
    r = launch(
        "run",
        "--method",
        "megatron",
        "--plan-dir",
        str(d),
        "--nodes",
        "1",
        "--gpus-per-node",
        "2",
        "--script",
        "train_ds.py",
        "--dry-run",
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("+ KAREUS_LOG=runs/megatron-00/measurement torchrun ")  # measured, no plan


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--nodes", "4"], "pass --nodes 2 --gpus-per-node 8"),
        (["--point", "7"], "has points 00..00"),
        (["--point", "fast"], "--point 'fast' is not valid"),
    ],
)
def test_bad_input_is_one_line_exit_2(plan_dir, args, fragment):
    r = launch("run", "--method", "kareus", "--plan-dir", str(plan_dir), "--dry-run", *args)
    assert r.returncode == 2 and fragment in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_the_job_shape_comes_from_the_plan_unless_given(tmp_path):
    d = make_plan_dir(tmp_path / "small", nodes=1, gpn=2, m=4)
    r = launch("run", "--method", "kareus", "--plan-dir", str(d), "--dry-run")
    assert r.returncode == 0 and " torchrun --nnodes 1 --nproc-per-node 2 " in r.stdout, r.stderr
    r = launch("run", "--method", "kareus", "--plan-dir", str(d), "--launcher", "slurm", "--dry-run")
    assert r.returncode == 0 and r.stdout.startswith("+ sbatch --nodes 1 --gpus-per-node 2 "), r.stderr
    r = launch("run", "--method", "kareus", "--plan-dir", str(d), "--nodes", "2", "--dry-run")  # told otherwise
    assert r.returncode == 2 and "pass --nodes 1 --gpus-per-node 2" in r.stderr and len(r.stderr.splitlines()) == 1
    r = launch("comparison", "--plan-dir", str(tmp_path / "none"), "--launcher", "slurm", "--dry-run")
    assert r.returncode == 2 and "has no plans yet" in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr


def test_a_kareus_error_on_a_rank_ends_the_launch_with_that_line_last(tmp_path):
    """A real torchrun of 2 CPU ranks (the generic launcher refuses a missing script on each rank): kareus launch
    ends with the ranks' first kareus error as its one last line, exit status 2, not torchrun's report."""
    from _dist import free_port

    d = make_plan_dir(tmp_path / "small", nodes=1, gpn=2, m=4)
    path = f"{Path(PY).parent}{os.pathsep}{os.environ.get('PATH', '')}"  # torchrun of this interpreter
    r = launch(
        "run",
        "--method",
        "kareus",
        "--plan-dir",
        str(d),
        "--script",
        str(tmp_path / "no_such_train.py"),
        "--master-port",
        str(free_port()),
        "--log-dir",
        str(tmp_path / "runs"),
        env={"PATH": path, "KAREUS_GPU_BACKEND": "simulated", "PYTHONPATH": str(ROOT)},
    )
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 2, r.stderr[-3000:]
    assert last.startswith("kareus launch: error: rank ") and "stopped the job (exit status 1)" in last
    assert f"training script {tmp_path}/no_such_train.py does not exist" in last, last


def test_missing_or_foreign_plan_dir(tmp_path):
    with pytest.raises(PlanError, match="does not exist"):
        select_frontier_points(tmp_path, "fastest", method="kareus")
    (tmp_path / "frontier.json").write_text('{"format": "kareus-frontier/0", "methods": {}}')
    with pytest.raises(PlanError, match="kareus-frontier/0"):
        select_frontier_points(tmp_path, "fastest", method="kareus")
    with pytest.raises(ConfigError, match="unknown method"):
        select_frontier_points(tmp_path, "fastest", method="zeus")


def test_megatron_args_reject_layouts_megatron_cannot_express(plan_dir):
    plan = load_plan(plan_dir / "plans" / "kareus-00.json")
    assert " ".join(megatron_args(plan, train_iters=20)) == LLAMA_ARGS
    data = plan.model_dump()
    data["parallel"].update(pp=4, tp=4, layers_per_stage=(7, 8, 6, 7))
    data["stages"] = [dict(pp_rank=r, instructions=data["stages"][0]["instructions"]) for r in range(4)]
    with pytest.raises(InfeasibleConfigError, match="only the first and last"):
        megatron_args(Plan.model_validate(data), train_iters=20)
    with pytest.raises(ConfigError, match="nodes"):
        JobSpec(nodes=0)


def test_earlier_logs_are_not_appended_to(plan_dir, tmp_path):
    old = tmp_path / "L" / "kareus-00" / "measurement" / "rank-00000.jsonl"  # a run's log directory
    old.parent.mkdir(parents=True)
    old.write_text('{"kind": "header"}\n')
    r = launch("run", "--method", "kareus", "--plan-dir", str(plan_dir), "--log-dir", str(tmp_path / "L"))
    assert r.returncode == 2 and "exists (1 earlier log(s)" in r.stderr and "--overwrite" in r.stderr
    assert r.stdout == "" and old.read_text() == '{"kind": "header"}\n'  # nothing started, nothing touched


def test_only_node_rank_0_plans(tmp_path):
    r = launch("comparison", "--plan-dir", str(tmp_path / "none"), "--node-rank", "1", "--dry-run")
    assert r.returncode == 2 and "plan on node rank 0 first" in r.stderr


@settings(max_examples=200, deadline=None)
@given(text=st.one_of(st.text(max_size=6), st.sampled_from(["kareus-all", "perseus-03", "x-01", "-00", "all"])))
def test_point_parser_accepts_or_names_the_value(text):
    try:
        p = parse_point(text, allow_all=True, flag="--point")
    except ConfigError as e:
        assert repr(text) in str(e) and str(e).startswith("--point")
        return
    assert p.which in ("fastest", "min-energy", "all") or (
        isinstance(p.which, int) and p.which == int(text.rsplit("-", 1)[-1])
    )

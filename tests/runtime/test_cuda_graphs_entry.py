"""CUDA graphs refused through real runs: the generic launcher running a megatron-core training script whose
model config has a CUDA-graph setting (2 processes, the real 1F1B schedule, simulated GPUs) exits 2 on every
rank with one line naming it, before any instruction; the overlap engine's model check refuses a model of
partitioned layers built with such a config (1 gloo process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import plans
from _dist import MEGATRON_CORE, free_port, read_ranks, spawn

from kareus_megatron.plan.io import save_plan

HERE = Path(__file__).resolve().parent

# tiny_gpt's model (built with graphs off: megatron-core's CUDA graph manager needs CUDA to be built), then
# given the CUDA-graph fields of a TransformerConfig made with the flag, as a GPU run's model config has them
STANDIN = textwrap.dedent(
    """
    import os, sys, warnings
    import tiny_gpt
    from megatron.core.transformer import TransformerConfig
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    tiny_gpt.setup(rank, world, int(os.environ["MASTER_PORT"]))
    tiny_gpt.init_parallel(2, None)
    chunks = tiny_gpt.build_chunks(2, None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flagged = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, cuda_graph_impl="local")
    for f in ("cuda_graph_impl", "cuda_graph_scope", "enable_cuda_graph", "external_cuda_graph"):
        setattr(chunks[0].config, f, getattr(flagged, f))
    tiny_gpt.train(chunks, 4, 2)
    open(os.path.join(sys.argv[1], f"trained{rank}"), "w").close()  # never reached
    """
)


def test_generic_launcher_refuses_a_model_under_cuda_graphs(tmp_path):
    save_plan(plans.tiny_plan(pp=2, vp=1, m=4), tmp_path / "plan.json")
    (tmp_path / "train.py").write_text(STANDIN)
    port, procs = free_port(), []
    for rank in range(2):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE="2",
            LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            KAREUS_GPU_BACKEND="simulated",
            KAREUS_SIMULATED_LATENCY_MS="0",
            KAREUS_SIMULATED_LOG=str(tmp_path / "clocks.jsonl"),
            PYTHONWARNINGS="ignore",
            PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")]),
        )
        env.pop("KAREUS_GPU", None)
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "kareus_megatron.launch",
                    "--kareus-plan",
                    "plan.json",
                    "--kareus-log",
                    "run",
                    "--",
                    "train.py",
                    str(tmp_path),
                ],
                env=env,
                cwd=tmp_path,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    for p in procs:
        _, err = p.communicate(timeout=240)
        lines = err.strip().splitlines()
        assert p.returncode == 2 and "Traceback" not in err, err[-3000:]
        assert len(lines) == 1 and "CUDA graphs are on" in lines[0] and "--cuda-graph-impl local" in lines[0], err
    assert not list(tmp_path.glob("trained*"))
    clocks = [json.loads(x) for x in (tmp_path / "clocks.jsonl").read_text().splitlines()]
    assert not [c for c in clocks if c["event"] in ("set", "skip")]  # refused before the first instruction


def model_check_worker(rank: int, world: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

    from kareus_megatron.errors import PlanMismatchError
    from kareus_megatron.runtime.frameworks import cpu_shim
    from kareus_megatron.runtime.overlap import check_model_for_plan, get_partitioned_gpt_layer_spec

    cpu_shim.apply()
    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    cfg = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    model = GPTModel(
        config=cfg, transformer_layer_spec=get_partitioned_gpt_layer_spec(), vocab_size=128, max_sequence_length=16
    )
    plan = SimpleNamespace(cross_layer=False, stages=[SimpleNamespace(instructions=[SimpleNamespace(nanobatches=2)])])
    res = {"layers_without_graphs": check_model_for_plan(model, plan)}
    cfg.cuda_graph_impl = "transformer_engine"  # as TransformerConfig(external_cuda_graph=True) leaves it
    try:
        check_model_for_plan([model], plan)
        res["refused"] = None
    except PlanMismatchError as e:
        res["refused"] = str(e)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


def test_overlap_model_check_refuses_partitioned_layers_under_cuda_graphs(tmp_path):
    spawn(model_check_worker, 1, str(tmp_path), preload=MEGATRON_CORE)
    (res,) = read_ranks(tmp_path, "rank{rank}.json", 1)
    assert res["layers_without_graphs"] == 2
    assert res["refused"] and "--cuda-graph-impl transformer_engine" in res["refused"]
    assert "\n" not in res["refused"]

"""Worker for the DeepSpeed CPU tests: a 2-stage PipelineModule on gloo, several scenarios per spawn.

Each scenario builds a fresh engine from the same seed and data, trains STEPS steps, runs one
eval_batch, and records losses, instruction events and errors to OUT/r{rank}.json. Scenarios:
``reference`` (no kareus), ``measure`` (kareus without a plan: measurement only), ``plan`` (a plan
file; thread or process clock controller), ``mismatch`` (a plan expected to be rejected); with
``"dualpipev": true`` the engine is DeepSpeed 0.19's DualPipeVEngine (a DualPipeVModule), which the
patch refuses before step 1.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

STEPS = 3
MICRO_BATCHES = 4
MBS = 2
HIDDEN = 8


def _data(n: int):
    import torch

    g = torch.Generator().manual_seed(1234)
    return [(torch.randn(MBS, HIDDEN, generator=g), torch.randn(MBS, HIDDEN, generator=g)) for _ in range(n)]


def _engine(dualpipev: bool = False):
    import deepspeed
    import torch
    from deepspeed.pipe import LayerSpec, PipelineModule

    torch.manual_seed(0)
    layers = [
        LayerSpec(torch.nn.Linear, HIDDEN, HIDDEN),
        LayerSpec(torch.nn.Tanh),
        LayerSpec(torch.nn.Linear, HIDDEN, HIDDEN),
        LayerSpec(torch.nn.Tanh),
    ]
    if dualpipev:  # DeepSpeed 0.19: 2 stages per rank; deepspeed.initialize then builds a DualPipeVEngine
        from deepspeed.pipe import DualPipeVModule as module_class
    else:
        module_class = PipelineModule
    module = module_class(layers=layers, num_stages=2, loss_fn=torch.nn.MSELoss(), partition_method="uniform")
    config = {
        "train_micro_batch_size_per_gpu": MBS,
        "gradient_accumulation_steps": MICRO_BATCHES,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "steps_per_print": 10**6,
        "wall_clock_breakdown": False,
    }
    engine, *_ = deepspeed.initialize(model=module, model_parameters=[p for p in module.parameters()], config=config)
    return engine


def run_scenario(rank: int, outdir: str, sc: dict) -> dict:
    import kareus_megatron.deepspeed as kds
    from kareus_megatron.errors import KareusError
    from kareus_megatron.runtime import hooks

    events: list[list] = []

    def listen(ev: hooks.InstructionEvent) -> None:
        events.append(
            [ev.iteration, ev.index, ev.instruction.kind, ev.instruction.microbatch, ev.instruction.sm_clock_mhz]
        )

    os.environ["KAREUS_SIMULATED_LOG"] = os.path.join(outdir, f"{sc['name']}-clock-r{rank}.jsonl")
    engine = _engine(sc.get("dualpipev", False))
    out_engine = type(engine).__name__
    data = _data(STEPS * MICRO_BATCHES)
    out: dict = {"losses": [], "error": None, "events": events, "engine": out_engine}
    hooks.add_instruction_listener(listen)
    try:
        if sc["mode"] != "reference":
            kds.install(sc.get("plan"), log_path=sc.get("log"), controller=sc.get("controller", "thread"))
        it = iter(data)
        for _ in range(STEPS):
            out["losses"].append(float(engine.train_batch(it)))
        out["eval_loss"] = float(engine.eval_batch(iter(data[:MICRO_BATCHES])))
        out["events_after_train"] = len(events)
    except KareusError as e:
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        hooks.remove_instruction_listener(listen)
        kds.uninstall()
    return out


def worker(rank: int, world: int, port: int, outdir: str, scenarios: list[dict]) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        KAREUS_GPU_BACKEND="simulated",
        KAREUS_SIMULATED_LATENCY_MS="1",
        DS_ACCELERATOR="cpu",
    )
    for k in ("KAREUS_GPU", "KAREUS_CLOCK_LOG", "KAREUS_SIMULATED_NO_PERMISSION", "KAREUS_PLAN", "KAREUS_LOG"):
        os.environ.pop(k, None)  # a developer's shell must not change the scenarios
    result: dict = {}
    try:
        import torch

        torch.set_num_threads(1)
        import deepspeed

        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # skip the ~55 s JIT build
        deepspeed.init_distributed(dist_backend="gloo")
        for sc in scenarios:
            result[sc["name"]] = run_scenario(rank, outdir, sc)
    except BaseException:
        result["crash"] = traceback.format_exc()
    with open(os.path.join(outdir, f"r{rank}.json"), "w") as f:
        json.dump(result, f)

"""Spawned 2-process worker for the megatron patch tests: several scenarios per process start.

Each rank writes ``rank{r}.json`` into the output folder; the test asserts on those files and on the
simulated backend's clock logs (one per scenario).
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

ITERATIONS = 2
M = 4


def _train_pair(pp: int, vp: int | None, plan: Any, log_dir: str, tag: str) -> dict[str, Any]:
    """Train without, then with, the patch from the same seed; compare bit for bit."""
    import tiny_gpt

    import kareus_megatron.megatron as kareus
    from kareus_megatron.runtime import hooks

    tiny_gpt.init_parallel(pp, vp)
    losses_a, grads_a = tiny_gpt.train(tiny_gpt.build_chunks(pp, vp), M, ITERATIONS)

    os.environ["KAREUS_SIMULATED_LOG"] = os.path.join(log_dir, f"{tag}.clocks.jsonl")
    events: list[list[Any]] = []

    def listener(ev: hooks.InstructionEvent) -> None:
        i = ev.instruction
        events.append([ev.iteration, ev.index, ev.pp_rank, i.kind, i.chunk, i.microbatch, i.sm_clock_mhz])

    hooks.add_instruction_listener(listener)
    session = kareus.install(plan, log_path=os.path.join(log_dir, f"{tag}.run.jsonl"))
    try:
        tiny_gpt.init_parallel(pp, vp)
        losses_b, grads_b = tiny_gpt.train(tiny_gpt.build_chunks(pp, vp), M, ITERATIONS, forward_only_every=1)
    finally:
        kareus.uninstall()
        hooks.remove_instruction_listener(listener)
    return {
        "losses_equal": losses_a == losses_b or all(a != a and b != b for a, b in zip(losses_a, losses_b)),
        "losses": [losses_a, losses_b],
        "grads_equal": sorted(grads_a) == sorted(grads_b) and all(torch.equal(grads_a[k], grads_b[k]) for k in grads_a),
        "n_grads": len(grads_a),
        "events": events,
        "order_deviations": session.patch.order_deviations if session.patch else None,
        "counts": session.client.counts if session.client else None,
    }


def _rejected(pp: int, vp: int | None, plan: Any, log_dir: str) -> dict[str, Any]:
    """Install a plan that does not fit; the first training call must fail before any forward step."""
    import tiny_gpt

    import kareus_megatron.megatron as kareus
    from kareus_megatron.errors import PlanMismatchError

    os.environ["KAREUS_SIMULATED_LOG"] = os.path.join(log_dir, "rejected.clocks.jsonl")
    tiny_gpt.init_parallel(pp, vp)
    chunks = tiny_gpt.build_chunks(pp, vp)
    kareus.install(plan, controller="thread")
    before = tiny_gpt.FORWARD_CALLS[0]
    try:
        tiny_gpt.train(chunks, M, 1)
        return {"raised": None}
    except PlanMismatchError as e:
        return {"raised": str(e), "forward_calls": tiny_gpt.FORWARD_CALLS[0] - before}
    finally:
        kareus.uninstall()


def _live_model(pp: int, vp: int | None) -> dict[str, Any]:
    """What the patch reads of the tiny GPT's model (LiveRun.model) from a schedule call's arguments."""
    import tiny_gpt

    from kareus_megatron.runtime.frameworks.megatron_patch import live_run_from_call

    tiny_gpt.init_parallel(pp, vp)
    return live_run_from_call({"model": tiny_gpt.build_chunks(pp, vp)[0], "num_microbatches": M}).model


def worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """Entry point for torch.multiprocessing.spawn."""
    import plans
    import tiny_gpt

    tiny_gpt.setup(rank, world, port)
    result: dict[str, Any] = {}
    result["1f1b"] = _train_pair(2, None, plans.tiny_plan(pp=2, vp=1, m=M), out_dir, "1f1b")
    result["vp"] = _train_pair(2, 2, plans.tiny_plan(pp=2, vp=2, m=M, seed=5), out_dir, "vp")
    result["wrong_m"] = _rejected(2, None, plans.tiny_plan(pp=2, vp=1, m=M + 4), out_dir)
    result["wrong_pp_and_m"] = _rejected(2, None, plans.tiny_plan(pp=4, vp=1, m=M + 1), out_dir)
    result["live_model"] = _live_model(2, None)
    llama_like = dict(
        activation="swiglu",
        normalization="rmsnorm",
        position_embedding="rope",
        precision="bf16",
        bias_linear=False,
        qkv_bias=False,
        tied_embeddings=True,
    )
    plan = plans.tiny_plan(pp=2, vp=1, m=M)
    result["wrong_arch"] = _rejected(
        2, None, plan.model_copy(update={"model": plan.model.model_copy(update=llama_like)}), out_dir
    )
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()

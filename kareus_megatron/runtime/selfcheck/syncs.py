"""Host-sync probe: the partitioned layer's forward and backward, and context parallelism's K/V reordering, counted.

``probe_partitioned_layer(device)`` runs, on one device in this process, a megatron-core ``TransformerBlock``
of 2 partitioned layers (``get_partitioned_gpt_layer_spec()``: SDPA core attention, TP=1) through one
forward and one backward per case, each under a plan instruction handed to the overlap engine through the
hooks listener (the per-instruction path a run takes): 1 and 2 nanobatches (2: every partition at its last
launch slot), every attention mask megatron gives a GPT layer (``none``; ``1x1``: ``[1, 1, s, s]``;
``bx1``: ``[b, 1, s, s]``, GPTDataset's default), full recompute off and on; then CP's attention
(``cp_attention.cp_attend``, CP=2 as rank 0 and 1, gathered K/V given, its reordering index cache cleared
first, so building the index is counted too), forward and backward. A case's ``syncs`` are the host
synchronisations counted during it: on ``cuda``, CUDA's sync debug mode (``torch.cuda.set_sync_debug_mode
("warn")``: each synchronising call warns) plus explicit ``torch.cuda.synchronize`` calls
(``sync_count.CudaSyncCounter``), with the operation count of ``sync_count.SyncCount`` beside it as
``sync_ops``; on ``cpu``, where nothing waits, the operation count (the operations that would sync on a
GPU). Every case must report 0.

Needs no process group beyond one process: it uses megatron's parallel state when it is initialised with
TP=CP=PP=1 (else it refuses: ConfigError), or makes a single-rank one (gloo on CPU, NCCL on CUDA, through a
file store in a temporary directory) and tears down what it made. Sizes are tiny (hidden 64, 4 heads,
sequence 64, micro-batch 4; bf16 on CUDA, fp32 on CPU): seconds on a GPU after the first kernels load.
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import torch

from kareus_megatron.errors import ConfigError
from kareus_megatron.runtime.selfcheck.sync_count import CudaSyncCounter, SyncCount

MASKS = ("none", "1x1", "bx1")  # megatron's GPT attention masks: None, [1, 1, s, s], [b, 1, s, s]
HIDDEN, HEADS, SEQ, MBS, LAYERS = 64, 4, 64, 4, 2


def causal_mask(kind: str, b: int, s: int, device: Any) -> torch.Tensor | None:
    """Megatron's causal attention mask (True = masked out) of `kind` (one of MASKS) for sequence `s`."""
    if kind == "none":
        return None
    m = torch.ones(s, s, dtype=torch.bool, device=device).triu_(1)
    return m.expand(b if kind == "bx1" else 1, 1, s, s).contiguous()


def instructions(nanobatches: int, slots: dict[str, tuple[str, ...]]) -> tuple[Any, Any]:
    """A forward and a backward plan instruction at `nanobatches`; with 2, each partition of `slots` (name ->
    its launch slots) at its last slot (the default is the first)."""
    from kareus_megatron.plan.schema import Instruction, PartitionKnobs

    knobs = (
        {name: PartitionKnobs(comm_sms=8, launch_slot=s[-1]) for name, s in slots.items()} if nanobatches > 1 else {}
    )
    fwd, bwd = (
        Instruction(kind=kind, microbatch=0, sm_clock_mhz=1410, nanobatches=nanobatches, partitions=knobs)
        for kind in ("forward", "backward")
    )
    return fwd, bwd


def partitioned_block(config: Any, device: Any, **spec_kwargs: Any) -> Any:
    """A megatron-core TransformerBlock of partitioned layers (``get_partitioned_gpt_layer_spec``) on `device`,
    without its final norm (the layers only)."""
    from megatron.core.transformer.transformer_block import TransformerBlock

    from kareus_megatron.runtime.overlap import get_partitioned_gpt_layer_spec

    torch.manual_seed(1234)
    block = TransformerBlock(config, get_partitioned_gpt_layer_spec(**spec_kwargs), post_layer_norm=False)
    return block.to(device=device, dtype=config.params_dtype)


def block_syncs(
    block: Any,
    x: torch.Tensor,
    mask: torch.Tensor | None,
    instrs: tuple[Any, Any],
    rotary_pos_emb: Any = None,
    cross_layer: bool = False,
    cuda: bool = False,
) -> dict[str, Any]:
    """Host syncs of one forward and one backward of `block` on input `x` (requires grad), each after its
    instruction of `instrs` went through the hooks listener (the overlap engine's settings switch); with
    `cross_layer`, also ``linked`` (layers marked) and ``carried`` (collectives a layer issued for another)."""
    from kareus_megatron.runtime import hooks
    from kareus_megatron.runtime.overlap import setup_overlap
    from kareus_megatron.runtime.overlap.layer import link_layers

    engine = setup_overlap(trace=cross_layer)
    engine.state.cross_layer = cross_layer
    engine.install_listener()
    linked = link_layers(block, enabled=cross_layer)
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(5)).to(x.device, x.dtype)
    events = [hooks.InstructionEvent(0, k, 0, ins) for k, ins in enumerate(instrs)]
    x = x.detach().requires_grad_()
    try:
        with _counters(cuda) as counters:
            hooks.notify_instruction(events[0])
            out = block(x, mask, rotary_pos_emb=rotary_pos_emb)
            hooks.notify_instruction(events[1])
            out.backward(grad)
    finally:
        engine.uninstall_listener()
        link_layers(block, enabled=False)
        from kareus_megatron.runtime.overlap import set_engine

        set_engine(None)
    res = _result(counters, cuda)
    if cross_layer:
        res["linked"] = linked
        res["carried"] = sum(
            1 for e in engine.tracer.events if e["kind"] == "issue" and not str(e["coll"]).startswith(f"L{e['layer']}.")
        )
    return res


def cp_attend_syncs(device: Any, dtype: torch.dtype, cuda: bool = False, cp: int = 2) -> list[dict[str, Any]]:
    """Host syncs of CP attention (``cp_attend``, forward and backward) as each of `cp` ranks, the first with an
    empty index cache; with megatron's CP-sliced ``[b, 1, sq, s]`` mask and without."""
    import torch.nn.functional as F

    from kareus_megatron.runtime.overlap import cp_attention

    def attend(q: Any, k: Any, v: Any, mask: Any, is_causal: bool, dropout_p: float) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, dropout_p=dropout_p)

    g = torch.Generator().manual_seed(3)
    b, heads, sq, hn = MBS, HEADS, SEQ // cp, HIDDEN // HEADS
    q, k, v = (
        torch.randn(shape, generator=g).to(device, dtype)
        for shape in ((b, heads, sq, hn), (b, heads, cp * sq, hn), (b, heads, cp * sq, hn))
    )
    out: list[dict[str, Any]] = []
    cp_attention.sequence_index.cache_clear()  # the index is built inside the first counted case
    for rank in range(cp):
        for kind in ("none", "bx1"):
            full = causal_mask(kind, b, cp * sq, device)
            rows = [r for c in cp_attention.local_chunks(cp, rank) for r in range(c * sq // 2, (c + 1) * sq // 2)]
            mask = None if full is None else full[:, :, rows].contiguous()
            qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
            with _counters(cuda) as counters:
                ctx = cp_attention.cp_attend(attend, qq, kk, vv, mask, cp, rank, 0.0)
                ctx.backward(torch.ones_like(ctx))
            out.append({"case": f"cp_attend.cp{cp}.rank{rank}.mask_{kind}", **_result(counters, cuda)})
    return out


@contextlib.contextmanager
def _counters(cuda: bool) -> Iterator[tuple[SyncCount, CudaSyncCounter | None]]:
    """The operation count, and on CUDA also the sync debug mode's."""
    with SyncCount(device="cuda" if cuda else "cpu") as ops:
        if not cuda:
            yield ops, None
            return
        with CudaSyncCounter() as detected:
            yield ops, detected
        with ops.paused():
            torch.cuda.synchronize()  # after the count: the case's kernels are done before the next one


def _result(counters: tuple[SyncCount, CudaSyncCounter | None], cuda: bool) -> dict[str, Any]:
    ops, detected = counters
    if detected is None:
        return {"syncs": ops.total, "ok": ops.total == 0, **({"sites": ops.report()["sites"]} if ops.total else {})}
    res: dict[str, Any] = {"syncs": detected.total, "sync_ops": ops.total, "ok": detected.total == 0 and ops.total == 0}
    if not res["ok"]:
        res["sites"] = detected.messages[:10] + ops.report()["sites"]
    return res


@contextlib.contextmanager
def _single_process(device: str) -> Iterator[bool]:
    """Megatron's parallel state with TP=CP=PP=1: the one found (False), or a single-rank one made (True; torn
    down after)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        sizes = (
            ps.get_tensor_model_parallel_world_size(),
            ps.get_context_parallel_world_size(),
            ps.get_pipeline_model_parallel_world_size(),
        )
        if sizes != (1, 1, 1):
            raise ConfigError(
                f"the host-sync probe runs with TP=CP=PP=1; megatron's parallel state has "
                f"TP={sizes[0]}, CP={sizes[1]}, PP={sizes[2]} (run it in a process of its own)"
            )
        yield False
        return
    made_pg = not dist.is_initialized()
    with tempfile.TemporaryDirectory(prefix="kareus-syncs-") as work:
        if made_pg:
            dist.init_process_group(
                "nccl" if device.startswith("cuda") else "gloo",
                init_method=f"file://{work}/store",
                rank=0,
                world_size=1,
            )
        try:
            ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
            try:
                yield True
            finally:
                ps.destroy_model_parallel()
        finally:
            if made_pg:
                dist.destroy_process_group()


@contextlib.contextmanager
def _cpu_recompute_rng() -> Iterator[None]:
    """Full recompute saves and restores the CUDA RNG state; a CPU has none: no-ops while inside."""
    from megatron.core.tensor_parallel import random as mrandom

    saved = mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state
    mrandom._get_cuda_rng_state = lambda *a, **k: None
    mrandom._set_cuda_rng_state = lambda *a, **k: None
    try:
        yield
    finally:
        mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state = saved


def _config(recompute: bool, cuda: bool) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = torch.bfloat16 if cuda else torch.float32
    extra: dict[str, Any] = (
        dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) if recompute else {}
    )
    return TransformerConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=cuda,
        **extra,
    )


def probe_partitioned_layer(device: str = "cpu") -> dict[str, Any]:
    """Host syncs of the partitioned layer and of CP attention on `device` ("cpu", "cuda", "cuda:N"); JSON-ready:
    ``{"device", "cases": [{"case", "syncs", "ok", ...}], "total_syncs", "ok", "elapsed_s"}`` (module doc)."""
    from kareus_megatron.vocab import TP_PARTITION_SLOTS

    t0 = time.monotonic()
    cuda = device.startswith("cuda")
    if cuda:
        if not torch.cuda.is_available():
            raise ConfigError(f"host-sync probe: device {device!r} asked for, but torch sees no CUDA device")
        if torch.device(device).index is not None:
            torch.cuda.set_device(torch.device(device))
        dev = torch.device("cuda", torch.cuda.current_device())
    elif device == "cpu":
        from kareus_megatron.runtime.frameworks import cpu_shim

        cpu_shim.apply()  # megatron's CUDA-only calls (RNG tracker fork) on the CPU; before megatron loads
        dev = torch.device("cpu")
    else:
        raise ConfigError(f"host-sync probe: device {device!r}; use cpu, cuda or cuda:N")
    cases: list[dict[str, Any]] = []
    with _single_process(device) as made, contextlib.nullcontext() if cuda else _cpu_recompute_rng():
        if cuda and made:  # megatron's CUDA RNG tracker, as a training run seeds it (full recompute saves it)
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

            model_parallel_cuda_manual_seed(1234)
        for recompute in (False, True):
            cfg = _config(recompute, cuda)
            block = partitioned_block(cfg, dev)
            x = torch.randn(SEQ, MBS, HIDDEN, generator=torch.Generator().manual_seed(1)).to(dev, cfg.params_dtype)
            block_syncs(block, x, None, instructions(1, {}), cuda=False)  # warm-up (first kernels), not reported
            for n in (1, 2):
                for kind in MASKS:
                    res = block_syncs(
                        block, x, causal_mask(kind, MBS, SEQ, dev), instructions(n, TP_PARTITION_SLOTS), cuda=cuda
                    )
                    cases.append({"case": f"layer.nb{n}.mask_{kind}.recompute_{'on' if recompute else 'off'}", **res})
        cases += cp_attend_syncs(dev, torch.bfloat16 if cuda else torch.float32, cuda=cuda)
    total = sum(c["syncs"] + c.get("sync_ops", 0) for c in cases)
    return {
        "device": device,
        "torch": torch.__version__,
        "cases": cases,
        "total_syncs": total,
        "ok": all(c["ok"] for c in cases) and bool(cases),
        "elapsed_s": round(time.monotonic() - t0, 3),
    }

"""Multi-GPU benchmark: one layer's phase time (s) and energy (J) per overlap knob, measured vs predicted.

For each partition of the layout and each knob setting (comm SMs, launch slot) the partitioned
megatron-core layer runs with that partition's knobs (the others at NCCL's default SMs and their first
slot) on every GPU; the script measures the layer's forward (or backward = forward+backward minus forward)
wall time per call and GPU energy (NVML's energy counter over a window of repetitions), and puts beside it
the cost model's prediction for the same phase and knobs (search/tables.py: the alone part plus every
partition at its knobs). Reference rows: 1 nanobatch, and 2 nanobatches with every partition at the
defaults. ``--write-calibration`` fits the overlap parameters of the kernel model (link efficiency and
latency, bytes per comm SM, comm-SM power, time scale; cost/calibrate.fit_series) to the measured rows and
writes a calibration.

Layouts (TP = world size / CP; the partitions and slots are the overlap engine's, runtime/overlap/config.py):

- TP (default): the TP all-reduce partitions (vocab.TP_PARTITION_SLOTS), input [s, b, h].
- ``--sp``: sequence parallelism (TP >= 2), the SP all-gather / reduce-scatter partitions
  (vocab.SP_PARTITION_SLOTS), input [s/TP, b, h].
- ``--cp N``: context parallelism (megatron's load-balanced layout: each CP rank holds 2 of the 2·N sequence
  chunks, input [s/N, b, h], the CP-sliced causal mask and RoPE table); the partitions of
  ``config.cp_engine_slots()`` (with ``--sp``: ``cp_sp_engine_slots()``, input [s/(N·TP), b, h]). With TP=1
  only the CP K/V ones: a 1-rank TP all-reduce is no collective. Needs ``--core-attention sdpa``.

The measured layer uses megatron-core's local spec with ``--core-attention sdpa`` (default: SDPAttention,
torch's scaled_dot_product_attention, flash kernels on a GPU, as the model assumes) or ``local`` (megatron's
unfused DotProductAttention, which makes attention-heavy rows slower than predicted). The ``attention_op``
entry of the output times the core attention alone (forward+backward, s) with each of the two (not with CP:
megatron's DotProductAttention does not run it).

    torchrun --nproc_per_node=8 benchmarks/overlap_gpu.py --model qwen3-1.7b --mbs 8 --seq 4096 \\
        [--sp] [--cp 2] [--partitions fwd_cp_kv,bwd_cp_kv] [--clock-mhz 1410] \\
        [--out kareus-out/overlap_measurements.json] [--write-calibration overlap_cal.json]
    python benchmarks/overlap_gpu.py --dry-run [--sp | --cp 2]   # CPU: 2 gloo processes (TP=2, or CP=2 TP=1),
                                                                 # a tiny layer, simulated energy

On ONE GPU (``python benchmarks/overlap_gpu.py``, or torchrun with one process; ``--dry-run --procs 1`` on a
CPU) there is no TP or CP collective: the layer runs at TP=1 and only the reference rows (1 and 2 nanobatches,
no knobs) are measured and predicted; the comm-SM and launch-slot rows need 2 or more GPUs. The output then
also holds ``communicators``: the engine's SM-limited communicators for the planner's TP grid built on this one
GPU (runtime/overlap/comm_probe.py: init time s, device memory bytes; at world size 1, so without the peers'
buffers a real TP group has).

Clocks: with ``--clock-mhz`` the SM clock is locked and the prediction is made at it; without, the clock is
whatever the GPU runs at, sampled through the device (NVML) while each row is measured, and each row is
predicted at its own measured clock (``clock_mhz`` of the row; the document's ``clock_mhz`` is then null and
``measured_clock_mhz`` the median over the rows).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

# Measured window on a GPU (s): NVML's energy counter moves in steps of about 100 ms, so a 0.5 s window
# carries up to ~20% quantisation and the backward row (a difference of two windows) twice that; 3 s keeps
# each window's step error near 3%.
GPU_WINDOW_S = 3.0
BACKWARD_ATTEMPTS = 3  # re-measurements when a backward row's difference comes out <= 0
PHASES = ("forward", "backward")  # a partition's phase is its name's prefix: fwd_ forward, bwd_ backward
DRY_RUN_WORLD = 2  # gloo processes of the dry run
OVERLAP_FREE = (  # (name, lo, hi, prior sigma): the kernel-model parameters of the overlap part
    ("nvlink_efficiency", 0.15, 1.0, 0.2),
    ("nvlink_latency_s", 0.0, 200e-6, 20e-6),
    ("comm_sm_bytes_per_cycle", 2.0, 128.0, 8.0),
    ("comm_sharpness", 1.0, 10.0, 2.0),
    ("comm_compute_activity", 0.0, 4.0, 0.5),
    ("time_scale", 0.02, 50.0, 1e3),
)
TINY = dict(
    name="tiny",
    num_layers=1,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=4,
    ffn_hidden_size=128,
    vocab_size=128,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (see the module docstring), with the layout they describe checked."""
    ap = argparse.ArgumentParser(prog="overlap_gpu.py", description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU: 2 gloo processes, tiny layer, simulated energy")
    ap.add_argument(
        "--procs",
        type=int,
        default=DRY_RUN_WORLD,
        choices=(1, 2),
        help="gloo processes of the dry run (1: the single-GPU path); on GPUs torchrun's WORLD_SIZE",
    )
    ap.add_argument("--model", default=None, help="model preset (workload/models.toml); tiny in a dry run")
    ap.add_argument("--gpu", default=None, help="GPU preset for the prediction (default: the device's)")
    ap.add_argument("--calibration", default=None, help="calibration file the prediction starts from")
    ap.add_argument("--mbs", type=int, default=None, help="micro-batch size (even: 2 nanobatches)")
    ap.add_argument("--seq", type=int, default=None, help="sequence length")
    ap.add_argument("--clock-mhz", type=int, default=None, help="lock the SM clock (needs permission)")
    ap.add_argument("--sms", default=None, help="comm SM counts, comma-separated (default: the planner's range)")
    ap.add_argument("--sp", action="store_true", help="sequence parallelism (TP >= 2)")
    ap.add_argument("--cp", type=int, default=1, help="context parallel size (TP = world size / CP; needs sdpa)")
    ap.add_argument("--partitions", default=None, help="comma-separated (default: every partition of the layout)")
    ap.add_argument(
        "--min-window-s",
        type=float,
        default=None,
        help=f"shortest measured window (s; default {GPU_WINDOW_S:g}: tens of energy-counter steps)",
    )
    ap.add_argument(
        "--core-attention",
        default="sdpa",
        choices=("sdpa", "local"),
        help="core attention of the measured layer: torch SDPA (default) or megatron's unfused one",
    )
    ap.add_argument("--out", default="kareus-out/overlap_measurements.json", help="measured and predicted rows (JSON)")
    ap.add_argument("--write-calibration", default=None, help="fit the overlap parameters; write this file")
    a = ap.parse_args(argv)
    if not a.dry_run:
        import torch

        if not torch.cuda.is_available():
            print("overlap_gpu: no CUDA GPU here; running the CPU dry run instead (--dry-run).")
            a.dry_run = True
    a.mbs = a.mbs or (2 if a.dry_run else 8)
    a.seq = a.seq or (32 if a.dry_run else 4096)
    a.min_window_s = a.min_window_s if a.min_window_s is not None else (0.0 if a.dry_run else GPU_WINDOW_S)
    if a.mbs % 2:
        ap.error(f"--mbs {a.mbs} must be even (2 nanobatches)")
    if a.sms and not all(s.strip().isdigit() and int(s) > 0 for s in a.sms.split(",")):
        ap.error(f"--sms {a.sms!r} must be positive integers, comma-separated (e.g. 6,18)")
    from kareus_megatron.vocab import MAX_COMM_SM_VALUES

    if a.sms and len({int(s) for s in a.sms.split(",")}) > MAX_COMM_SM_VALUES:
        ap.error(f"--sms {a.sms!r}: at most {MAX_COMM_SM_VALUES} counts (the overlap engine's communicators per group)")
    a.world = a.procs if a.dry_run else int(os.environ.get("WORLD_SIZE", "1"))
    where = f"the dry run's {a.world} process(es)" if a.dry_run else f"world size {a.world}"
    if a.cp < 1:
        ap.error(f"--cp {a.cp} must be a positive integer (1: no context parallelism)")
    if a.world % a.cp:
        ap.error(f"--cp {a.cp} does not divide {where}; use a --cp dividing {a.world}")
    if a.cp > 1 and a.core_attention != "sdpa":
        ap.error(f"--cp {a.cp} needs --core-attention sdpa (the CP attention runs on SDPA)")
    a.tp = a.world // a.cp
    if a.sp and a.tp == 1:
        ap.error(f"--sp needs TP >= 2, but {where} / --cp {a.cp} leaves TP=1; drop --sp or lower --cp")
    a.engine_slots, a.layout = layout_slots(a.tp, a.cp, a.sp)
    a.single = not a.layout  # one GPU: no collective, the reference rows only
    if a.single and (a.partitions or a.write_calibration):
        ap.error(
            f"--{'partitions' if a.partitions else 'write-calibration'}: {where} has no TP or CP collective to "
            "overlap; run on 2 or more GPUs"
        )
    a.partitions = [p for p in (a.partitions or ",".join(a.layout)).split(",") if p]
    bad = [p for p in a.partitions if p not in a.layout]
    if bad or (not a.partitions and not a.single):
        ap.error(
            f"--partitions {','.join(bad) or '(none)'}: not a partition of this layout "
            f"({layout_name(a.tp, a.cp, a.sp)}); use some of {', '.join(a.layout)}"
        )
    from kareus_megatron.errors import KareusError
    from kareus_megatron.workload.parallel import make_parallel

    try:  # the planner's check of the layout (sequence divisible by 2·CP, and so on) and the prediction's config
        a.par = make_parallel(
            model_spec(a),
            tp=a.tp,
            cp=a.cp,
            sequence_parallel=a.sp,
            micro_batch_size=a.mbs,
            seq_length=a.seq,
            gpus_per_node=a.world,
        )
    except KareusError as e:
        ap.error(f"{layout_name(a.tp, a.cp, a.sp)} ({where}, --cp {a.cp}): {e}")
    return a


def layout_name(tp: int, cp: int, sp: bool) -> str:
    """The layout in words, e.g. 'TP=2, CP=2, SP'."""
    return f"TP={tp}" + (f", CP={cp}" if cp > 1 else "") + (", SP" if sp else "")


def layout_slots(tp: int, cp: int, sp: bool) -> tuple[dict[str, tuple[str, ...]], dict[str, tuple[str, ...]]]:
    """(partition → launch slots the engine runs for the layout, in execution order; the measurable ones).

    Measurable: those with a collective, i.e. without the TP and SP ones at TP=1 (a 1-rank all-reduce is none).
    """
    from kareus_megatron.runtime.overlap.config import cp_engine_slots, cp_sp_engine_slots
    from kareus_megatron.vocab import CP_PARTITION_SLOTS, SP_PARTITION_SLOTS, TP_PARTITION_SLOTS

    if cp > 1:
        engine = cp_sp_engine_slots() if sp else cp_engine_slots()
    else:
        engine = dict(SP_PARTITION_SLOTS if sp else TP_PARTITION_SLOTS)
    return engine, {n: s for n, s in engine.items() if tp > 1 or n in CP_PARTITION_SLOTS}


def phase_of(partition: str) -> str:
    """The phase ('forward' / 'backward') whose layer a partition runs in."""
    return "forward" if partition.startswith("fwd_") else "backward"


def model_spec(args: argparse.Namespace):
    """The measured model shape (one layer of it)."""
    from kareus_megatron.workload.models import model_from_dict
    from kareus_megatron.workload.models import model_spec as preset

    if args.model:
        return preset(args.model)
    return model_from_dict(TINY, "tiny")


def knob_rows(args: argparse.Namespace, gpu: Any) -> list[dict[str, Any]]:
    """Rows to measure: references, then every (partition, comm SMs, slot) of the chosen partitions (comm SMs:
    the planner's grid, search/tables.py knob_sms, unless --sms)."""
    from kareus_megatron.cost.kernel import KernelModel
    from kareus_megatron.cost.overlap import OverlapCost
    from kareus_megatron.search.tables import knob_sms

    default_sms = getattr(args, "default_sms", None) or OverlapCost(KernelModel(gpu)).default_sms
    rows: list[dict[str, Any]] = []
    for phase in PHASES:
        rows.append({"phase": phase, "nanobatches": 1, "partition": None, "comm_sms": None, "slot": None})
        rows.append({"phase": phase, "nanobatches": 2, "partition": None, "comm_sms": None, "slot": None})
        for name, slots in args.layout.items():
            if phase_of(name) != phase or name not in args.partitions:
                continue
            sms = (
                [int(s) for s in args.sms.split(",")]
                if args.sms  # default: the planner's grid
                else [int(s) for s in knob_sms(gpu, name, default_sms)]
            )
            if args.dry_run:  # exercise the path, not the grid
                sms, slots = sms[:1], tuple(dict.fromkeys((slots[0], slots[-1])))
            for s in sms:
                for slot in slots:
                    rows.append({"phase": phase, "nanobatches": 2, "partition": name, "comm_sms": s, "slot": slot})
    return rows


# ---------------------------------------------------------------- prediction (cost model; no torch)
def row_clocks(rows: list[dict[str, Any]], clock_mhz: int | None) -> list[int]:
    """The SM clock (MHz) to predict each row at: `clock_mhz` (locked) for all, else each row's measured one."""
    return [int(clock_mhz) if clock_mhz else int(r["clock_mhz"]) for r in rows]


def predict_rows(rows: list[dict[str, Any]], km: Any, model: Any, par: Any, clock_mhz: int | Sequence[int]):
    """Predicted (time s, energy J) of one layer's phase for each row, at `clock_mhz` (MHz: one for all rows, or
    one per row): arrays (n_rows,)."""
    from kareus_megatron.cost.overlap import OverlapCost
    from kareus_megatron.search.tables import phase_table

    ad = OverlapCost(km)
    per_row = [int(clock_mhz)] * len(rows) if isinstance(clock_mhz, (int, np.integer)) else [int(c) for c in clock_mhz]
    t_out, e_out = np.zeros(len(rows)), np.zeros(len(rows))
    tables = {(r["phase"], c): phase_table(ad, model, par, r["phase"], [c], 2) for r, c in zip(rows, per_row)}
    for i, r in enumerate(rows):
        table, clocks = tables[r["phase"], per_row[i]], np.array([float(per_row[i])])
        if r["nanobatches"] == 1:
            t_out[i], e_out[i] = table.seq_time_s[0], table.seq_energy_j[0]
            continue
        t, e = float(table.alone_time_s[0]), float(table.alone_energy_j[0])
        for name, pt in table.partitions.items():
            mine = name == r["partition"]
            sms = r["comm_sms"] if mine else ad.default_sms
            k = pt.slots.index(r["slot"] if mine else pt.slots[0])
            hit = np.flatnonzero(pt.comm_sms == sms)
            if hit.size:  # on the planner's grid: the table already holds it (summed over instances)
                t, e = t + float(pt.time_s[0, k, hit[0]]), e + float(pt.energy_j[0, k, hit[0]])
                continue
            for inst in table.schedule.instances:
                if inst.name == name:
                    ti, ei = ad.instance(inst, clocks, np.array([float(sms)]))
                    t, e = t + float(ti[0, k, 0]), e + float(ei[0, k, 0])
        t_out[i], e_out[i] = t, e
    return t_out, e_out


def _valid(r: dict[str, Any]) -> bool:
    """A measured row the fit can use: finite, positive time (s) and energy (J)."""
    t, e = r["measured_time_s"], r["measured_energy_j"]
    return math.isfinite(t) and math.isfinite(e) and t > 0 and e > 0


def fit_overlap(rows: list[dict[str, Any]], gpu: Any, model: Any, par: Any, clock_mhz: int | None, base_cal: Any):
    """Fit the overlap parameters to the measured 2-nanobatch rows, each at `clock_mhz` (MHz; None: each row's
    measured clock); return a Calibration."""
    from kareus_megatron.cost.calibrate import FreeParam, Series, fit_series, series_metrics
    from kareus_megatron.cost.calibration import FORMAT, Calibration
    from kareus_megatron.cost.kernel import KernelModel

    series = []
    for phase in PHASES:
        sel = [r for r in rows if r["phase"] == phase and r["nanobatches"] == 2 and _valid(r)]
        if len(sel) < 2:
            continue
        t = np.array([r["measured_time_s"] for r in sel])
        e = np.array([r["measured_energy_j"] for r in sel])
        clocks = row_clocks(sel, clock_mhz)
        series.append(
            Series(
                f"{phase} knobs",
                np.array(clocks, dtype=float),
                t,
                e,
                lambda km, sel=sel, clocks=clocks: predict_rows(sel, km, model, par, clocks),
            )
        )
    base_km = KernelModel(gpu, base_cal)
    free = [FreeParam(*x) for x in OVERLAP_FREE]
    before = series_metrics(base_km, series)
    fitted_gpu, params, values = fit_series(series, base_km.gpu, free, base=base_km.params, fit_abs_time=True)
    after = series_metrics(KernelModel.from_params(fitted_gpu, params), series)
    merged = {**(base_cal.params if base_cal else {}), **values}
    return Calibration(
        format=FORMAT,
        gpu=gpu.name,
        params=merged,
        fit={"uncalibrated": before, "calibrated": after},
        source=f"benchmarks/overlap_gpu.py ({len(rows)} knob rows at "
        f"{f'{clock_mhz} MHz' if clock_mhz else 'their measured clocks'})",
        workload={
            "model": model.name,
            "tp": par.tp,
            "cp": par.cp,
            "sequence_parallel": par.sequence_parallel,
            "mbs": par.micro_batch_size,
            "seq": par.seq_length,
        },
    )


# ---------------------------------------------------------------- measurement (torch, megatron)
def _layer(model: Any, tp: int, seq: int, cpu: bool, core_attention: str = "sdpa", sp: bool = False, cp: int = 1):
    """The partitioned layer, its RoPE table for the whole sequence (or None) and dtype."""
    import torch
    import torch.nn.functional as F
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from kareus_megatron.runtime.overlap import get_partitioned_gpt_layer_spec

    dtype = torch.float32 if cpu else torch.bfloat16
    cfg = TransformerConfig(
        num_layers=1,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        ffn_hidden_size=model.ffn_hidden_size,
        kv_channels=model.kv_channels,
        gated_linear_unit=model.activation == "swiglu",
        activation_func=F.silu if model.activation == "swiglu" else F.gelu,
        add_bias_linear=False,
        normalization="RMSNorm" if model.norm == "rmsnorm" else "LayerNorm",
        qk_layernorm=model.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        use_cpu_initialization=cpu,
        sequence_parallel=sp,
        context_parallel_size=cp,
        params_dtype=dtype,
        bf16=not cpu,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
    )
    spec = get_partitioned_gpt_layer_spec(
        core_attention=core_attention,
        normalization="RMSNorm" if model.norm == "rmsnorm" else None,
        qk_layernorm=model.qk_norm,
    )
    layer = build_module(spec, config=cfg, layer_number=1)
    rope = None
    if model.position == "rope":
        # packed_seq=True: megatron leaves the table unsliced under CP; measure() slices it as the batch
        rope = RotaryEmbedding(kv_channels=model.kv_channels, rotary_percent=1.0, use_cpu_initialization=cpu)(
            seq, packed_seq=cp > 1
        )
    return layer, rope, dtype


def attention_op_times(cfg: Any, seq: int, mbs: int, device: Any, dtype: Any, reps: int, sync=lambda: None):
    """Forward+backward time (s, median of `reps`) of the core attention alone: {"local": s, "sdpa": s}.

    Inputs as in a TP rank's layer: query [seq, mbs, heads / TP, hn], key/value [seq, mbs, groups / TP, hn],
    megatron's causal boolean mask (SDPAttention recognises it and runs is_causal).
    """
    import statistics

    import torch
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from kareus_megatron.runtime.overlap import SDPAttention

    tp = cfg.tensor_model_parallel_size
    g = torch.Generator(device="cpu").manual_seed(3)
    np_, ng, hn = cfg.num_attention_heads // tp, cfg.num_query_groups // tp, cfg.kv_channels
    q, k, v = (torch.randn(seq, mbs, h, hn, generator=g).to(device, dtype).requires_grad_() for h in (np_, ng, ng))
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=device), 1).view(1, 1, seq, seq)
    out = {}
    for name, cls in (("local", DotProductAttention), ("sdpa", SDPAttention)):
        mod = cls(config=cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
        times = []
        for i in range(reps + 1):  # the first is warm-up
            sync()
            t0 = time.perf_counter()
            mod(q, k, v, mask).sum().backward()
            sync()
            if i:
                times.append(time.perf_counter() - t0)
            q.grad = k.grad = v.grad = None
        out[name] = statistics.median(times)
    return out


def measure(rank: int, world: int, args: argparse.Namespace, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Measure every row on this rank (all ranks run the same rows in the same order); also time the core
    attention alone ({} with CP)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.utils import get_batch_on_this_cp_rank

    from kareus_megatron.hardware.device import open_cuda_gpu, open_gpu
    from kareus_megatron.hardware.device.stop_signals import stops_cleanly
    from kareus_megatron.runtime.overlap import Knobs, LayerSettings, set_engine, setup_overlap
    from kareus_megatron.vocab import CP_PARTITION_SLOTS

    cpu = args.dry_run
    if cpu:  # attention forks megatron's CUDA RNG tracker and takes a scratch buffer on the current device
        mrandom.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
        torch.cuda.current_device = lambda: torch.device("cpu")
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        mrandom.model_parallel_cuda_manual_seed(1234)
    assert world == args.tp * args.cp, (world, args.tp, args.cp)
    ps.initialize_model_parallel(tensor_model_parallel_size=args.tp, context_parallel_size=args.cp)
    model = model_spec(args)
    layer, rope, dtype = _layer(model, args.tp, args.seq, cpu, args.core_attention, args.sp, args.cp)
    device = torch.device("cpu") if cpu else torch.device("cuda", torch.cuda.current_device())
    layer.to(device)
    gpu = args.gpu or ("a100-sxm4-40gb" if cpu else None)  # NVML: the GPU that is cuda:current (by UUID)
    dev = open_gpu(0, backend="simulated", gpu=gpu) if cpu else open_cuda_gpu(torch.cuda.current_device(), gpu=gpu)
    with stops_cleanly():  # SIGTERM/SIGHUP too: the finally resets a clock this run locked (an NVML lock outlives it)
        try:
            if args.clock_mhz:
                dev.set_sm_clock_mhz(args.clock_mhz)
            s_local = args.seq // args.cp // (args.tp if args.sp else 1)  # this rank's part of the sequence
            g = torch.Generator(device="cpu").manual_seed(7)
            x = torch.randn(s_local, args.mbs, model.hidden_size, generator=g).to(device, dtype).requires_grad_()
            dy = torch.randn(s_local, args.mbs, model.hidden_size, generator=g).to(device, dtype)
            mask = torch.triu(torch.ones(args.seq, args.seq, dtype=torch.bool, device=device), 1).view(
                1, 1, args.seq, args.seq
            )
            if args.cp > 1:  # megatron's CP layout: this rank's 2 of the 2·CP chunks (mask rows; RoPE table, dim 0)
                cut = get_batch_on_this_cp_rank(
                    {"attention_mask": mask, "rope": None if rope is None else rope.transpose(0, 1)}
                )
                mask = cut["attention_mask"]
                rope = None if rope is None else cut["rope"].transpose(0, 1).contiguous()
            is_cp = {r["partition"]: r["partition"] in CP_PARTITION_SLOTS for r in rows if r["partition"]}
            tp_sms = sorted({r["comm_sms"] for r in rows if r["comm_sms"] and not is_cp[r["partition"]]})
            cp_sms = sorted({r["comm_sms"] for r in rows if r["comm_sms"] and is_cp[r["partition"]]})
            # one communicator per count (NCCL)
            engine = setup_overlap(comm_sms=tuple(tp_sms), cp_comm_sms=tuple(cp_sms))
            base = {name: Knobs(None, slots[0]) for name, slots in args.engine_slots.items()}  # the layout's defaults
            sync = (lambda: None) if cpu else torch.cuda.synchronize

            def window(fn) -> tuple[float, float, int, int]:
                fn()  # warm-up (and NCCL communicator creation)
                sync()
                t0 = time.perf_counter()
                fn()
                sync()
                single = max(time.perf_counter() - t0, 1e-6)
                reps = max(2 if cpu else 10, int(np.ceil(args.min_window_s / single)))
                dist.barrier()
                sync()
                with ClockSampler(dev) as clock:  # the SM clock the GPU runs the window at (locked or not)
                    e0, t0 = dev.energy_j(), time.perf_counter()
                    for _ in range(reps):
                        fn()
                    sync()
                    t1, e1 = time.perf_counter(), dev.energy_j()
                return (t1 - t0) / reps, (e1 - e0) / reps, reps, clock.median_mhz()

            def every_rank(ok: bool) -> bool:
                flag = torch.tensor([1.0 if ok else 0.0], device=device)
                dist.all_reduce(flag, op=dist.ReduceOp.MIN)
                return bool(flag.item() > 0)

            def fwd() -> None:
                y, _ = layer(x, attention_mask=mask, rotary_pos_emb=rope)
                del y

            def fwd_bwd() -> None:
                y, _ = layer(x, attention_mask=mask, rotary_pos_emb=rope)
                y.backward(dy)
                x.grad = None
                layer.zero_grad(set_to_none=True)

            out = []
            for r in rows:
                knobs = {**base, r["partition"]: Knobs(r["comm_sms"], r["slot"])} if r["partition"] else base
                engine.state.set(LayerSettings(nanobatches=r["nanobatches"], knobs=knobs))
                tf, ef, nf, mhz = window(fwd)
                if r["phase"] == "forward":
                    t, e, n = tf, ef, nf
                else:
                    for attempt in range(BACKWARD_ATTEMPTS):  # backward = (forward+backward) - forward: on a
                        if attempt:  # noisy machine the difference can come out <= 0
                            tf, ef, nf, _ = window(fwd)
                        tb, eb, n, mhz = window(fwd_bwd)
                        t, e = tb - tf, eb - ef
                        if every_rank(t > 0 and e > 0):  # all ranks retry together (window() has collectives)
                            break
                groups = engine.comm.cp_sm_groups if is_cp.get(r["partition"]) else engine.comm.sm_groups
                out.append(
                    {
                        **r,
                        "measured_time_s": t,
                        "measured_energy_j": e,
                        "reps": n,
                        "clock_mhz": mhz,
                        "sm_limit_requested": r["comm_sms"] in groups,
                    }
                )  # issued on an SM-limited communicator
            set_engine(None)
        finally:
            dev.close()
    attn = (
        {}
        if args.cp > 1
        else attention_op_times(layer.config, args.seq, args.mbs, device, dtype, reps=3 if cpu else 10, sync=sync)
    )
    extra: dict[str, Any] = {}
    if args.single:  # no collective to measure: what the TP communicators cost to build here, at world size 1
        from kareus_megatron.runtime.overlap.comm_probe import probe_sm_limited_comms
        from kareus_megatron.search.tables import knob_sms

        grid = [int(v) for v in knob_sms(args.gpu_spec, "fwd_attn", args.default_sms)]
        extra["communicators"] = probe_sm_limited_comms(str(device), grid)
    return out, attn, extra


class ClockSampler:
    """Reads the device's SM clock (MHz) every `period_s` on a helper thread while the block runs (NVML, or the
    simulated device), so a window's clock is the one the GPU ran it at, not one read before or after it."""

    def __init__(self, dev: Any, period_s: float = 0.02) -> None:
        import threading

        self.dev, self.period_s, self.samples = dev, period_s, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kareus-clock-sampler", daemon=True)

    def _run(self) -> None:
        while True:
            self.samples.append(int(self.dev.sm_clock_mhz()))
            if self._stop.wait(self.period_s):
                return

    def __enter__(self) -> ClockSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def median_mhz(self) -> int:
        """Median of the samples (MHz; at least one is taken)."""
        return int(np.median(self.samples))


def _spawned(rank: int, world: int, store: str, args: argparse.Namespace, rows: list, result: dict) -> None:
    """One dry-run rank; `store`: the rendezvous file (no TCP port to race for on a busy machine)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    got, attn, extra = measure(rank, world, args, rows)
    if rank == 0:
        result["rows"], result["attention_op"], result["extra"] = got, attn, extra
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """Measure (or dry-run), predict, print, write the rows and optionally a calibration; exit status."""
    args = parse_args(argv)
    import torch

    from kareus_megatron.cost.calibration import load_calibration, save_calibration
    from kareus_megatron.cost.kernel import KernelModel
    from kareus_megatron.cost.overlap import OverlapCost
    from kareus_megatron.hardware.gpus import gpu_spec
    from kareus_megatron.plan.io import write_json_atomic

    model, par = model_spec(args), args.par  # par: the layout as the planner builds it (parse_args)
    gpu_name = args.gpu or ("a100-sxm4-40gb" if args.dry_run else None)
    if gpu_name is None:
        from kareus_megatron.hardware.gpus import gpu_spec_for_device_name

        gpu = gpu_spec_for_device_name(torch.cuda.get_device_name())
        if gpu is None:
            print(f"overlap_gpu: no preset for {torch.cuda.get_device_name()!r}; pass --gpu", file=sys.stderr)
            return 2
    else:
        gpu = gpu_spec(gpu_name)
    base_cal = load_calibration(args.calibration) if args.calibration else None
    args.gpu_spec, args.default_sms = gpu, OverlapCost(KernelModel(gpu, base_cal)).default_sms
    rows = knob_rows(args, gpu)
    if args.dry_run:
        import torch.multiprocessing as mp

        with mp.Manager() as mgr, tempfile.TemporaryDirectory() as tmp:
            result = mgr.dict()
            store = os.path.join(tmp, "store")
            mp.spawn(_spawned, args=(args.world, store, args, rows, result), nprocs=args.world, join=True)
            measured, attn, extra = list(result["rows"]), dict(result["attention_op"]), dict(result["extra"])
    else:
        import torch.distributed as dist

        if "WORLD_SIZE" in os.environ:  # torchrun
            dist.init_process_group("nccl")
        else:  # plain `python overlap_gpu.py` on one GPU: a world of one, bound to it
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
        measured, attn, extra = measure(dist.get_rank(), dist.get_world_size(), args, rows)
        if dist.get_rank() != 0:
            dist.destroy_process_group()
            return 0
        dist.destroy_process_group()
    locked = args.clock_mhz  # None: each row is predicted at the clock the GPU ran it at
    clocks = row_clocks(measured, locked)
    pt, pe = predict_rows(measured, KernelModel(gpu, base_cal), model, par, clocks)
    for r, t, e in zip(measured, pt, pe):
        r["predicted_time_s"], r["predicted_energy_j"] = float(t), float(e)
    notes = (
        []
        if not args.single
        else [
            "world size 1: no TP or CP collective, so only the reference rows (1 and 2 nanobatches, no knobs) are "
            "measured; comm-SM and launch-slot rows need 2 or more GPUs; 'communicators' holds what the engine's "
            "SM-limited communicators cost to build here (at world size 1: no peers' buffers)"
        ]
    )
    doc = {
        "format": "kareus-overlap-measurements/1",
        "dry_run": args.dry_run,
        "gpu": gpu.name,
        "model": model.name,
        "tp": args.tp,
        "cp": args.cp,
        "sequence_parallel": args.sp,
        "partitions": {n: list(args.layout[n]) for n in args.partitions},
        "mbs": args.mbs,
        "seq": args.seq,
        "clock_mhz": locked,
        "measured_clock_mhz": int(np.median(clocks)) if clocks else None,
        "clock_source": "locked" if locked else "measured",
        "core_attention": args.core_attention,
        "attention_op": {f"{k}_s": v for k, v in attn.items()},
        "rows": measured,
        "notes": notes,
        **extra,
    }
    write_json_atomic(args.out, doc)
    where = (
        f"locked at {locked} MHz"
        if locked
        else (
            f"not locked: measured {doc['measured_clock_mhz']} MHz (median; "
            "each row predicted at its own measured clock)"
        )
    )
    print(f"{layout_name(args.tp, args.cp, args.sp)}, {model.name}, mbs {args.mbs}, seq {args.seq}, SM clock {where}")
    for note in notes:
        print(f"note: {note}")
    print(
        f"{'phase':9} {'nb':>2} {'partition':16} {'sms':>4} {'slot':12} {'meas ms':>9} {'pred ms':>9} "
        f"{'meas J':>9} {'pred J':>9}"
    )
    for r in measured:
        print(
            f"{r['phase']:9} {r['nanobatches']:>2} {r['partition'] or '-':16} {r['comm_sms'] or '-':>4} "
            f"{r['slot'] or '-':12} {1e3 * r['measured_time_s']:9.3f} {1e3 * r['predicted_time_s']:9.3f} "
            f"{r['measured_energy_j']:9.4f} {r['predicted_energy_j']:9.4f}"
        )
    mt = np.array([r["measured_time_s"] for r in measured])
    print(
        f"time MAPE {100 * np.mean(np.abs(pt / np.maximum(mt, 1e-12) - 1)):.1f}% over {len(measured)} rows"
        + (" (dry run: CPU times, not comparable)" if args.dry_run else "")
    )
    if args.write_calibration:
        cal = fit_overlap(measured, gpu, model, par, locked, base_cal)
        save_calibration(cal, args.write_calibration)
        print(
            f"wrote {args.write_calibration}: time-ratio MAPE {cal.fit['uncalibrated']['time_ratio_mape_pct']:.1f}% "
            f"-> {cal.fit['calibrated']['time_ratio_mape_pct']:.1f}%"
        )
    if not attn:
        print("core attention alone: left out with CP (megatron's DotProductAttention does not run it)")
    else:
        print(
            f"core attention alone, fwd+bwd per call: local (unfused) {1e3 * attn['local']:.3f} ms, "
            f"sdpa {1e3 * attn['sdpa']:.3f} ms ({attn['local'] / max(attn['sdpa'], 1e-12):.2f}x)"
            + (" (dry run: CPU math path)" if args.dry_run else "")
        )
    print(f"wrote {Path(args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The names every layer shares: methods, pipeline schedules, frameworks, layer ops, segments, partitions.

This module is the one owner of these spellings; every other module imports them from here, so adding
a method or a schedule is a change here plus its implementation.

Methods (how a plan is made; see search/planner.py for each one's search):

- ``megatron``: stock Megatron-LM, every instruction at the maximum SM clock, no overlap.
- ``perseus``: Perseus (SOSP '24): per-instruction SM clocks on the pipeline's time-energy frontier.
- ``nanobatch_perseus``: 2 nanobatches with NCCL's default overlap (comm SMs, launch at segment start),
  then Perseus' clock frontier on top.
- ``kareus``: Kareus (OSDI '26): clock, comm SMs and launch slot chosen jointly per partition.
- ``powercap``: one board power limit (W) for every GPU of the job, no clock locks (``nvidia-smi -pl``,
  Zeus's power-limit optimizer); search/powercap.py.
- ``solve`` (plans only): a frontier point of ``kareus solve`` over a measured Perseus profile.

Schedules (the instruction order of one pipeline rank; search/schedules.py builds them):

- ``1f1b``: megatron-core's ``forward_backward_pipelining_without_interleaving``.
- ``interleaved-1f1b``: megatron-core's ``forward_backward_pipelining_with_interleaving`` (VP > 1).
- ``deepspeed-train``: DeepSpeed's ``TrainSchedule`` (PipelineEngine).

Layer vocabulary: one transformer layer's op list is cut at each tensor- or context-parallel
collective into *segments*. With two nanobatches (halves of the microbatch along the batch dimension)
a *partition* is one nanobatch's compute segment running beside the other nanobatch's pending
collective. The collective is issued just before one of the segment's compute ops: its *launch slot*.
The search (cost model) and the overlap engine (runtime) both use exactly these names, so a plan
written by one runs on the other.

Layer structure (TP, no sequence parallelism), in execution order:

forward (and recompute) segments
    attn: input_norm, qkv, rope, attention, proj   -> TP all-reduce of the attention output
    mlp:  pre_mlp_norm, fc1, activation, fc2        -> TP all-reduce of the MLP output
backward segments (reverse order; column-parallel inputs all-reduce their input gradient)
    mlp:  fc2, activation, fc1                      -> TP all-reduce of d(pre_mlp_norm output)
    attn: pre_mlp_norm, proj, attention, rope, qkv  -> TP all-reduce of d(input_norm output)
    tail: input_norm (runs after the last wait)

With context parallelism (CP > 1) the attention's KV is all-gathered across the CP group in forward
(issued after qkv/rope, overlapped with the other nanobatch's input_norm/qkv/rope) and its gradient
reduce-scattered in backward right after the attention backward (overlapped with the other
nanobatch's pre_mlp_norm, proj and attention backward). The CP collective splits the attn segment in
two; the TP partition of that segment then launches only before the ops after the cut.

With sequence parallelism (SP, TP > 1) each TP block starts with an all-gather of the sequence-split
activation (before qkv / fc1) and ends in a reduce-scatter (after proj / fc2), so the norms form their
own segments:

forward (and recompute) segments
    sp_attn_norm: input_norm                         -> TP all-gather of the norm output
    sp_attn:      qkv, rope, attention, proj         -> TP reduce-scatter of the attention output
    sp_mlp_norm:  pre_mlp_norm                       -> TP all-gather
    sp_mlp:       fc1, activation, fc2               -> TP reduce-scatter of the MLP output
backward segments
    (none):       the all-gather of the output gradient leads the layer with no compute before it: exposed
    sp_mlp:       fc2, activation, fc1               -> TP reduce-scatter of d(fc1 input)
    sp_attn_norm: pre_mlp_norm                       -> TP all-gather of d(proj output)
    sp_attn:      proj, attention, rope, qkv         -> TP reduce-scatter of d(qkv input)
    tail:         input_norm

With 2 nanobatches a segment's two instances overlap different collectives (nanobatch 1 the
other nanobatch's collective of the same segment, nanobatch 0 that of the segment before), so an SP
partition's comm SMs apply to all-gathers and reduce-scatters alike; PARTITION_COLLECTIVE names the
collective that ends the segment.

Partition names: ``fwd_attn``, ``fwd_mlp``, ``bwd_attn``, ``bwd_mlp``, with CP ``fwd_cp_kv``,
``bwd_cp_kv``, and with SP ``fwd_sp_attn_norm``, ``fwd_sp_attn``, ``fwd_sp_mlp_norm``, ``fwd_sp_mlp``,
``bwd_sp_mlp``, ``bwd_sp_attn_norm``, ``bwd_sp_attn``. The recompute pass inside a backward instruction
uses the forward partition names.
"""

from __future__ import annotations

from typing import Final, Literal

# ---- methods ------------------------------------------------------------------------------------
MethodName = Literal["megatron", "perseus", "nanobatch_perseus", "kareus", "powercap", "solve"]
MEGATRON: Final = "megatron"
PERSEUS: Final = "perseus"
NANOBATCH_PERSEUS: Final = "nanobatch_perseus"
KAREUS: Final = "kareus"
POWERCAP: Final = "powercap"
SOLVE: Final = "solve"
METHODS: Final[tuple[MethodName, ...]] = (MEGATRON, PERSEUS, NANOBATCH_PERSEUS, KAREUS, POWERCAP)  # kareus plan
PLAN_METHODS: Final[tuple[MethodName, ...]] = (*METHODS, SOLVE)  # what a plan file may record
# planned from per-instruction options (search/options.py); powercap is planned per power limit instead
OPTION_METHODS: Final[tuple[MethodName, ...]] = (MEGATRON, PERSEUS, NANOBATCH_PERSEUS, KAREUS)
REFERENCE_METHODS: Final[tuple[MethodName, ...]] = (MEGATRON, PERSEUS)  # the reductions are measured against these
DEFAULT_METHOD: Final = KAREUS  # the method a plan directory's point refers to when none is named
NANOBATCH_METHODS: Final[tuple[MethodName, ...]] = (NANOBATCH_PERSEUS, KAREUS)  # plan 2 nanobatches

# ---- frameworks and schedules ---------------------------------------------------------------------
FrameworkName = Literal["megatron", "deepspeed"]
ScheduleName = Literal["1f1b", "interleaved-1f1b", "deepspeed-train"]
FRAMEWORK_MEGATRON: Final = "megatron"
FRAMEWORK_DEEPSPEED: Final = "deepspeed"
FRAMEWORKS: Final[tuple[FrameworkName, ...]] = (FRAMEWORK_MEGATRON, FRAMEWORK_DEEPSPEED)
SCHEDULE_1F1B: Final = "1f1b"
SCHEDULE_INTERLEAVED: Final = "interleaved-1f1b"
SCHEDULE_DEEPSPEED: Final = "deepspeed-train"
SCHEDULES: Final[tuple[ScheduleName, ...]] = (SCHEDULE_1F1B, SCHEDULE_INTERLEAVED, SCHEDULE_DEEPSPEED)
FRAMEWORK_OF_SCHEDULE: Final[dict[ScheduleName, FrameworkName]] = {
    SCHEDULE_1F1B: FRAMEWORK_MEGATRON,
    SCHEDULE_INTERLEAVED: FRAMEWORK_MEGATRON,
    SCHEDULE_DEEPSPEED: FRAMEWORK_DEEPSPEED,
}
# Schedules without virtual chunks (what a measured Perseus profile can describe: kareus solve).
FLAT_SCHEDULES: Final[tuple[ScheduleName, ...]] = (SCHEDULE_1F1B, SCHEDULE_DEEPSPEED)


def schedule_for(framework: str, vp: int) -> ScheduleName:
    """The schedule a `framework` job runs with `vp` virtual stages per pipeline rank."""
    if framework == FRAMEWORK_DEEPSPEED:
        return SCHEDULE_DEEPSPEED
    return SCHEDULE_INTERLEAVED if vp > 1 else SCHEDULE_1F1B


# ---- pipeline instructions ----------------------------------------------------------------------
InstructionKind = Literal["forward", "backward"]  # the two instructions of a pipeline schedule

# ---- layer ops, segments and partitions ---------------------------------------------------------
FORWARD_SEGMENTS: Final[dict[str, tuple[str, ...]]] = {
    "attn": ("input_norm", "qkv", "rope", "attention", "proj"),
    "mlp": ("pre_mlp_norm", "fc1", "activation", "fc2"),
}
BACKWARD_SEGMENTS: Final[dict[str, tuple[str, ...]]] = {
    "mlp": ("fc2", "activation", "fc1"),
    "attn": ("pre_mlp_norm", "proj", "attention", "rope", "qkv"),
}
BACKWARD_TAIL: Final[tuple[str, ...]] = ("input_norm",)

# partition name -> the compute ops (launch slots) of the segment it overlaps, in execution order.
TP_PARTITION_SLOTS: Final[dict[str, tuple[str, ...]]] = {
    "fwd_attn": FORWARD_SEGMENTS["attn"],
    "fwd_mlp": FORWARD_SEGMENTS["mlp"],
    "bwd_mlp": BACKWARD_SEGMENTS["mlp"],
    "bwd_attn": BACKWARD_SEGMENTS["attn"],
}
CP_PARTITION_SLOTS: Final[dict[str, tuple[str, ...]]] = {
    "fwd_cp_kv": ("input_norm", "qkv", "rope"),
    "bwd_cp_kv": ("pre_mlp_norm", "proj", "attention"),
}
SP_PARTITION_SLOTS: Final[dict[str, tuple[str, ...]]] = {
    "fwd_sp_attn_norm": ("input_norm",),
    "fwd_sp_attn": ("qkv", "rope", "attention", "proj"),
    "fwd_sp_mlp_norm": ("pre_mlp_norm",),
    "fwd_sp_mlp": ("fc1", "activation", "fc2"),
    "bwd_sp_mlp": ("fc2", "activation", "fc1"),
    "bwd_sp_attn_norm": ("pre_mlp_norm",),
    "bwd_sp_attn": ("proj", "attention", "rope", "qkv"),
}
# Partitions the overlap engine (runtime/overlap) runs: TP all-reduce and SP all-gather/reduce-scatter ones.
ENGINE_PARTITION_SLOTS: Final[dict[str, tuple[str, ...]]] = {**TP_PARTITION_SLOTS, **SP_PARTITION_SLOTS}
PARTITION_SLOTS: Final[dict[str, tuple[str, ...]]] = {**TP_PARTITION_SLOTS, **CP_PARTITION_SLOTS, **SP_PARTITION_SLOTS}

# Collective kind of each partition (the collective that runs beside the compute segment).
PARTITION_COLLECTIVE: Final[dict[str, str]] = {
    "fwd_attn": "tp_all_reduce",
    "fwd_mlp": "tp_all_reduce",
    "bwd_mlp": "tp_all_reduce",
    "bwd_attn": "tp_all_reduce",
    "fwd_cp_kv": "cp_all_gather",
    "bwd_cp_kv": "cp_reduce_scatter",
    "fwd_sp_attn_norm": "tp_all_gather",
    "fwd_sp_attn": "tp_reduce_scatter",
    "fwd_sp_mlp_norm": "tp_all_gather",
    "fwd_sp_mlp": "tp_reduce_scatter",
    "bwd_sp_mlp": "tp_reduce_scatter",
    "bwd_sp_attn_norm": "tp_all_gather",
    "bwd_sp_attn": "tp_reduce_scatter",
}

SUPPORTED_NANOBATCHES: Final[tuple[int, ...]] = (1, 2)

# Comm-SM budget: at most this many distinct comm_sms values per communicator kind (the TP group's
# partitions, TP all-reduce or SP; the CP group's K/V partitions). The planner searches at most this many
# (search/tables.py knob_sms, NCCL's default included) and the runtime builds one SM-limited NCCL
# communicator per value, so at most 2 x this many per rank (runtime/overlap/comm_groups.py;
# docs/sources.md#comm-sm-communicators).
MAX_COMM_SM_VALUES: Final = 10


SP_FORWARD_PARTITIONS: Final = ("fwd_sp_attn_norm", "fwd_sp_attn", "fwd_sp_mlp_norm", "fwd_sp_mlp")
SP_BACKWARD_PARTITIONS: Final = ("bwd_sp_mlp", "bwd_sp_attn_norm", "bwd_sp_attn")


def partitions_for(phase: str, cp: int, recompute: bool = False, sp: bool = False) -> tuple[str, ...]:
    """Partition names present in an instruction of `phase` ("forward"/"backward") for CP size `cp`.

    sp: sequence parallelism (TP > 1): the SP partitions replace the TP all-reduce ones.
    """
    if sp:
        if phase not in ("forward", "backward"):
            raise ValueError(f"phase must be 'forward' or 'backward', not {phase!r}")
        cp_sp = ("fwd_cp_kv",) if cp > 1 else ()
        fwd = (*SP_FORWARD_PARTITIONS, *cp_sp)
        if phase == "forward":
            return fwd
        return (*(fwd if recompute else ()), *SP_BACKWARD_PARTITIONS, *(("bwd_cp_kv",) if cp > 1 else ()))
    cp_names = ("fwd_cp_kv",) if cp > 1 else ()
    if phase == "forward":
        return ("fwd_attn", "fwd_mlp", *cp_names)
    if phase != "backward":
        raise ValueError(f"phase must be 'forward' or 'backward', not {phase!r}")
    fwd = ("fwd_attn", "fwd_mlp", *cp_names) if recompute else ()
    return (*fwd, "bwd_mlp", "bwd_attn", *(("bwd_cp_kv",) if cp > 1 else ()))


# ---- power readings (issue 26): where a GPU's power samples come from (runtime/clock/power_samples.py) --------
POWER_READING_MODEL: Final = "model"  # a simulated GPU's power model
POWER_READING_INSTANT: Final = "nvml_instant"  # NVML_FI_DEV_POWER_INSTANT
POWER_READING_AVERAGE_1S: Final = "nvml_average_1s"  # nvmlDeviceGetPowerUsage: a 1 s average on Ampere and later

# ---- comparisons: when two plans take the same time --------------------------------------------------------
# Relative: a time (or energy) within 0.1% of the reference counts as the same -- iso-time's "no slower than
# Megatron" in --kareus-point (plan/points.py), the frontier's reductions (plan/frontier.py), the points chosen
# to decide them (search/planner.py) and --kareus-objective iso-time (plan/objective.py). Engineering choice
# (docs/sources.md#iso-tolerance): above the clock-change lag the planner costs into a plan (0.017% in
# tests/megatron_lm/test_mlm_auto.py's calibrated job), below the spread of measured iterations (up to 1%
# between two identical runs in benchmarks/runtime_overhead.py).
ISO_REL_TOL: Final = 1e-3

# A prediction band is the [5th, 95th] percentile of a predicted quantity over the cost model's parameter draws
# (cost/uncertainty.py draws them; search/bands.py re-evaluates the plans; plan/frontier.py takes the percentiles).
BAND_PERCENTILES: Final[tuple[float, float]] = (5.0, 95.0)
BAND_DRAWS: Final = 32  # parameter draws per kareus plan run (--band-samples' default)

"""The plan file, ``kareus-plan/1``: what the planner writes and the runtime executes.

A plan is data, never code. It records the workload (the model's shape, architecture and training
precision) and parallel configuration it was made for, the GPU preset and calibration it was predicted
with and the blocked power (W) the prediction used, the predicted iteration time (s) and energy (J, all
GPUs of the job), and for every pipeline rank its instructions in execution order, each with its SM clock
(MHz), nanobatch count and, with 2 nanobatches, the overlap knobs of every partition (comm SMs and launch
slot; names from ``kareus_megatron.vocab``); ``cross_layer`` says the overlap was predicted with
cross-layer overlap (the overlap engine runs it with and without SP; refused with CP). A
``powercap`` plan also records
the one board power limit (W) of every GPU of the job: the runtime sets that limit and locks no clock,
and its instructions carry the GPU's maximum SM clock, the clock the prediction requested (the driver
lowers it under the cap).
"""

from __future__ import annotations

from typing import Final, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kareus_megatron.vocab import (
    FRAMEWORK_MEGATRON,
    PARTITION_SLOTS,
    POWERCAP,
    SCHEDULE_1F1B,
    SUPPORTED_NANOBATCHES,
    FrameworkName,
    InstructionKind,
    MethodName,
    ScheduleName,
)
from kareus_megatron.workload.models import ACTIVATIONS, NORMS, POSITIONS
from kareus_megatron.workload.parallel import PRECISION_BYTES

PLAN_FORMAT: Final = "kareus-plan/1"
FRONTIER_FORMAT = "kareus-frontier/1"


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ModelShape(_Frozen):
    """Transformer shape, architecture and training precision the plan was made for.

    Checked against the live model where the runtime can read it; the launch commands are derived from
    it. The architecture fields (activation .. precision) were added after the first plans: absent (None)
    means unknown, not checked at run time, and ``kareus launch`` refuses to guess them. Spellings are
    workload/models.py's (activation, norm, position) and workload/parallel.py's precisions.
    """

    name: str
    num_layers: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_query_groups: int = Field(gt=0)
    ffn_hidden_size: int = Field(gt=0)
    vocab_size: int = Field(gt=0)
    activation: str | None = Field(default=None, description=f"MLP activation: {', '.join(ACTIVATIONS)}")
    normalization: str | None = Field(default=None, description=f"layer norm: {', '.join(NORMS)}")
    position_embedding: str | None = Field(default=None, description=f"positions: {', '.join(POSITIONS)}")
    kv_channels: int | None = Field(default=None, gt=0, description="width of one attention head (elements)")
    bias_linear: bool | None = Field(default=None, description="every linear layer has a bias")
    qkv_bias: bool | None = Field(default=None, description="the QKV projection has a bias (true with bias_linear)")
    tied_embeddings: bool | None = Field(default=None, description="output layer shares the input embedding")
    qk_norm: bool | None = Field(default=None, description="query and key are normalised before attention")
    precision: str | None = Field(default=None, description=f"training precision: {', '.join(PRECISION_BYTES)}")

    @model_validator(mode="after")
    def _check(self) -> ModelShape:
        for name, allowed in (
            ("activation", ACTIVATIONS),
            ("normalization", NORMS),
            ("position_embedding", POSITIONS),
            ("precision", tuple(PRECISION_BYTES)),
        ):
            value = getattr(self, name)
            if value is not None and value not in allowed:
                raise ValueError(f"{name} {value!r} is not one of {', '.join(allowed)}")
        if self.bias_linear and self.qkv_bias is False:
            raise ValueError("qkv_bias is false but bias_linear is true (a bias on every linear layer includes QKV)")
        return self

    def unknown_fields(self) -> list[str]:
        """The architecture fields this record leaves unknown (plans from before they were recorded)."""
        return [name for name in MODEL_RECORD_FIELDS if getattr(self, name) is None]


# The architecture fields of ModelShape that older plans lack (None there = unknown).
MODEL_RECORD_FIELDS: Final = (
    "activation",
    "normalization",
    "position_embedding",
    "kv_channels",
    "bias_linear",
    "qkv_bias",
    "tied_embeddings",
    "qk_norm",
    "precision",
)


class ParallelLayout(_Frozen):
    """Parallel configuration of the job the plan was made for."""

    tp: int = Field(ge=1)
    cp: int = Field(ge=1)
    pp: int = Field(ge=1)
    vp: int = Field(ge=1, description="virtual pipeline chunks per rank (1 = plain 1F1B)")
    dp: int = Field(ge=1)
    sequence_parallel: bool = False
    micro_batch_size: int = Field(ge=1)
    seq_length: int = Field(ge=1)
    num_microbatches: int = Field(ge=1)
    recompute: Literal["none", "full", "selective"] = "none"
    layers_per_stage: tuple[int, ...] = Field(description="transformer layers on each pipeline stage")
    nodes: int = Field(ge=1)
    gpus_per_node: int = Field(ge=1)
    schedule: ScheduleName = SCHEDULE_1F1B

    @model_validator(mode="after")
    def _check(self) -> ParallelLayout:
        if len(self.layers_per_stage) != self.pp:
            raise ValueError(f"layers_per_stage has {len(self.layers_per_stage)} entries for pp={self.pp}")
        if self.tp * self.cp * self.pp * self.dp != self.nodes * self.gpus_per_node:
            raise ValueError("tp*cp*pp*dp must equal nodes*gpus_per_node")
        return self


class PartitionKnobs(_Frozen):
    """Overlap knobs of one partition: SMs of the collective kernel and the op it is issued before."""

    comm_sms: int = Field(ge=1)
    launch_slot: str


class Instruction(_Frozen):
    """One pipeline instruction: the forward or backward of one microbatch of one virtual chunk."""

    kind: InstructionKind
    microbatch: int = Field(ge=0)
    chunk: int = Field(ge=0, default=0)
    sm_clock_mhz: int = Field(gt=0)
    nanobatches: int = 1
    partitions: dict[str, PartitionKnobs] = Field(default_factory=dict)
    predicted_time_s: float | None = Field(default=None, ge=0)
    predicted_energy_j: float | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _check(self) -> Instruction:
        if self.nanobatches not in SUPPORTED_NANOBATCHES:
            raise ValueError(f"nanobatches must be one of {SUPPORTED_NANOBATCHES}, not {self.nanobatches}")
        if self.nanobatches == 1 and self.partitions:
            raise ValueError("partitions are set but nanobatches is 1 (overlap needs 2 nanobatches)")
        for name, knobs in self.partitions.items():
            if name not in PARTITION_SLOTS:
                raise ValueError(f"unknown partition {name!r}; known: {', '.join(PARTITION_SLOTS)}")
            if knobs.launch_slot not in PARTITION_SLOTS[name]:
                raise ValueError(
                    f"partition {name}: launch_slot {knobs.launch_slot!r} is not one of "
                    f"{', '.join(PARTITION_SLOTS[name])}"
                )
        return self


class StagePlan(_Frozen):
    """The ordered instructions of one pipeline rank."""

    pp_rank: int = Field(ge=0)
    instructions: tuple[Instruction, ...]


class PowerPrediction(_Frozen):
    """The job's predicted power waveform over one iteration (cost/waveform.py): totals of every GPU, W;
    ramp in W/s; band_fraction dimensionless (RMS of its 0.1-20 Hz components over its mean)."""

    peak_power_w: float = Field(ge=0, allow_inf_nan=False)
    min_power_w: float = Field(ge=0, allow_inf_nan=False)
    mean_power_w: float = Field(ge=0, allow_inf_nan=False)
    swing_w: float = Field(ge=0, allow_inf_nan=False)
    ramp_w_per_s: float = Field(ge=0, allow_inf_nan=False)
    band_fraction: float = Field(ge=0, allow_inf_nan=False)


Band = tuple[float, float]  # [5th, 95th] percentile over the cost model's parameter draws (plan/frontier.py)


class Predicted(_Frozen):
    """Predicted iteration time (s) and GPU energy (J, summed over every GPU of the job), its power waveform's
    metrics (None: plans written before they were predicted) and the bands of time and energy (None: plans
    written before bands, or planned without them, kareus plan --band-samples 0; omitted from the file)."""

    iteration_time_s: float = Field(gt=0)
    iteration_energy_j: float = Field(gt=0)
    power: PowerPrediction | None = None
    iteration_time_s_band: Band | None = Field(
        default=None, description="[low, high] iteration time (s): 5th and 95th percentile over the parameter draws"
    )
    iteration_energy_j_band: Band | None = Field(
        default=None, description="[low, high] iteration energy (J): 5th and 95th percentile over the parameter draws"
    )

    @model_validator(mode="after")
    def _check(self) -> Predicted:
        for name in ("iteration_time_s_band", "iteration_energy_j_band"):
            b = getattr(self, name)
            if b is not None and not (0 <= b[0] <= b[1] and b[1] < float("inf")):
                raise ValueError(f"{name} {list(b)} must be [low, high] with 0 <= low <= high, finite")
        return self


class Plan(_Frozen):
    """A whole-job plan, format ``kareus-plan/1``."""

    format: Literal["kareus-plan/1"]
    method: MethodName
    framework: FrameworkName = FRAMEWORK_MEGATRON
    gpu: str
    calibration_sha256: str | None = None
    p_blocked_w: float | None = Field(
        default=None,
        ge=0,
        allow_inf_nan=False,
        description="power (W) of one GPU blocked in the pipeline that the prediction used (None: plans "
        "written before it was recorded; reports then take the GPU preset's)",
    )
    power_limit_w: float | None = Field(
        default=None,
        gt=0,
        allow_inf_nan=False,
        description="board power limit (W) of every GPU of the job (method powercap only): the runtime sets "
        "it and locks no SM clock; every instruction then carries the maximum SM clock",
    )
    power_floor_w: float | None = Field(
        default=None,
        gt=0,
        allow_inf_nan=False,
        description="power (W, one GPU) at which blocked GPUs are held to meet a power bound (kareus plan "
        "--max-swing/--max-ramp), as a hardware power floor or a power damper does; its energy "
        "is in the prediction (None: no floor; omitted from the file)",
    )
    clock_latency_s: float | None = Field(
        default=None,
        ge=0,
        allow_inf_nan=False,
        description="the clock controller's latency (s) the prediction assumed: a clock change is in force this "
        "long after its instruction begins, the previous clock runs until then (GPU preset "
        "clock_latency_ms; None: changes at once, or a plan that locks no clock; omitted from the file)",
    )
    min_clock_segment_s: float | None = Field(
        default=None,
        ge=0,
        allow_inf_nan=False,
        description="shortest clock segment (s of busy time; a maximal run of one rank's instructions at one SM "
        "clock, cyclic across iterations) the planner merged to: k x clock_latency_s; a segment before a raise "
        "requested ahead may be shortened to one latency (search/segments.py; None with clock_latency_s None)",
    )
    model: ModelShape | None = None
    parallel: ParallelLayout
    predicted: Predicted
    stages: tuple[StagePlan, ...]
    cross_layer: bool | None = Field(
        default=None,
        description="the 2-nanobatch instructions were predicted with cross-layer overlap (kareus plan "
        "--cross-layer), which the overlap engine runs with and without SP; refused at run time "
        "with CP (None: without; omitted from the file)",
    )

    @model_validator(mode="after")
    def _check(self) -> Plan:
        if (self.power_limit_w is not None) != (self.method == POWERCAP):
            raise ValueError(
                f"power_limit_w is set exactly for method {POWERCAP} plans (method {self.method}, "
                f"power_limit_w {self.power_limit_w})"
            )
        if self.power_limit_w is not None:
            clocks = {i.sm_clock_mhz for s in self.stages for i in s.instructions}
            nbs = {i.nanobatches for s in self.stages for i in s.instructions}
            if len(clocks) > 1 or nbs - {1}:
                raise ValueError(
                    f"a {POWERCAP} plan runs every instruction at one (the maximum) SM clock with 1 "
                    f"nanobatch; found clocks {sorted(clocks)} MHz, nanobatches {sorted(nbs)}"
                )
        if (self.clock_latency_s is None) != (self.min_clock_segment_s is None):
            raise ValueError("clock_latency_s and min_clock_segment_s are set together (or neither)")
        if self.clock_latency_s is not None and self.power_limit_w is not None:
            raise ValueError(f"a {POWERCAP} plan locks no clock: it assumes no clock latency")
        ranks = [s.pp_rank for s in self.stages]
        if ranks != list(range(self.parallel.pp)):
            raise ValueError(f"stages must list pp_rank 0..{self.parallel.pp - 1} in order, got {ranks}")
        m, vp = self.parallel.num_microbatches, self.parallel.vp
        for s in self.stages:
            for kind in ("forward", "backward"):
                seen = sorted((i.chunk, i.microbatch) for i in s.instructions if i.kind == kind)
                want = [(c, mb) for c in range(vp) for mb in range(m)]
                if seen != want:
                    raise ValueError(
                        f"stage {s.pp_rank}: {kind} instructions must cover microbatches 0..{m - 1} "
                        f"of chunks 0..{vp - 1} exactly once"
                    )
        return self

    def clock_sequence(self, pp_rank: int) -> list[int]:
        """SM clocks (MHz) of rank `pp_rank`'s instructions in execution order."""
        return [i.sm_clock_mhz for i in self.stages[pp_rank].instructions]

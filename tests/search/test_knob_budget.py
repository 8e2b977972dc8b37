"""The planner searches at most vocab.MAX_COMM_SM_VALUES comm SM counts per communicator group (the TP group's
partitions; the CP group's K/V ones), NCCL's default among them, so every plan fits the runtime's budget of
SM-limited communicators (runtime/overlap/comm_groups.py); the thinned grid keeps the range's ends."""

from __future__ import annotations

import pytest

from kareus_megatron.cost.kernel import KernelModel
from kareus_megatron.hardware.gpus import gpu_spec
from kareus_megatron.search.options import layer_tables
from kareus_megatron.search.tables import comm_sms_range, knob_sms
from kareus_megatron.vocab import CP_PARTITION_SLOTS, MAX_COMM_SM_VALUES
from kareus_megatron.workload.models import model_spec
from kareus_megatron.workload.parallel import make_parallel

GPUS = ("a100-sxm4-40gb", "a40", "h100-sxm5-80gb", "h200-sxm-141gb")
LAYOUTS = (dict(tp=4), dict(tp=4, sequence_parallel=True, cp=2), dict(tp=2, cp=2))


@pytest.mark.parametrize("gpu_name", GPUS)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()))
def test_every_searched_grid_fits_the_budget(gpu_name, layout):
    gpu, model = gpu_spec(gpu_name), model_spec("qwen3-1.7b")
    par = make_parallel(
        model,
        pp=2,
        micro_batch_size=2,
        seq_length=1024,
        num_microbatches=4,
        recompute="full",
        gpus_per_node=8,
        **layout,
    )
    kernel = KernelModel(gpu)
    tables = layer_tables(gpu, model, par, kernel, [int(gpu.max_sm_clock_mhz)])
    assert tables.overlap_error is None
    grids: dict[str, set[int]] = {"TP": set(), "CP": set()}
    for phase in tables.phases.values():
        for name, pt in phase.partitions.items():
            values = [int(s) for s in pt.comm_sms]
            grids["CP" if name in CP_PARTITION_SLOTS else "TP"].update(values)
            rng = comm_sms_range(gpu, name)
            assert tables.adapter.default_sms in values and {int(rng[0]), int(rng[-1])} <= set(values), name
    assert grids["TP"] and (grids["CP"] or par.cp == 1)
    for kind, union in grids.items():  # what one group's communicators can be asked for, over every partition
        assert len(union) <= MAX_COMM_SM_VALUES, (kind, sorted(union))


def test_a_grid_within_the_budget_is_left_as_it_was():
    a100 = gpu_spec("a100-sxm4-40gb")
    assert knob_sms(a100, "fwd_attn", 24).tolist() == list(range(3, 31, 3))  # the Kareus A100 grid, default inside

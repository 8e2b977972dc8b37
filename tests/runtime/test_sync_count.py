"""The host-sync counter (runtime/selfcheck/sync_count.py) and the host-sync probe (runtime/selfcheck/syncs.py).

The counter: every operation of its table is seen (tensor methods, torch functions, blocking copies, explicit
waits), in forward and in a custom autograd backward, only on the entering thread, once per call (``repr``
reads through ``tolist``), not while paused, and torch is unchanged after it. Operations that do not wait are
not counted (an index by a long tensor, a dtype conversion, ``non_blocking`` copies, pinned host tensors).

The probe: ``probe_partitioned_layer("cpu")`` in a process of its own (single-rank gloo, megatron's parallel
state made and torn down) reports every case with zero host syncs; with the mask check of attention.py put back
(one ``torch.equal`` per call), the mask cases report it.
"""

from __future__ import annotations

import json
import threading

import pytest
import torch
from _dist import MEGATRON_CORE, read_ranks, spawn

from kareus_megatron.runtime.selfcheck.sync_count import SyncCount


def _count(fn, **kw) -> SyncCount:
    with SyncCount(**kw) as sc:
        fn()
    return sc


@pytest.mark.parametrize(
    "name, op",
    [
        ("Tensor.item", lambda t: t.sum().item()),
        ("Tensor.tolist", lambda t: t.tolist()),
        ("Tensor.__bool__", lambda t: bool(t.sum() > 0)),
        ("Tensor.__bool__", lambda t: (t.sum() > 0) and 1),
        ("Tensor.__int__", lambda t: int(t.sum())),
        ("Tensor.__float__", lambda t: float(t.sum())),
        ("Tensor.__index__", lambda t: [1, 2, 3][t.long()[0]]),
        ("Tensor.__repr__", lambda t: repr(t)),
        ("Tensor.__format__", lambda t: f"{t.sum():.3f}"),
        ("Tensor.numpy", lambda t: t.detach().numpy()),
        ("Tensor.cpu", lambda t: t.cpu()),
        ("Tensor.nonzero", lambda t: t.nonzero()),
        ("torch.nonzero", lambda t: torch.nonzero(t)),
        ("torch.where(cond)", lambda t: torch.where(t > 0)),
        ("Tensor[bool mask]", lambda t: t[t > 0]),
        ("Tensor[bool mask]=", lambda t: t.detach().clone().__setitem__(t > 0, 0.0)),
        ("Tensor.masked_select", lambda t: t.masked_select(t > 0)),
        ("torch.unique", lambda t: torch.unique(t)),
        ("torch.equal", lambda t: torch.equal(t, t)),
        ("Tensor.equal", lambda t: t.equal(t)),
        ("torch.allclose", lambda t: torch.allclose(t, t)),
        ("Tensor.repeat_interleave(tensor)", lambda t: t.repeat_interleave(torch.tensor([1, 2, 1, 1]), dim=0)),
        ("torch.tensor(data, device)", lambda t: torch.tensor([1, 2], device=t.device)),
        ("torch.as_tensor(data, device)", lambda t: torch.as_tensor([1, 2], device=torch.device("cpu"))),
        ("Tensor.to(device)", lambda t: t.to(t.device)),
        ("Tensor.to(device)", lambda t: t.to(device="cpu", dtype=torch.float64)),
    ],
)
def test_each_sync_prone_operation_is_counted_once_with_its_site(name, op):
    t = torch.linspace(-1.0, 1.0, 4, requires_grad=True)
    sc = _count(lambda: op(t))
    assert dict(sc.counts) == {name: 1}, sc.report()
    assert sc.sites[0][1].startswith(__file__ + ":")  # the caller's line, not the counter's


@pytest.mark.parametrize(
    "name, wait",
    [
        ("torch.cuda.synchronize", lambda: torch.cuda.synchronize()),
        ("Event.synchronize", lambda: torch.cuda.Event.synchronize(object())),
        ("Stream.synchronize", lambda: torch.cuda.Stream.synchronize(object())),
    ],
)
def test_explicit_waits_are_counted(name, wait):
    with SyncCount() as sc:
        try:
            wait()
        except Exception:  # no CUDA (or no real event) here: counted before the call fails
            pass
    assert dict(sc.counts) == {name: 1}


@pytest.mark.parametrize(
    "op",
    [
        lambda t: t[torch.tensor([0, 2])],  # gather by a long index: no size from device values
        lambda t: t[1:3],
        lambda t: t.to(torch.float64),  # dtype only
        lambda t: t.to("cpu", non_blocking=True),
        lambda t: t.repeat_interleave(2),
        lambda t: torch.tensor([1, 2]),  # a host tensor
        lambda t: torch.tensor([1, 2], device="cpu"),  # asked for on the host by name
        lambda t: torch.where(t > 0, t, 0.0),
        lambda t: (t.sum() > 0).any(),  # stays a tensor
        lambda t: torch.arange(4, device=t.device) * 2,
    ],
)
def test_operations_that_do_not_wait_are_not_counted(op):
    t = torch.linspace(-1.0, 1.0, 4)
    assert _count(lambda: op(t)).total == 0


def test_custom_backward_is_counted_and_the_thread_filter_holds():
    class Syncing(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            g.sum().item()  # a host read inside a backward
            return g * 2

    x = torch.ones(3, requires_grad=True)
    other: list[float] = []
    with SyncCount() as sc:
        Syncing.apply(x).sum().backward()
        th = threading.Thread(target=lambda: other.append(x.sum().item()))  # a helper thread may wait
        th.start()
        th.join()
    assert dict(sc.counts) == {"Tensor.item": 1} and other == [3.0]


def test_pause_counting_windows_and_restore():
    t = torch.ones(2)
    original, equal, getitem = torch.Tensor.item, torch.equal, torch.Tensor.__getitem__
    with SyncCount(active=False) as sc:
        t.sum().item()  # not counting yet
        with sc.counting():
            t.sum().item()
            with sc.paused():
                t.sum().item()
        sc.counting_call(lambda: t.tolist())()
        sc.counting_call(sc.paused_call(lambda: t.tolist()))()
        sc.note("Event.synchronize")  # not counting here
        with sc.counting():
            sc.note("Event.synchronize")
    assert dict(sc.counts) == {"Tensor.item": 1, "Tensor.tolist": 1, "Event.synchronize": 1}
    assert torch.Tensor.item is original and "item" not in torch.Tensor.__dict__
    assert torch.equal is equal and torch.Tensor.__getitem__ is getitem and t.sum().item() == 2.0


def test_a_gpu_training_device_counts_only_copies_that_cross():
    t = torch.ones(2)
    with SyncCount(device="cuda") as sc:
        t.to("cpu")  # host to host: nothing crosses
        t.to(torch.float64)
    assert sc.total == 0


def _probe_worker(rank: int, world: int, port: int, out: str, put_equal_back: bool) -> None:
    from kareus_megatron.runtime.frameworks import cpu_shim

    cpu_shim.apply()  # (the probe applies it too; megatron-core itself was imported by the fork server)
    if put_equal_back:  # the review's finding: one torch.equal per layer call to spot the causal mask
        from kareus_megatron.runtime.overlap import attention

        convert = attention.sdpa_mask

        def checked(mask, mask_type, sq, sk):
            if mask is not None and tuple(mask.shape[-2:]) == (sq, sk):
                torch.equal(mask, ~attention.causal_attend_mask(sq, sk, mask.device).expand_as(mask))
            return convert(mask, mask_type, sq, sk)

        attention.sdpa_mask = checked
    from kareus_megatron.runtime.selfcheck.syncs import probe_partitioned_layer

    torch.set_num_threads(1)
    res = probe_partitioned_layer("cpu")
    import torch.distributed as dist

    res["left_initialised"] = dist.is_initialized()
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(res, f)


@pytest.fixture(scope="module")
def probes(tmp_path_factory):
    out = {}
    for tag, broken in (("fixed", False), ("equal_back", True)):
        d = tmp_path_factory.mktemp(tag)
        spawn(_probe_worker, 1, str(d), broken, env={"KAREUS_GPU_BACKEND": "simulated"}, preload=MEGATRON_CORE)
        out[tag] = read_ranks(d, "rank{rank}.json", 1)[0]
    return out


def test_the_probe_reports_zero_host_syncs_for_every_case_on_cpu(probes):
    res = probes["fixed"]
    names = [c["case"] for c in res["cases"]]
    assert len(names) == 2 * 2 * 3 + 4 and len(set(names)) == len(names)  # nb x recompute x mask, CP 2 ranks x 2
    for mask in ("none", "1x1", "bx1"):
        assert f"layer.nb2.mask_{mask}.recompute_on" in names
    assert res["total_syncs"] == 0 and res["ok"] and all(c["syncs"] == 0 and c["ok"] for c in res["cases"]), res
    assert res["device"] == "cpu" and not res["left_initialised"]  # the single-rank group it made is gone
    json.dumps(res)


def test_the_probe_fails_when_one_torch_equal_is_put_back(probes):
    res = probes["equal_back"]
    bad = {c["case"] for c in res["cases"] if not c["ok"]}
    assert not res["ok"] and res["total_syncs"] > 0
    assert bad == {c["case"] for c in res["cases"] if c["case"].startswith("layer.") and "mask_none" not in c["case"]}
    assert all("torch.equal" in c["sites"][0] for c in res["cases"] if c["case"] in bad)

"""The steps of benchmarks/gpu_check.py, each ``step(ctx, box_s) -> dict`` with ``status`` ok / failed /
not_applicable and its figures (units in the keys: s, J, W, MHz, bytes). Steps that set up torch.distributed or
megatron state run in a subprocess of their own, so one step's failure or hang cannot spoil the next."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Settings nvidia-smi reports that no run of kareus may change (compared before and after), and live readings
# (reported, not compared).
SETTINGS = (
    "name",
    "uuid",
    "driver_version",
    "persistence_mode",
    "compute_mode",
    "power.limit",
    "power.default_limit",
    "enforced.power.limit",
    "power.min_limit",
    "power.max_limit",
    "clocks.applications.graphics",
    "clocks.applications.memory",
    "clocks.default_applications.graphics",
    "clocks.default_applications.memory",
    "mig.mode.current",
    "ecc.mode.current",
    "clocks_event_reasons.applications_clocks_setting",
)
LIVE = (
    "clocks.sm",
    "clocks.mem",
    "clocks.max.sm",
    "power.draw",
    "temperature.gpu",
    "pstate",
    "utilization.gpu",
    "memory.used",
)
SAMPLE_PERIOD_S = 0.002  # the power/energy sampler's period
HOPPER_ALLREDUCE_SMS = tuple(range(2, 19, 2))  # the planner's comm-SM grid for a Hopper TP all-reduce


@dataclass
class Context:
    dry_run: bool
    device: int
    work: Path

    @property
    def torch_device(self) -> str:
        return "cpu" if self.dry_run else f"cuda:{self.device}"

    @property
    def backend(self) -> str:
        from kareus_megatron.hardware.device import dry_run_backend

        return dry_run_backend() if self.dry_run else "nvml"


# -- 1, 9: nvidia-smi --------------------------------------------------------------------------------------
def _smi(fields: tuple[str, ...], index: int, timeout_s: float) -> dict[str, str] | None:
    r = subprocess.run(
        ["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits", "-i", str(index)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    if r.returncode != 0:
        return None
    values = [v.strip() for v in r.stdout.strip().split(",")]
    return dict(zip(fields, values)) if len(values) == len(fields) else None


def _query(fields: tuple[str, ...], index: int, timeout_s: float) -> tuple[dict[str, str], list[str]]:
    """The fields nvidia-smi answers (all at once, else one by one), and the ones it does not know."""
    got = _smi(fields, index, timeout_s)
    if got is not None:
        return got, []
    out, unknown = {}, []
    for f in fields:
        one = _smi((f,), index, timeout_s)
        if one is None:
            unknown.append(f)
        else:
            out.update(one)
    return out, unknown


def nvidia_smi(ctx: Context, box_s: float) -> dict[str, Any]:
    if shutil.which("nvidia-smi") is None:
        return {"status": "not_applicable", "message": "no nvidia-smi on this machine"}
    settings, unknown = _query(SETTINGS, ctx.device, box_s / 3)
    live, _ = _query(LIVE, ctx.device, box_s / 3)
    if not settings:
        return {"status": "failed", "message": "nvidia-smi answered no settings field", "unknown_fields": unknown}
    return {"status": "ok", "settings": settings, "live": live, "unknown_fields": unknown}


def same_settings(before: dict[str, Any], after: dict[str, Any]) -> bool | None:
    """Whether the settings snapshot is unchanged (None: one side has none)."""
    if "settings" not in before or "settings" not in after:
        return None
    return bool(before["settings"] == after["settings"])


def refused_nvml_calls() -> list[str]:
    """The changing NVML calls the read-only pynvml refused in this process (must be none)."""
    from kareus_megatron.hardware.device import nvml_access

    guard = nvml_access._guarded
    return list(guard.refused) if guard is not None else []


# -- 2: kareus env -------------------------------------------------------------------------------------------
def env(ctx: Context, box_s: float) -> dict[str, Any]:
    from kareus_megatron.cli.env import environment

    rep = environment(ctx.device, check_permission=True)
    n = rep["nvml"]
    status = "ok" if n.get("nvml") and not n.get("error") else ("not_applicable" if ctx.dry_run else "failed")
    return {"status": status, "report": rep}


# -- 3: energy counter against power samples -----------------------------------------------------------------
def _field_ids(pynvml: Any) -> dict[str, int]:
    return {
        k: getattr(pynvml, f)
        for k, f in (("instant_w", "NVML_FI_DEV_POWER_INSTANT"), ("average_w", "NVML_FI_DEV_POWER_AVERAGE"))
        if hasattr(pynvml, f)
    }


def _fields_w(pynvml: Any, handle: Any, ids: dict[str, int]) -> dict[str, float | None]:
    out: dict[str, float | None] = dict.fromkeys(ids)
    try:
        vals = pynvml.nvmlDeviceGetFieldValues(handle, list(ids.values()))
    except Exception:  # noqa: BLE001  (no field API on this driver: unavailable)
        return out
    for key, v in zip(ids, vals):
        if getattr(v, "nvmlReturn", 1) == 0:
            out[key] = float(v.value.uiVal) / 1000.0  # mW
    return out


def _update_period_s(ts: list[float], vs: list[float | None]) -> float | None:
    """Median time between changes of a sampled reading (s); None when it never changed."""
    changes = [t for i, (t, v) in enumerate(zip(ts, vs)) if i and v is not None and v != vs[i - 1]]
    gaps = [b - a for a, b in zip(changes, changes[1:])]
    return statistics.median(gaps) if gaps else None


def _integral_j(ts: list[float], ws: list[float | None]) -> float | None:
    pts = [(t, w) for t, w in zip(ts, ws) if w is not None]
    if len(pts) < 2:
        return None
    return sum((t1 - t0) * (w0 + w1) / 2 for (t0, w0), (t1, w1) in zip(pts, pts[1:]))


def energy_counter(ctx: Context, box_s: float) -> dict[str, Any]:
    import torch

    from kareus_megatron.hardware.device import open_cuda_gpu

    seconds = 0.5 if ctx.dry_run else max(2.0, min(6.0, box_s - 8.0))
    dev = open_cuda_gpu(ctx.device, backend=ctx.backend)
    pynvml = handle = None
    ids: dict[str, int] = {}
    if ctx.backend == "nvml":
        from kareus_megatron.hardware.device.nvml_access import nvml_module

        pynvml = nvml_module()
        handle = pynvml.nvmlDeviceGetHandleByUUID(dev.nvml_uuid())
        ids = _field_ids(pynvml)
    n = 256 if ctx.dry_run else 8192
    dtype = torch.float32 if ctx.dry_run else torch.bfloat16
    a = torch.randn(n, n, device=ctx.torch_device, dtype=dtype)
    b = torch.randn(n, n, device=ctx.torch_device, dtype=dtype)
    samples: list[tuple[float, float, float | None, dict[str, float | None]]] = []
    stop = threading.Event()
    call_s: list[float] = []

    def sample() -> None:
        while not stop.is_set():
            t0 = time.monotonic()
            e = dev.energy_j()
            p = float(pynvml.nvmlDeviceGetPowerUsage(handle)) / 1000.0 if pynvml is not None else None
            f = _fields_w(pynvml, handle, ids) if pynvml is not None and ids else {}
            t1 = time.monotonic()
            call_s.append(t1 - t0)
            samples.append(((t0 + t1) / 2, e, p, f))
            stop.wait(SAMPLE_PERIOD_S)

    gemms = 0
    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    t_start = time.monotonic()
    try:
        while time.monotonic() - t_start < seconds:
            for _ in range(4):
                a @ b
            gemms += 4
            if not ctx.dry_run:
                torch.cuda.synchronize(ctx.device)
    finally:
        stop.set()
        thread.join()
        dev.close()
    wall = time.monotonic() - t_start
    ts = [s[0] for s in samples]
    es = [s[1] for s in samples]
    out: dict[str, Any] = {
        "status": "ok",
        "seconds": wall,
        "samples": len(samples),
        "sample_call_s_median": statistics.median(call_s) if call_s else None,
        "gemm": {"n": n, "dtype": str(dtype), "count": gemms, "tflops": 2 * n**3 * gemms / wall / 1e12},
        "energy_counter": {
            "update_period_s": _update_period_s(ts, es),
            "energy_j": es[-1] - es[0] if es else None,
            "unit": "J (NVML: mJ)",
        },
    }
    series = {"power_usage_w": [s[2] for s in samples]} if pynvml is not None else {}
    for key in ids:
        series[f"field_{key}"] = [s[3].get(key) for s in samples]
    span = ts[-1] - ts[0] if len(ts) > 1 else 0.0
    for key, ws in series.items():
        got = [w for w in ws if w is not None]
        integ = _integral_j(ts, ws)
        out[key] = {
            "available": bool(got),
            "update_period_s": _update_period_s(ts, ws),
            "mean_w": statistics.fmean(got) if got else None,
            "integral_j": integ,
            "counter_over_integral": (es[-1] - es[0]) / integ if integ else None,
        }
    out["span_s"] = span
    if not series:
        out["note"] = "simulated GPU: no NVML power readings; the energy counter alone"
    return out


# -- 4: the runtime self-check --------------------------------------------------------------------------------
def _python(code_or_args: list[str], box_s: float, ctx: Context) -> subprocess.CompletedProcess[str]:
    here = str(Path(__file__).resolve().parent)  # gpu_check_controller beside this file
    env = {
        **os.environ,
        "KAREUS_GPU_READ_ONLY": "1",
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p),
    }
    return subprocess.run(
        [sys.executable, *code_or_args], capture_output=True, text=True, timeout=box_s, env=env, cwd=ctx.work
    )


def selfcheck(ctx: Context, box_s: float) -> dict[str, Any]:
    out = ctx.work / "selfcheck.json"
    args = ["-m", "kareus_megatron.runtime.selfcheck", "--out", str(out), "--device", str(ctx.device)]
    r = _python(args + (["--dry-run"] if ctx.dry_run else []), box_s, ctx)
    if not out.exists():
        return {"status": "failed", "message": "no report: " + " | ".join(r.stderr.strip().splitlines()[-5:])}
    rep = json.loads(out.read_text())
    out.unlink()
    checks = ("megatron_patch", "event_alignment", "partitioned_layer")
    rep["status"] = "ok" if all(rep[c]["status"] != "failed" for c in checks) else "failed"
    return rep


# -- 5, 6: probes in a process of their own -------------------------------------------------------------------
def _probe(ctx: Context, box_s: float, module: str, call: str) -> dict[str, Any]:
    code = (
        f"import json, sys\nfrom {module} import {call.split('(')[0]}\nres = {call}\n"
        "sys.stdout.write('\\nKAREUS-PROBE ' + json.dumps(res, default=str) + '\\n')\n"
    )
    r = _python(["-c", code], box_s, ctx)
    line = [s for s in r.stdout.splitlines() if s.startswith("KAREUS-PROBE ")]
    if not line:
        tail = " | ".join(r.stderr.strip().splitlines()[-6:])
        return {"status": "failed", "message": f"exit {r.returncode}: {tail}"}
    res: dict[str, Any] = json.loads(line[-1].removeprefix("KAREUS-PROBE "))
    res.setdefault("status", "ok")
    return res


def host_syncs(ctx: Context, box_s: float) -> dict[str, Any]:
    res = _probe(
        ctx, box_s, "kareus_megatron.runtime.selfcheck.syncs", f"probe_partitioned_layer({ctx.torch_device!r})"
    )
    if res.get("status") == "ok" and res.get("total_syncs", 0) != 0:
        res["status"] = "failed"
    return res


def nccl_comms(ctx: Context, box_s: float) -> dict[str, Any]:
    return _probe(
        ctx,
        box_s,
        "kareus_megatron.runtime.overlap.comm_probe",
        f"probe_sm_limited_comms({ctx.torch_device!r}, {list(HOPPER_ALLREDUCE_SMS)!r})",
    )


# -- 7: the clock controller's side process --------------------------------------------------------------------
def controller(ctx: Context, box_s: float) -> dict[str, Any]:
    return _probe(ctx, box_s, "gpu_check_controller", f"run_controller({ctx.torch_device!r}, {ctx.backend!r})")


# -- 8: the model's kernels at the GPU's own clock ----------------------------------------------------------------
def kernels(ctx: Context, box_s: float) -> dict[str, Any]:
    from kareus_megatron.cost.gpu_validate import validate_gpu
    from kareus_megatron.hardware.device import open_cuda_gpu, simulation_of

    dev = open_cuda_gpu(ctx.device, backend=ctx.backend)
    try:
        rep = validate_gpu(
            dev,
            read_only=True,
            dry_run=ctx.dry_run,
            sim=simulation_of(dev),
            min_window_s=0.02 if ctx.dry_run else 1.0,
            budget_s=box_s,
        )
    finally:
        dev.close()
    keep = (
        "mode",
        "gpu",
        "identity",
        "clocks",
        "energy_counter",
        "sweep",
        "kernels",
        "accuracy",
        "clock_calls",
        "elapsed_s",
    )
    out = {k: rep[k] for k in keep if k in rep}
    out["status"] = "ok" if rep["clock_calls"] == {"set": 0, "reset": 0} else "failed"
    return out


# -- the page ------------------------------------------------------------------------------------------------------
def summary(report: dict[str, Any]) -> str:
    """One page: each step's verdict and its headline figures."""
    s = report["steps"]
    lines = [
        f"kareus GPU check ({'dry run' if report['dry_run'] else 'GPU'}, read-only), {report['elapsed_s']:.0f} s "
        f"of {report['budget_s']:.0f}; verdict: {'OK' if report['ok'] else 'FAILED'}",
        f"settings unchanged (nvidia-smi before = after): {report['settings_unchanged']}; changing NVML calls "
        f"refused: {len(report['nvml_changes_refused'])}",
    ]
    for name, res in s.items():
        lines.append(f"- {name}: {res['status']} ({res['wall_s']:.1f} s){_headline(name, res)}")
    return "\n".join(lines) + "\n"


def _fmt(x: Any, scale: float = 1.0, unit: str = "", digits: int = 1) -> str:
    return "n/a" if x is None else f"{x * scale:.{digits}f}{unit}"


def _headline(name: str, r: dict[str, Any]) -> str:
    if r["status"] != "ok":
        return f": {r.get('message', '')[:200]}" if r.get("message") else ""
    try:
        return _figures(name, r)
    except (KeyError, TypeError, ValueError) as e:  # a report without the expected figures: say so, keep the page
        return f": (figures missing: {e!r})"


def _figures(name: str, r: dict[str, Any]) -> str:
    if name.startswith("nvidia_smi") and "settings" in r:
        st = r["settings"]
        return (
            f": {st.get('name')}, driver {st.get('driver_version')}, power limit {st.get('power.limit')} W, "
            f"persistence {st.get('persistence_mode')}; SM {r['live'].get('clocks.sm')} MHz now"
        )
    if name == "env" and "report" in r:
        n = r["report"]["nvml"]
        return (
            f": {n.get('name')} (preset {n.get('preset')}), {len(n.get('supported_sm_clocks_mhz') or [])} "
            f"clocks, {n.get('permission_note') or n.get('permission_error') or ''}"
        )
    if name == "energy_counter":
        pu, inst = r.get("power_usage_w", {}), r.get("field_instant_w", {})
        return (
            f": GEMM {_fmt(r['gemm']['tflops'], unit=' TFLOP/s')}; counter updates every "
            f"{_fmt(r['energy_counter']['update_period_s'], 1e3, ' ms')}; power usage every "
            f"{_fmt(pu.get('update_period_s'), 1e3, ' ms')} (mean {_fmt(pu.get('mean_w'), unit=' W')}, counter/"
            f"integral {_fmt(pu.get('counter_over_integral'), digits=3)}); instant field every "
            f"{_fmt(inst.get('update_period_s'), 1e3, ' ms')}"
        )
    if name == "selfcheck":
        mp, ea = r.get("megatron_patch", {}), r.get("event_alignment", {})
        return (
            f": patch {mp.get('status')} (losses identical {mp.get('losses_identical')}, syncs added "
            f"{mp.get('device_syncs_added_by_patch')}, overhead {_fmt(mp.get('overhead_pct'), unit=' %')}); "
            f"events {ea.get('status')}; layer {r.get('partitioned_layer', {}).get('status')}"
        )
    if name == "host_syncs":
        return f": {r.get('total_syncs')} syncs in {len(r.get('cases', []))} cases"
    if name == "nccl_comms":
        return (
            f": NCCL {r.get('nccl_version')}, {len(r.get('communicators', []))} communicators, shared {r.get('shared')}"
        )
    if name == "controller":
        key = "event_to_controller" if "event_to_controller_s_median" in r else "cpu_mark_round_trip"
        return (
            f": {key.replace('_', ' ')} {_fmt(r.get(key + '_s_median'), 1e3, ' ms', 2)} median, counts "
            f"{r.get('counts')}, exit {r.get('exit_status')}"
        )
    if name == "kernels":
        acc = r.get("accuracy", {}).get("preset", {})
        return (
            f": at {r.get('clocks', {}).get('current_mhz')} MHz, preset time MAPE "
            f"{_fmt(acc.get('time_abs_mape_pct'), unit=' %')}, power MAPE "
            f"{_fmt(acc.get('power_mape_pct'), unit=' %')}"
        )
    return ""

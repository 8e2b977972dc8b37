"""Rank 0's side of ``--kareus-plan auto`` (auto.py): calibrate, plan, check for drift, off the training thread.

A daemon thread that never blocks training. After a profile phase it waits until every rank's profile
iterations are in the run log, then runs, as subprocesses of this Python (the runtime never imports the
search):

1. ``kareus calibrate --from-log LOG --plan BASE --iterations A:B -o AUTO/calib-N.json``;
2. ``kareus plan <the job's flags> --calibration AUTO/calib-N.json --methods M --out AUTO/plan-N`` (iso-time
   first plans once to learn the max-clock plan's time under the calibration, then again with ``--max-time``
   at that time; plan/objective.py chooses the point);

and posts the chosen plan to every rank (AutoController.post). At start it plans once with the preset model
(AUTO/plan-0) for the "before calibration" figures. After a switch it reads the log every CHECK_S (or
READ_SPACING times the last read's duration, when longer) and compares the plan's latest iterations (each
run's first left out) with its prediction (``against``: time the median, energy over each rank's own window).
The model error before and after calibration (on the profile's max-clock iterations) and after the switch is
written as events (``calibrated``, ``checked``, ``drift``).
AUTO is LOG/auto.
"""

from __future__ import annotations

import os
import queue
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kareus_megatron.errors import KareusError
from kareus_megatron.plan.io import load_plan
from kareus_megatron.plan.objective import ISO_TIME, MAX_TIME, MIN_ENERGY, ObjectiveError, select_point
from kareus_megatron.plan.points import select_frontier_points
from kareus_megatron.plan.schema import Plan
from kareus_megatron.plan.workload import plan_cli_args, write_model_file
from kareus_megatron.vocab import ISO_REL_TOL, KAREUS, MEGATRON

POLL_S = 0.5
CHECK_S = 1.0  # how often a running plan is compared with its prediction (s), at least
# Reading the whole run log takes this thread's share of the interpreter from the training thread: the next read
# waits READ_SPACING times as long as the last one took, so reading is at most ~2% of the wall time however long
# the log grows.
READ_SPACING = 50.0
LOG_WAIT_S = 300.0  # how long rank 0 waits for every rank's profile iterations in the log
SUBPROCESS_TIMEOUT_S = 900.0
WINDOW_S = 1.0  # NVML's energy counter updates about every 100 ms (report/measurements.py MIN_WINDOW_S)
SIMULATED_WINDOW_S = 0.05  # the simulated GPU integrates power exactly
DENSE_POINTS = 64  # frontier points written when the objective is an energy budget


def kareus_command(*args: str) -> list[str]:
    """The `kareus` CLI as a subprocess of this interpreter."""
    return [sys.executable, "-m", "kareus_megatron.cli.main", *args]


class AutoError(Exception):
    """A step of the closed loop failed (its message is one line for the log)."""


@dataclass(frozen=True, slots=True)
class Verdict:
    """Measured iteration time and energy of some iterations against a plan's prediction.

    time: the median job iteration time (s; the slowest rank) against the plan's predicted iteration time.
    energy: the energy the ranks measured (J, summed) against the model's energy *over each rank's own
    measurement window*: per rank its stage's predicted instruction energies plus the plan's blocked power times
    the rest of that rank's window. Ranks' windows differ (a last stage starts its iteration later than the first
    ends it), so comparing the ranks' summed energy with the prediction over one common iteration time would
    count blocked time the windows do not hold.
    """

    iterations: int
    time_s: float | None = None
    energy_j: float | None = None  # mean measured energy per iteration (J, every rank)
    error_time: float | None = None
    error_energy: float | None = None


def against(log: Any, plan: Plan, match: dict[str, Any], skip_first: bool = True, last: int | None = None) -> Verdict:
    """The complete iterations whose every rank carries the tags `match` (the latest `last` of them when given;
    the first of each run of them left out with `skip_first`: a switch lands inside it) against `plan`."""
    from kareus_megatron.hardware.gpus import gpu_spec

    pb = plan.p_blocked_w if plan.p_blocked_w is not None else gpu_spec(plan.gpu).p_blocked_w
    busy_t = {st.pp_rank: sum(i.predicted_time_s or 0.0 for i in st.instructions) for st in plan.stages}
    busy_e = {st.pp_rank: sum(i.predicted_energy_j or 0.0 for i in st.instructions) for st in plan.stages}
    rows: list[tuple[float, float, float]] = []
    prev = None
    for rec in log.iterations:
        ranks = rec.get("ranks") or []
        ok = (
            bool(ranks)
            and rec.get("iteration") not in log.partial
            and all(r.get(k) == v for r in ranks for k, v in match.items())
        )
        first = ok and (prev is None or prev + 1 != rec["iteration"])
        prev = rec["iteration"] if ok else None
        if not ok or (first and skip_first) or rec.get("time_s") is None or rec.get("energy_j") is None:
            continue
        try:
            pred = sum(busy_e[r["pp_rank"]] + pb * (float(r["time_s"]) - busy_t[r["pp_rank"]]) for r in ranks)
        except (KeyError, TypeError):
            continue
        rows.append((float(rec["time_s"]), float(rec["energy_j"]), pred))
    if last is not None:
        rows = rows[-last:]
    if not rows:
        return Verdict(0)
    t = statistics.median(r[0] for r in rows)
    e = sum(r[1] for r in rows)
    known = all(i.predicted_energy_j is not None for st in plan.stages for i in st.instructions)
    return Verdict(
        len(rows),
        t,
        e / len(rows),
        _rel(t, plan.predicted.iteration_time_s),
        _rel(e, sum(r[2] for r in rows)) if known else None,
    )


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:+.1%}"


def _rel(measured_v: float | None, predicted: float | None) -> float | None:
    if measured_v is None or not predicted:
        return None
    return measured_v / predicted - 1.0


class AutoWorker(threading.Thread):
    """The closed loop's planning and checking on rank 0 (a daemon thread)."""

    def __init__(self, ctl: Any) -> None:
        super().__init__(name="kareus-auto", daemon=True)
        self.ctl = ctl
        self.dir = Path(ctl.log_dir) / "auto"
        self.tasks: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self.base_file: Path | None = None
        self.job_args: list[str] = []
        self.reference_plan: Path | None = None  # the preset model's max-clock plan (plan-0's megatron point)
        self.watching: tuple[int, Plan] | None = None  # (version, plan) compared with its prediction
        self.stopped = threading.Event()
        self._next_check = 0.0
        self._read_s = 0.0  # how long the last read of the run log took (s)
        self._proc: subprocess.Popen[str] | None = None
        self._checked = -1  # the plan version whose first verdict was written

    # -- called by the controller (training thread) ----------------------------------------------
    def profile_done(self, first: int, last: int) -> None:
        """Iterations first..last were the profile phase: calibrate and plan from them."""
        self.watching = None
        self.tasks.put(("profile", first, last))

    def switched(self, version: int, plan: Plan) -> None:
        """Every rank runs `plan` now: compare it with its prediction from here on."""
        self.watching = (version, plan)

    # -- the thread ------------------------------------------------------------------------------
    def run(self) -> None:  # noqa: D102
        try:
            self._prepare()
        except (AutoError, KareusError, OSError) as e:
            self._fail(str(e))
            return
        while not self.stopped.is_set():
            try:
                task = self.tasks.get(timeout=POLL_S)
            except queue.Empty:
                task = None
            try:
                if task is not None:
                    self._replan(*task[1:])
                elif self.watching is not None:
                    self._check()
            except ObjectiveError as e:
                self.ctl._event("objective-unmet", reason=str(e))
                self.ctl.say(f"{e}; training goes on at the current plan")
            except (AutoError, KareusError, OSError, ValueError) as e:  # the loop stops trying; training goes on
                self._fail(str(e))
                if task is None:
                    self.watching = None

    def _fail(self, message: str) -> None:
        self.ctl._event("auto-failed", reason=message)
        self.ctl.say(f"{message}; training goes on at the current plan")

    def _prepare(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        base = self.ctl.base
        self.base_file = self.dir / "base-plan.json"
        self.base_file.write_text(base.model_dump_json(indent=1) + "\n")
        self.job_args = plan_cli_args(base, write_model_file(base, self.dir / "model.json"))
        out = self._plan(0, None, "preset")
        self.reference_plan = select_frontier_points(out, "all", method=MEGATRON, allow_all=True)[0].plan_path

    def _run(self, args: list[str], what: str) -> None:
        try:
            proc = subprocess.Popen(
                args,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env={**os.environ, "PYTHONWARNINGS": "ignore"},
            )
        except OSError as e:
            raise AutoError(f"{what} did not start: {e}") from None
        self._proc = proc
        try:
            out, err = proc.communicate(timeout=SUBPROCESS_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise AutoError(f"{what} did not finish in {SUBPROCESS_TIMEOUT_S:.0f} s") from None
        finally:
            self._proc = None
        if self.stopped.is_set():
            raise AutoError(f"{what}: the job ended")
        if proc.returncode != 0:
            lines = (err or out or "").strip().splitlines()
            msg = lines[-1] if lines else f"exit status {proc.returncode}"
            if "--max-time" in args and "--max-time" in msg:  # the objective's time bound is below every plan
                raise ObjectiveError(msg)
            raise AutoError(f"{what} failed: {msg}")

    def stop(self) -> None:
        """The session closes: stop, and end a planning subprocess still running."""
        self.stopped.set()
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.terminate()

    def _window_s(self) -> float:
        """Shortest energy window of the fit (s): NVML's counter needs WINDOW_S; the simulated GPU's is exact."""
        from kareus_megatron.hardware.device import backend_from_env

        return SIMULATED_WINDOW_S if backend_from_env(self.ctl.session.backend) == "simulated" else WINDOW_S

    def _method(self) -> str:
        return self.ctl.method or KAREUS

    def _plan(
        self, version: int, calibration: Path | None, tag: str, max_time_s: float | None = None, points: int = 2
    ) -> Path:
        out = self.dir / (f"plan-{version}" + ("" if max_time_s is None else "-bounded"))
        # --band-samples 0: the loop selects on the point estimate, and drawing bands would take CPU from the
        # training it replans beside; --no-figures: nobody looks at them, and they took 1.3 s of a 3.4 s small plan
        args = kareus_command(
            "plan",
            *self.job_args,
            "--methods",
            self._method(),
            "--points",
            str(points),
            "--band-samples",
            "0",
            "--no-figures",
            "--out",
            str(out),
        )
        if calibration is not None:
            args += ["--calibration", str(calibration)]
        from kareus_megatron.hardware.device import backend_from_env

        if backend_from_env(self.ctl.session.backend) == "simulated":  # plan for its own clock-call latency
            from kareus_megatron.hardware.device.sim_model import latency_from_env

            args += ["--clock-latency-ms", repr(latency_from_env() * 1000.0)]
        if max_time_s is not None:
            args += ["--max-time", repr(max_time_s * (1 + 1e-9))]
        self._run(args, f"kareus plan ({tag})")
        return out

    def _wait_for(self, last: int) -> Any:
        from kareus_megatron.report.runlog import read_run_log

        deadline = time.monotonic() + LOG_WAIT_S
        while True:
            try:
                log = self._read(read_run_log)
                its = {r["iteration"] for r in log.iterations}
                if last in its and last not in log.partial:
                    return log
            except KareusError:
                pass
            if time.monotonic() > deadline or self.stopped.is_set():
                raise AutoError(
                    f"the run log {self.ctl.log_dir} did not get iteration {last} from every rank in "
                    f"{LOG_WAIT_S:.0f} s (is it on a file system every rank shares?)"
                )
            time.sleep(max(POLL_S, READ_SPACING * self._read_s))

    def _read(self, reader: Any) -> Any:
        """The run log, read with `reader`; remembers how long it took (s)."""
        t0 = time.monotonic()
        try:
            return reader(self.ctl.log_dir)
        finally:
            self._read_s = time.monotonic() - t0

    def _replan(self, first: int, last: int) -> None:
        log = self._wait_for(last)
        version = self.ctl.version + 1
        calib = self.dir / f"calib-{version}.json"
        self._run(
            kareus_command(
                "calibrate",
                "--from-log",
                self.ctl.log_dir,
                "--plan",
                str(self.base_file),
                "--force",
                "--iterations",
                f"{first}:{last}",
                "--seconds",
                repr(self._window_s()),
                "-o",
                str(calib),
            ),
            "kareus calibrate --from-log",
        )
        objective = self.ctl.settings.objective
        out = self._plan(
            version,
            calib,
            "calibrated",
            max_time_s=objective.bound if objective.kind == MAX_TIME else None,
            points=2 if objective.kind in (ISO_TIME, MIN_ENERGY, MAX_TIME) else DENSE_POINTS,
        )
        mega = select_frontier_points(out, "all", method=MEGATRON, allow_all=True)[0]
        if objective.kind == ISO_TIME:
            out = self._plan(version, calib, "calibrated, iso-time", max_time_s=mega.time_s * (1 + ISO_REL_TOL))
        points = select_frontier_points(out, "all", method=self._method(), allow_all=True)
        chosen = select_point(points, objective, reference_time_s=mega.time_s)
        fmax = self.ctl.clocks[0]
        top = {"profile_mhz": fmax, "plan_version": self.ctl.version}
        before = against(log, load_plan(self.reference_plan), top) if self.reference_plan else Verdict(0)
        after = against(log, load_plan(mega.plan_path), top)
        self.ctl._event(
            "calibrated",
            plan_version=version,
            calibration=str(calib),
            iterations=[first, last],
            max_clock_iterations=after.iterations,
            measured_time_s=after.time_s,
            measured_energy_j=after.energy_j,
            error_before_time=before.error_time,
            error_before_energy=before.error_energy,
            error_after_time=after.error_time,
            error_after_energy=after.error_energy,
            objective=str(objective),
            point=f"{chosen.method}-{chosen.index:02d}",
            plan=str(chosen.plan_path),
        )
        plan = load_plan(chosen.plan_path)
        self.ctl.post(1, version, plan.model_dump_json())

    def _check(self) -> None:
        from kareus_megatron.report.runlog import read_run_log

        if time.monotonic() < self._next_check:
            return
        watching = self.watching
        assert watching is not None
        version, plan = watching
        try:
            log = self._read(read_run_log)
        except KareusError:
            return
        finally:
            self._next_check = time.monotonic() + max(CHECK_S, READ_SPACING * self._read_s)
        window = self.ctl.settings.drift_window
        v = against(log, plan, {"plan_version": version, "phase": "plan"}, last=window)
        if v.iterations < window or self.watching is not watching:
            return
        et, ee, n = v.error_time, v.error_energy, v.iterations
        bad = [x for x in (et, ee) if x is not None and abs(x) > self.ctl.settings.drift_threshold]
        fields = dict(
            plan_version=version,
            iterations=n,
            error_time=et,
            error_energy=ee,
            threshold=self.ctl.settings.drift_threshold,
        )
        if not bad:
            if self._checked != version:  # the model error on the run after calibration, once per plan
                self._checked = version
                self.ctl._event("checked", **fields)
            return
        self.watching = None
        self.ctl._event("drift", **fields)
        self.ctl.say(
            f"measured iteration time {_pct(et)} / energy {_pct(ee)} against plan {version}'s prediction "
            f"over the last {n} iterations; re-profiling and re-planning"
        )
        self.ctl.post(2)

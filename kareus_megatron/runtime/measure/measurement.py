"""Per-iteration measurement: each rank appends its own iteration time (s) and GPU energy (J) to its own file.

An *iteration* is one training call of the framework's schedule, from entry to exit; on a GPU both
points are GPU-aligned (the clock client's MarkTicket, filled off the training thread once the GPU has
reached them), on a CPU they are ``time.monotonic()``. Energy comes from the device's counter (NVML:
total-energy counter; simulated: the power model).

Layout: ``--kareus-log DIR`` is a directory; global rank r appends to ``DIR/rank-NNNNN.jsonl``
(rank_files.RANK_FILE, r with 5 digits), one O_APPEND ``os.write`` per line (jsonl.JsonlAppender), so no line
depends on any other rank and nothing needs a collective. The first line is a header::

    {"kind": "header", "format": RANK_LOG_FORMAT, "rank": r, "world": N, "pp_rank": s, "pp": P, "tp": ...,
     "cp": ..., "dp": ..., "num_microbatches": m, "micro_batch_size": b, "plan": ..., "plan_sha256": ...,
     "gpu": ..., "backend": "simulated"|"nvml", "clock_control": bool, "local_rank": l, "gpu_index": g,
     "gpu_uuid": ..., "gpu_name": ..., ...}

written when the rank knows its pipeline stage (``set_stage``, at validation before the first step, or
with the first iteration). A run refused before step 1 writes no header and leaves no file, and
``--kareus-log-mode new`` replaces a rank file without an iteration line, so the corrected rerun
starts in the same directory. A run whose overlap engine built SM-limited NCCL communicators adds
``"comm_groups": [{"comm_sms": n|null, "kind": "tp"|"cp", "init_s": s, "memory_bytes": b|null, "shared": bool}]``
(runtime/overlap/comm_groups.py; null comm_sms: the shared parent). Then one line per iteration::

    {"kind": "iteration", "iteration": i, "t_start": s, "t_end": s, "time_s": T, "energy_j": E,
     "temperature_c": C, "sm_clock_mhz": F, "clock_stale": n, "clock_errors": n, "instructions": {...}, **tags}

``temperature_c`` is the GPU temperature at the end mark (°C), ``sm_clock_mhz`` the clock the controller had
locked then (MHz; null when none), ``clock_stale``/``clock_errors`` how many of the clock calls between the
iteration's two marks were skipped as stale or failed (``clock_applied``/``clock_late``: applied, and of those made
late) (the controller's counts on its mark answers; on
NVML, decided meanwhile, so an iteration may be charged a neighbour's); each null where unknown (no clock
controller, measurement only). ``instructions`` (runtime/measure/instruction_times.py; KAREUS_LOG_INSTRUCTIONS=0:
left out) holds each planned instruction's time, as columns; ``power`` (where the clock controller samples
the GPU: runtime/clock/power_samples.py) the GPU's power samples over the iteration, {t0, dt_s, w, reading}.
*Tags* (``set_tags``: e.g. phase, plan_sha256,
plan_version) are keys every iteration that begins after they are set carries; *events* (``event``) are
lines ``{"kind": "event", "event": name, "iteration": i, "t": s, ...}`` (i: the iteration in progress,
else the next; t: time.monotonic()) written through the same writer, after every iteration that ended
before them. All of these keys are optional to readers: older logs keep RANK_LOG_FORMAT.

The GPU a rank measured: ``gpu_index`` is its NVML index (the simulated backend's index too),
``gpu_uuid``/``gpu_name`` are written only where they are known (CUDA's device properties once CUDA is
initialised at validation, or the clock controller's ready message); readers treat every one of these
keys as optional, so logs from before them stay readable under the same RANK_LOG_FORMAT.

A *sink* (IterationSink; runtime/frameworks/megatron_writers.py) is the one hook for other consumers of the figures:
``iteration_ended(i)`` on the training thread right after the end mark (must not wait), ``record(rec)``
on whichever thread writes a line, once per iteration line, and ``close()`` after the last line.

The training thread only takes the two marks and appends to a deque; a writer thread writes every
iteration whose marks have resolved, every FLUSH_INTERVAL_S (0.25 s). ``drain()`` writes what has
resolved now (signal handlers, atexit); ``close()`` waits (bounded) for the rest. report/runlog.py merges
the rank files (time = max over ranks, energy = sum, stages by pp_rank, and each rank's own figures kept for
the per-GPU view).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from kareus_megatron.errors import ConfigError
from kareus_megatron.jsonl import JsonlAppender
from kareus_megatron.runtime.measure.instruction_times import InstructionTimes, TimingEvents, instructions_from_env
from kareus_megatron.runtime.measure.marks import count_growth, finite, resolve, wait_for
from kareus_megatron.runtime.measure.rank_files import remove_if_empty
from kareus_megatron.runtime.process_env import cuda_device_identity

RANK_LOG_FORMAT = "kareus-rank-log/1"
RECENT_RECORDS = 1000  # lines kept in memory (IterationMeter.records); the file holds them all
ANSWER_WAIT_S = 0.05  # how long the writer waits per period for marks still being answered
FLUSH_INTERVAL_S = 0.25  # the writer thread's period: a resolved iteration is on disk this long after
# The keys an iteration line has of its own (a tag may not take one); report/measurements.py reads the rest as tags.
RECORD_KEYS = frozenset(
    {
        "kind",
        "iteration",
        "t_start",
        "t_end",
        "time_s",
        "energy_j",
        "temperature_c",
        "sm_clock_mhz",
        "clock_stale",
        "clock_errors",
        "clock_applied",
        "clock_late",
        "instructions",
        "power",
        "rank",
        "pp_rank",
    }
)
EVENT_KEYS = frozenset({"kind", "event", "iteration", "t"})
_TAG_TYPES = (str, int, float, bool)


class IterationSink(Protocol):
    """Another consumer of each iteration's figures (see the module doc); none of its methods may raise."""

    def iteration_ended(self, iteration: int) -> None: ...

    def record(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class IterationMeter:
    """Marks each iteration's start and end on the training thread; a writer thread appends resolved ones."""

    def __init__(
        self,
        log: JsonlAppender | None,
        mark: Callable[[], Any] | None = None,
        header: dict[str, Any] | None = None,
        flush_interval_s: float | None = FLUSH_INTERVAL_S,
        instructions: bool | None = None,
    ) -> None:
        """`log`: this rank's open file (open_rank_log) or None; `mark()` returns a ticket with
        .wait()/.done/.t/.energy_j (and .info: the controller's answer) (the clock client), None: CPU time
        only. `flush_interval_s` None: no writer thread (only drain/close write). `instructions`: log each
        instruction's time (None: KAREUS_LOG_INSTRUCTIONS; ConfigError for a bad value)."""
        self._log_instructions = instructions_from_env() if instructions is None else bool(instructions)
        self._times: InstructionTimes | None = None  # set by instruction_callables (validation)
        self._tags: dict[str, Any] = {}  # replaced, never changed in place: iterations keep their snapshot
        self._start_tags: dict[str, Any] = {}
        self._running: int | None = None  # the iteration in progress
        self._next = 0  # the iteration after the last one that ended
        self._mark = mark
        self._log = log
        self._header = dict(header or {})
        self._header_written = False
        # (iteration, start point, end point, tags, instruction stamps) or an event line (dict)
        self._queue: deque[tuple[int, Any, Any, dict[str, Any], Any] | dict[str, Any]] = deque()
        self._start: Any = None
        self._lock = threading.RLock()  # reentrant: a signal handler may drain inside a drain
        self.pp_rank = 0
        self._staged = False  # set_stage has run: the header can be written
        self.records: deque[dict[str, Any]] = deque(maxlen=RECENT_RECORDS)  # the latest lines written
        self.sink: IterationSink | None = None  # set by attach_sink (the training thread, at validation)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if log is not None and flush_interval_s is not None:
            self._thread = threading.Thread(
                target=self._run, args=(flush_interval_s,), name="kareus-log-writer", daemon=True
            )
            self._thread.start()

    def _point(self) -> Any:
        """A measurement point: the clock client's ticket, or the time now (s) without a client."""
        mark = self._mark
        return mark() if mark is not None else time.monotonic()

    def begin(self, iteration: int) -> None:
        """Mark the start of `iteration` (training thread; does not wait)."""
        self._start = self._point()
        self._start_tags, self._running = self._tags, iteration
        if self._times is not None:
            self._times.start()

    def end(self, iteration: int) -> None:
        """Mark the end of `iteration` and queue it for the writer (training thread; does not wait)."""
        if self._start is None:
            return
        end = self._point()
        stamps = self._times.take() if self._times is not None else None
        sink = self.sink
        if sink is not None:  # before the writer can see the iteration
            sink.iteration_ended(iteration)
        self._queue.append((iteration, self._start, end, self._start_tags, stamps))
        self._start, self._running, self._next = None, None, iteration + 1

    def instruction_callables(
        self, begins: Callable[[int, int, int, str], None] | None, ends: Callable[[], None]
    ) -> tuple[Callable[[int, int, int, str], None] | None, Callable[[], None]]:
        """The session's per-instruction callables, timed for the ``instructions`` columns (as they are
        when the columns are off or nothing is planned: `begins` None). Call at validation (training
        thread): a GPU's timing events are chosen there."""
        if begins is None or not self._log_instructions:
            return begins, ends
        if self._times is None:
            self._times = InstructionTimes(TimingEvents.available())
        return self._times.wrap(begins, ends)

    def set_plan(self, instructions: Sequence[Any]) -> None:
        """This rank's planned instructions (plan.stages[pp_rank].instructions): what the columns name
        (chunk, microbatch, kind, clock) for every iteration that ends from now on."""
        if self._times is None:
            self._times = InstructionTimes(TimingEvents.available()) if self._log_instructions else None
        if self._times is not None:
            self._times.set_plan(instructions)

    def set_tags(self, **tags: Any) -> None:
        """Every iteration that begins from now on carries these keys (a None value removes a tag);
        ConfigError for a key the line has of its own or a value that is not a str, number or bool."""
        for key, value in tags.items():
            if key in RECORD_KEYS:
                raise ConfigError(f"run-log tag {key!r} is a key of the iteration line itself; choose another name")
            if value is not None and not isinstance(value, _TAG_TYPES):
                raise ConfigError(f"run-log tag {key}={value!r} must be a string, number or bool")
        merged = {**self._tags, **tags}
        self._tags = {k: v for k, v in merged.items() if v is not None}

    @property
    def tags(self) -> dict[str, Any]:
        """The tags in force (a copy)."""
        return dict(self._tags)

    def event(self, name: str, **fields: Any) -> None:
        """Append an event line (see the module doc) after every iteration queued so far (any thread)."""
        if not isinstance(name, str) or not name:
            raise ConfigError(f"run-log event name {name!r} must be a non-empty string")
        clash = sorted(EVENT_KEYS & fields.keys())
        if clash:
            raise ConfigError(f"run-log event {name!r}: field(s) {', '.join(clash)} are the event line's own keys")
        running = self._running
        self._queue.append(
            {
                "kind": "event",
                "event": name,
                "iteration": self._next if running is None else running,
                "t": time.monotonic(),
                **fields,
            }
        )

    def attach_sink(self, sink: IterationSink | None) -> None:
        """Hand every later iteration to `sink` too (None: no sink); see the module doc."""
        with self._lock:
            self.sink = sink

    def set_stage(self, pp_rank: int, **fields: Any) -> None:
        """This rank's pipeline stage and parallel sizes (known at validation); writes the header now."""
        with self._lock:
            self.pp_rank = pp_rank
            self._staged = True
            self._header.update({k: v for k, v in fields.items() if v is not None})
            for key, value in cuda_device_identity().items():
                self._header.setdefault(key, value)
            self._write_header()

    def _write_header(self) -> None:
        if self._header_written:
            return
        self._header_written = True
        if self._log is not None:
            self._log.write({"kind": "header", "format": RANK_LOG_FORMAT, **self._header, "pp_rank": self.pp_rank})

    def drain(self, wait_s: float = 0.0, to_sink: bool = True) -> int:
        """Write every queued iteration whose marks have resolved (waiting up to `wait_s` s in all for the
        rest, which stay queued); return how many were written. Any thread, signal handlers included.

        The sink is fed after the lock is released, and not at all with ``to_sink=False`` (signal
        handlers: the interrupted thread may hold a lock of the sink's writer, e.g. TensorBoard's)."""
        deadline = time.monotonic() + wait_s
        written: list[dict[str, Any]] = []
        with self._lock:
            queue = self._queue
            while queue:
                item = queue[0]
                if isinstance(item, dict) and not self._staged and not self._stop.is_set():
                    break  # an event before validation waits: the header (with this rank's stage) comes first
                if not isinstance(item, dict) and not (wait_for(item[1], deadline) and wait_for(item[2], deadline)):
                    break
                record = self._write_item(queue.popleft())
                if record is not None:
                    written.append(record)
            sink = self.sink if to_sink else None
        if sink is not None:
            for record in written:
                sink.record(record)
        return len(written)

    def close(self, wait_s: float = 5.0) -> None:
        """Stop the writer, write everything (unresolved marks after `wait_s` s: null figures), close."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)
        with self._lock:
            if not self._staged and not any(isinstance(item, tuple) for item in self._queue):
                self._queue.clear()  # events of a run that never began (its stage unknown): not written
            self.drain(wait_s)
            rest = [
                r for r in (self._write_item(self._queue.popleft()) for _ in range(len(self._queue))) if r is not None
            ]
            if self.sink is not None:
                for record in rest:
                    self.sink.record(record)
            if self._staged or self._header_written:  # never a header before this rank knows its stage
                self._write_header()
            if self._log is not None:
                self._log.close()
                if not self._header_written:  # refused before step 1: leave no file behind
                    remove_if_empty(self._log.path)
                self._log = None
            sink, self.sink = self.sink, None
        if sink is not None:
            sink.close()

    def _run(self, interval_s: float) -> None:
        # A CPU client's marks are answered lazily, when someone waits for them: waiting a little here
        # asks for the answers, so a completed iteration reaches the disk within about one period.
        while not self._stop.wait(interval_s):
            try:
                self.drain(wait_s=ANSWER_WAIT_S)
            except OSError:  # pragma: no cover - disk full etc.: keep training, retry next period
                continue

    def _write_item(self, item: tuple[int, Any, Any, dict[str, Any], Any] | dict[str, Any]) -> dict[str, Any] | None:
        """Write a queued iteration (returned, for the sink) or event line (None)."""
        if isinstance(item, dict):
            self._write_header()
            if self._log is not None:
                self._log.write(item)
            return None
        return self._write(*item)

    def _write(
        self, iteration: int, p0: Any, p1: Any, tags: dict[str, Any] | None = None, stamps: Any = None
    ) -> dict[str, Any]:
        t0, e0 = resolve(p0)
        t1, e1 = resolve(p1)
        info0, info1 = getattr(p0, "info", None) or {}, getattr(p1, "info", None) or {}
        clock = info1.get("sm_clock_mhz")
        record = {
            "kind": "iteration",
            "iteration": iteration,
            "t_start": finite(t0),
            "t_end": finite(t1),
            "time_s": finite(t1 - t0),
            "energy_j": finite(e1 - e0),
            "temperature_c": finite(info1.get("temperature_c")),
            "sm_clock_mhz": clock if isinstance(clock, int) else None,
            "clock_stale": count_growth(info0, info1, "stale"),
            "clock_errors": count_growth(info0, info1, "errors"),
            "clock_applied": count_growth(info0, info1, "applied"),
            "clock_late": count_growth(info0, info1, "late"),
        }
        if isinstance(info1.get("power"), dict):  # the GPU's power samples over the iteration (clock/power_samples.py)
            record["power"] = info1["power"]
        if stamps is not None and self._times is not None:
            record["instructions"] = self._times.columns(stamps)
        if tags:
            record.update(tags)
        self._write_header()
        if self._log is not None:
            self._log.write(record)
        self.records.append(record)
        return record

"""Clock client: the training side of the clock controller (controller.py).

The training thread only hands over "instruction begins/ends" and "mark"; nothing it calls waits for
the device. How the messages travel is chosen once, here, by whether there are CUDA events to wait for:
``GpuTransport`` (transport_gpu.py: a forwarder thread waits for each event, then passes the message on)
or ``CpuTransport`` (transport_cpu.py: records gather and a sender thread writes them once per
coalescing window). The client's ``instruction_begins``, ``instruction_ends`` and ``mark`` are the
transport's own methods, so the per-instruction path has no layer in between.

The controller runs in a side process per local GPU (``start_process``; process.py) or in a thread of
this process (``start_thread``: tests, single-process use). A *mark* is a measurement point: the
controller answers it with the GPU energy (J) at that point (on a CPU it holds the answers until the
client waits for one).
"""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Callable
from typing import Any

from kareus_megatron.errors import DeviceUnavailableError, KareusError
from kareus_megatron.hardware.device.base import GPUDevice, SimulationHooks
from kareus_megatron.runtime.clock import process
from kareus_megatron.runtime.clock.transport import MarkTicket, Transport, coalesce_from_env
from kareus_megatron.runtime.clock.transport_cpu import CPU_COALESCE_S, CpuTransport
from kareus_megatron.runtime.clock.transport_gpu import GpuTransport


def _error_class(name: Any) -> type[KareusError]:
    from kareus_megatron import errors

    cls = vars(errors).get(str(name))
    return cls if isinstance(cls, type) and issubclass(cls, KareusError) else DeviceUnavailableError


class ClockClient:
    """Training-side handle of one controller; every public method returns without device work.

    ``instruction_begins(iteration, index, mhz, kind)``: instruction `index` of `iteration` begins at
    `mhz` MHz; ``instruction_ends()``: it ends (only a simulated GPU needs it); ``mark()``: a
    measurement point, returning a ``MarkTicket`` that fills with its time (s) and energy (J)."""

    def __init__(
        self,
        event_factory: Callable[[], Any] | None = None,
        coalesce_s: float | None = None,
        bind_thread: Callable[[], None] | None = None,
        recycle: Callable[[Any], None] | None = None,
    ) -> None:
        """`event_factory` makes a recorded CUDA event (GPU); None means CPU timing (time.monotonic).
        `coalesce_s`: how long messages gather before one write (default: KAREUS_CLOCK_COALESCE_MS,
        else CPU_COALESCE_S on CPU, where timestamps are taken at hand-over, and 0 on GPU, where
        waiting on events paces the forwarder). `bind_thread` runs in the forwarder before its first
        wait (``CudaEvents.bind_thread``: the training thread's CUDA device); `recycle` gets each event back
        once the forwarder has waited on it (``CudaEvents.give_back``: the factory's pool)."""
        transport: Transport
        if event_factory is None:
            transport = CpuTransport(coalesce_from_env(CPU_COALESCE_S) if coalesce_s is None else coalesce_s)
        else:
            transport = GpuTransport(
                event_factory, coalesce_from_env(0.0) if coalesce_s is None else coalesce_s, bind_thread, recycle
            )
        self.transport = transport
        self.instruction_begins: Callable[[int, int, int, str], None] = transport.instruction_begins
        self.instruction_ends: Callable[[], None] = transport.instruction_ends
        self.mark: Callable[[], MarkTicket] = transport.mark
        self._proc: subprocess.Popen[bytes] | None = None
        self._controller_thread: threading.Thread | None = None

    # -- state -------------------------------------------------------------------------------
    @property
    def clock_control(self) -> bool:
        """Whether clocks are set (False: the controller may not lock clocks; energy is still measured)."""
        return self.transport.clock_control

    @property
    def counts(self) -> dict[str, int] | None:
        """The controller's decision counts (applied, stale, unchanged, errors), known after ``close``."""
        return self.transport.counts

    @property
    def closed(self) -> bool:
        return self.transport.closed

    @property
    def gone(self) -> bool:
        """True once the controller has ended (later marks answer NaN at once)."""
        return self.transport.gone

    @property
    def coalesce_s(self) -> float:
        """The gathering window in effect (s)."""
        return self.transport.coalesce_s

    @property
    def controller_pid(self) -> int | None:
        """PID of the side process (None in thread mode)."""
        return self._proc.pid if self._proc is not None else None

    # -- starting ----------------------------------------------------------------------------
    def start_process(
        self,
        index: int,
        backend: str | None = None,
        gpu: str | None = None,
        log_path: str | None = None,
        timeout_s: float = 60.0,
        uuid: str | None = None,
        power_limit_w: float | None = None,
    ) -> dict[str, Any]:
        """Start the side process for GPU `index` (NVML's; `uuid` picks it when given); return its
        ``ready`` message or raise."""
        self._proc = proc = process.spawn(index, backend, gpu, log_path, uuid, power_limit_w)
        assert proc.stdin is not None and proc.stdout is not None
        self.transport.connect_pipe(proc.stdin.fileno())
        threading.Thread(
            target=self.transport.read_replies, args=(proc.stdout,), name="kareus-clock-reader", daemon=True
        ).start()
        return self._await_ready(timeout_s)

    def start_thread(
        self,
        device: GPUDevice,
        *,
        simulation: SimulationHooks | None,
        log_path: str | None = None,
        power_limit_w: float | None = None,
    ) -> dict[str, Any]:
        """Run the controller in a thread of this process around `device`; `simulation`: its
        SimulationHooks when it is a simulated GPU (``hardware.device.simulation_of``), else None."""
        from kareus_megatron.hardware.device import power_reader_of
        from kareus_megatron.runtime.clock.controller import ClockController

        transport = self.transport
        ctl = ClockController(
            device,
            transport.on_reply,
            simulation=simulation,
            log_path=log_path,
            power_limit_w=power_limit_w,
            power=power_reader_of(device),
        )
        transport.connect(ctl.feed)
        transport.on_reply(ctl.probe())
        self._controller_thread = threading.Thread(target=ctl.run, name="kareus-clock-controller", daemon=True)
        self._controller_thread.start()
        return self._await_ready(5.0)

    def _await_ready(self, timeout_s: float) -> dict[str, Any]:
        transport = self.transport
        if not transport.wait_ready(timeout_s):
            self._kill()
            raise DeviceUnavailableError(f"the clock controller did not start within {timeout_s:.0f} s")
        ready = transport.ready
        if ready is None:  # the process ended before saying anything
            self._kill()
            status = self._proc.poll() if self._proc is not None else None
            raise DeviceUnavailableError(
                f"the clock controller exited before it was ready (exit status {status}); "
                "run `kareus env` to check the GPU backend"
            )
        if ready.get("op") == "error":
            if ready.get("type") == "ClockControlError":
                transport.begin(clock_control=False, want_ends=bool(ready.get("busy_events", False)))
                return ready  # the caller decides: fail, or warn and train at default clocks
            self._kill()
            raise _error_class(ready.get("type"))(str(ready.get("message")))
        transport.begin(clock_control=True, want_ends=bool(ready.get("busy_events", True)))
        return ready

    # -- requests and closing ----------------------------------------------------------------
    def reset(self, timeout_s: float = 5.0) -> bool:
        """Reset clocks after every message handed over before; wait up to `timeout_s` for it."""
        if self.transport.closed:
            return True
        return self.transport.request("reset", timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        """Reset clocks, stop the controller and wait for it (at most about `timeout_s`)."""
        transport = self.transport
        if transport.closed:
            return
        transport.request("close", timeout_s)
        transport.shut()
        if self._controller_thread is not None:
            self._controller_thread.join(timeout_s)
        if self._proc is not None:
            try:
                self._proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._kill()

    def _kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()  # SIGTERM: the controller resets clocks, then exits
            try:
                self._proc.wait(5.0)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()

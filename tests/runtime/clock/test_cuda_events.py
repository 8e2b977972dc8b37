"""CUDA events of a GPU run, against a stand-in torch.cuda: blocking events, the forwarder's device."""

from __future__ import annotations

import threading
import types

from clock_util import wait_for

from kareus_megatron.runtime.clock.client import ClockClient
from kareus_megatron.runtime.clock.transport_gpu import CudaEvents


class FakeCuda:
    """Records Event kwargs and set_device per thread; the current device is per thread, as in CUDA."""

    def __init__(self, training_device: int) -> None:
        self.event_kwargs: list[dict] = []
        self.set_device_calls: list[tuple[str, int]] = []
        self.sync_devices: list[int] = []
        self._local = threading.local()
        self._training_device = training_device
        cuda = self

        class Event:
            def __init__(self, **kwargs):
                cuda.event_kwargs.append(kwargs)

            def record(self):
                pass

            def synchronize(self):
                cuda.sync_devices.append(cuda.current_device())

        self.Event = Event

    def current_device(self) -> int:
        default = self._training_device if threading.current_thread() is threading.main_thread() else 0
        return getattr(self._local, "device", default)

    def set_device(self, index: int) -> None:
        self.set_device_calls.append((threading.current_thread().name, index))
        self._local.device = index


def test_events_are_blocking_and_waited_on_the_training_threads_device():
    cuda = FakeCuda(training_device=3)
    events = CudaEvents(types.SimpleNamespace(cuda=cuda), fallback_device=1)
    client = ClockClient(event_factory=events, bind_thread=events.bind_thread)
    ready = []
    client.transport.connect(lambda data: ready.append(data))
    client.transport.begin(clock_control=True, want_ends=False)
    for k in range(3):
        client.instruction_begins(0, k, 1200, "forward")
    assert wait_for(lambda: len(cuda.sync_devices) == 3, 5)
    client.transport.shut()
    assert cuda.event_kwargs and all(kw == {"blocking": True} for kw in cuda.event_kwargs)
    assert events.device == 3
    # the forwarder set its device once, before its first wait, to the training thread's
    assert [d for _, d in cuda.set_device_calls] == [3]
    assert cuda.set_device_calls[0][0] != threading.main_thread().name
    assert cuda.sync_devices == [3, 3, 3]  # never waited on device 0


def test_bind_before_any_event_uses_the_fallback_device():
    cuda = FakeCuda(training_device=2)
    events = CudaEvents(types.SimpleNamespace(cuda=cuda), fallback_device=1)
    events.bind_thread()
    assert cuda.set_device_calls[-1][1] == 1


def test_events_come_back_to_the_pool_once_waited_on():
    cuda = FakeCuda(training_device=0)
    events = CudaEvents(types.SimpleNamespace(cuda=cuda))
    client = ClockClient(event_factory=events, bind_thread=events.bind_thread, recycle=events.give_back)
    client.transport.connect(lambda data: None)
    client.transport.begin(clock_control=True, want_ends=False)
    for k in range(3):
        client.instruction_begins(0, k, 1200, "forward")
    assert wait_for(lambda: len(cuda.sync_devices) == 3 and len(events._free) == 3, 5)
    for k in range(3, 9):  # the training thread records the pool's events again: none made while it has some
        client.instruction_begins(0, k, 1200, "forward")
        assert wait_for(lambda n=k + 1: len(cuda.sync_devices) == n, 5)
    client.transport.shut()
    assert len(cuda.event_kwargs) == 3, cuda.event_kwargs

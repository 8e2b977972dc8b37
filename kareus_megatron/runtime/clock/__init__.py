"""The runtime's clock path: each planned instruction's SM clock, set off the training thread.

Training side: client.py (``ClockClient``, what the patch and the session call) over one transport,
chosen when the client is made: transport_gpu.py (a forwarder thread waits on CUDA events) or
transport_cpu.py (records batched per coalescing window by a sender thread); transport.py is what both
share. Between them: wire.py (the byte format). Controller side: process.py (the side process per GPU,
``python -m kareus_megatron.runtime.clock.process``), controller.py (``ClockController``: decides and
calls ``device.set_sm_clock_mhz``), decisions.py (locked clock, counts, decision log), timeline.py (a
simulated GPU's input, on its own time line). sched.py: CPU scheduling of the helpers. Import the
modules themselves; this package module imports nothing (the side process runs one of them as
``__main__``).
"""

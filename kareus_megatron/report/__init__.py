"""Measured runs: the reader of run logs, the comparison with a plan (``kareus report``, per GPU too) and the measured
frontier of many runs (``kareus compare``).

May import hardware, workload, cost, plan and vocab; never runtime, search or torch, so a laptop reads
logs that a cluster wrote.
"""

"""The runtime: what runs inside the training process to execute a plan.

- process_env.py: which process and GPU this is (ranks, the GPU's NVML index and UUID).
- hooks.py: per-instruction listeners (which pipeline instruction runs next).
- session.py: one plan executing in one training process (clock client, meter, patch).
- session_signals.py: SIGTERM/SIGINT with a session (reset clocks, write what is measured, chain).
- frameworks/: the megatron-core and DeepSpeed patches and the training scripts' entry points.
- clock/: each planned instruction's SM clock, set off the training thread.
- overlap/: the overlap engine (layers run as 2 nanobatches, TP collectives overlapped).
- measure/: per-iteration time and energy per rank, per-instruction times (the run log).
- closed_loop/: ``--kareus-plan auto`` (profile, calibrate, plan, switch) and the simulated truth.
- selfcheck/: the validation kit's runtime checks.
"""

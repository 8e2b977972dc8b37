"""GPUs: presets, the board power model, and the devices the runtime drives.

- gpus.toml, gpus.py: GPU presets (every number with its source) read into frozen ``GPUSpec`` values.
- derive.py: power-model parameters derived from datasheet facts alone.
- power.py: board power (W) as a function of the SM clock (MHz) and of compute and memory activity.
- device/: the ``GPUDevice`` contract and its backends (nvml.py, sim.py), chosen at run time; stop_signals.py:
  SIGTERM/SIGHUP as an exception where a process locks clocks, so its `finally` resets them.
- measure.py: energy measurement on one GPU that holds still.
- validate.py: the device-level checks of `kareus validate` (identity, clocks, clock-change latency).
"""

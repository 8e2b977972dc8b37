"""Figures drawn with matplotlib, for the `kareus` commands that draw.

- units.py: axis units that scale with the data.
- timeline.py: one plan's pipeline timeline (a row per rank, a bar per instruction).
- frontier.py: the iteration time–energy frontier of each method, with its plans.
- power.py: the job's total power over time.
- report.py: a run report (per-iteration time against the prediction, per-stage energy).
- validate.py: a `kareus validate` report (measured kernels against the preset, clock latency).
"""

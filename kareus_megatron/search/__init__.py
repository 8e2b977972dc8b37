"""The planner: per-instruction options, the pipeline DAG, and its time–energy frontier.

- partition.py: cut one layer's op list at collectives and lay out the nanobatch overlap schedule.
- collective_list.py: the collectives costed for one instruction, in the overlap engine's issue order.
- tables.py: knob tables of one layer's partitions over clock × launch slot × comm SMs.
- compose.py: per-partition frontiers composed into per-instruction options.
- options.py: per-instruction time–energy options of each planning method.
- powercap.py: the ``powercap`` baseline (one board power limit, no clock locks).
- schedules.py: per-rank compute order of the pipeline schedules.
- pipeline.py: the pipeline DAG (instructions and their dependencies).
- frontier.py: Pareto frontiers of (time, energy) points.
- solver_options.py, solver.py, solver_lp.py, solver_local.py: the frontier solver (options, driver,
  LP/MILP, discrete repair).
- segments.py: clock segments the clock controller can apply, and the lag of every change.
- simulate.py: event simulation of a plan (start/end times, iteration time, energy).
- plan_power.py: a plan's power waveform and the frontier under a power bound.
- planner.py: every method of one configuration, options → DAG → frontier → chosen points.
"""

"""kareus-megatron: joint SM-clock and nanobatch-overlap planning for energy-efficient training.

Data flows top to bottom: hardware -> workload -> cost -> search -> plan -> runtime. The planner
(everything up to ``plan``) never imports torch; the runtime never imports ``search``.
"""

__version__ = "0.1.0"

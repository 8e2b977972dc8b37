"""kareus-megatron: joint SM-clock and nanobatch-overlap planning for energy-efficient training.

Data flows top to bottom: hardware -> workload -> cost -> search -> plan -> runtime. The planner
(everything up to ``plan``) never imports torch; the runtime never imports ``search``. The version
is the installed distribution's (pyproject.toml is its one source).
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("kareus-megatron")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

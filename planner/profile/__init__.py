"""The profile: per-node bytes and times, the timing store and the calibration (README.md).

The names of `profiler.py` are re-exported, so `from ckpt_planner.profile import ProfileConfig, profile`
works as when it was a module; `profile` here is the function (bound after the submodule is imported)."""

from .profiler import ProfileConfig, profile
from .record import CostProfiler

__all__ = ["CostProfiler", "ProfileConfig", "profile"]

"""The profile: per-node bytes and times, the timing store and the calibration (README.md).

`from ckpt_planner.profile import ProfileConfig, profile` still gives the names of `profile.py`, as when it
was a module: they resolve on first use, and `profile` stays the function (importing the submodule of that
name does not rebind it)."""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

_NAMES = ("ProfileConfig", "CostProfiler", "profile")


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        return getattr(importlib.import_module(".profile", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _Package(types.ModuleType):
    def __setattr__(self, name: str, value: Any) -> None:
        if name in _NAMES and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

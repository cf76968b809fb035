"""Capture: model + example inputs -> fx.GraphModule, and the graph facts later stages read (README.md).

The names of `trace.py` are re-exported, so `from ckpt_planner.capture import Capture, capture` works as
when it was a module; `capture` here is the function (bound after the submodule is imported)."""

from .trace import Capture, capture, flatten_for_graph, normalize_inputs

__all__ = ["Capture", "capture", "flatten_for_graph", "normalize_inputs"]

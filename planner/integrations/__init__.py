"""Training-framework callbacks that plan on the first batch and apply the plan in place.

    from ckpt_planner.integrations import TrainerPlanCallback      # transformers.Trainer
    from ckpt_planner.integrations import LightningPlanCallback    # lightning.Trainer

Each is imported on first use, so this package needs neither framework until then.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["TrainerPlanCallback", "LightningPlanCallback", "FirstBatchPlanner"]

_EXPORTS = {
    "TrainerPlanCallback": ("trainer", "transformers", "pip install transformers"),
    "LightningPlanCallback": ("lightning", "lightning", 'pip install lightning  (or: pip install "ckpt-planner[lightning]")'),
    "FirstBatchPlanner": ("core", None, ""),
}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'ckpt_planner.integrations' has no attribute {name!r}")
    module, needs, hint = _EXPORTS[name]
    if needs is not None and importlib.util.find_spec(needs) is None:
        raise ImportError(f"{name} needs the {needs!r} package, which is not installed: {hint}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value

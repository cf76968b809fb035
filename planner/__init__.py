"""ckpt-planner: automatic activation-checkpoint placement for PyTorch.

    from ckpt_planner import optimize
    plan = optimize(model, example_inputs, budget_gb=10)
    loss = loss_fn(plan.module(batch), target); loss.backward()

Names are imported on first use, so `import ckpt_planner.solvers` (plain data, no torch)
never loads torch.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> submodule that defines it
_EXPORTS = {
    "optimize": "api",
    "Planner": "api",
    "verify": "verify",
    "Plan": "plan",
    "Report": "verify",
    "capture": "capture",
    "Capture": "capture",
    "profile": "profile",
    "ProfileConfig": "profile",
    "CostGraph": "graph",
    "PlannerError": "errors",
    "InputError": "errors",
    "NothingToPlanError": "errors",
    "UnplannableError": "errors",
    "ShapeError": "errors",
    "CaptureError": "errors",
    "ProfileError": "errors",
    "PlanFileError": "errors",
    "PlanMismatchError": "errors",
    "InfeasibleBudgetError": "errors",
    "UnknownSolverError": "errors",
}

__all__ = [
    "optimize",
    "Planner",
    "verify",
    "Plan",
    "Report",
    "capture",
    "Capture",
    "profile",
    "ProfileConfig",
    "CostGraph",
    "PlannerError",
    "InputError",
    "NothingToPlanError",
    "UnplannableError",
    "ShapeError",
    "CaptureError",
    "ProfileError",
    "PlanFileError",
    "PlanMismatchError",
    "InfeasibleBudgetError",
    "UnknownSolverError",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ckpt_planner' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip this hook
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    """Keeps `ckpt_planner.verify` (and capture, profile) the functions: importing the submodule of
    the same name would otherwise rebind the package attribute to the module."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _EXPORTS and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


if TYPE_CHECKING:
    from .api import Planner, optimize
    from .capture import Capture, capture
    from .errors import (
        CaptureError,
        InfeasibleBudgetError,
        InputError,
        PlanFileError,
        PlanMismatchError,
        PlannerError,
        ProfileError,
        ShapeError,
        UnknownSolverError,
        UnplannableError,
    )
    from .graph import CostGraph
    from .plan import Plan
    from .profile import ProfileConfig, profile
    from .verify import Report, verify

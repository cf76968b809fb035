"""ckpt-planner: automatic activation-checkpoint placement for PyTorch.

    from ckpt_planner import optimize
    plan = optimize(model, example_inputs, budget_gb=10)
    loss = loss_fn(plan.module(batch), target); loss.backward()

Names are imported on first use, so `import ckpt_planner.solvers` (plain data, no torch)
never loads torch. The stages are subpackages: `ckpt_planner.capture.capture(model, inputs)` and
`ckpt_planner.profile.profile(capture)` run the first two on their own.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "optimize": "api",
    "Planner": "api",
    "verify": "verification",
    "Report": "verification",
    "Plan": "plan",
    "Budget": "settings",
    "PlanRequest": "settings",
    "Setup": "settings",
    "Capture": "capture.trace",
    "ProfileConfig": "profile.profiler",
    "CostGraph": "profile.graph",
    "PlannerError": "errors",
    "InputError": "errors",
    "NothingToPlanError": "errors",
    "UnplannableError": "errors",
    "ShapeError": "errors",
    "CaptureError": "errors",
    "ProfileError": "errors",
    "PlanFileError": "errors",
    "PlanMismatchError": "errors",
    "InfeasibleBudgetError": "solvers.registry",
    "UnknownSolverError": "solvers.registry",
    "export_for_cli": "cli.export",
    "calibrate": "integrations.calibrate",
}

__all__ = [
    "optimize",
    "Planner",
    "verify",
    "Report",
    "Plan",
    "Budget",
    "PlanRequest",
    "Setup",
    "Capture",
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
    "export_for_cli",
    "calibrate",
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


if TYPE_CHECKING:
    from .api import Planner, optimize
    from .capture.trace import Capture
    from .cli.export import export_for_cli
    from .errors import (
        CaptureError,
        InputError,
        PlanFileError,
        PlanMismatchError,
        PlannerError,
        ProfileError,
        ShapeError,
        UnplannableError,
    )
    from .integrations.calibrate import calibrate
    from .plan import Plan
    from .profile.graph import CostGraph
    from .profile.profiler import ProfileConfig
    from .settings import Budget, PlanRequest, Setup
    from .solvers.registry import InfeasibleBudgetError, UnknownSolverError
    from .verification import Report, verify

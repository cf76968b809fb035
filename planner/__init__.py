"""ckpt-planner: automatic activation-checkpoint placement for PyTorch.

    plan = optimize(model, example_inputs, budget_gb=10)
    loss = loss_fn(plan.module(batch), target); loss.backward()
"""

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
    UnknownSolverError,
)
from .graph import CostGraph
from .plan import Plan
from .profile import ProfileConfig, profile
from .verify import Report, verify

__version__ = "0.1.0"

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
    "CaptureError",
    "ProfileError",
    "PlanFileError",
    "PlanMismatchError",
    "InfeasibleBudgetError",
    "UnknownSolverError",
]

"""ckpt-planner: automatic activation-checkpoint placement for PyTorch.

    from ckpt_planner import optimize
    plan = optimize(model, example_inputs, budget_gb=10)
    loss = loss_fn(plan.module(batch), target); loss.backward()

Names are imported on first use, so `import ckpt_planner.solvers` (plain data, no torch)
never loads torch.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
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
    "capture": "capture.capture",
    "Capture": "capture.capture",
    "profile": "profile.profile",
    "ProfileConfig": "profile.profile",
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

# Module paths from before the stage folders (`ckpt_planner.loading`, `ckpt_planner.compiled`, ...): each
# imports as its module's new home, so code and apply folders written against them keep working.
# (`ckpt_planner.capture` and `ckpt_planner.profile` are folders now that re-export their old names.)
_MOVED = {
    **{m: f"capture.{m}" for m in ("export_exact", "exported", "own_checkpoint", "shapes", "preflight", "archive",
                                    "mutation", "rng")},
    **{m: f"lower.{m}" for m in ("rewrite", "fastcode", "selective", "apply")},
    **{m: f"profile.{m}" for m in ("record", "backward", "timing", "timing_store", "memory", "graph", "loss")},
    **{m: f"compile.{m}" for m in ("compiled", "compiled_measure", "knapsack")},
    **{m: f"cli.{m}" for m in ("cli_args", "loading", "applied", "report", "bench", "examples")},
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        head, _, name = fullname.partition(".")
        if head == __name__ and name in _MOVED:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        return importlib.import_module(f"{__name__}.{_MOVED[spec.name.partition('.')[2]]}")

    def exec_module(self, module: types.ModuleType) -> None:
        return None


if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
    sys.meta_path.append(_MovedModules())


if TYPE_CHECKING:
    from .api import Planner, optimize
    from .capture.capture import Capture, capture
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
    from .plan import Plan
    from .profile.graph import CostGraph
    from .profile.profile import ProfileConfig, profile
    from .verify import Report, verify

"""The errors the planner raises; each message names the field or input at fault."""

from __future__ import annotations

from .solvers.registry import InfeasibleBudgetError, UnknownSolverError

__all__ = [
    "PlannerError",
    "InputError",
    "NothingToPlanError",
    "UnplannableError",
    "ShapeError",
    "ModelInputError",
    "CaptureError",
    "ProfileError",
    "PlanFileError",
    "PlanMismatchError",
    "SelectiveReplayError",
    "InexactPlanError",
    "StaleGraphError",
    "OutputError",
    "CheckOutOfMemoryError",
    "InfeasibleBudgetError",
    "UnknownSolverError",
]


class PlannerError(RuntimeError):
    """Base of the planner's runtime failures."""


class InputError(ValueError):
    """A bad argument or input (shape, dtype, budget, path); the message names it."""


class NothingToPlanError(InputError):
    """A training step of this model saves nothing for backward (frozen, or no tensor output)."""


class UnplannableError(InputError):
    """A model or calling context that has no training step to plan (no_grad, an eval-mode export)."""


class ShapeError(InputError):
    """An input larger than the shape the plan was made for; the message names both."""


class ModelInputError(InputError):
    """The model's own code refused the example inputs when run as given; `raised` is its error, in one line
    (`TypeName: message`), for a caller that can name the inputs better (the command line's input specs)."""

    def __init__(self, message: str, raised: str) -> None:
        super().__init__(message)
        self.raised = raised


class SelectiveReplayError(PlannerError):
    """The recompute of a selective region ran other ops than its forward; the message names the position."""


class InexactPlanError(PlannerError):
    """No plan found whose training step equals the model's own; the message names what differs."""


class CheckOutOfMemoryError(PlannerError):
    """The step that checks a plan ran out of device memory; the message names the budget and the way out."""


class StaleGraphError(PlannerError):
    """A Python value the captured graph holds as a constant changed after planning; the message names it."""


class CaptureError(PlannerError):
    """Neither symbolic_trace nor torch.export could capture the model."""


class ProfileError(PlannerError):
    """Running a node of the captured graph failed; the message names the node."""


class PlanFileError(ValueError):
    """A plan file that cannot be read (missing, corrupt, wrong schema)."""


class PlanMismatchError(ValueError):
    """A plan applied to a model whose graph differs from the one it was made for."""


class OutputError(InputError):
    """An output path that cannot be written, or may not be replaced; nothing was written."""

"""The one interface every planner offers: a model captured and profiled once, planned for any budget.

    planner = Planner(model, inputs)                       # or PartialPlanner, CompiledPlanner
    plans = [planner.plan(activation_budget=f) for f in (0.25, 0.5, 0.75)]

`plan(...)` takes `optimize()`'s per-plan keywords and builds a `PlanRequest`; a subclass implements
`plan_for(request)` alone, so whole-graph, partial and compiled planning answer the same call.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from typing import Any

from ..plan import Plan
from ..settings import PlanRequest

__all__ = ["BasePlanner"]


class BasePlanner(abc.ABC):
    """A model captured and profiled once; `plan` answers one budget at a time."""

    def plan(
        self,
        *,
        budget_gb: float | None = None,
        budget_bytes: int | None = None,
        activation_budget: float | None = None,
        solver: str = "auto",
        solver_options: Mapping[str, Any] | None = None,
        safety_margin: float = 0.02,
        on_larger_shape: str = "error",
        own_checkpointing: str = "replace",
        autotune: bool | int | None = None,
    ) -> Plan:
        """The plan for one budget and its checkpointed module (the keywords are `optimize()`'s)."""
        return self.plan_for(PlanRequest.of(
            budget_gb=budget_gb, budget_bytes=budget_bytes, activation_budget=activation_budget, solver=solver,
            solver_options=solver_options, safety_margin=safety_margin, on_larger_shape=on_larger_shape,
            own_checkpointing=own_checkpointing, autotune=autotune,
        ))

    @abc.abstractmethod
    def plan_for(self, request: PlanRequest) -> Plan:
        """The plan for `request`."""

    @property
    @abc.abstractmethod
    def baseline_peak_bytes(self) -> int:
        """Predicted peak of one step of the model as given (bytes)."""

"""optimize(..., exact=False): the exact plan where it fits the budget, else the plan on the graph whose
token-wise groups (MLPs, the LM head and its loss) run in chunks of tokens (lower/chunk.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ..errors import CaptureError
from ..plan import Plan
from ..settings import PlanRequest, Setup
from ..solvers.registry import InfeasibleBudgetError
from .base import BasePlanner

__all__ = ["inexact_setup", "plan_inexact"]


def inexact_setup(setup: Setup, exact: bool) -> Setup:
    """The setup of exact=False's two planners: the exact one, and the chunked one (captured by export,
    whose aten ops the token-wise analysis reads)."""
    exactness = dataclasses.replace(setup.exactness, exact=exact)
    return dataclasses.replace(setup, exactness=exactness, capture_method=setup.capture_method if exact else "export")


def plan_inexact(make: Callable[[bool], BasePlanner], request: PlanRequest,
                 exact_plan: Callable[[], Plan] | None = None) -> tuple[Plan, BasePlanner | None]:
    """optimize(..., exact=False): the exact plan where it fits the budget; else the plan on the graph whose
    token-wise groups run in chunks. `make(exact)` builds the Planner; `exact_plan`, where given, plans the
    exact way instead of `make(True)` (as exact=True plans: a model the capture cannot take whole, in parts).
    Returns the plan and its planner (None where `exact_plan` made it)."""
    planner: BasePlanner | None = None
    try:
        if exact_plan is not None:
            plan = exact_plan()
        else:
            planner = make(True)
            plan = planner.plan_for(request)
    except InfeasibleBudgetError as e:
        exact_error = e
    else:
        plan.stats["exact"] = False
        plan.stats["chunks"] = []
        plan.notes = (*plan.notes, "exact=False: the exact plan fits the budget, so no token-wise work is chunked")
        return plan, planner
    try:
        chunked = make(False)
    except CaptureError:  # chunks run in one whole graph; the exact plan's refusal is the one that applies
        raise exact_error from None
    if not chunked.chunks:
        raise exact_error
    try:
        plan = chunked.plan_for(request)
    except InfeasibleBudgetError as chunked_error:
        # each names its own smallest budget; at the smaller one, its planner plans (the exact one first)
        if exact_error.smallest_bytes < chunked_error.smallest_bytes:
            raise exact_error from None
        raise
    plan.notes = (*plan.notes, f"exact=False: token-wise work is chunked because the exact plan does not fit ({exact_error})")
    return plan, chunked

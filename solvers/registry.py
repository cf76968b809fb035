"""Solver registry: one signature for every solver, one place that simulates and checks."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .plans import normalize_regions
from .problem import Problem, Solution
from .simulate import simulate

__all__ = [
    "SolverResult",
    "SolverFn",
    "SOLVERS",
    "register",
    "get_solver",
    "solve",
    "UnknownSolverError",
    "InfeasibleBudgetError",
]


@dataclass(frozen=True)
class SolverResult:
    """What a solver function returns: regions, and statistics for the report."""

    regions: tuple[tuple[int, int], ...]
    stats: dict[str, Any] = field(default_factory=dict)
    saved: tuple[int, ...] = ()
    """Nodes inside (non-nested) regions whose outputs a selective policy keeps."""
    offloaded: tuple[int, ...] = ()
    """Storages the plan copies to pinned host memory between forward and backward (`offload`)."""


SolverFn = Callable[..., SolverResult]
"""fn(problem: Problem, budget_bytes: int | None, **options) -> SolverResult.

With a budget, a solver returns the least-recompute plan it finds whose
simulated peak fits; when none fits, its lowest-memory plan (the caller
reports it as infeasible). With budget None, it returns its default plan.
"""

SOLVERS: dict[str, SolverFn] = {}


class UnknownSolverError(ValueError):
    """The solver name is not registered; the message lists the valid ones."""


class InfeasibleBudgetError(RuntimeError):
    """No plan fits the budget; `smallest_bytes` is the smallest budget that does."""

    def __init__(
        self, budget_bytes: int, smallest_bytes: int, solver: str, fixed_bytes: int = 0, detail: str = ""
    ) -> None:
        self.budget_bytes = budget_bytes
        self.smallest_bytes = smallest_bytes
        self.solver = solver
        self._args = (budget_bytes, smallest_bytes, solver, fixed_bytes, detail)
        super().__init__(
            f"budget {_gb(budget_bytes)} is infeasible: the smallest budget solver {solver!r} fits is "
            f"{_gb(smallest_bytes)} ({smallest_bytes} bytes, of which {_gb(fixed_bytes)} is parameters, "
            f"inputs and optimizer state){detail}; raise the budget or reduce the batch size"
        )

    def __reduce__(self) -> tuple:
        # pickled whole (sent from the planning rank to the others under torch.distributed)
        return type(self), self._args


def _gb(nbytes: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.3f} {unit}"
    return f"{int(nbytes)} B"


def register(name: str) -> Callable[[SolverFn], SolverFn]:
    """Decorator: make `fn` available as solve(..., solver=name)."""

    def deco(fn: SolverFn) -> SolverFn:
        SOLVERS[name] = fn
        return fn

    return deco


def get_solver(name: str) -> SolverFn:
    try:
        return SOLVERS[name]
    except KeyError:
        raise UnknownSolverError(
            f"unknown solver {name!r}; valid solvers: {', '.join(sorted(SOLVERS))}"
        ) from None


def solve(problem: Problem, budget_bytes: int | None = None, solver: str = "uniform", **options: Any) -> Solution:
    """Run a solver, simulate its plan and check it against the budget.

    Raises InfeasibleBudgetError when the plan does not fit, naming the
    smallest budget the solver can meet.
    """
    fn = get_solver(solver)
    if budget_bytes is not None and budget_bytes < 0:
        raise ValueError(f"budget_bytes: {budget_bytes} is negative")
    t0 = time.perf_counter()
    result = fn(problem, budget_bytes, **options)
    solve_time = time.perf_counter() - t0
    regions = normalize_regions(problem, result.regions)
    sim = simulate(problem, regions, saved=result.saved, offloaded=result.offloaded)
    if sim.host_bytes > problem.host_budget_bytes:
        raise ValueError(f"solver {solver!r} offloads {sim.host_bytes} bytes, over host_budget_bytes")
    if budget_bytes is not None and sim.peak_bytes > budget_bytes:
        smallest = int(result.stats.get("min_peak_bytes", sim.peak_bytes))
        raise InfeasibleBudgetError(budget_bytes, max(smallest, problem.fixed_bytes), solver, problem.fixed_bytes)
    return Solution(
        regions=regions,
        solver=solver,
        peak_bytes=sim.peak_bytes,
        recompute_time=sim.recompute_time,
        budget_bytes=budget_bytes,
        solve_time=solve_time,
        stats={
            **result.stats, "breakdown": sim.breakdown, "peak_phase": sim.peak_phase, "call_time": sim.call_time,
            **({"offload_time": sim.offload_time, "host_bytes": sim.host_bytes} if result.offloaded else {}),
        },
        saved=tuple(sorted(result.saved)),
        offloaded=tuple(sorted(result.offloaded)),
    )

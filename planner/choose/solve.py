"""Solving one budget: the solver's plan, finished, re-simulated, tightened while its last change leaves
it over the budget, and the plan an earlier run chose where it still fits (plan_store.py).

An infeasible budget is refused from bytes alone (budget.py), before any plan is tried.
"""

from __future__ import annotations

from typing import Any

from ..settings import PlanRequest
from ..solvers.problem import Problem, Solution
from ..solvers.registry import InfeasibleBudgetError, solve
from ..solvers.simulate import simulate
from ..solvers.sweep import knee, sweep
from .budget import ResolvedBudget, floor_of, refuse
from .plan_store import kept_plan, plan_key
from .profiled import Profiled
from .regions import finish_regions, with_regions

__all__ = ["solve_budget", "solve_unbudgeted", "solve_partial", "finish"]


def finish(p: Profiled, regions, keep: bool) -> tuple[tuple[tuple[int, int], ...], list[str]]:
    """`regions` after what happens to every plan of this model (regions.finish_regions)."""
    return finish_regions(p.problem, p.capture.graph_module, regions, p.own_regions if keep else ())


def solve_budget(p: Profiled, resolved: ResolvedBudget, request: PlanRequest) -> tuple[Solution, list[str]]:
    """The plan for the budget `resolved.nbytes` (bytes; None: the knee of the curve) and the notes that
    explain it."""
    problem, cfg, budget = p.problem, request.solve, resolved.nbytes
    solver, options = cfg.solver, dict(cfg.options)
    keep = cfg.own_checkpointing == "keep" and bool(p.own_regions)
    if budget is None:
        solution, notes = solve_unbudgeted(problem, solver, options)
        regions, moved = finish(p, solution.regions, keep)
        return with_regions(problem, solution, regions), notes + moved
    # The model as given (its own regions, moved off in-place writes like any plan) and, when
    # replacing them, the plain step: either fits a budget at or above its peak with no margin.
    given = finish(p, p.own_regions, False)[0] if p.own_regions else ()
    given_peak = simulate(problem, given).peak_bytes
    plain_peak = p.no_checkpoint_peak_bytes
    if plain_peak <= budget and not keep:
        note = f"the step fits the budget without checkpointing (predicted peak {plain_peak / 1e9:.3f} GB): no-op plan"
        return with_regions(problem, solve(problem, None, "none"), (), budget), [note]
    fixed, inner = problem.fixed_bytes, resolved.inner
    floor_peak, floor_regions, floor_offloaded = floor_of(p, solver, options, keep, inner)
    refuse(p, resolved, request)
    stats = {"planned_for_bytes": inner}
    if floor_peak > inner or (keep and given_peak <= budget):
        note = f"the model as given fits the budget (predicted peak {given_peak / 1e9:.3f} GB): its own checkpointing, unchanged"
        return with_regions(problem, solve(problem, None, "none"), given, budget, {**stats, "as_given": True}), [note]
    target = inner
    for attempt in range(4):  # the measured-time plan, tightened while its last change leaves it over
        try:
            solution = solve(problem, target, solver, **options)
        except InfeasibleBudgetError:
            break
        regions, moved = finish(p, solution.regions, keep)
        finished = with_regions(problem, solution, regions, budget, {**stats, "tightened": attempt})
        peak = finished.peak_bytes
        if peak <= inner:
            if attempt:
                moved.append(f"re-solved {attempt}x at a lower internal budget: moved regions had left it over")
            solution = finished
            if p.cost.time_source != "fitted":  # FLOP times repeat by themselves
                return solution, moved
            solution, kept = kept_plan(problem, solution, inner, plan_key(problem, inner, solver, options, keep), p.store())
            return solution, moved + kept
        target -= peak - inner
        if target <= fixed:
            break
    note = (
        f"the {solver!r} plan on measured times did not fit once its regions were finished: this is the "
        "least-memory plan on FLOP costs"
    )
    floor = Solution(regions=(), solver=solver, peak_bytes=0, recompute_time=0.0, budget_bytes=budget, offloaded=floor_offloaded)
    return with_regions(problem, floor, floor_regions, budget, {**stats, "floor_plan": True}), [note]


def solve_unbudgeted(problem: Problem, solver: str, options: dict[str, Any]) -> tuple[Solution, list[str]]:
    notes: list[str] = []
    base = simulate(problem, ())
    fixed = problem.fixed_bytes
    act = base.peak_bytes - fixed
    budgets = [int(fixed + act * f / 20) for f in range(1, 21)]
    curve = [s for s in sweep(problem, budgets, solver=solver, **options) if s is not None]
    if curve:
        chosen = knee(curve)
        notes.append(
            f"no budget given: chose the knee of the memory/recompute curve "
            f"({chosen.peak_bytes / 1e9:.3f} GB, {len(curve)} points swept)"
        )
        return chosen, notes
    notes.append("no budget given: solver default plan")
    return solve(problem, None, solver, **options), notes


def solve_partial(
    problem: Problem, resolved: ResolvedBudget, solver: str, options: dict[str, Any]
) -> tuple[Solution, list[str]]:
    """Solve a partially captured model's joined problem for `resolved.nbytes`: no-op when it fits, the margin
    as for a whole graph, and an infeasible budget named from bytes (budget.py)."""
    budget = resolved.nbytes
    if budget is None:
        return solve_unbudgeted(problem, solver, options)
    plain_peak = simulate(problem, ()).peak_bytes
    if plain_peak <= budget:
        note = f"the step fits the budget without checkpointing (predicted peak {plain_peak / 1e9:.3f} GB): no-op plan"
        return with_regions(problem, solve(problem, None, "none"), (), budget), [note]
    fixed, inner = problem.fixed_bytes, resolved.inner
    try:
        solution = solve(problem, inner, solver, **options)
    except InfeasibleBudgetError as e:
        smallest = min(plain_peak, resolved.smallest(e.smallest_bytes))
        raise InfeasibleBudgetError(budget, smallest, solver, fixed) from None
    return with_regions(problem, solution, solution.regions, budget, {"planned_for_bytes": inner}), []

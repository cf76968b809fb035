"""The choose stage in the order a `Planner` runs it: the budget resolved once (budget.budget_of), the solve, the
safety net's check, the measured race held to the planning's own time, and the one gate every plan passes
before it is returned (`held_to_budget`: no plan leaves whose own prediction is over its budget, whichever
solver or candidate made it). Also the judges the profile asks while it measures (`judges`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ..errors import PlannerError
from ..progress import logger, stage
from ..settings import PlanRequest, Setup
from ..solvers.problem import Problem, Solution
from ..solvers.registry import InfeasibleBudgetError
from ..solvers.simulate import simulate
from .autotune import autotuned
from .budget import ResolvedBudget, check_feasible, plain_step_fits
from .profiled import Profiled, profiled
from .race.rules import race_steps
from .safety_net import checked
from .solve import solve_budget

__all__ = ["judges", "race_cap", "held_to_budget", "choose_solution", "planning_clock"]

Judge = Callable[[Any], Any]


def judges(model: Any, cap: Any, setup: Setup, chunks: list, notes: list[str],
           feasible_for: PlanRequest | None) -> tuple[Judge | None, Judge | None]:
    """(check, fits) for the profile to call on each CostGraph it makes: `check` refuses, before any timing, a
    budget no plan meets; `fits` says whether the plain step fits it (else the profile is stage-wise, and the
    plain step never runs). (None, None) without a budget to judge."""
    if feasible_for is None:
        return None, None

    def judged(cost: Any) -> Profiled:
        return profiled(model, cap, cost, setup, chunks=chunks, capture_notes=notes)

    def check(cost: Any) -> None:
        check_feasible(judged(cost), feasible_for)

    def fits(cost: Any) -> bool:
        return plain_step_fits(judged(cost), feasible_for)

    return check, fits


def race_cap(steps: int, planning_s: float, step_s: float) -> tuple[int, str | None]:
    """The default race's model steps, held to the planning's time (`race_steps`), and the note when held.
    `step_s`: a racing plan's step, the plain one's and its recompute (the plain step's alone would let the
    race run past the planning's time)."""
    held = race_steps(steps, planning_s, step_s)
    if held >= steps:
        return steps, None
    return held, (f"autotune: held to {held} model steps of about {step_s:.2f} s, the {planning_s:.0f} s the "
                  f"planning before it took (autotune={steps} runs them all)")


def held_to_budget(problem: Problem, solution: Solution, budget: int | None,
                   fallback: Solution | None = None) -> tuple[Solution, list[str]]:
    """`solution` where its own prediction (re-simulated here, not the solver's estimate) is within `budget`
    (bytes); else `fallback` (a plan that passed the same check earlier), with a note. Raises PlannerError
    when neither fits: a plan over its own budget is never returned."""
    if budget is None:
        return solution, []
    peak = simulate(problem, solution.regions, saved=solution.saved, offloaded=solution.offloaded).peak_bytes
    if peak <= budget:
        return solution, []
    over = (f"the {solution.solver} plan is predicted at {peak / 1e6:.3f} MB, over the budget of "
            f"{budget / 1e6:.3f} MB")
    if fallback is not None and fallback is not solution:
        back, notes = held_to_budget(problem, fallback, budget)
        return back, [f"{over}: the plan before it was kept", *notes]
    raise PlannerError(f"{over}, and no plan within it was found; report the model")


def choose_solution(p: Profiled, request: PlanRequest, resolved: ResolvedBudget, *, steps: int,
                    planning_s: Callable[[], float] | None) -> tuple[Solution, list[str]]:
    """Solve the budget (`resolved`, from `budget_of`), check the plan's step against the model's, race the
    best plans on the device (`steps` model steps; `planning_s()`, where given, the seconds planning took so
    far: the default race is held to them), and pass the one gate. An infeasible budget the device clamp
    lowered names the clamp."""
    budget = resolved.nbytes
    shown = f"{budget / 1e6:.1f} MB" if budget is not None else "none (knee of the curve)"
    with stage("solve", f"solver {request.solve.solver}, budget {shown}"):
        try:
            solution, notes = solve_budget(p, resolved, request)
        except InfeasibleBudgetError as e:
            if not resolved.lowered:
                raise
            raise InfeasibleBudgetError(e.budget_bytes, e.smallest_bytes, e.solver, p.problem.fixed_bytes,
                                        detail=f"; {resolved.lowered[0]}, which no plan fits") from None
    if p.check and (solution.regions or solution.offloaded or p.chunks):
        with stage("check", "one step of the plan against the model's own"):
            solution, notes = checked(p, solution, notes, resolved, request)
    solution, gated = held_to_budget(p.problem, solution, budget)
    notes = notes + gated
    keep = request.solve.own_checkpointing == "keep" and bool(p.own_regions)
    if steps and budget is not None and (solution.regions or solution.offloaded) and not keep and p.real:
        if planning_s is not None:  # the default race: at most the planning's time
            steps, note = race_cap(steps, planning_s(), p.problem.base_step_s + solution.recompute_time)
            notes = notes + ([note] if note else [])
        with stage("autotune", f"the best plans that fit, timed on the device, at most {steps} steps"):
            tuned, more = autotuned(p, solution, resolved, request, steps)
        tuned, gated = held_to_budget(p.problem, tuned, budget, fallback=solution)
        solution, notes = tuned, notes + more + gated
    logger.info("solve: %s chose %d regions, predicted peak %.1f MB, recompute %.1f ms", solution.solver,
                len(solution.regions), solution.peak_bytes / 1e6, solution.recompute_time * 1e3)
    return solution, notes


def planning_clock(prepared_s: float) -> Callable[[], float]:
    """Seconds planning has taken: `prepared_s` (capture and profile) and the time since this call."""
    started = time.perf_counter()
    return lambda: prepared_s + time.perf_counter() - started

"""From a solver's solution to a Plan: region bookkeeping, unbudgeted solves, partial captures.

The solving half of `optimize()` that does not need a Planner: re-simulating a solution with moved
regions, laminar merges with a model's own checkpoint spans, and building the Plan record.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .. import solvers
from ..capture.trace import flatten_for_graph
from ..plan import Plan, Region, graph_fingerprint
from ..profile.graph import CostGraph
from ..solvers import Problem, Solution, simulate
from ..solvers.simulate import normalize_regions
from .budget import inner_budget, smallest_budget

__all__ = [
    "plan_from_solution", "kept_saved", "with_regions", "laminar", "merge_own", "solve_unbudgeted", "solve_partial",
]


def with_regions(problem: Problem, solution: Solution, regions, budget=None, stats=None) -> Solution:
    """`solution` with `regions` in place of its own (and the kept ops still inside them), re-simulated."""
    saved = kept_saved(regions, solution.saved)
    sim = simulate(problem, regions, saved=saved)
    return dataclasses.replace(
        solution,
        regions=tuple(regions),
        saved=saved,
        peak_bytes=sim.peak_bytes,
        recompute_time=sim.recompute_time,
        budget_bytes=solution.budget_bytes if budget is None else budget,
        stats={**solution.stats, **(stats or {})},
    )


def laminar(problem: Problem, spans) -> tuple[tuple[int, int], ...]:
    """The spans that nest properly, in order (a span crossing an earlier one is left out)."""
    kept: list[tuple[int, int]] = []
    for span in spans:
        try:
            kept = list(normalize_regions(problem, kept + [span]))
        except Exception:  # noqa: BLE001 - a crossing span is not kept
            continue
    return tuple(kept)


def merge_own(own, regions) -> list[tuple[int, int]]:
    """The model's own regions plus the solver's regions that are disjoint from them or contain them."""
    out = list(own)
    for s, e in regions:
        if all(e < a or b < s or (s <= a and b <= e and (s, e) != (a, b)) for a, b in own):
            out.append((s, e))
    return out


def solve_unbudgeted(problem: Problem, solver: str, options: dict[str, Any]) -> tuple[Solution, list[str]]:
    notes: list[str] = []
    base = simulate(problem, ())
    sweep = getattr(solvers, "sweep", None)
    knee = getattr(solvers, "knee", None)
    if sweep is not None and knee is not None:
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
    return solvers.solve(problem, None, solver, **options), notes


def plan_from_solution(
    cost: CostGraph,
    problem: Problem,
    solution: Solution,
    cap,
    *,
    notes: list[str] | tuple[str, ...] = (),
    solver_options: dict[str, Any] | None = None,
    baseline_regions=(),
) -> Plan:
    """Wrap a solver's Solution as a Plan (no module yet); the baseline runs `baseline_regions`
    (the model's own checkpointing: the model as given)."""
    base = simulate(problem, tuple(baseline_regions))
    sim = simulate(problem, solution.regions, saved=solution.saved)
    saved = cost.saved_bytes
    kept = set(solution.saved)
    depth_of: list[int] = []
    stack: list[tuple[int, int]] = []
    for s, e in solution.regions:
        while stack and stack[-1][1] < s:
            stack.pop()
        depth_of.append(len(stack))
        stack.append((s, e))
    regions = []
    for (s, e), depth in zip(solution.regions, depth_of):
        mods: list[str] = []
        for n in cost.nodes[s : e + 1]:
            top = n.module
            if top and top not in mods:
                mods.append(top)
        regions.append(
            Region(
                start=s,
                end=e,
                first_node=cost.nodes[s].name,
                last_node=cost.nodes[e].name,
                modules=tuple(_collapse(mods)),
                depth=depth,
                recompute_s=sum(n.time for n in cost.nodes[s : e + 1]),
                saved_bytes=sum(saved[s : e + 1]),
                saved_ops=tuple(cost.nodes[i].name for i in range(s, e + 1) if i in kept),
                saved_positions=tuple(i for i in range(s, e + 1) if i in kept),
            )
        )
    gm = cap.graph_module
    return Plan(
        solver=solution.solver,
        budget_bytes=solution.budget_bytes,
        baseline_peak_bytes=base.peak_bytes,
        predicted_peak_bytes=sim.peak_bytes,
        predicted_recompute_s=sim.recompute_time,
        baseline_step_s=cost.total_time,
        regions=tuple(regions),
        fingerprint=graph_fingerprint(gm, flatten_for_graph(gm, cap.args, cap.kwargs)),
        capture_method=cap.method,
        solve_time_s=solution.solve_time,
        solver_options=dict(solver_options or {}),
        breakdown=dict(sim.breakdown),
        baseline_breakdown=dict(base.breakdown),
        notes=tuple(notes) + (("captured with torch.export",) if cap.fallback_reason else ()),
        stats={k: v for k, v in solution.stats.items() if k != "breakdown"},
        time_source=cost.time_source,
        num_nodes=len(cost.nodes),
        eager_step_s=problem.base_step_s - problem.graph_overhead_s,
        predicted_step_s=problem.base_step_s + sim.recompute_time,
        call_overhead_s=sim.call_time,
        graph_overhead_s=problem.graph_overhead_s,
    )


def kept_saved(regions, saved) -> tuple[int, ...]:
    """Saved ops still inside a region after the regions moved (a moved region's cache may not reach them)."""
    return tuple(i for i in saved if any(s <= i <= e for s, e in regions))


def _collapse(paths: list[str], limit: int = 8) -> list[str]:
    """Module paths with children of a listed parent dropped; at most `limit` shown."""
    out: list[str] = []
    for p in paths:
        if not any(p == q or p.startswith(q + ".") for q in out):
            out = [q for q in out if not q.startswith(p + ".")] + [p]
    return out[:limit] + ([f"... {len(out) - limit} more"] if len(out) > limit else [])


def solve_partial(
    problem: Problem, budget: int | None, solver: str, options: dict[str, Any], margin: float
) -> tuple[Solution, list[str]]:
    """Solve a partially captured model's joined problem: no-op when it fits, the margin as for a whole graph,
    and an infeasible budget named from bytes (budget.py)."""
    if budget is None:
        return solve_unbudgeted(problem, solver, options)
    plain_peak = simulate(problem, ()).peak_bytes
    if plain_peak <= budget:
        note = f"the step fits the budget without checkpointing (predicted peak {plain_peak / 1e9:.3f} GB): no-op plan"
        return with_regions(problem, solvers.solve(problem, None, "none"), (), budget), [note]
    fixed = problem.fixed_bytes
    inner = inner_budget(budget, fixed, margin)
    try:
        solution = solvers.solve(problem, inner, solver, **options)
    except solvers.InfeasibleBudgetError as e:
        smallest = min(plain_peak, smallest_budget(e.smallest_bytes, fixed, margin))
        raise solvers.InfeasibleBudgetError(budget, smallest, solver, fixed) from None
    return with_regions(problem, solution, solution.regions, budget, {"planned_for_bytes": inner}), []

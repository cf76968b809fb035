"""The memory/recompute curve in one call, and its knee.

`sweep` solves a list of budgets, reusing what does not depend on the
budget: the DP table and the greedy threshold plans are built once, and
every plan is simulated at most once. Going up the budgets, a plan that fits
a smaller budget also fits a larger one, so the curve is made monotone: a
larger budget never gets more recompute time.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from .exact.dp import DPConfig, DPSearch
from .heuristics.greedy import GreedySearch
from .plans import normalize_regions
from .problem import Problem, Solution
from .registry import SolverResult, get_solver
from .simulate import simulate

logger = logging.getLogger(__name__)

__all__ = ["sweep", "knee"]


def _searches(problem: Problem, solver: str, options: dict[str, Any]):
    """Budget -> SolverResult callables for the solvers to run."""
    if solver == "dp":
        search = DPSearch(problem, DPConfig(**options))
        return {"dp": search.solve}
    if solver == "greedy":
        return {"greedy": GreedySearch(problem, **options).solve}
    if solver == "auto":
        from .auto import auto_portfolio

        names = list(options.pop("solvers", None) or auto_portfolio(problem))
        time_limit = options.pop("time_limit", 10.0)
        out = {}
        for name in names:
            if name == "dp":
                out[name] = DPSearch(problem).solve
            elif name == "greedy":
                out[name] = GreedySearch(problem).solve
            else:
                out[name] = _bound(problem, name, {"time_limit": time_limit} if name == "ilp" else {})
        return out
    return {solver: _bound(problem, solver, options)}


def _bound(problem: Problem, name: str, options: dict[str, Any]):
    fn = get_solver(name)
    return lambda budget: fn(problem, budget, **options)


def sweep(problem: Problem, budgets, solver: str = "auto", **options: Any) -> list[Solution | None]:
    """One Solution per budget (same order), None where the solver fits nothing within it."""
    budgets = [int(b) for b in budgets]
    searches = _searches(problem, solver, dict(options))
    sims: dict[tuple, Any] = {}

    def sim(regions, saved=()):
        key = (regions, tuple(saved))
        if key not in sims:
            sims[key] = simulate(problem, regions, saved=saved)
        return sims[key]

    out: list[Solution | None] = [None] * len(budgets)
    carried: Solution | None = None
    for step, idx in enumerate(sorted(range(len(budgets)), key=lambda i: budgets[i]), 1):
        budget = budgets[idx]
        t0 = time.perf_counter()
        best = None
        for name, solve_at in searches.items():
            result: SolverResult = solve_at(budget)
            regions = normalize_regions(problem, result.regions)
            s = sim(regions, result.saved)
            if s.peak_bytes <= budget and (best is None or (s.recompute_time, s.peak_bytes) < best[0]):
                best = ((s.recompute_time, s.peak_bytes), name, regions, result.stats, s, result.saved)
        elapsed = time.perf_counter() - t0
        logger.info(
            "sweep: budget %d/%d (%.1f MB) in %.2f s: %s", step, len(budgets), budget / 1e6, elapsed, best[1] if best is not None else "nothing fits",
        )
        if best is not None:
            (_, _), name, regions, stats, s, saved = best
            sol = Solution(
                regions=regions,
                solver=name if solver == "auto" else solver,
                peak_bytes=s.peak_bytes,
                recompute_time=s.recompute_time,
                budget_bytes=budget,
                solve_time=elapsed,
                stats={**stats, "breakdown": s.breakdown, "peak_phase": s.peak_phase},
                saved=tuple(sorted(saved)),
            )
            if carried is not None and carried.recompute_time < sol.recompute_time:
                sol = Solution(**{**carried.__dict__, "budget_bytes": budget, "solve_time": elapsed})
            carried = sol
            out[idx] = sol
        elif carried is not None:
            out[idx] = Solution(**{**carried.__dict__, "budget_bytes": budget, "solve_time": elapsed})
    return out


def knee(solutions) -> Solution | None:
    """The knee of the memory/recompute curve: the point farthest below the chord joining its ends.

    Both axes are scaled to [0, 1]; with fewer than three distinct points, the
    one with the lowest peak among those with the least recompute is returned.
    """
    points = {}
    for sol in solutions:
        if sol is not None:
            key = (sol.peak_bytes, sol.recompute_time)
            points.setdefault(key, sol)
    if not points:
        return None
    pts = sorted(points)  # by peak, ascending
    if len(pts) < 3:
        return points[min(pts, key=lambda p: (p[1], p[0]))]
    (p0, t0), (p1, t1) = pts[0], pts[-1]
    dp_, dt = max(p1 - p0, 1), (t0 - t1) or 1.0

    def below(p):
        u, v = (p[0] - p0) / dp_, (p[1] - t1) / dt  # u: memory used, v: recompute left, both in [0, 1]
        return (1 - u) - v  # the chord is v = 1 - u

    return points[max(pts, key=below)]

"""`ilp_offload`: `ilp`'s flat-plan MILP with offloading as a third state of each kept storage.

The terms are `offload_terms.OffloadTerms` (which says what the MILP models exactly and what it bounds);
this solver runs the MILP with them, checks each plan with `simulate` and tightens the budget by the excess
when a plan does not fit. Graphs above `max_nodes` get `ilp`'s recompute-only plan with offloads added by
`offload.choose_offloads`.
"""

from __future__ import annotations

import time
from typing import Any

from ..copies import offloadable
from ..offload import choose_offloads
from ..problem import Problem
from ..registry import SolverResult, register
from ..simulate import simulate
from .ilp import _solve_any, ilp
from .milp_backend import ILPSolveError

__all__ = ["ilp_offload"]


@register("ilp_offload")
def ilp_offload(
    problem: Problem,
    budget_bytes: int | None = None,
    *,
    backend: str = "auto",
    time_limit: float | None = 20.0,
    gap: float = 0.0,
    max_nodes: int = 96,
    max_retries: int = 4,
) -> SolverResult:
    """Least recompute plus exposed copy time over flat plans x offload sets (see the module docstring), on
    graphs of at most `max_nodes` nodes (larger ones: the recompute-only `ilp`, offloads added by
    `offload.choose_offloads`). A problem that cannot offload gets `ilp`'s answer."""
    if not problem.can_offload or problem.n > max_nodes or budget_bytes is None:
        result = ilp(problem, budget_bytes, backend=backend, time_limit=time_limit, gap=gap, selective=False)
        if budget_bytes is None or not problem.can_offload:
            return result
        found = choose_offloads(problem, budget_bytes, result.regions, result.saved)
        offloaded = found[0] if found is not None else ()
        return SolverResult(regions=result.regions, saved=result.saved, offloaded=offloaded, stats=result.stats)
    base = simulate(problem, ())
    if base.peak_bytes <= budget_bytes:
        return SolverResult(regions=(), stats={"min_peak_bytes": base.peak_bytes})
    t0 = time.perf_counter()
    target, low = budget_bytes, None
    stats: dict[str, Any] = {"exact": True}
    for attempt in range(max_retries + 1):
        left = None if time_limit is None else max(0.5, time_limit - (time.perf_counter() - t0))
        try:
            regions, info = _solve_any(problem, target, backend, left, gap, None, False, offload=True)
        except ILPSolveError as e:
            stats["ilp_fallback"] = str(e)
            break
        stats.update({k: v for k, v in info.items() if k != "offloaded"})
        if regions is None:
            break
        allowed = set(offloadable(problem, regions))
        offloaded = tuple(t for t in info.get("offloaded", ()) if t in allowed)  # unkept ones cost nothing
        sim = simulate(problem, regions, offloaded=offloaded)
        if sim.peak_bytes <= budget_bytes:
            return SolverResult(regions=regions, offloaded=offloaded, stats={**stats, "retries": attempt, "min_peak_bytes": sim.peak_bytes})
        low = sim.peak_bytes if low is None else min(low, sim.peak_bytes)
        target -= sim.peak_bytes - budget_bytes
    # Nothing found: the lowest-peak flat plan, reported as infeasible by the caller.
    result = ilp(problem, budget_bytes, backend=backend, time_limit=time_limit, gap=gap, selective=False)
    return SolverResult(regions=result.regions, stats={**result.stats, **stats, "infeasible": True})

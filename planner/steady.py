"""Plans that stay put: the plan an earlier run chose for the same graph and budget, kept while a new
solve does not clearly beat it.

Node times are measurements. With the timing store two runs read the same times, but a later run may
heal one that load inflated in the first profile (planner.timing_store), and near-equal plans then
swap places for a gain far inside what a measured step can tell apart (the trade-off benchmark's
steps spread by about 9 % between repeats of one plan; the swaps it recorded gained 0.3-1.4 % of a
step). So the store also keeps, per graph, budget and solver settings, the plan last chosen. A later
run keeps it when, priced on this run's figures, it still fits the budget planned for and its
predicted step is within `KEEP_WITHIN` of the new plan's; a clearly better plan replaces it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .solvers import Problem, Solution, simulate
from .solvers.problem import ProblemError
from .solvers.simulate import normalize_regions, normalize_saved
from .timing_store import TimingStore, signature

__all__ = ["KEEP_WITHIN", "plan_key", "steady"]

KEEP_WITHIN = 0.02
"""A stored plan stays unless the new one's predicted step is shorter by more than this fraction of
the step without checkpointing."""


def plan_key(problem: Problem, budget: int, solver: str, options: dict[str, Any], keep_own: bool) -> str:
    """What a stored plan answers: the graph's structure and sizes, the bytes planned for, the solver."""
    return signature([
        problem.fingerprint(), f"fixed={problem.fixed_bytes}", f"budget={budget}", f"solver={solver}",
        f"options={sorted(options.items())!r}", f"keep={keep_own}",
    ])


def _stored(problem: Problem, entry: Any) -> tuple[tuple[tuple[int, int], ...], tuple[int, ...], str] | None:
    """The stored plan's regions, saved nodes and solver, when it is a valid plan of `problem`."""
    if not isinstance(entry, dict):
        return None
    try:
        regions = normalize_regions(problem, [(int(s), int(e)) for s, e in entry["regions"]])
        saved = normalize_saved(problem, regions, [int(i) for i in entry["saved"]])
    except (ProblemError, KeyError, TypeError, ValueError):
        return None  # written for another graph of the same key, or by another version: solved afresh
    return regions, saved, str(entry.get("solver", ""))


def steady(problem: Problem, solution: Solution, budget: int, key: str, store: TimingStore) -> tuple[Solution, list[str]]:
    """`solution`, or the plan stored under `key` where that one fits `budget` and is within
    KEEP_WITHIN of a step of it; the returned plan is stored. Returns (solution, notes)."""
    stored = _stored(problem, store.get("plans", key))
    if stored is not None and (stored[0], stored[1]) != (tuple(solution.regions), tuple(solution.saved)):
        regions, saved, solver = stored
        sim = simulate(problem, regions, saved=saved)
        gain = sim.recompute_time - solution.recompute_time
        step = problem.base_step_s
        if sim.peak_bytes <= budget and step > 0 and gain <= KEEP_WITHIN * step:
            kept = dataclasses.replace(
                solution, regions=regions, saved=saved, peak_bytes=sim.peak_bytes, recompute_time=sim.recompute_time,
                solver=solver or solution.solver, stats={**solution.stats, "kept_plan": True},
            )
            against = (
                f"this run's {solution.solver} plan is predicted {gain / step:.1%} of a step faster, within the "
                f"{KEEP_WITHIN:.0%} that measurements cannot tell apart"
                if gain > 0 else f"it is predicted no slower than this run's {solution.solver} plan"
            )
            note = f"kept the plan an earlier run chose for this graph and budget (timing store): {against}"
            return kept, [note]
    entry = {"regions": [list(r) for r in solution.regions], "saved": list(solution.saved), "solver": solution.solver}
    if store.get("plans", key) != entry:
        store.keep("plans", key, entry)
        store.save()
    return solution, []

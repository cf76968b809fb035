"""The plans `ilp` answers no worse than, and starts its MILP from.

The MILP is exact over flat region plans only, and only when the graph is not
coarsened and the solver reaches its gap within the time limit. `dp` searches
nested plans (the rotor family, multi-level schedules included) that reach
lower peaks and, at tight budgets, less recompute than any flat plan (an MLP
stack under bf16 autocast: tests/unit/solvers/test_ilp_not_worse_than_dp.py).
A coarsened MILP can also lose to plain uniform segments on
the fine graph. So `ilp`'s plan space is the flat plans (the MILP) together
with these known plans:

* `dp`'s plan for the budget: the least-recompute plan of the rotor family
  that fits (exact on chains), with kept ops;
* `uniform`'s and `greedy`'s plans on the fine graph (flat, found in
  milliseconds; the flat ones, `dp`'s included, are also the MILP's warm
  starts where they map onto the coarse graph);
* the least-peak plan an earlier call on the same problem found, so that a
  smallest budget `ilp` names is met again when asked for.

`best_of` returns the least predicted recompute that fits among the MILP's
plan and these (the MILP's on ties); when none fits, the lowest peak.
"""

from __future__ import annotations

from typing import Any

from ..heuristics.basic import uniform
from ..heuristics.greedy import GreedySearch
from ..plans import region_parents
from ..problem import Problem
from ..registry import SolverResult
from ..simulate import simulate
from .dp import DPSearch, solve_with

__all__ = ["known_plans", "flat_plans", "best_of"]

_LOWEST: dict[tuple[str, tuple[tuple[bool, bool], ...]], tuple[tuple[tuple[int, int], ...], tuple[int, ...]]] = {}
"""Least-peak plan of the known ones by the problem's structure and which nodes may be recomputed or kept."""
_LOWEST_KEPT = 64


def _canonical(regions) -> tuple[tuple[int, int], ...]:
    """Regions in `simulate`'s order: by start, outer before inner."""
    return tuple(sorted(set(regions), key=lambda r: (r[0], -r[1])))


def _key(problem: Problem) -> tuple[str, tuple[tuple[bool, bool], ...]]:
    """The structure and what the plan's rules depend on: a remembered plan is valid on any problem with this key."""
    return problem.fingerprint(), tuple((node.recomputable, node.saveable) for node in problem.nodes)


def known_plans(problem: Problem, budget_bytes: int, *, nested: bool, selective: bool) -> list[tuple[str, SolverResult]]:
    """(name, result) of each known plan for `budget_bytes` (see the module docstring)."""
    out: list[tuple[str, SolverResult]] = []
    if nested:
        out.append(("dp", solve_with(DPSearch(problem), budget_bytes, selective=selective)))
    out.append(("uniform", uniform(problem, budget_bytes)))
    out.append(("greedy", GreedySearch(problem).solve(budget_bytes)))
    remembered = _LOWEST.get(_key(problem))
    if remembered is not None and all(0 <= s <= e < problem.n for s, e in remembered[0]):
        regions, saved = remembered
        if nested or all(p < 0 for p in region_parents(regions)):  # the plan space asked for holds it
            out.append(("remembered", SolverResult(regions=regions, saved=saved if selective else ())))
    return out


def flat_plans(known: list[tuple[str, SolverResult]]) -> list[tuple[tuple[int, int], ...]]:
    """The region plans among `known` that the MILP can hold (no region inside another), kept ops dropped."""
    out = []
    for _, result in known:
        regions = _canonical(result.regions)
        if regions and all(p < 0 for p in region_parents(regions)):
            out.append(regions)
    return out


def best_of(
    problem: Problem,
    budget_bytes: int,
    own: SolverResult,
    known: list[tuple[str, SolverResult]],
    *,
    selective: bool,
) -> SolverResult:
    """The MILP's result `own`, or a known plan that fits and recomputes less (or, when none fits, peaks lower).

    `stats["plan_from"]` names the known plan taken; `min_peak_bytes` is the least of all of them.
    """
    scored = []
    for order, (name, result) in enumerate([("ilp", own), *known]):
        sim = simulate(problem, result.regions, saved=result.saved)
        fits = sim.peak_bytes <= budget_bytes
        scored.append(((not fits, sim.recompute_time if fits else sim.peak_bytes, sim.peak_bytes, order), name, result, sim))
    low = min(scored, key=lambda t: (t[3].peak_bytes, t[0]))
    if len(_LOWEST) >= _LOWEST_KEPT:
        _LOWEST.pop(next(iter(_LOWEST)))
    _LOWEST[_key(problem)] = (_canonical(low[2].regions), tuple(low[2].saved))
    key, name, result, sim = min(scored, key=lambda t: t[0])  # when none fits, the lowest peak
    if key[0]:
        smallest = min(own.stats.get("min_peak_bytes", scored[0][3].peak_bytes), sim.peak_bytes)
        stats = {**own.stats, "min_peak_bytes": smallest}
        if name != "ilp":
            stats["plan_from"] = name
        return SolverResult(regions=result.regions, saved=result.saved, stats=stats)
    if name == "ilp":
        return own
    if selective and not result.saved:
        from ..heuristics.selective import block_regions, with_saved

        result = with_saved(problem, budget_bytes, result, [block_regions(problem)])
        sim = simulate(problem, result.regions, saved=result.saved)
    stale = ("infeasible", "selective", "saved_ops", "region_plan_recompute_time")  # they describe the MILP's plan
    stats: dict[str, Any] = {
        **{k: v for k, v in own.stats.items() if k not in stale},
        "plan_from": name,
        "milp_plan_fits": not scored[0][0][0],
        "min_peak_bytes": sim.peak_bytes,
    }
    for field in stale[1:]:
        if field in result.stats:
            stats[field] = result.stats[field]
    return SolverResult(regions=result.regions, saved=result.saved, stats=stats)

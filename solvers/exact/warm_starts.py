"""The MILP's starting plans: the heuristics' flat plans and the known ones, mapped onto the coarse graph.

A start that fits the target gives a time-limited MILP a plan to improve on from its first node, and the
MILP's answer is never worse than it (`ilp._ilp` keeps the start where the solver stops short of it).
"""

from __future__ import annotations

from ..costs import recompute_time, trim_flat_regions
from ..heuristics.basic import uniform
from ..heuristics.greedy import GreedySearch
from ..problem import Problem
from ..simulate import simulate

__all__ = ["flat_start", "on_coarse"]


def on_coarse(groups: list[tuple[int, int]], regions) -> tuple[tuple[int, int], ...] | None:
    """A fine graph's flat plan on the coarse graph, or None when a region does not begin and end on groups."""
    first = {g[0]: i for i, g in enumerate(groups)}
    last = {g[1]: i for i, g in enumerate(groups)}
    if not all(s in first and e in last for s, e in regions):
        return None
    return tuple((first[s], last[e]) for s, e in regions)


def flat_start(coarse: Problem, target: int, known=()) -> tuple[tuple[int, int], ...] | None:
    """The least-recompute flat plan of greedy, uniform and `known` (coarse plans) that fits `target`
    on the coarse graph."""
    best = None
    greedy_plan = GreedySearch(coarse).solve(target)
    candidates = list(known)
    if greedy_plan.stats.get("min_peak_bytes", target + 1) <= target:
        candidates.append(greedy_plan.regions)
    candidates.append(uniform(coarse, target).regions)
    for regions in candidates:
        regions = trim_flat_regions(coarse, regions)
        if simulate(coarse, regions).peak_bytes <= target:
            cost = recompute_time(coarse, regions)
            if best is None or cost < best[0]:
                best = (cost, regions)
    return None if best is None else best[1]

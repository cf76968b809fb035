"""`greedy`: Chen et al. 2016's budget-driven greedy segmentation.

For a threshold b (bytes), walk the nodes forward accumulating the bytes each
node's backward would keep; when the sum passes b, the node becomes a kept
checkpoint and the nodes since the previous one form a recomputed region.
The threshold is searched over a geometric grid: every candidate plan is
simulated, and the one with the least recompute time whose simulated peak
fits the budget wins (the lowest peak when none fits).
"""

from __future__ import annotations

import math
from typing import Any

from ..costs import recompute_time, trim_flat_regions
from ..problem import Problem
from ..registry import SolverResult, register
from ..simulate import simulate

__all__ = ["greedy", "greedy_segments", "GreedySearch"]


def _saved_bytes(problem: Problem) -> list[int]:
    """Bytes made by each node that some backward keeps. # bytes"""
    out = [0] * problem.n
    for st in problem.storages:
        if st.saved_by:
            out[st.producer] += st.nbytes
    return out


def greedy_segments(problem: Problem, threshold: float, saved: list[int] | None = None) -> tuple[tuple[int, int], ...]:
    """Chen's walk: a node whose bytes push the running sum past threshold is kept; the run before it is a region."""
    saved = saved if saved is not None else _saved_bytes(problem)
    regions, start, acc = [], None, 0
    for i, node in enumerate(problem.nodes):
        if not node.recomputable:
            if start is not None:
                regions.append((start, i - 1))
            start, acc = None, 0
            continue
        if acc + saved[i] > threshold and start is not None:
            regions.append((start, i - 1))  # node i is the checkpoint
            start, acc = None, 0
            continue
        if start is None:
            start = i
        acc += saved[i]
    if start is not None:
        regions.append((start, problem.n - 1))
    return trim_flat_regions(problem, regions)


class GreedySearch:
    """All the plans of the threshold grid, simulated once (reused across budgets by `sweep`)."""

    def __init__(self, problem: Problem, steps: int = 24) -> None:
        self.problem = problem
        saved = _saved_bytes(problem)
        total = sum(saved)
        positive = [b for b in saved if b > 0]
        lo = max(1, min(positive, default=1))
        plans: dict[tuple, float] = {}
        thresholds = [0.0]
        if total > 0:
            ratio = (total / lo) ** (1 / max(1, steps - 1))
            thresholds += [lo * ratio**k for k in range(steps)]
        self.thresholds = thresholds
        for b in thresholds:
            regions = greedy_segments(problem, b, saved)
            if regions not in plans:
                plans[regions] = b
        plans.setdefault((), float("inf"))
        self.plans = [(recompute_time(problem, r), r, plans[r]) for r in plans]
        self.plans.sort(key=lambda p: p[0])
        self._peaks: dict[tuple, int] = {}

    def peak(self, regions) -> int:
        if regions not in self._peaks:
            self._peaks[regions] = simulate(self.problem, regions).peak_bytes
        return self._peaks[regions]

    def solve(self, budget_bytes: int | None) -> SolverResult:
        stats: dict[str, Any] = {"thresholds": len(self.thresholds), "plans": len(self.plans)}
        if budget_bytes is None:
            # Chen's default: about sqrt(n) segments.
            goal = max(1, round(math.sqrt(self.problem.n)))
            _, regions, b = min(self.plans, key=lambda p: abs(len(p[1]) - goal))
            return SolverResult(regions=regions, stats={**stats, "threshold_bytes": b})
        low = None
        for _time, regions, b in self.plans:
            peak = self.peak(regions)
            if peak <= budget_bytes:
                return SolverResult(regions=regions, stats={**stats, "threshold_bytes": b, "min_peak_bytes": peak})
            if low is None or peak < low[0]:
                low = (peak, regions, b)
        assert low is not None
        return SolverResult(regions=low[1], stats={**stats, "threshold_bytes": low[2], "min_peak_bytes": low[0]})


@register("greedy")
def greedy(problem: Problem, budget_bytes: int | None = None, *, steps: int = 24) -> SolverResult:
    """Chen's greedy with the threshold searched so the simulated peak fits with the least recompute."""
    if problem.n == 0:
        return SolverResult(regions=(), stats={"plans": 0})
    return GreedySearch(problem, steps).solve(budget_bytes)

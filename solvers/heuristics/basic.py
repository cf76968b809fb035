"""The baseline solvers: `none` (no checkpointing) and `uniform` (Chen et al.'s sqrt(n))."""

from __future__ import annotations

import bisect
import itertools
import math

from ..problem import Problem
from ..registry import SolverResult, register
from ..simulate import simulate

__all__ = ["no_checkpointing", "uniform", "segment_runs", "equal_cost_segments", "Segmenter"]


@register("none")
def no_checkpointing(problem: Problem, budget_bytes: int | None = None) -> SolverResult:
    """Keep every activation: the fastest step and the baseline peak."""
    return SolverResult(regions=())


def segment_runs(problem: Problem) -> list[tuple[int, int]]:
    """Maximal runs of recomputable nodes: regions may not cross the others."""
    runs, start = [], None
    for i, node in enumerate(problem.nodes):
        if node.recomputable and start is None:
            start = i
        elif not node.recomputable and start is not None:
            runs.append((start, i - 1))
            start = None
    if start is not None:
        runs.append((start, problem.n - 1))
    return runs


def equal_cost_segments(problem: Problem, k: int, cut_bytes: list[int] | None = None) -> list[tuple[int, int]]:
    """About k segments of equal forward cost, each boundary moved to the cheapest cut nearby.

    Cost is forward time where it is known, else one unit per node. A boundary
    after node i costs cut_bytes[i]; within a window of half a segment around the
    ideal place the cheapest cut is taken (articulation points are the cheapest).
    """
    return Segmenter(problem, cut_bytes)(k)


class Segmenter:
    """`equal_cost_segments` for one problem at any k: what does not depend on k is computed once."""

    def __init__(self, problem: Problem, cut_bytes: list[int] | None = None) -> None:
        self.n = problem.n
        self.cuts = list(cut_bytes if cut_bytes is not None else problem.cut_bytes())  # bytes
        weights = [node.time for node in problem.nodes]
        if sum(weights) <= 0:
            weights = [1.0] * self.n
        self.prefix = [0.0, *itertools.accumulate(weights)]
        self.runs = segment_runs(problem)

    def __call__(self, k: int) -> list[tuple[int, int]]:
        if self.n == 0 or k <= 0:
            return []
        prefix, cuts = self.prefix, self.cuts
        total = prefix[-1]
        segments: list[tuple[int, int]] = []
        for lo, hi in self.runs:
            share = (prefix[hi + 1] - prefix[lo]) / total
            parts = max(1, min(hi - lo + 1, round(k * share)))
            bounds, prev = [], lo - 1
            for p in range(1, parts):
                goal = prefix[lo] + (prefix[hi + 1] - prefix[lo]) * p / parts
                ideal = min(max(bisect.bisect_left(prefix, goal) - 1, prev + 1), hi - 1)
                half = max(1, (hi - lo + 1) // (2 * parts))
                first, last = max(prev + 1, ideal - half), min(hi - 1, ideal + half)
                if first > last:
                    continue
                cut = _cheapest(cuts, first, last, ideal)
                bounds.append(cut)
                prev = cut
            start = lo
            for b in bounds:
                segments.append((start, b))
                start = b + 1
            segments.append((start, hi))
        return segments


def _cheapest(cuts: list[int], first: int, last: int, ideal: int) -> int:
    """The position of the cheapest cut in cuts[first..last]; among equals the nearest `ideal`, then the earliest."""
    window = cuts[first : last + 1]
    low = min(window)
    j = window.index(low)
    best = first + j
    while True:
        try:
            j = window.index(low, j + 1)
        except ValueError:
            return best
        if abs(first + j - ideal) < abs(best - ideal):
            best = first + j


@register("uniform")
def uniform(problem: Problem, budget_bytes: int | None = None, *, max_segments: int | None = None) -> SolverResult:
    """Chen's sqrt(n): equal-cost segments, each recomputed once in backward.

    Without a budget: round(sqrt(n)) segments. With a budget: the fewest
    segments whose simulated peak fits; when none fits, the lowest peak found.
    """
    n = problem.n
    if n == 0:
        return SolverResult(regions=(), stats={"segments": 0})
    segments = Segmenter(problem)
    if budget_bytes is None:
        k = max(1, round(math.sqrt(n)))
        return SolverResult(regions=tuple(segments(k)), stats={"segments": k})
    base = simulate(problem, ())
    if base.peak_bytes <= budget_bytes:
        return SolverResult(regions=(), stats={"segments": 0, "min_peak_bytes": base.peak_bytes})
    limit = max_segments or min(n, 16 + 4 * math.isqrt(n))
    best: tuple[int, tuple] | None = None
    seen = set()
    for k in range(1, limit + 1):
        regions = tuple(segments(k))
        if regions in seen:
            continue
        seen.add(regions)
        peak = simulate(problem, regions).peak_bytes
        if best is None or peak < best[0]:
            best = (peak, regions)
        if peak <= budget_bytes:
            return SolverResult(regions=regions, stats={"segments": len(regions), "min_peak_bytes": best[0]})
    assert best is not None
    return SolverResult(regions=best[1], stats={"segments": len(best[1]), "min_peak_bytes": best[0]})

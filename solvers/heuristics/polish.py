"""`lower_peak`: a plan's regions moved, split, merged or dropped one at a time while its simulated peak falls.

The solvers' lowest-peak plans are the lowest of their own plan spaces: the ILP's graph is coarsened
(runs of nodes merged, so some region bounds cannot be placed), dp's regions follow its own segment
structure. Where no plan of the portfolio fits a budget, `auto` polishes the plan of least peak with this
local search before it names the smallest budget, and takes the polished plan where it fits. On a small
Llama with its token-wise work chunked, merging regions, moving a region's end off an attention output and
nesting one region in another lower the least peak by about an eighth (benchmarks/results/reach-one-thread.md).

Each step tries every move of one region (its start or its end to any node between its neighbours, a
split at any node, a merge with the next region, dropping it) and takes the one of least peak, then of
least recompute; where no such move lowers the peak, the same with one region nested at a region's start
or end (at most one at each end of a region); then with one region more around a run of regions (where the
peak sits in a late layer's backward, one region around the earlier layers' regions lowers it). The work is
bounded by node-simulations (`max_work`), not by a clock, so the plan is the same on any machine.
"""

from __future__ import annotations

from collections.abc import Iterator

from ..plans import normalize_regions
from ..problem import Problem, ProblemError
from ..simulate import simulate

__all__ = ["MAX_WORK", "lower_peak", "lowest_polished"]

MAX_WORK = 1_000_000
"""Nodes simulated at most (simulations x nodes): a few seconds of a CPU, small beside planning itself."""

Regions = tuple[tuple[int, int], ...]


def _moves(regions: Regions, n: int) -> Iterator[Regions]:
    """Every plan one move away from `regions` (flat: sorted, disjoint)."""
    cur = list(regions)
    for i, (s, e) in enumerate(cur):
        lo = cur[i - 1][1] + 1 if i else 0
        hi = cur[i + 1][0] - 1 if i + 1 < len(cur) else n - 1
        before, after = cur[:i], cur[i + 1:]
        for s2 in range(lo, e + 1):
            if s2 != s:
                yield (*before, (s2, e), *after)
        for e2 in range(s, hi + 1):
            if e2 != e:
                yield (*before, (s, e2), *after)
        for k in range(s, e):
            yield (*before, (s, k), (k + 1, e), *after)
        if after:
            yield (*before, (s, after[0][1]), *after[1:])
        yield (*before, *after)


def _inside(r: tuple[int, int], o: tuple[int, int]) -> bool:
    return o != r and o[0] <= r[0] and r[1] <= o[1]


def _tops(regions: Regions) -> list[tuple[int, int]]:
    """The regions no other region holds, in order."""
    return sorted(r for r in regions if not any(_inside(r, o) for o in regions))


def _nests(regions: Regions, n: int) -> Iterator[Regions]:
    """Every plan with one region more, nested in a top-level region of `regions` at its start or its end,
    clear of the children it holds already (so a region holds at most one at each end): within the outer
    region's recompute, the inner one's part runs again in the backward of its own, so the outer recompute
    no longer holds what the inner part made."""
    for s, e in _tops(regions):
        kids = [c for c in regions if _inside(c, (s, e))]
        first = min((c[0] for c in kids), default=e + 1)  # a child at the start ends before the first one
        last = max((c[1] for c in kids), default=s - 1)  # a child at the end starts after the last one
        for inner in [*((s, b) for b in range(s, min(e, first))), *((a, e) for a in range(max(s + 1, last + 1), e + 1))]:
            if inner not in regions:
                yield (*regions, inner)


def _encloses(regions: Regions, n: int) -> Iterator[Regions]:
    """Every plan with one region more that holds a run of two or more consecutive top-level regions of
    `regions`: from the first one's start to the last one's end, or to any node before the next top-level
    region. What the run keeps between its regions (their outputs, the inputs of the next) is then made
    again in the new region's recompute instead of held from the forward on."""
    tops = _tops(regions)
    for i in range(len(tops)):
        for j in range(i + 1, len(tops)):
            hi = tops[j + 1][0] - 1 if j + 1 < len(tops) else n - 1
            for e in range(tops[j][1], hi + 1):
                if (tops[i][0], e) not in regions:
                    yield (*regions, (tops[i][0], e))


def lower_peak(problem: Problem, regions: Regions, target: int | None = None,
               max_work: int = MAX_WORK) -> tuple[Regions, int]:
    """(regions, peak): `regions` (a plan of `problem`) after moves that lower the simulated peak, until the
    peak is within `target`, no move lowers it, or `max_work` node-simulations are spent: first the moves
    of flat plans, then regions nested at a top-level region's start or end, then regions that hold runs of
    top-level regions. Plans nested already are returned as they are."""
    n = problem.n
    cur = normalize_regions(problem, regions)
    sim = simulate(problem, cur)
    score = (sim.peak_bytes, sim.recompute_time)
    if any(b[0] <= a[1] for a, b in zip(cur, cur[1:])) or n == 0:
        return cur, score[0]  # nested: the moves below assume disjoint regions
    work = 0
    for moves in (_moves, _nests, _encloses):
        while (target is None or score[0] > target) and work < max_work:
            step = None
            for plan in moves(cur, n):
                if work >= max_work:
                    break
                work += n
                try:
                    plan = normalize_regions(problem, plan)
                except ProblemError:
                    continue  # a region over a node that must not be recomputed
                s = simulate(problem, plan)
                key = (s.peak_bytes, s.recompute_time)
                if key < score and (step is None or key < step[0]):
                    step = (key, plan)
            if step is None:
                break
            score, cur = step
    return cur, score[0]


def lowest_polished(problem: Problem, plans, target: int | None = None,
                    max_work: int = MAX_WORK) -> tuple[Regions, int, Regions]:
    """(regions, peak, start) of the lowest of `plans` each polished (`lower_peak`, fewer regions on a tie),
    in order of their own peak, until one is within `target`. The search is local, so where it ends
    depends on where it starts: two plans of equal peak can polish to different ones."""
    starts = sorted({tuple(map(tuple, r)) for r in plans}, key=lambda r: (simulate(problem, r).peak_bytes, len(r)))
    best: tuple[int, int, Regions, Regions] | None = None
    for start in starts:
        regions, peak = lower_peak(problem, start, target=target, max_work=max_work)
        if best is None or (peak, len(regions)) < best[:2]:
            best = (peak, len(regions), regions, start)
        if target is not None and best[0] <= target:
            break
    if best is None:
        raise ValueError("lowest_polished: no plan given")
    return best[2], best[0], best[3]


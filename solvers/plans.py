"""What a plan is: its regions (nested or disjoint) and the nodes a selective region keeps, checked.

The simulator, the offload model and the solvers all take plans in this normal form; nothing here
prices a plan.
"""

from __future__ import annotations

import numpy as np

from .problem import Problem, ProblemError

__all__ = ["normalize_regions", "normalize_saved", "region_parents"]


def normalize_regions(problem: Problem, regions) -> tuple[tuple[int, int], ...]:
    """Sort regions, check bounds, recomputability and proper nesting."""
    out = sorted({(int(s), int(e)) for s, e in regions}, key=lambda r: (r[0], -r[1]))
    stack: list[tuple[int, int]] = []
    n = problem.n
    unrecomputable = problem.arrays.unrecomputable if out else []
    for s, e in out:
        if not 0 <= s <= e < n:
            raise ProblemError(f"region ({s}, {e}) is outside the {n} nodes")
        if unrecomputable[e + 1] != unrecomputable[s]:
            i = next(i for i in range(s, e + 1) if not problem.nodes[i].recomputable)
            raise ProblemError(f"region ({s}, {e}) contains node {problem.nodes[i].name!r}, which must not be recomputed")
        while stack and stack[-1][1] < s:
            stack.pop()
        if stack and e > stack[-1][1]:
            raise ProblemError(f"regions {stack[-1]} and ({s}, {e}) overlap without nesting")
        stack.append((s, e))
    return tuple(out)


def normalize_saved(problem: Problem, regions: tuple[tuple[int, int], ...], saved) -> tuple[int, ...]:
    """Sorted saved nodes; each must be saveable and inside a region that neither nests nor is nested."""
    out = tuple(sorted({int(i) for i in saved}))
    if not out:
        return out
    parents = region_parents(regions)
    nested = {p for p in parents if p >= 0} | {r for r, p in enumerate(parents) if p >= 0}
    n, nodes = problem.n, problem.nodes
    inner = np.full(n, -1, dtype=np.int64)  # innermost region of each node: regions come outer first
    for r, (s, e) in enumerate(regions):
        inner[s : e + 1] = r
    kept = np.array(out, dtype=np.int64)
    if kept[0] >= 0 and kept[-1] < n:
        where = inner[kept]
        flat = np.ones(len(regions), dtype=bool)
        flat[list(nested)] = False
        if (where >= 0).all() and flat[where].all() and problem.arrays.saveable[kept].all():
            return out
    for i in out:  # name the first node that breaks a rule
        if not 0 <= i < n or inner[i] < 0:
            raise ProblemError(f"saved: node {i} is not inside a region")
        if inner[i] in nested:
            raise ProblemError(f"saved: node {i} is in a nested region; selective regions do not nest")
        if not nodes[i].saveable:
            raise ProblemError(f"saved: node {nodes[i].name!r} may not be kept by a selective region")
    return out


def region_parents(regions: tuple[tuple[int, int], ...]) -> list[int]:
    """parents[r]: index of the innermost region containing region r, or -1."""
    parents, stack = [], []
    for r, (s, _e) in enumerate(regions):
        while stack and regions[stack[-1]][1] < s:
            stack.pop()
        parents.append(stack[-1] if stack else -1)
        stack.append(r)
    return parents

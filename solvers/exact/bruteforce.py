"""`bruteforce`: the reference optimum on tiny problems, by enumerating plan spaces.

Every plan of the chosen space is judged by `simulate`; the answer is the
least recompute time among plans whose simulated peak fits the budget. Plans
are visited in increasing recompute time (computed without replaying memory),
so a loose budget stops the search early.

Plan spaces (option `space`):

* 'flat': every set of disjoint regions (adjacent regions allowed).
* 'flat_saver_ended': flat sets whose regions end on a node that saves
  something. Same optimum as 'flat' (`costs.trim_flat_regions` maps any flat plan
  to one of these with no more time nor peak), much smaller; the space `ilp`
  searches.
* 'nested': every laminar family of regions (nesting depth bounded by
  `max_depth`).
* 'rotor': laminar families where the last node of every region, and of the
  graph, runs outside any child region: the space `dp` searches on a chain of
  single-node stages.
* 'selective': every flat plan with every subset of its regions' saveable
  nodes kept (op-level selective recompute); plans are (regions, saved) there.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ..costs import recompute_time, saver_flags
from ..problem import Problem
from ..registry import SolverResult, register
from ..simulate import simulate

__all__ = ["bruteforce", "enumerate_plans", "SPACES", "PlanSpaceTooLargeError"]

SPACES = ("flat", "flat_saver_ended", "nested", "rotor", "selective")

Regions = tuple[tuple[int, int], ...]


class PlanSpaceTooLargeError(ValueError):
    """The problem has more nodes than brute force is allowed to enumerate."""


def _flat(problem: Problem, saver_ended: bool) -> Iterator[Regions]:
    n, rec = problem.n, [node.recomputable for node in problem.nodes]
    saves = saver_flags(problem)

    def rec_from(i: int) -> Iterator[list[tuple[int, int]]]:
        if i >= n:
            yield []
            return
        for rest in rec_from(i + 1):
            yield rest
        e = i
        while e < n and rec[e]:
            if not saver_ended or saves[e]:
                for rest in rec_from(e + 1):
                    yield [(i, e), *rest]
            e += 1

    for plan in rec_from(0):
        yield tuple(plan)


def _sequences(
    lo: int, hi: int, ctx: tuple[int, int], rec: list[bool], depth: int, max_depth: int, rotor: bool
) -> Iterator[list]:
    """Interiors of the context `ctx` from node lo to hi: own nodes and child regions (with their interiors)."""
    if lo > hi:
        yield []
        return
    # First piece: node lo runs in this context ...
    for rest in _sequences(lo + 1, hi, ctx, rec, depth, max_depth, rotor):
        yield rest
    if depth >= max_depth:
        return
    # ... or a child region lo..d starts here.
    last = hi - 1 if rotor else hi
    d = lo
    while d <= last and rec[d]:
        if depth == 0 or (lo, d) != ctx:  # a child equal to its parent is the same region
            for inner in _sequences(lo, d, (lo, d), rec, depth + 1, max_depth, rotor):
                for rest in _sequences(d + 1, hi, ctx, rec, depth, max_depth, rotor):
                    yield [(lo, d), *inner, *rest]
        d += 1


def _nested(problem: Problem, max_depth: int, rotor: bool) -> Iterator[Regions]:
    rec = [node.recomputable for node in problem.nodes]
    seen: set[Regions] = set()
    for plan in _sequences(0, problem.n - 1, (0, problem.n - 1), rec, 0, max_depth, rotor):
        key = tuple(sorted(set(plan), key=lambda r: (r[0], -r[1])))
        if key not in seen:
            seen.add(key)
            yield key


def enumerate_selective(problem: Problem) -> Iterator[tuple[Regions, tuple[int, ...]]]:
    """Every flat plan with every subset of the saveable nodes inside its regions."""
    for plan in _flat(problem, saver_ended=False):
        members = [i for s, e in plan for i in range(s, e + 1) if problem.nodes[i].saveable]
        for mask in range(1 << len(members)):
            yield plan, tuple(i for b, i in enumerate(members) if mask >> b & 1)


def enumerate_plans(problem: Problem, space: str = "flat", *, max_depth: int = 64) -> Iterator[Regions]:
    """Every plan of a space (see the module docstring), each once ('selective': see enumerate_selective)."""
    if space == "flat":
        return _flat(problem, saver_ended=False)
    if space == "flat_saver_ended":
        return _flat(problem, saver_ended=True)
    if space == "nested":
        return _nested(problem, max_depth, rotor=False)
    if space == "rotor":
        return _nested(problem, max_depth, rotor=True)
    if space == "selective":
        return enumerate_selective(problem)  # type: ignore[return-value]
    raise ValueError(f"space: {space!r} is not one of {', '.join(SPACES)}")


@register("bruteforce")
def bruteforce(
    problem: Problem,
    budget_bytes: int | None = None,
    *,
    space: str = "flat_saver_ended",
    max_depth: int = 64,
    max_nodes: int = 14,
) -> SolverResult:
    """The least-recompute plan of `space` whose simulated peak fits; exhaustive."""
    if problem.n > max_nodes:
        raise PlanSpaceTooLargeError(
            f"solver 'bruteforce': the graph has {problem.n} nodes, more than the {max_nodes} (max_nodes) it can "
            "enumerate; use solver 'dp', 'ilp' or 'auto' for this model"
        )
    if space == "selective":
        pairs = list(enumerate_selective(problem))
    else:
        pairs = [(plan, ()) for plan in enumerate_plans(problem, space, max_depth=max_depth)]
    plans = sorted((recompute_time(problem, plan, saved), len(plan), len(saved), plan, saved) for plan, saved in pairs)
    stats: dict[str, Any] = {"space": space, "plans": len(plans)}
    if budget_bytes is None:
        return SolverResult(regions=(), stats=stats)
    best: tuple[int, Regions, tuple[int, ...]] | None = None
    for visited, (_time, _k, _m, plan, saved) in enumerate(plans, 1):
        peak = simulate(problem, plan, saved=saved).peak_bytes
        if peak <= budget_bytes:
            return SolverResult(
                regions=plan, saved=saved, stats={**stats, "simulated": visited, "min_peak_bytes": peak}
            )
        if best is None or peak < best[0]:
            best = (peak, plan, saved)
    assert best is not None
    return SolverResult(
        regions=best[1], saved=best[2], stats={**stats, "simulated": len(plans), "min_peak_bytes": best[0]}
    )

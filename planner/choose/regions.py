"""Region bookkeeping every plan goes through: re-simulated after its regions move, merged with the
model's own checkpoint spans, and moved off in-place writes (`finish_regions`)."""

from __future__ import annotations

import dataclasses

from ..lower.rewrite import safe_regions
from ..solvers.copies import offloadable
from ..solvers.plans import normalize_regions
from ..solvers.problem import Problem, Solution
from ..solvers.simulate import simulate

__all__ = ["Regions", "with_regions", "kept_offloads", "laminar", "merge_own", "kept_saved", "finish_regions", "per_block_regions"]

Regions = tuple[tuple[int, int], ...]


def with_regions(problem: Problem, solution: Solution, regions, budget=None, stats=None) -> Solution:
    """`solution` with `regions` in place of its own (and the kept ops still inside them, and the offloads
    the new regions still keep from the forward to the backward), re-simulated."""
    saved = kept_saved(regions, solution.saved)
    offloaded = kept_offloads(problem, regions, saved, solution.offloaded)
    sim = simulate(problem, regions, saved=saved, offloaded=offloaded)
    return dataclasses.replace(
        solution,
        regions=tuple(regions),
        saved=saved,
        offloaded=offloaded,
        peak_bytes=sim.peak_bytes,
        recompute_time=sim.recompute_time,
        budget_bytes=solution.budget_bytes if budget is None else budget,
        stats={**solution.stats, **(stats or {})},
    )


def kept_offloads(problem: Problem, regions, saved, offloaded) -> tuple[int, ...]:
    """The offloads of a plan that its (moved) regions still keep from the forward to the backward: a region
    that grew over an offloaded storage recomputes it instead."""
    if not offloaded:
        return ()
    allowed = set(offloadable(problem, regions, saved))
    return tuple(sorted(t for t in offloaded if t in allowed))


def laminar(problem: Problem, spans) -> tuple[tuple[int, int], ...]:
    """The spans that nest properly, in order (a span crossing an earlier one is left out)."""
    kept: list[tuple[int, int]] = []
    for span in spans:
        try:
            kept = list(normalize_regions(problem, kept + [span]))
        except Exception:  # noqa: BLE001 - a crossing span is not kept
            continue
    return tuple(kept)


def merge_own(own, regions) -> list[tuple[int, int]]:
    """The model's own regions plus the solver's regions that are disjoint from them or contain them."""
    out = list(own)
    for s, e in regions:
        if all(e < a or b < s or (s <= a and b <= e and (s, e) != (a, b)) for a, b in own):
            out.append((s, e))
    return out


def kept_saved(regions, saved) -> tuple[int, ...]:
    """Saved ops still inside a region after the regions moved (a moved region's cache may not reach them)."""
    return tuple(i for i in saved if any(s <= i <= e for s, e in regions))


def finish_regions(problem: Problem, graph_module, regions, own: Regions = ()) -> tuple[Regions, list[str]]:
    """A solver's regions after what happens to every plan: the model's own regions merged in (`own`,
    when they are kept), cuts moved off in-place writes (safe_regions). Returns (regions, notes)."""
    regions = list(regions)
    if own:
        regions = merge_own(own, regions)
    notes: list[str] = []
    for _ in range(4):  # until stable: rewrite() runs safe_regions again on what it is given
        safe, moved = safe_regions(graph_module, regions)
        notes += moved
        if sorted(safe) == sorted(tuple(r) for r in regions):
            break
        regions = safe
    return normalize_regions(problem, safe), notes


def per_block_regions(problem: Problem, graph_module) -> Regions:
    """The step checkpointed per block (one region per numbered block, else about sqrt(n) even runs),
    finished as every plan is: where the plain step was never run, what a plan's step is compared and
    raced with (its recompute is the model's own forward, so its step equals the plain step's)."""
    from ..solvers.costs import trim_flat_regions
    from ..solvers.heuristics.basic import uniform
    from ..solvers.heuristics.selective import block_regions

    regions = block_regions(problem) or trim_flat_regions(problem, uniform(problem).regions)
    return finish_regions(problem, graph_module, regions)[0]

"""Op-level selective recompute: which ops a checkpoint region keeps instead of re-running.

A selective region is one non-reentrant checkpoint call whose policy keeps
(MUST_SAVE) the outputs of some of its ops and recomputes the rest. The
simulator prices it exactly (`simulate(..., saved=...)`); this module holds

* `selective`: the named baseline policy of Megatron and torch.compile: one
  region per block, matmul / convolution / attention outputs kept, the rest
  recomputed;
* `refine_saved`: given region plans, the saved ops that lower the predicted
  overhead while the peak still fits, chosen greedily by seconds saved per
  byte kept (a prefix found by bisection, then single additions); `dp` and
  `ilp` call it on their candidate plans, so regions and saved ops are
  chosen together.
"""

from __future__ import annotations

import re

from ..costs import recompute_time, trim_flat_regions
from ..kept_search import KeptSearch
from ..plans import region_parents
from ..problem import Problem
from ..registry import SolverResult, register
from ..simulate import simulate

__all__ = ["selective", "block_regions", "heavy_nodes", "refine_saved", "best_selective", "with_saved"]

_HEAVY = re.compile(r"(^|[._])(mm|addmm|bmm|baddbmm|matmul|linear|einsum|conv\w*|\w*attention\w*)($|[._])")
_BLOCK = re.compile(r"^(.*?\.\d+)(\.|$)")
MAX_SINGLE_TRIES = 48  # candidates tried one at a time after the bisected prefix


def is_heavy(op: str) -> bool:
    """Matmul, convolution or attention: the ops Megatron and compile's policies keep."""
    return bool(_HEAVY.search(op.lower()))


def heavy_nodes(problem: Problem) -> list[int]:
    return [i for i, node in enumerate(problem.nodes) if node.saveable and is_heavy(node.op)]


def block_regions(problem: Problem) -> tuple[tuple[int, int], ...]:
    """One region per repeated block: maximal runs of recomputable nodes under the same numbered
    module (`transformer.h.3`, `model.layers.0`), trimmed to end on a node that saves something."""
    keys = []
    for node in problem.nodes:
        m = _BLOCK.match(node.module) if node.module else None
        keys.append(m.group(1) if m and node.recomputable else None)
    runs, start = [], 0
    for i in range(1, problem.n + 1):
        if i == problem.n or keys[i] != keys[start]:
            if keys[start] is not None:
                runs.append((start, i - 1))
            start = i
    return trim_flat_regions(problem, runs)


def _flat_members(problem: Problem, regions) -> list[int]:
    parents = region_parents(tuple(regions))
    nested = {p for p in parents if p >= 0} | {r for r, p in enumerate(parents) if p >= 0}
    return [i for r, (s, e) in enumerate(regions) if r not in nested for i in range(s, e + 1)]


def refine_saved(
    problem: Problem, regions, budget_bytes: int | None, saved: tuple[int, ...] = ()
) -> tuple[tuple[int, ...], float, int]:
    """Saved ops for `regions` that lower the predicted recompute time while the peak fits.

    Returns (saved, recompute seconds, peak bytes) of the best found, `saved` as given when nothing helps.
    """
    regions = tuple(regions)
    if not regions or budget_bytes is None:
        base_sim = simulate(problem, regions, saved=saved)
        return tuple(sorted(saved)), base_sim.recompute_time, base_sim.peak_bytes
    produced = [0] * problem.n
    for st in problem.storages:
        produced[st.producer] += st.nbytes
    chosen = set(saved)
    cands = [i for i in _flat_members(problem, regions) if problem.nodes[i].saveable and problem.nodes[i].time > 0]
    cands = [i for i in cands if i not in chosen]
    # Seconds saved per byte kept; ties by position, so the order is the same on every run.
    cands.sort(key=lambda i: (-problem.nodes[i].time / max(1, produced[i]), i))
    search = KeptSearch(problem, regions, [*chosen, *cands])  # every set below is priced on one layout
    start = tuple(sorted(chosen))
    best = (search.seconds(start), start, search.peak(start))

    lo, hi = 0, len(cands)  # largest prefix that fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if search.peak(chosen | set(cands[:mid])) <= budget_bytes:
            lo = mid
        else:
            hi = mid - 1
    if lo:
        plan = tuple(sorted(chosen | set(cands[:lo])))
        seconds = search.seconds(plan)
        if seconds < best[0]:
            best = (seconds, plan, search.peak(plan))
    # Then one at a time, each tried on the best plan so far: the peaks of every remaining candidate on
    # that plan come at once, and are priced again only after a candidate is taken.
    rest = cands[lo : lo + MAX_SINGLE_TRIES]
    while rest:
        taken = None
        for k, (i, peak) in enumerate(zip(rest, search.peaks_each(best[1], rest))):
            if peak <= budget_bytes:
                plan = tuple(sorted({*best[1], i}))
                seconds = search.seconds(plan)
                if seconds < best[0]:
                    best, taken = (seconds, plan, peak), k
                    break
        rest = rest[taken + 1 :] if taken is not None else []
    return best[1], best[0], best[2]


def best_selective(problem: Problem, budget_bytes: int | None, plans) -> tuple[tuple[tuple[int, int], ...], tuple[int, ...]] | None:
    """Among region plans (each refined with saved ops), the least predicted recompute that fits."""
    if budget_bytes is None:
        return None
    best = None
    seen = set()
    for regions in plans:
        regions = tuple(sorted(set(regions), key=lambda r: (r[0], -r[1])))
        if regions in seen or not regions:
            continue
        seen.add(regions)
        saved, seconds, peak = refine_saved(problem, regions, budget_bytes)
        if peak <= budget_bytes and (best is None or (seconds, len(saved)) < best[0]):
            best = ((seconds, len(saved)), regions, saved)
    return (best[1], best[2]) if best is not None else None


def with_saved(problem: Problem, budget_bytes: int | None, result: SolverResult, plans=()) -> SolverResult:
    """`result`, or the best of its regions and `plans` with saved ops, when that predicts less time and fits.

    The solvers' half of choosing regions and saved ops together: each candidate region plan is given
    the saved ops that pay for themselves (`refine_saved`), and the least predicted time wins. A
    candidate that wins with no saved op is taken too: a time-limited or coarsened MILP, or dp's
    stages, can miss a plain plan (one region per block) that fits and recomputes less.
    """
    if budget_bytes is None or not any(node.saveable for node in problem.nodes):
        return result
    own = simulate(problem, result.regions, saved=result.saved)
    if own.peak_bytes > budget_bytes:
        return result
    found = best_selective(problem, budget_bytes, [result.regions, *plans])
    if found is None:
        return result
    regions, saved = found
    seconds = recompute_time(problem, regions, saved)
    if seconds >= own.recompute_time:
        return result
    stats = {**result.stats, "selective": bool(saved), "saved_ops": len(saved), "region_plan_recompute_time": own.recompute_time}
    return SolverResult(regions=regions, saved=saved, stats=stats)


@register("selective")
def selective(problem: Problem, budget_bytes: int | None = None) -> SolverResult:
    """The baseline policy: a region per block, matmul/conv/attention outputs kept, the rest recomputed.

    With a budget it does not meet, kept ops are dropped (least seconds per byte first) until it fits;
    when even the plain per-block plan does not fit, that plan is returned (the caller reports it).
    """
    regions = block_regions(problem)
    if not regions:
        return SolverResult(regions=(), stats={"blocks": 0, "min_peak_bytes": simulate(problem, ()).peak_bytes})
    inside = set(_flat_members(problem, regions))
    keep = [i for i in heavy_nodes(problem) if i in inside]
    plain = simulate(problem, regions)
    stats = {"blocks": len(regions), "min_peak_bytes": plain.peak_bytes, "policy_saved": len(keep)}
    if budget_bytes is not None:
        # Kept ops are dropped least seconds per byte first until the plan fits: the peaks of that walk
        # come from one layout, up to the first that fits.
        produced = [0] * problem.n
        for st in problem.storages:
            produced[st.producer] += st.nbytes
        keep.sort(key=lambda i: (problem.nodes[i].time / max(1, produced[i]), -i))
        walk = KeptSearch(problem, regions, keep).peaks_walked(keep, keep, dropping=True, until=budget_bytes)
        keep = keep[len(walk) - 1 :]
    return SolverResult(
        regions=regions, saved=tuple(sorted(keep)), stats={**stats, "recompute_time": recompute_time(problem, regions, keep)}
    )

"""`auto`: run the solvers that are fast for the graph's size and keep the best verified plan.

Small graphs: dp, ilp, greedy, uniform, the `selective` baseline policy and the hand-written plans
(`structured`: every n-th block, per-block selective).
Medium: the same with ilp coarsened and time-limited; above `ROOT_ONLY_NODES` the coarsened MILP also stops
after its root node. Large: no ilp. dp and
ilp also try saved ops inside their regions. Every plan is simulated; the
least predicted recompute time (checkpoint-call and policy costs included,
so the least predicted step time) among those within the budget wins (ties:
the lower peak). When none fits, the plans are polished, least peak first (`heuristics/polish.py`: their
regions moved, split, merged, dropped, nested or wrapped while the peak falls; a local search, so each plan is
a start of its own); the lowest polished plan is taken where it
fits, else its peak is the smallest budget reported.
When every MILP backend fails, the plans of the other solvers stand and
`stats["ilp_fallback"]` says why the MILP is missing.

Offloading: on a problem that can offload (`Problem.can_offload`: both copy bandwidths and a host
budget), auto also runs `ilp_offload` (up to `ilp.MAX_NODES` nodes) and adds offloads
(`offload.choose_offloads`) to the plan without regions, to the best recompute-only plan and to dp's plans
for looser budgets (`SPLITS`, and `WINDOW_SPLITS` of the bytes the forward's copy stream moves: recompute
less, copy the rest); the same rule picks among all, so the
answer is never worse than the recompute-only one. Elsewhere nothing of
this runs and the plans are those of a problem without offloading.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from .exact.dp import DPSearch
from .exact.ilp import MAX_NODES
from .exact.ilp_offload import ilp_offload
from .exact.milp_backend import ILPSolveError
from .heuristics.polish import lowest_polished
from .offload import choose_offloads, most_offloaded
from .problem import Problem
from .registry import SolverResult, get_solver, register
from .simulate import simulate

__all__ = ["auto", "auto_portfolio"]

logger = logging.getLogger(__name__)

ILP_NODES = 2000  # nodes above which auto skips the MILP
ILP_GAP = 0.005  # relative MIP gap auto accepts from the MILP
COARSE_MILP_S = 5.0
"""Most seconds auto gives the MILP of a graph above ROOT_ONLY_NODES (its root search). Coarsened, the MILP has at most `ilp.MAX_NODES` nodes whatever
the graph's size, and on graphs of repeated blocks its proven gap stalls at a few per cent within seconds
(the coarse model's LP bound is weak): the solver would spend any limit proving nothing."""
ROOT_ONLY_NODES = 1000
"""Nodes above which auto's (coarsened) MILP also stops after its root node (the root's LP, cuts and
heuristics, no branching), when that comes before COARSE_MILP_S: on graphs this large (a Llama-2-7B's step,
benchmarks/results/scale.md) the root finds the plans a longer search finds, and the tree beyond it spends its
seconds failing to close the gap. Where the root takes longer, the clock stops the search."""


def ilp_time_limit(problem: Problem, time_limit: float | None) -> float | None:
    """Seconds auto gives the MILP: about one, growing with the MILP's size, which coarsening holds at
    `ilp.MAX_NODES` nodes whatever the graph's. Above ROOT_ONLY_NODES the MILP stops at its
    root, which on the largest graphs takes longer: up to COARSE_MILP_S.

    The clock follows the MILP, not the graph: given the graph's size in seconds instead, the MILP of a
    GPT-2, Llama or BERT found the same plans or worse (benchmarks/results/quickstart.md)."""
    if problem.n > ROOT_ONLY_NODES:
        scaled = COARSE_MILP_S
    else:
        scaled = 1.0 + 9.0 * min(problem.n, MAX_NODES) / 1000
    return scaled if time_limit is None else min(time_limit, scaled)


def ilp_search_nodes(problem: Problem) -> int | None:
    """Branch-and-bound nodes auto gives the MILP: the root alone above ROOT_ONLY_NODES (whichever of it and
    the clock ends first), else no bound."""
    return 1 if problem.n > ROOT_ONLY_NODES else None


def auto_portfolio(problem: Problem) -> list[str]:
    """The solvers `auto` runs for this problem, fastest first."""
    names = ["uniform", "greedy", "selective", "dp"]
    if problem.n <= ILP_NODES:
        names.append("ilp")
    return [*names, "structured"]  # last: the hand-written plans win only where they beat the solvers


@register("auto")
def auto(
    problem: Problem,
    budget_bytes: int | None = None,
    *,
    time_limit: float | None = 10.0,
    solvers: tuple[str, ...] | None = None,
) -> SolverResult:
    """The best verified plan of the portfolio (see the module docstring)."""
    names = list(solvers) if solvers is not None else auto_portfolio(problem)
    if problem.n == 0 or budget_bytes is None:
        name = "dp" if "dp" in names else names[0]
        result = get_solver(name)(problem, budget_bytes)
        return SolverResult(regions=result.regions, saved=result.saved, stats={**result.stats, "chosen": name})
    tried: dict[str, Any] = {}
    best = None  # (fits, time, peak, name, result)
    low = None
    lowest = None  # (peak, name, result) of the plan of least peak
    starts: list[tuple[int, str, tuple]] = []  # (peak, name, regions) of each plan without offloads
    failed: dict[str, str] = {}
    for name in names:
        options: dict[str, Any] = {}
        if name == "ilp":
            # No fallback inside the ILP when the plans of other solvers are here already.
            alone = all(other == "ilp" for other in names)
            # dp's plans are compared here anyway: the ILP need not run dp again. Where a plan fits
            # already, no smallest budget is named: the ILP need not search the least peak either.
            options = {
                "time_limit": ilp_time_limit(problem, time_limit), "gap": ILP_GAP, "fallback": alone,
                "nested": "dp" not in names, "search_nodes": ilp_search_nodes(problem),
                "floor": best is None or best[0][0],
            }
        logger.info("auto: running %s (%d/%d) on %d nodes", name, names.index(name) + 1, len(names), problem.n)
        t0 = time.perf_counter()
        try:
            result = get_solver(name)(problem, budget_bytes, **options)
        except ILPSolveError as e:
            failed[name] = str(e)
            tried[name] = {"error": str(e)}
            continue
        sim = simulate(problem, result.regions, saved=result.saved)
        fits = sim.peak_bytes <= budget_bytes
        logger.info(
            "auto: %s in %.2f s: peak %.1f MB (%s), recompute %.2f ms",
            name, time.perf_counter() - t0, sim.peak_bytes / 1e6, "fits" if fits else "over the budget",
            sim.recompute_time * 1e3,
        )
        tried[name] = {"recompute_time": sim.recompute_time, "peak_bytes": sim.peak_bytes, "fits": fits}
        low = min(low, sim.peak_bytes, result.stats.get("min_peak_bytes", sim.peak_bytes)) if low is not None else min(
            sim.peak_bytes, result.stats.get("min_peak_bytes", sim.peak_bytes)
        )
        key = (not fits, sim.recompute_time if fits else sim.peak_bytes, sim.peak_bytes)
        if best is None or key < best[0]:
            best = (key, name, result)
        if lowest is None or sim.peak_bytes < lowest[0]:
            lowest = (sim.peak_bytes, name, result)
        if not result.offloaded and not result.saved:
            starts.append((sim.peak_bytes, name, tuple(map(tuple, result.regions))))
        if fits and sim.recompute_time == 0:
            break  # nothing beats no recompute
    if best is None:
        raise ILPSolveError("; ".join(failed.values()))  # the portfolio was the MILP alone
    if best[0][0] and not lowest[2].offloaded:  # nothing fits: the plans of least peak, polished
        named = {r: n for _, n, r in sorted(starts, reverse=True)}  # a plan two solvers found: the lower's name
        named.setdefault(tuple(map(tuple, lowest[2].regions)), lowest[1])
        regions, peak, start = lowest_polished(problem, list(named), target=budget_bytes)
        if peak < lowest[0]:
            name = f"{named[start]}, polished"
            sim = simulate(problem, regions)
            fits = peak <= budget_bytes
            tried[name] = {"recompute_time": sim.recompute_time, "peak_bytes": peak, "fits": fits}
            low = min(low, peak)
            best = ((not fits, sim.recompute_time if fits else peak, peak), name, SolverResult(regions=regions))
    if problem.can_offload and not (best[0][0] is False and best[0][1] == 0):
        for name, result in _offload_plans(problem, budget_bytes, best[2], time_limit, "ilp" in names):
            sim = simulate(problem, result.regions, saved=result.saved, offloaded=result.offloaded)
            fits = sim.peak_bytes <= budget_bytes and sim.host_bytes <= problem.host_budget_bytes
            tried[name] = {"recompute_time": sim.recompute_time, "peak_bytes": sim.peak_bytes, "fits": fits,
                           "offload_time": sim.offload_time}
            low = min(low, sim.peak_bytes)
            key = (not fits, sim.recompute_time if fits else sim.peak_bytes, sim.peak_bytes)
            if key < best[0]:
                best = (key, name, result)
    _, name, result = best
    stats: dict[str, Any] = {"chosen": name, "tried": tried, "min_peak_bytes": low}
    if "ilp" in failed:
        stats["ilp_fallback"] = failed["ilp"]
    return SolverResult(regions=result.regions, saved=result.saved, offloaded=result.offloaded, stats=stats)


SPLITS = (0.1, 0.25, 0.5)
"""Where between the budget and the plain step's peak (fractions of the gap) `auto` also takes dp's
recompute plan and offloads down to the budget: a plan that recomputes less and copies the rest."""

WINDOW_SPLITS = (0.5, 1.0)
"""Looser budgets `auto` also takes dp's plan for, above the budget by these fractions of the bytes the copy
stream moves in one forward (forward seconds x `d2h_bytes_per_s`), then offloads down to the budget."""


def _offload_plans(problem: Problem, budget_bytes: int, best: SolverResult, time_limit: float | None, milp: bool):
    """(name, result) of the offloading plans auto weighs against the recompute-only ones: offloads alone,
    offloads added to the best recompute plan, and the budget split between them (dp's plan for a looser
    budget, `SPLITS`, with the offloads that bring it down to this one); on small graphs `ilp_offload`,
    which chooses both at once."""
    bases = [("offload", SolverResult(regions=())), ("offload+best", best)]
    top = simulate(problem, ()).peak_bytes
    if top > budget_bytes:
        search = DPSearch(problem)
        for f in SPLITS:
            looser = int(budget_bytes + f * (top - budget_bytes))
            bases.append((f"offload+dp@{f:g}", search.solve(looser)))
        # The bytes the forward's copy stream can move while compute hides it: a looser plan that keeps more
        # than that pays for each extra byte in exposed copy time, one that keeps less leaves the stream idle.
        # SPLITS follow the plain step's peak, which has nothing to do with the copies.
        window = problem.total_time * problem.d2h_bytes_per_s
        for f in WINDOW_SPLITS:
            if budget_bytes + f * window < top:  # a float: a stream of unbounded bandwidth moves everything
                bases.append((f"offload+dp@window{f:g}", search.solve(int(budget_bytes + f * window))))
    for name, base in bases:
        found = choose_offloads(problem, budget_bytes, base.regions, base.saved)
        if found is not None and found[0]:
            yield name, SolverResult(regions=base.regions, saved=base.saved, offloaded=found[0])
        elif found is None:  # nothing fits: the most it can offload, for the smallest budget auto names
            yield name, SolverResult(regions=base.regions, saved=base.saved, offloaded=most_offloaded(problem, base))
    if milp and problem.n <= MAX_NODES:
        try:
            yield "ilp_offload", ilp_offload(problem, budget_bytes, time_limit=ilp_time_limit(problem, time_limit), gap=ILP_GAP)
        except ILPSolveError as e:
            logger.info("auto: ilp_offload failed: %s", e)

"""`ilp`: a MILP over the graph, exact for flat (non-nested) region plans.

Variables: one binary per candidate region [s, e] (nodes s..e recomputable, e
a node that saves something: `costs.trim_flat_regions` shows other ends never
help) and a path through the positions 0..n that either keeps node i (arc
i -> i + 1) or jumps over a region (arc s -> e + 1); so regions are disjoint
and may be adjacent. keep_i = 1 - (node i is recomputed).

Memory constraints are the simulator's observations for flat plans:

* forward, node j: what is live at j, plus every storage freed earlier that
  is still kept (a saver outside all regions, or an input of a region);
* backward, node k: gradients, outputs, forward storages whose release step
  (earliest saver outside regions or start of a region it feeds) is <= k,
  and the storages the active region's recompute keeps (those made at or
  after its start whose first saver is <= k);
* recompute of region [s, e] at step e: the same forward storages and the
  peak of the recompute pass (precomputed per candidate).

Objective: recompute time, sum of the candidates' forward times.

Numerics and strength: bytes are expressed in budget units and time in units
of the whole forward, so coefficients are near 1 (raw bytes, ~1e8, let the
solvers' absolute tolerances prune feasible plans: HiGHS once proved a wrong
optimum that way). A storage's release indicator is bounded below by the
*sum* of the keep arc and the region-start arc at a step (they are exclusive
arcs of the path), which closes most of the relaxation's gap. Each answer is
checked: objective against `recompute_time` of the plan read back, proven
bound against the warm start. HiGHS runs without presolve: its presolve returned
wrong optima on this model even when well scaled.
Large graphs are coarsened first (runs of nodes merged, cut at cheap cuts);
every plan is checked with `simulate` on the original problem and the
budget tightened by the excess when it does not fit.

With `offload` (solver `ilp_offload`), kept storages may also be offloaded (`offload_terms.py`).

Plan space: the flat plans of the MILP, and the known plans of
`known_plans`: dp's plan for the budget (nested plans reach lower peaks and,
at tight budgets, less recompute than any flat plan), uniform's and greedy's
on the fine graph, and the least-peak plan of an earlier call on the problem.
The flat ones start the MILP where they map onto the coarse graph; the answer
is the least recompute of all that fit, or, when none fits, the lowest peak,
which is the smallest budget `ilp` names. So `ilp` never loses to dp: not
on its smallest budget, not at a budget dp fits (with `nested=False` the
space is the flat plans alone).

Backends: HiGHS in-process (`highspy`) when installed, else pulp's bundled
CBC. CBC is never warm-started (`-mips`) under a time limit: CBC 2.10.3
segfaults that way on a loaded machine. A backend that fails (an exception
such as `pulp.PulpSolverError`, a crash of the CBC process, an undefined or
unbounded status, values that are not a plan) is retried once with the other
backend; when both fail, `ilp` returns the best plan of uniform, greedy and
dp instead and says why in `stats["ilp_fallback"]` (with `fallback=False` it
raises `ILPSolveError`, for callers such as `auto` that already hold those
plans). A time limit that passes with no plan found is an answer, not a failure.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ..costs import recompute_time
from ..problem import Problem
from ..registry import SolverResult, register
from ..simulate import simulate
from .known_plans import best_of, flat_plans, known_plans
from .milp_backend import ILPBackendError, ILPSolveError, _BackendFailure, _backends, default_backend
from .milp_model import _solve_milp
from .stages import coarsen
from .warm_starts import flat_start, on_coarse

logger = logging.getLogger(__name__)

__all__ = ["ilp", "coarsen", "ILPBackendError", "ILPSolveError", "default_backend", "MAX_NODES"]

MAX_NODES = 96
"""Nodes above which `ilp` coarsens the graph (its `max_nodes`)."""


def _solve_any(
    problem: Problem,
    budget: int | None,
    backend: str,
    time_limit: float | None,
    gap: float,
    start=None,
    presolve: bool = True,
    offload: bool = False,
    search_nodes: int | None = None,
):
    """`_solve_milp` with the backend asked for, then the other one if it fails; ILPSolveError if both do.

    stats["backend_failures"] lists the failures that were retried.
    """
    failures: list[str] = []
    for name in _backends(backend):
        try:
            regions, stats = _solve_milp(problem, budget, name, time_limit, gap, start, presolve, offload, search_nodes)
        except _BackendFailure as e:
            failures.append(f"{name}: {e}")
            continue
        if failures:
            stats = {**stats, "backend_failures": failures}
        return regions, stats
    raise ILPSolveError("MILP backend failed (" + "; ".join(failures) + ")")


_LOWEST_PLANS: dict[tuple[str, tuple[bool, ...]], tuple[tuple[int, int], ...]] = {}
"""Least-peak coarse plans found so far, by the problem's structure and which nodes may be recomputed;
a few dozen at most."""


def _lowest_peak_plan(coarse: Problem, backend: str, time_limit: float | None, gap: float, search_nodes: int | None = None):
    """(peak, regions) of the least-peak plan known for `coarse`: the MILP's or a remembered one."""
    key = (coarse.fingerprint(), tuple(node.recomputable for node in coarse.nodes))
    found, _ = _solve_any(coarse, None, backend, time_limit, gap, search_nodes=search_nodes)
    candidates = [r for r in (found, _LOWEST_PLANS.get(key)) if r is not None]
    if not candidates:
        return None, None
    peak, regions = min((simulate(coarse, r).peak_bytes, r) for r in candidates)
    if len(_LOWEST_PLANS) >= 64:
        _LOWEST_PLANS.pop(next(iter(_LOWEST_PLANS)))
    _LOWEST_PLANS[key] = regions
    return peak, regions


def _checked_solve(
    problem: Problem, budget: int, backend: str, time_limit: float | None, gap: float, start, exact: bool,
    search_nodes: int | None = None,
) -> tuple[tuple[tuple[int, int], ...] | None, dict[str, Any]]:
    """Solve the MILP and check its claims against the cost model; a failed check is reported in the stats.

    Checks: the objective equals the recompute time of the plan read back (when `exact`, i.e. not
    coarsened), and no known plan (the warm start) beats the lower bound the solver proved.
    """
    stats: dict[str, Any] = {}
    regions = None
    # HiGHS presolve (1.15) returns wrong optima on this model even when it is well scaled
    # (a 7-node DAG: 10.75 s "optimal" against 6.75 s): it stays off.
    for presolve in (False,):
        regions, stats = _solve_any(problem, budget, backend, time_limit, gap, start, presolve, search_nodes=search_nodes)
        if regions is None:
            return None, stats
        problems = []
        if exact:
            actual = recompute_time(problem, regions)
            if abs(actual - stats["objective"]) > 1e-6 * max(1e-9, problem.total_time):
                problems.append(f"objective {stats['objective']:.9g} s but the plan recomputes {actual:.9g} s")
        if start is not None and "bound" in stats:
            known = recompute_time(problem, start)
            if known < stats["bound"] - 1e-6 * max(1e-9, problem.total_time):
                problems.append(f"the warm start ({known:.9g} s) beats the proven bound {stats['bound']:.9g} s")
        if not problems:
            return regions, stats
        stats = {**stats, "optimal": False, "check_failed": "; ".join(problems)}
        if stats.get("backend") != "highs":
            break  # CBC has no presolve switch here: report the failed check
    return regions, stats


def _selective(problem: Problem, budget_bytes: int, result: SolverResult) -> SolverResult:
    from ..heuristics.selective import block_regions, with_saved

    return with_saved(problem, budget_bytes, result, [block_regions(problem)])


@register("ilp")
def ilp(
    problem: Problem,
    budget_bytes: int | None = None,
    *,
    backend: str = "auto",
    time_limit: float | None = 20.0,
    gap: float = 0.0,
    max_nodes: int = MAX_NODES,
    max_retries: int = 6,
    warm_start: bool = True,
    fallback: bool = True,
    selective: bool = True,
    nested: bool = True,
    search_nodes: int | None = None,
    floor: bool = True,
) -> SolverResult:
    """Least recompute time over flat region plans (exact when the graph is not coarsened) and the
    known plans of `known_plans` (nested ones from dp's table among them).

    `backend`: 'auto' (HiGHS when highspy is installed, else CBC), 'highs' or 'cbc'; a failing
    backend is retried with the other one. `time_limit` bounds the whole call (every MILP solve
    it makes), in seconds. When every backend fails, the best plan of uniform, greedy and dp is
    returned (`fallback=False`: ILPSolveError is raised instead).

    stats: `optimal` (the MILP was solved to within `gap`), `gap` (the solver's proven relative gap),
    `exact` (not coarsened: the MILP is the simulator's model), `check_failed` (the solver's answer
    disagreed with the cost model, see `_checked_solve`), `backend_failures` (failures retried with
    the other backend), `ilp_fallback` (why the plan comes from another solver, named in
    `fallback_solver`). With `selective`, the plan found and one
    region per block are also tried with saved ops inside their regions (`selective.with_saved`).
    `nested`: dp's plan for the budget is one of the known plans (False: only flat ones, uniform's and
    greedy's, so the answer is the flat optimum when the MILP is exact; callers that run dp themselves,
    such as `auto`, save its time that way). A known plan that wins is named in `plan_from`.
    `search_nodes`: branch-and-bound nodes each MILP solve may take (None: no limit; 1: the root node, with
    the solver's heuristics), a bound on the work that, unlike `time_limit`, gives the same plan on a busy
    machine as on an idle one.
    `floor`: when no plan fits, search the least peak the model reaches (the smallest budget to name). A
    caller that holds a plan that fits already names no smallest budget and saves that MILP (`auto`: 5 s
    on a 24-layer Llama at per-layer checkpointing's peak).
    """
    _backends(backend)  # an unknown or missing backend is the caller's error, never a fallback
    t0 = time.perf_counter()
    known = []
    if budget_bytes is not None and problem.n and simulate(problem, ()).peak_bytes > budget_bytes:
        known = known_plans(problem, budget_bytes, nested=nested, selective=selective)
    if time_limit is not None:
        time_limit = max(0.5, time_limit - (time.perf_counter() - t0))  # the known plans' time is the call's too
    try:
        result = _ilp(
            problem, budget_bytes, backend, time_limit, gap, max_nodes, max_retries, warm_start, selective,
            flat_plans(known), search_nodes, floor,
        )
    except ILPSolveError as e:
        if not fallback:
            raise
        reason = str(e)
    else:
        return best_of(problem, budget_bytes, result, known, selective=selective) if known else result
    from ..registry import get_solver  # the portfolio runs through the registry (auto registers itself there)

    result = get_solver("auto")(problem, budget_bytes, solvers=FALLBACK_SOLVERS)
    stats = {**result.stats, "ilp_fallback": reason, "fallback_solver": result.stats.get("chosen")}
    return SolverResult(regions=result.regions, stats=stats)


FALLBACK_SOLVERS = ("uniform", "greedy", "dp")
"""What `ilp` falls back to when every MILP backend fails."""


def _ilp(
    problem: Problem,
    budget_bytes: int | None,
    backend: str,
    time_limit: float | None,
    gap: float,
    max_nodes: int,
    max_retries: int,
    warm_start: bool,
    selective: bool = True,
    known=(),
    search_nodes: int | None = None,
    floor: bool = True,
) -> SolverResult:
    n = problem.n
    if n == 0:
        return SolverResult(regions=(), stats={"nodes": 0, "coarse_nodes": 0})
    coarse, groups = coarsen(problem, max_nodes)
    exact = coarse.n == n
    stats: dict[str, Any] = {"nodes": n, "coarse_nodes": coarse.n, "exact": exact}

    def lift(regions):
        return tuple((groups[s][0], groups[e][1]) for s, e in regions)

    known_coarse = [c for c in (on_coarse(groups, r) for r in known) if c is not None]

    base = simulate(problem, ())
    if budget_bytes is None or base.peak_bytes <= budget_bytes:
        return SolverResult(regions=(), stats={**stats, "min_peak_bytes": base.peak_bytes})
    t0 = time.perf_counter()

    def left() -> float | None:
        return None if time_limit is None else max(0.5, time_limit - (time.perf_counter() - t0))

    target, best_low = budget_bytes, None
    lowest = None  # the coarse plan of least peak, from the peak-minimizing MILP (solved once, when needed)
    for attempt in range(max_retries + 1):
        logger.info(
            "ilp: MILP attempt %d on %d nodes, target %.1f MB, %s s left",
            attempt + 1, coarse.n, target / 1e6, "no limit" if left() is None else f"{left():.1f}",
        )
        start = regions = None
        if warm_start:
            start = flat_start(coarse, target, known_coarse)
            if start is None and lowest is None:
                # No heuristic fits. The target alone first: its MILP proves a target out of the coarse
                # graph's reach at the root (0.3 s on a 24-layer Llama at per-layer checkpointing's peak),
                # where the least-peak MILP below takes 7 s to find the same.
                regions, info = _checked_solve(coarse, target, backend, left(), gap, None, exact, search_nodes)
                if regions is None and info.get("status") == "Infeasible":
                    stats.update(info)
                    break
                if regions is None:
                    # Still no plan: the least-peak plan is the start. With it (and the one remembered
                    # from earlier calls), a budget the solver named as its smallest is met again on the
                    # next call, however far a time-limited MILP gets.
                    lowest = _lowest_peak_plan(coarse, backend, left(), gap, search_nodes)
            if regions is None and start is None and lowest is not None and lowest[1] is not None and lowest[0] <= target:
                start = lowest[1]
        if regions is None:
            regions, info = _checked_solve(coarse, target, backend, left(), gap, start, exact, search_nodes)
        stats.update(info)
        if start is not None:
            if regions is None or recompute_time(coarse, start) < recompute_time(coarse, regions):
                stats["from_warm_start"] = True  # the solver stopped before matching its start
                regions = start
        if regions is None:
            break
        regions = lift(regions)
        peak = simulate(problem, regions).peak_bytes
        logger.info("ilp: attempt %d gives peak %.1f MB (budget %.1f MB)", attempt + 1, peak / 1e6, budget_bytes / 1e6)
        if peak <= budget_bytes:
            result = SolverResult(regions=regions, stats={**stats, "retries": attempt, "min_peak_bytes": peak})
            return _selective(problem, budget_bytes, result) if selective else result
        best_low = (peak, regions) if best_low is None or peak < best_low[0] else best_low
        target -= peak - budget_bytes
    # Nothing fits on the coarse graph. One region per block, on the fine graph, may: coarsening merges
    # nodes across the blocks' bounds (GPT-2 at per-layer checkpointing's own peak: 21.6 MB at least
    # coarsened, 20.4 MB for the blocks).
    from ..heuristics.selective import block_regions

    blocks = block_regions(problem)
    if blocks:
        peak = simulate(problem, blocks).peak_bytes
        if peak <= budget_bytes:
            result = SolverResult(regions=blocks, stats={**stats, "min_peak_bytes": peak, "from_blocks": True})
            return _selective(problem, budget_bytes, result) if selective else result
        best_low = (peak, blocks) if best_low is None or peak < best_low[0] else best_low
    # Nothing fits: the lowest peak the model reaches.
    if lowest is not None:
        low = lowest[1]
    elif floor:
        low = _solve_any(coarse, None, backend, left(), gap, search_nodes=search_nodes)[0]
    else:
        low = None
    if low is not None:
        low = lift(low)
        peak = simulate(problem, low).peak_bytes
        if best_low is None or peak < best_low[0]:
            best_low = (peak, low)
    if best_low is None:
        best_low = (base.peak_bytes, ())
    return SolverResult(regions=best_low[1], stats={**stats, "min_peak_bytes": best_low[0], "infeasible": True})

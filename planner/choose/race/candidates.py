"""The race's candidates: the solver's plan, its runners-up (other solvers' plans, or the named solver's own
variants across the safety margin) and the plans people write by hand (solvers/heuristics/structured.py),
each simulated as it would run; only plans predicted within the budget take part, and only what can change
the answer: a plan with the same checkpoint calls as one already in, predicted within MIN_BAND of a step of
it, is a tie no round could break."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ...solvers.heuristics.structured import structured_plans
from ...solvers.plans import normalize_regions, normalize_saved
from ...solvers.problem import Problem, ProblemError, Solution
from ...solvers.registry import InfeasibleBudgetError, solve
from ...solvers.simulate import simulate
from .rules import MIN_BAND, Candidate

__all__ = ["MAX_CANDIDATES", "RUNNERS_UP", "candidate", "candidates", "explicit_variants", "runner_up_plans"]

MAX_CANDIDATES = 3
"""Plans measured at most: the solver's, the best hand-written one and the best of another solver (a fourth is
one of these kinds again, and costs steps without changing the answer)."""
RUNNERS_UP = ("dp", "greedy", "uniform")
"""Solvers whose plans stand beside the solver's own (cheap to run once more)."""


def candidate(problem: Problem, label: str, regions, saved, finish, modules: tuple[str, ...] = (),
               offloaded: tuple[int, ...] = ()) -> Candidate | None:
    try:
        regions = normalize_regions(problem, finish(tuple(regions)) if finish else regions)
        saved = normalize_saved(problem, regions, tuple(i for i in saved if any(s <= i <= e for s, e in regions)))
        sim = simulate(problem, regions, saved=saved, **({"offloaded": offloaded} if offloaded else {}))
    except ProblemError:  # an offload its regions moved off no longer fits: not a candidate
        return None
    if not regions and not offloaded:
        return None
    return Candidate(label, tuple(regions), tuple(saved), sim.peak_bytes, sim.recompute_time, tuple(modules),
                     tuple(offloaded))


def candidates(
    problem: Problem, chosen: Candidate, budget: int, inner: int, runners_up: Sequence[tuple[str, Any, Any]] = (),
    *, limit: int = MAX_CANDIDATES, finish: Callable[[tuple], tuple] | None = None,
    modules: Callable[[tuple], list[tuple[tuple[int, int], str]] | None] | None = None,
    hand_written: bool = True,
) -> list[Candidate]:
    """The plans to measure: `chosen` (the solver's) first, then the best plain hand-written plan, the
    best runner-up, and the rest by predicted time, `limit` in all. A plan takes part when its predicted
    peak is within the budget, inside the safety margin too (the margin, budget - `inner`, is the
    prediction's error allowance): its measured peak decides. `runners_up`: (label, regions,
    saved) of other solvers; `finish` moves regions off in-place writes as every plan's are.
    `modules(regions)`: the whole submodules (span, path) a hand-written plan's regions are, if any; such
    a plan races as the model's own code with those modules checkpointed (as transformers runs it: no
    captured graph to pay for), labelled "(modules)"; anything but a function (None, False) means none.
    `hand_written=False` races `runners_up` alone (a solver the user named: its own variants)."""
    if not callable(modules):  # "no whole-module maker" may arrive as False: never called
        modules = None
    admit = budget  # a plan predicted over its budget is never returned, whatever it measures
    pool: list[Candidate] = []
    seen = {(chosen.regions, chosen.saved)}
    plans = [(p.name, p.regions, p.saved) for p in structured_plans(problem, inner)] if hand_written else []
    plans += list(runners_up)
    for label, regions, saved in plans:
        whole = modules(tuple(regions)) if modules is not None and _hand_written(label) and not saved else None
        if whole:
            c = candidate(problem, f"{label} (modules)", [sp for sp, _ in whole], (), None, tuple(p for _, p in whole))
        else:
            c = candidate(problem, label, regions, saved, finish)
        if c is None or c.predicted_peak_bytes > admit or (c.regions, c.saved) in seen:
            continue
        seen.add((c.regions, c.saved))
        pool.append(c)
    pool.sort(key=lambda c: (c.predicted_extra_s, c.predicted_peak_bytes, c.label))
    untied: list[Candidate] = []
    tie = MIN_BAND * problem.base_step_s
    for c in pool:  # fastest predicted first: of a tie, the solver's plan or the predicted-fastest stays
        if not any(_same_calls(c, d) and abs(c.predicted_extra_s - d.predicted_extra_s) <= tie for d in [chosen, *untied]):
            untied.append(c)
    picked = [chosen]
    firsts = [
        next((c for c in untied if _hand_written(c.label) and "+kept" not in c.label), None),
        next((c for c in untied if not _hand_written(c.label)), None),  # a runner-up solver's plan
    ]
    for c in [*firsts, *untied]:
        if c is not None and c not in picked and len(picked) < limit:
            picked.append(c)
    return picked


def _same_calls(a: Candidate, b: Candidate) -> bool:
    """The same checkpoint calls (regions, whole modules, offloads): the plans differ in a few ops kept inside.
    Predicted within MIN_BAND of a step of each other, two such plans are a tie no race can break (its band is
    at least MIN_BAND): only one of them races, the solver's plan where it is one of them, else the
    predicted-fastest (where ties go), and the other's steps go to plans that differ."""
    return (a.regions, a.modules, a.offloaded) == (b.regions, b.modules, b.offloaded)


def _hand_written(label: str) -> bool:
    return label.startswith(("every_", "per_block"))


def explicit_variants(problem: Problem, solver: str, options: dict[str, Any], budget: int,
                      inner: int) -> list[tuple[str, Any, Any]]:
    """(label, regions, saved) of the plans the solver the user named makes between the budget the solvers
    plan for (`inner`) and the budget: its variants, which differ in how much of the margin they use. The
    clock decides among them; no other solver's plan takes part."""
    out = []
    for target in dict.fromkeys((inner, (inner + budget) // 2, budget)):
        try:
            found = solve(problem, target, solver, **options)
        except (InfeasibleBudgetError, ProblemError, RuntimeError, ValueError, TypeError):
            continue  # a solver that cannot reach this target adds no variant
        out.append((f"{solver} at {target / 1e6:.2f} MB", found.regions, found.saved))
    return out


def runner_up_plans(problem: Problem, solution: Solution, inner: int) -> list[tuple[str, Any, Any]]:
    """(label, regions, saved) of the RUNNERS_UP solvers' plans for `inner` bytes, but the solver's own."""
    runners = []
    for name in RUNNERS_UP:
        if name in (solution.solver, solution.stats.get("chosen")):
            continue
        try:
            found = solve(problem, inner, name)
        except (InfeasibleBudgetError, ProblemError, RuntimeError):
            continue
        runners.append((name, found.regions, found.saved))
    return runners

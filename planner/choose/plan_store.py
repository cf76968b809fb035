"""Plans that stay put: the plan an earlier run chose for the same graph and budget is the plan every
later run returns, while it fits.

Node times are measurements. With the timing store two runs read the same times, but a later run may
heal one that load inflated in the first profile (profile/timing_store.py), and near-equal plans then
swap places for a gain far inside what a measured step can tell apart (repeats of one plan's step
spread wider than such a gain on a loaded CPU). A first run on a loaded machine may also time the model
two or three times slower than the next run heals it to, and then no band holds the choice. So the store keeps, per graph, budget and
solver settings, the plan chosen first, and a later run returns it whenever it is still a plan of the
graph that fits the budget planned for: a user's first plan is the plan they get next time (as an
autotuner's cache keeps its first choice). Where this run's own solve is predicted faster by more than
`KEEP_WITHIN` of a step, the plan's notes say so and how to time afresh.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..profile.timing_store import TimingStore, signature
from ..solvers.plans import normalize_regions, normalize_saved
from ..solvers.problem import Problem, ProblemError, Solution
from ..solvers.simulate import simulate

__all__ = ["KEEP_WITHIN", "plan_key", "kept_plan", "set_aside_stale"]

KEEP_WITHIN = 0.02
"""A gain of this run's solve over the kept plan above this fraction of the step without
checkpointing is named in the notes: beyond what repeats of one step tell apart."""


def plan_key(problem: Problem, budget: int, solver: str, options: dict[str, Any], keep_own: bool) -> str:
    """What a stored plan answers: the graph's structure and sizes, the bytes planned for, the solver, and
    whether it may offload (a recompute-only plan is not the answer where copies are priced, nor the other
    way round; the bandwidth itself is a measurement, re-read when the stored plan is re-simulated)."""
    return signature([
        problem.fingerprint(), f"fixed={problem.fixed_bytes}", f"budget={budget}", f"solver={solver}",
        f"options={sorted(options.items())!r}", f"keep={keep_own}", *(["offload"] if problem.can_offload else []),
    ])


def _stored(problem: Problem, entry: Any) -> tuple[tuple[tuple[int, int], ...], tuple[int, ...], str, tuple[int, ...]] | None:
    """The stored plan's regions, saved nodes, solver and offloaded storages, when it is a valid plan of
    `problem`."""
    if not isinstance(entry, dict):
        return None
    try:
        regions = normalize_regions(problem, [(int(s), int(e)) for s, e in entry["regions"]])
        saved = normalize_saved(problem, regions, [int(i) for i in entry["saved"]])
        offloaded = tuple(int(t) for t in entry.get("offloaded", ()))
        simulate(problem, regions, saved=saved, offloaded=offloaded)  # an offload this problem refuses raises
    except (ProblemError, KeyError, TypeError, ValueError):
        return None  # written for another graph of the same key, or by another version: solved afresh
    return regions, saved, str(entry.get("solver", "")), offloaded


def kept_plan(problem: Problem, solution: Solution, budget: int, key: str, store: TimingStore) -> tuple[Solution, list[str]]:
    """The plan stored under `key` where it is a plan of this graph that fits `budget`, else `solution`
    (then stored). Returns (plan, notes); the notes say when this run's solve is predicted clearly
    faster (by more than KEEP_WITHIN of a step) than the plan kept, and how to take it."""
    stored = _stored(problem, store.get("plans", key))
    mine = (tuple(solution.regions), tuple(solution.saved), tuple(solution.offloaded))
    if stored is not None and (stored[0], stored[1], stored[3]) != mine:
        regions, saved, solver, offloaded = stored
        sim = simulate(problem, regions, saved=saved, offloaded=offloaded)
        if sim.peak_bytes <= budget:
            kept = dataclasses.replace(
                solution, regions=regions, saved=saved, offloaded=offloaded, peak_bytes=sim.peak_bytes,
                recompute_time=sim.recompute_time,
                solver=solver or solution.solver, stats={**solution.stats, "kept_plan": True},
            )
            gain = sim.recompute_time - solution.recompute_time
            step = problem.base_step_s
            if step > 0 and gain > KEEP_WITHIN * step:
                against = (
                    f"this run's {solution.solver} plan is predicted {gain / step:.1%} of a step faster on this "
                    "run's times; to take it, time afresh (delete the timing store, or CKPT_PLANNER_TIMINGS=off)"
                )
            elif gain > 0:
                against = (
                    f"this run's {solution.solver} plan is predicted {gain / step:.1%} of a step faster, within the "
                    f"{KEEP_WITHIN:.0%} that measurements cannot tell apart"
                )
            else:
                against = f"it is predicted no slower than this run's {solution.solver} plan"
            note = f"kept the plan an earlier run chose for this graph and budget (timing store): {against}"
            return kept, [note]
    entry = {"regions": [list(r) for r in solution.regions], "saved": list(solution.saved), "solver": solution.solver,
             **({"offloaded": list(solution.offloaded)} if solution.offloaded else {})}
    if store.get("plans", key) != entry:
        store.keep("plans", key, entry)
        store.save()
    return solution, []


def set_aside_stale(store: TimingStore, key: str, model: torch.nn.Module) -> list[str]:
    """Set aside the entry stored under `key` when it names a module `model` does not have (the model's code
    changed since, or the file was edited): planning goes on as if nothing were stored, and this run's
    choice replaces it. Returns the note saying so (none when the entry is absent or fits the model)."""
    entry = store.get("plans", key)
    paths = entry.get("modules") if isinstance(entry, dict) else None
    if not isinstance(paths, list) or not paths:
        return []
    names = dict(model.named_modules())
    missing = next((p for p in paths if not isinstance(p, str) or p not in names or p == ""), None)
    if missing is None:
        return []
    store.set_aside("plans", key)
    shown = repr(missing)[:80]
    return [f"timing store: the plan stored for this graph names module {shown}, which {type(model).__name__} "
            "does not have; it was set aside and this run's choice is stored in its place"]

"""Measured choice: the few best plans that fit a budget, each timed on the device; the clock decides.

The simulator's step time is a prediction, and on shapes it has not seen it can be off by 2x for plans of
many small regions. So after the solve, the solver's plan, its runners-up and the plans people write by
hand (solvers/heuristics/structured.py) that are predicted within the budget each run a few interleaved
training steps, and the fastest whose measured peak is within the budget wins. This file runs the race;
its parts are in race/: the rules (`rules.py`, pure), the candidates (`candidates.py`), the measuring
(`device.py`), the timing store's reads and writes (`stored.py`) and the cost model's refit (`refit.py`).

A plan predicted over its budget never takes part, even one inside the safety margin that would measure
within it: no plan is returned whose own prediction is over its budget. The choice is kept in the timing
store, so the same model and budget give the same plan on the next run without measuring.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import torch

from ..errors import InputError
from ..lower.apply import checkpointed_copy, whole_module_spans
from ..lower.offload import targets_of
from ..lower.rewrite import rewrite
from ..model_state import ModelState
from ..profile.timing_store import TimingStore
from ..settings import PlanRequest
from ..solvers.problem import Problem, ProblemError, Solution
from ..solvers.simulate import simulate
from ..verification import step_differences
from .budget import ResolvedBudget
from .plan_store import plan_key, set_aside_stale
from .profiled import Profiled, whole_modules_allowed
from .race.candidates import candidate, candidates, explicit_variants, runner_up_plans
from .race.device import device_measure
from .race.rules import AUTOTUNE_STEPS, CHECK_STEPS, WHOLE_MODULES, Measure, tune
from .race.stored import keep_choice, stored_choice
from .safety_net import reference_module
from .solve import finish

__all__ = ["AUTOTUNE_ENV", "steps_for", "autotune_solution", "autotuned"]

AUTOTUNE_ENV = "CKPT_PLANNER_AUTOTUNE"
"""Set to off/0/no/false to make autotune's default off (an explicit `autotune=` still decides)."""


def steps_for(autotune: bool | int | None, clock: bool) -> int:
    """Model steps autotune may run: `autotune` True -> AUTOTUNE_STEPS, False -> 0, an int -> that many;
    None (the default) -> AUTOTUNE_STEPS when the profile's times are on the clock (`clock`: measured
    on a real device, not FLOPs), the environment does not turn it off and no process group of several
    ranks is running, else 0."""
    if isinstance(autotune, bool):
        return AUTOTUNE_STEPS if autotune else 0
    if isinstance(autotune, int):
        if autotune < 0:
            raise InputError(f"autotune: {autotune} steps; pass True, False or a step count >= 0")
        return autotune
    if autotune is not None:
        raise InputError(f"autotune: {autotune!r}; pass True, False or a step count")
    off = os.environ.get(AUTOTUNE_ENV, "").strip().lower() in {"off", "0", "no", "false"}
    # Ranks that measured apart could choose apart, and a plan that differs between ranks can deadlock
    # collectives (FSDP): off by default under a process group of several ranks.
    dist = torch.distributed
    ranks = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    return AUTOTUNE_STEPS if clock and not off and not ranks else 0


def _as(problem: Problem, solution: Solution, regions, saved, stats: dict[str, Any], offloaded: tuple[int, ...] = ()) -> Solution:
    sim = simulate(problem, regions, saved=saved, **({"offloaded": offloaded} if offloaded else {}))
    return Solution(
        regions=tuple(regions), solver=solution.solver, peak_bytes=sim.peak_bytes, recompute_time=sim.recompute_time,
        budget_bytes=solution.budget_bytes, solve_time=solution.solve_time, stats={**solution.stats, **stats},
        saved=tuple(saved), **({"offloaded": tuple(offloaded)} if offloaded else {}),
    )


def autotune_solution(
    problem: Problem, solution: Solution, budget: int, inner: int, *, steps: int, key: str, store: TimingStore,
    measure: Measure, differs: Callable[[tuple, tuple, tuple], bool | None],
    finish: Callable[[tuple], tuple] | None = None, learn: bool = True,
    modules: Callable[[tuple], list[tuple[tuple[int, int], str]] | None] | None = None,
    solver: str | None = None, options: dict[str, Any] | None = None,
) -> tuple[Solution, list[str]]:
    """The plan to return after the solve (and its safety-net check): the choice stored under `key` by an
    earlier run where it is still a plan of this graph for this budget, else the measured choice among
    the candidates, which is then stored (and its rows given to the cost model's refit when `learn`).
    A winner other than `solution` passes the safety net's check (`differs(regions, saved, modules)`) or
    `solution` stands. Returns (plan, notes); the plan's stats carry the record under "autotune", and
    under WHOLE_MODULES the module paths when the winner runs as the model's own code (see `candidates`).
    `solver`: the solver the user named (None for "auto"): only its variants race (`explicit_variants`),
    since naming a solver is the user's choice of plan. Whatever wins, or comes from the store, is within
    the budget as predicted."""
    notes: list[str] = []
    stored = stored_choice(problem, store.get("plans", key), budget, inner, solver)
    if stored is not None:
        regions, saved, paths, record = stored
        raw = store.get("plans", key).get("offloaded", ())
        offloaded = tuple(int(i) for i in raw) if isinstance(raw, list) and all(type(i) is int for i in raw) else ()
        same = (regions, saved, paths, offloaded) == (tuple(solution.regions), tuple(solution.saved), (),
                                                      tuple(solution.offloaded))
        if same or differs(regions, saved, paths, *((offloaded,) if offloaded else ())) is False:
            whole = {WHOLE_MODULES: list(paths)} if paths else {}
            try:
                return _as(problem, solution, regions, saved, {"autotune": {**record, "from_store": True}, **whole},
                           offloaded), notes
            except ProblemError:  # a stored offload this problem refuses: measured afresh
                pass
    chosen = candidate(problem, f"{solution.solver} plan", solution.regions, solution.saved, None,
                        offloaded=tuple(solution.offloaded))
    if chosen is None:
        return solution, notes
    if solver is not None:
        chosen = dataclasses.replace(chosen, label=f"{solver} plan")
        runners = explicit_variants(problem, solver, dict(options or {}), budget, inner)
    else:
        runners = runner_up_plans(problem, solution, inner)
    cands = candidates(problem, chosen, budget, inner, runners, finish=finish, modules=modules,
                       hand_written=solver is None)
    tuned = tune(cands, budget, measure, steps)
    record = {**tuned.record, "from_store": False}
    result = solution
    if tuned.index:  # a plan other than the solver's won: it passes the safety net or the solver's stands
        win = cands[tuned.index]
        verdict = differs(win.regions, win.saved, win.modules, *((win.offloaded,) if win.offloaded else ()))
        record["steps"] = record.get("steps", 0) + CHECK_STEPS
        if verdict is False:
            result = _as(problem, solution, win.regions, win.saved, {WHOLE_MODULES: list(win.modules)} if win.modules else {},
                         win.offloaded)
        else:
            notes.append(f"autotune: {win.label} measured fastest but its step differs from the model's (or "
                         "could not be compared): the solver's plan stands")
            record["chosen"] = cands[0].label
            for c in record.get("candidates", []):
                c["chosen"] = c["label"] == cands[0].label
    elif tuned.index is None and record.get("candidates"):
        notes.append("autotune: no candidate measured within the budget; the solver's plan stands")
    result = _as(problem, result, result.regions, result.saved, {"autotune": record},
                 tuple(result.offloaded))
    if record.get("candidates"):
        keep_choice(store, key, problem, result, record, learn)
    return result, notes


def autotuned(p: Profiled, solution: Solution, resolved: ResolvedBudget, request: PlanRequest,
              steps: int) -> tuple[Solution, list[str]]:
    """The measured choice among the plans of `p` that fit the budget `resolved.nbytes`, kept in the timing store."""
    gm, model, cap = p.capture.graph_module, p.model, p.capture
    cfg, budget, inner = request.solve, resolved.nbytes, resolved.inner

    def build(regions, saved, paths, offloaded=()) -> torch.nn.Module:
        if paths:
            return checkpointed_copy(model, paths)
        return rewrite(gm, regions, model=model, saved=saved, offload=targets_of(p.problem, offloaded, regions, saved))

    reference = reference_module(p)

    def differs(regions, saved, paths, offloaded=()) -> bool | None:
        if not p.check:
            return False
        found = step_differences(model, build(regions, saved, paths, offloaded), cap.args, cap.kwargs,
                                 reference=reference)
        return None if found is None else bool(found)

    def modules(regions):
        return whole_module_spans(p.problem, model, regions)

    # Rounds are paired with the plain graph's step; where profiling never ran it, with the step
    # checkpointed per block if that fits the budget (else unpaired), and they teach the refit nothing.
    spans = p.reference_regions
    baseline = (spans, (), p.reference_paths) if not spans or p.reference_fits(budget) else None
    measure = device_measure(model, gm, cap.args, cap.kwargs, torch.device(p.cost.device), build, baseline=baseline)
    store, key = p.store(), plan_key(p.problem, inner, cfg.solver, dict(cfg.options), False) + "|autotune"
    stale = set_aside_stale(store, key, model)  # an entry naming a module this model lacks: a note, not an error
    with ModelState(model).preserved():
        result, notes = autotune_solution(
            p.problem, solution, budget, inner, steps=steps, measure=measure, differs=differs, store=store,
            key=key, finish=lambda r: finish(p, r, False)[0], learn=p.cost.time_source == "fitted" and not spans,
            modules=modules if whole_modules_allowed(p) else None,
            solver=None if cfg.solver == "auto" else cfg.solver, options=dict(cfg.options),
        )
    return result, [*stale, *notes]

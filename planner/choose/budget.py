"""Which budgets are feasible, decided from bytes alone, and the smallest one an error names.

A fresh `optimize()` re-times the model, and solvers that cut by time
(`uniform`'s equal-time segments, `dp`'s stages) then find other plans. So
that the smallest budget one call names is accepted by the next, feasibility
does not depend on the times: the *floor plan* is the least-memory plan the
solver finds on the problem with deterministic costs (FLOPs, plus one per
node), after every change a plan goes through before it leaves `optimize`
(`safe_regions`, keeping the model's own checkpointing). A budget B is
feasible when the step as given fits it, or when the floor plan's peak fits
`inner(B)`, the budget less the safety margin:

    inner(B) = B - floor(margin * (B - fixed))       # bytes; fixed = parameters, inputs, optimizer state

The smallest feasible budget is the least B for which that holds, and never
more than the peak of the step as given (which fits with no plan; on a stage-wise
profile, that peak with the margin: `as_is_floor`).

A request's budget is resolved once per problem into a `ResolvedBudget`: B in bytes
as asked, B after the device clamp (`within_device_limit`), inner(B), and the notes
that explain them. Every stage of choosing reads that record.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..capture.preflight import nothing_to_plan
from ..capture.trace import autocast_blocks
from ..profile.memory import allocator_limit, device_room
from ..settings import Budget, PlanRequest
from ..solvers.heuristics.polish import lowest_polished
from ..solvers.offload import most_offloaded
from ..solvers.problem import Problem, Solution
from ..solvers.registry import SOLVERS, InfeasibleBudgetError, get_solver
from ..solvers.simulate import simulate
from .profiled import REFERENCE_TOLERANCE, Profiled
from .regions import finish_regions

__all__ = ["ResolvedBudget", "budget_of", "inner_budget", "as_is_floor", "deterministic_problem", "floor_plans", "peak_detail", "floor_of",
           "refuse", "check_feasible", "plain_step_fits", "reference_over_budget", "refuse_unplannable", "within_device_limit"]

Regions = tuple[tuple[int, int], ...]

# Solvers whose least-memory search is deterministic on deterministic costs; `auto` uses these
# for its floor (the MILP's least-peak search stops on a wall-clock limit).
_FLOOR_PORTFOLIO = ("uniform", "greedy", "dp")


def inner_budget(budget: int, fixed: int, margin: float) -> int:
    """The budget the solvers plan for: `budget` less `margin` x its activation part (bytes)."""
    return budget - max(0, int(margin * (budget - fixed)))


@dataclass(frozen=True, kw_only=True)
class ResolvedBudget:
    """One request's budget converted to bytes once, for one problem: every stage of choosing (the solve,
    the safety net, the race, the gate, the refusal of an infeasible budget) reads these figures.

    Made by `ResolvedBudget.of`, the one place `Budget.in_bytes`, the device clamp (`within_device_limit`)
    and the safety margin (`inner_budget`) are applied."""

    asked: int | None
    """The budget as the request gives it, in bytes (a fraction counted on this problem's fixed bytes and
    peak as given); None: no budget given."""
    nbytes: int | None
    """What plans are held to (bytes): `asked`, or the peak as given for a model that checkpoints itself
    and was given no budget, lowered to what the device lets a step's tensors take."""
    fixed: int
    """The problem's fixed bytes: parameters, gradients, inputs, optimizer state."""
    margin: float
    """The request's safety margin (fraction of the budget's activation part)."""
    notes: tuple[str, ...] = ()
    """Why `nbytes` is not `asked`, one line each (the plan's notes)."""
    lowered: tuple[str, ...] = ()
    """The device clamp's note alone, where it lowered the budget (an infeasible budget names it)."""

    @classmethod
    def of(cls, budget: Budget, fixed_bytes: int, as_given_peak_bytes: int, device: torch.device | str, *,
           own_checkpointing: bool = False) -> ResolvedBudget:
        """`budget` for a problem with these fixed bytes and peak as given (bytes) on `device`;
        `own_checkpointing`: the model checkpoints itself, so with no budget it is held to its own peak."""
        asked = budget.in_bytes(fixed_bytes, as_given_peak_bytes)
        nbytes, notes = asked, []
        if nbytes is None and own_checkpointing:
            nbytes = as_given_peak_bytes
            notes.append("no budget given: the budget is the peak of the model as given, with its own checkpointing")
        nbytes, lowered = within_device_limit(nbytes, device)
        return cls(asked=asked, nbytes=nbytes, fixed=fixed_bytes, margin=budget.safety_margin,
                   notes=(*notes, *lowered), lowered=tuple(lowered))

    @property
    def inner(self) -> int | None:
        """What the solvers plan for (bytes): `nbytes` less the margin of its activation part."""
        return None if self.nbytes is None else inner_budget(self.nbytes, self.fixed, self.margin)

    def smallest(self, peak: int) -> int:
        """The least budget B (bytes) whose inner budget holds `peak` (bytes): what an infeasible budget
        names. Bisection: inner_budget is non-decreasing in B."""
        fixed, margin = self.fixed, self.margin
        lo, hi = peak, max(peak, fixed + int((peak - fixed) / max(1e-9, 1 - margin)) + 2)
        while inner_budget(hi, fixed, margin) < peak:
            hi = 2 * hi + 1
        while lo < hi:
            mid = (lo + hi) // 2
            if inner_budget(mid, fixed, margin) >= peak:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def as_asked(self) -> ResolvedBudget:
        """The budget as asked, before the device clamp: what the bytes pass judges (the clamp is named
        where a plan is solved)."""
        return dataclasses.replace(self, nbytes=self.asked, notes=(), lowered=())


def budget_of(p: Profiled, request: PlanRequest) -> ResolvedBudget:
    """The request's budget resolved for `p`'s problem: made once per plan (and once per profile the bytes
    pass judges: its bytes may differ from the timed profile's), read by every later step. A model that
    checkpoints itself with no budget given is held to its own peak."""
    return ResolvedBudget.of(request.budget, p.problem.fixed_bytes, p.baseline_peak_bytes, p.cost.device,
                             own_checkpointing=bool(p.own_regions))


def deterministic_problem(problem: Problem) -> Problem:
    """The problem with each node's time replaced by its FLOPs plus one: the same on every profile."""
    nodes = tuple(dataclasses.replace(n, time=float(max(0.0, n.flops)) + 1.0) for n in problem.nodes)
    return dataclasses.replace(problem, nodes=nodes)


def floor_plans(
    problem: Problem,
    solver: str,
    options: dict[str, Any],
    finish: Callable[[Sequence[tuple[int, int]]], tuple[Regions, list[str]]],
    extra: Sequence[Regions] = (),
) -> list[tuple[int, Regions, tuple[int, ...]]]:
    """(peak bytes, regions, offloaded storages) of every plan `solver` finds on deterministic costs,
    finished, least peak first (then fewer regions, fewer offloads): the first is the floor.

    `extra`: plans that are candidates too (the model's own checkpoint regions).

    `finish` applies what happens to every plan after solving (in-place safety, own checkpointing);
    the peak is simulated on the real problem (bytes do not depend on the times). Where the problem can
    offload, each candidate also counts with as much offloaded as the host holds (`most_offloaded`).
    """
    det = deterministic_problem(problem)
    names = _FLOOR_PORTFOLIO if solver == "auto" else (solver,)
    opts = {k: v for k, v in options.items() if k not in ("time_limit", "solvers")} if solver == "auto" else options
    scored: list[tuple[int, Regions, tuple[int, ...]]] = []
    candidates: list[Regions] = [tuple(r) for r in extra]
    for name in names:
        fn = get_solver(name)
        result = fn(det, problem.fixed_bytes, **(opts if name == solver else {}))
        candidates.append(tuple(result.regions))
    for regions in candidates:
        finished, _ = finish(regions)
        offloads = [()]
        if problem.can_offload:
            offloads.append(most_offloaded(problem, Solution(regions=finished, solver="floor", peak_bytes=0, recompute_time=0.0)))
        for offloaded in offloads:
            scored.append((simulate(problem, finished, offloaded=offloaded).peak_bytes, finished, tuple(offloaded)))
    scored.sort(key=lambda c: (c[0], len(c[1]), len(c[2])))
    return scored


def peak_detail(problem: Problem, regions: Regions, names: Sequence[str]) -> str:
    """Why no plan lowers the peak of the step as given, in words (appended to the error)."""
    sim = simulate(problem, regions)
    node = sim.peak_node
    if node < 0:
        return ""
    name = names[node] if node < len(names) else str(node)
    what = "the step as given" if regions else "the step without checkpointing"
    text = f"; no checkpoint plan lowers the peak below that of {what} (reached in the {sim.peak_phase} of {name})"
    # What the node's own backward needs: the tensors it saved itself and its temporaries (bytes).
    # Recomputing the node brings them back for that same backward, so no plan frees them there.
    own = problem.nodes[node].backward_temp_bytes + sum(st.nbytes for st in problem.storages if node in st.saved_by)
    if sim.peak_phase == "backward" and own >= 0.5 * max(1, sim.peak_bytes - problem.fixed_bytes):
        text += (
            f": it is inside {name}'s own backward, which needs the {own / 1e6:.3f} MB it saved and allocates "
            "itself, and a recompute holds them again"
        )
    return text


def floor_of(p: Profiled, solver: str, options: dict[str, Any], keep: bool,
             target: int | None = None) -> tuple[int, Regions, tuple[int, ...]]:
    """The floor plan of `p` for this solver (cached until the safety net narrows the problem). For `auto`,
    a floor above `target` (the budget the solvers plan for) is polished (`solvers/heuristics/polish.py`),
    as auto polishes its plan of least peak where nothing fits: only where the polish can decide whether
    the budget is met, as it takes up to a few seconds."""
    key = (solver, keep, repr(sorted(options.items())))
    graph = p.capture.graph_module

    def finish(regions):
        return finish_regions(p.problem, graph, regions, p.own_regions if keep else ())

    if key not in p.floors:
        # The model's own regions are a plan too: replacing them never needs more memory than keeping them.
        extra = [p.own_regions] if p.own_regions else []
        p.floors[(*key, "all")] = floor_plans(p.problem, solver, options, finish, extra)
        p.floors[key] = p.floors[(*key, "all")][0]
    floor = p.floors[key]
    if solver != "auto" or target is None or floor[0] <= target or floor[2]:
        return floor
    if (*key, "polished") not in p.floors:
        # every candidate without offloads is a start: the polish is a local search. It steps to the move of
        # least (peak, recompute time), so on measured times its path, and the peak it ends at, differ from
        # profile to profile (dinov2: 1,225,457 B on one, 1,225,729 B on the next): it runs on FLOP times.
        starts = [c[1] for c in p.floors[(*key, "all")] if not c[2]]
        polished, _ = finish(lowest_polished(deterministic_problem(p.problem), starts)[0])
        peak = simulate(p.problem, polished).peak_bytes
        p.floors[(*key, "polished")] = (peak, polished, ()) if peak < floor[0] else floor
    return p.floors[(*key, "polished")]


def as_is_floor(p: Profiled, as_is: int, budget: ResolvedBudget) -> int:
    """The budget (bytes) an error names where the step as given (peak `as_is`) is the floor. A stage-wise
    profile (`cost.stages`) never ran that step whole: its peak is summed from each stage's own step, which
    misses some of an op's backward workspace (an LSTM's: 2-3 KB), and a call at the named budget profiles
    the step whole (its plain step fits), measuring it again. So the floor is named with the margin plans
    keep for the same error, as a plan's floor is; a whole profile's peak was measured and is named as is."""
    return budget.smallest(as_is) if p.cost.stages else as_is


def refuse(p: Profiled, resolved: ResolvedBudget, request: PlanRequest) -> None:
    """InfeasibleBudgetError naming the smallest feasible budget when neither a plan nor the step as given
    fits `resolved.nbytes`."""
    problem, cfg, budget, inner = p.problem, request.solve, resolved.nbytes, resolved.inner
    keep = cfg.own_checkpointing == "keep" and bool(p.own_regions)
    given = finish_regions(problem, p.capture.graph_module, p.own_regions)[0] if p.own_regions else ()
    given_peak = simulate(problem, given).peak_bytes
    plain_peak = p.no_checkpoint_peak_bytes
    if plain_peak <= budget and not keep:
        return
    fixed = problem.fixed_bytes
    floor_peak, _, _ = floor_of(p, cfg.solver, dict(cfg.options), keep, inner)
    as_is = given_peak if keep else min(plain_peak, given_peak)
    named_as_is = as_is_floor(p, as_is, resolved)
    if p.cost.stages:
        refuse_unplannable(p, budget, cfg.solver, min(named_as_is, resolved.smallest(floor_peak)))
    if floor_peak > inner and as_is > budget:
        smallest = min(named_as_is, resolved.smallest(floor_peak))
        detail = ""
        if smallest == named_as_is:
            regions = given if given_peak <= plain_peak or keep else ()
            detail = peak_detail(problem, regions, [n.name for n in p.cost.nodes])
        blocks = autocast_blocks(p.capture.graph_module)
        if blocks:
            detail += (f"; the forward's own torch.autocast block{'s' if blocks > 1 else ''} ({blocks}) reach the planner as "
                       "one op each, so nothing inside is checkpointed: enter autocast around the call instead "
                       "(`with torch.autocast(...):` around optimize() and the training step) to plan inside")
        raise InfeasibleBudgetError(budget, smallest, cfg.solver, fixed, detail=detail)


def check_feasible(p: Profiled, request: PlanRequest) -> None:
    """Raise InfeasibleBudgetError when no plan can meet the request's budget as asked (the device clamp is
    named where a plan is solved). Bytes alone decide, so this holds on the bytes pass's profile as on the
    timed one."""
    if nothing_to_plan(p.model, p.capture.graph_module, p.cost.total_saved_bytes) is not None:
        return  # planning says why
    budget = budget_of(p, request)
    if budget.asked is None or request.solve.solver not in SOLVERS:
        return
    refuse(p, budget.as_asked(), request)


def plain_step_fits(p: Profiled, request: PlanRequest) -> bool:
    """Whether the step with no checkpointing fits the request's budget as asked, on bytes (no budget: it does)."""
    asked = budget_of(p, request).asked
    return asked is None or p.no_checkpoint_peak_bytes <= asked


def reference_over_budget(p: Profiled, budget: int) -> int:
    """Bytes by which the safety net's reference step is predicted over `budget` (0: it fits, to the
    simulator's tolerance, or no check runs): where the plain step was never run, checking a plan runs
    the step checkpointed per block (or the plain step where that saves nothing)."""
    if not p.check or not p.cost.stages or p.reference_fits(budget):
        return 0
    return p.reference_peak_bytes - budget


def refuse_unplannable(p: Profiled, budget: int, solver: str, smallest: int) -> None:
    """A budget the reference step does not fit, on a device without room for it either, is refused
    naming the least budget planning needs (never an out-of-memory error mid-plan): on a GPU capped at
    the budget, checking the plan would need more than the cap. Where the device has room (the budget
    is a target below what the device holds), the check runs above the budget and the plan says so."""
    over = reference_over_budget(p, budget)
    if not over:
        return
    need = budget + over
    room = device_room(p.cost.device)
    resident = p.problem.param_bytes + p.problem.input_bytes  # allocated already: the room is beyond them
    if room is not None and need - resident <= room:
        return
    least = math.ceil(need / (1 + REFERENCE_TOLERANCE))
    what = "the step checkpointed per block" if p.reference_regions else "the model's own step"
    detail = (f"; checking the plan runs {what} (predicted {need / 1e6:.1f} MB: the reference the plan's step is "
              "compared with), and the device has no room for it, so planning needs at least that; pass "
              "check_step=False to plan below it unchecked, or plan on device='meta'")
    raise InfeasibleBudgetError(budget, max(least, smallest), solver, p.problem.fixed_bytes, detail=detail)


def within_device_limit(budget: int | None, device: torch.device | str) -> tuple[int | None, list[str]]:
    """`budget` (bytes), lowered to what the device lets a step's tensors take where that is less, and the
    note that says so. A budget is judged on allocated bytes, but a device's limit (its memory, or the
    memory fraction set for the process) binds what the caching allocator reserves, which is more: a plan
    made right up to that limit runs out of memory in its own check, or in training."""
    limit = allocator_limit(device)
    if budget is None or limit is None or limit >= budget:
        return budget, []
    note = (f"the budget ({budget / 1e6:.1f} MB) is beyond what the device lets this process's tensors take with "
            f"the caching allocator's overhead: planned for {limit / 1e6:.1f} MB (PYTORCH_CUDA_ALLOC_CONF="
            "expandable_segments:True leaves the allocator less overhead, so more for the step)")
    return limit, [note]

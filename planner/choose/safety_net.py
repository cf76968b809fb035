"""The safety net: a plan's training step against the model's own, before `optimize` returns it.

One step of the model and one of the checkpointed module run from the same state (buffers, generator
state), and their outputs, parameter gradients and buffers are compared (`verification.step_differences`,
which `Plan.rebuild` also runs on every plan read from a file): bitwise on the CPU, and
within the dtype's `assert_close` tolerance on other devices, whose atomics may sum in another order
from run to run. A wrong replay (a random op the planner did not see, a kept op that a cache hid)
differs by far more than that. `inexact_parts` then finds what is at fault: the kept ops, or the
regions that differ on their own, so that the planner can forbid them and solve again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from ..errors import CheckOutOfMemoryError, InexactPlanError
from ..lower.apply import checkpointed_copy
from ..lower.offload import targets_of
from ..lower.rewrite import rewrite
from ..settings import PlanRequest
from ..solvers.problem import Solution
from ..solvers.registry import InfeasibleBudgetError
from ..verification import OUT_OF_MEMORY, REFERENCE_OUT_OF_MEMORY, step_differences
from .budget import ResolvedBudget, reference_over_budget
from .profiled import Profiled
from .solve import solve_budget

__all__ = ["inexact_parts", "reference_module", "checked"]


class _OutOfMemory(Exception):
    """A checking step ran out of device memory: it says nothing of exactness."""


def inexact_parts(
    regions: Sequence[tuple[int, int]],
    saved: Sequence[int],
    differs: Callable[[Sequence[tuple[int, int]], Sequence[int]], bool],
) -> tuple[bool, list[tuple[int, int]]]:
    """What to forbid in a plan whose step differs: (its kept ops, when the plan without them is exact;
    else the regions whose step differs each on its own). `differs(regions, saved)` builds and steps
    a plan. An empty list with False: no single region differs (the fault needs them together)."""
    if saved and not differs(regions, ()):
        return True, []
    bad = [r for r in regions if differs([r], ())]
    return False, bad


def reference_module(p: Profiled) -> torch.nn.Module | None:
    """The module whose step stands for the model's (None: the model's own): the graph checkpointed per
    block, in the model's own code, where the plain step was never run (`Profiled.reference_paths`)."""
    return checkpointed_copy(p.model, p.reference_paths) if p.reference_paths else None


def checked(p: Profiled, solution: Solution, notes: list[str], budget: ResolvedBudget,
            request: PlanRequest) -> tuple[Solution, list[str]]:
    """`solution` when its step equals the model's, else the plan solved again with what differed
    forbidden (kept ops, else regions) in `p.problem`, and a note that says so.

    Each checking step holds on the device only its own step (`step_differences` keeps the other's figures
    on the host): the plan's step within its predicted peak, the reference within its own (the budget where
    `reference_over_budget` finds it fits, else the note says by how much it was over). The steps that are
    not the plan's own (the chunked graph with no region, one region at a time) run only to find what is at
    fault in a plan whose step differs."""
    gm, model, cap = p.capture.graph_module, p.model, p.capture
    reference = reference_module(p)
    over = reference_over_budget(p, budget.nbytes) if budget.nbytes is not None else 0
    against = "the step checkpointed per block" if p.reference_regions else "the model's own step"
    if over:
        notes = [*notes, (
            f"the check ran {against}, predicted {over / 1e6:.1f} MB over the budget, as the device had room for it; "
            "check_step=False keeps planning within the budget")]

    def differs(regions, saved, offload=()) -> bool | None:
        module = rewrite(gm, regions, model=model, saved=saved, offload=offload)
        found = step_differences(model, module, cap.args, cap.kwargs,
                                 bitwise=None if p.exact else False, reference=reference)
        if found == [REFERENCE_OUT_OF_MEMORY]:
            raise CheckOutOfMemoryError(
                f"the step the plan is checked against ({against}, predicted {p.reference_peak_bytes / 1e9:.3f} GB) ran "
                "out of device memory: the caching allocator needs room beyond the tensors a step counts; plan for a "
                "budget about 10 % under the device's limit, set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, or "
                "pass check_step=False")
        if found == [OUT_OF_MEMORY]:
            raise _OutOfMemory
        return None if found is None else bool(found)

    names = p.names
    for _ in range(3):
        try:
            offload = targets_of(p.problem, solution.offloaded, solution.regions, solution.saved)  # checked too
            planned = bool(solution.regions or offload or p.chunks)
            verdict = differs(solution.regions, solution.saved, offload) if planned else False
        except _OutOfMemory:
            raise CheckOutOfMemoryError(_plan_out_of_memory(solution)) from None
        if verdict is None:
            note = "not checked against the model's own step: that step raises as given (its backward fails)"
            return solution, [*notes, note]
        if not verdict:
            return solution, notes
        try:
            # the chunked graph alone (no region: above the budget) runs only once the plan's step differs
            if p.chunks and (not (solution.regions or offload) or differs((), ())):
                raise InexactPlanError("exact=False: the chunked step's gradients are not allclose to the model's; "
                                       "plan with exact=True or report the model")
            # a captured graph that differs with no region at all would make every region look at fault
            if not p.chunks and differs((), ()):
                raise InexactPlanError(
                    f"the captured graph's training step differs from {against} with no checkpoint at all: the "
                    "capture, not the plan, is at fault; try another capture_method or report the model")
            kept_only, bad = inexact_parts(solution.regions, solution.saved, differs)
        except _OutOfMemory:  # a region alone keeps nearly the plain step's activations
            raise CheckOutOfMemoryError(
                "the plan's training step differed from the model's, and the steps that find the region at fault "
                "(one region at a time) do not fit the device; plan where the model's plain step fits, pass "
                "check_step=False, or report the model") from None
        nodes = list(p.problem.nodes)
        if kept_only:
            for i in solution.saved:
                nodes[i] = dataclasses.replace(nodes[i], saveable=False)
            what = f"its kept ops ({', '.join(names[i] for i in solution.saved[:6])})"
        else:
            spans = bad or list(solution.regions)
            for s, e in spans:
                for i in range(s, e + 1):
                    nodes[i] = dataclasses.replace(nodes[i], recomputable=False)
            what = "the regions " + ", ".join(f"{names[s]}..{names[e]}" for s, e in spans[:6])
        notes = [*notes, (
            f"the plan's training step differed from the model's with {what}: they are not recomputed "
            "(or kept) by this plan, solved again"
        )]
        p.narrowed(dataclasses.replace(p.problem, nodes=tuple(nodes)))
        try:
            solution, more = solve_budget(p, budget, request)
        except InfeasibleBudgetError as e:
            raise InexactPlanError(f"{notes[-1]}; without them: {e}") from e
        notes += more
    try:
        inexact = bool(solution.regions) and differs(solution.regions, solution.saved)
    except _OutOfMemory:
        raise CheckOutOfMemoryError(_plan_out_of_memory(solution)) from None
    if inexact:
        raise InexactPlanError(
            f"no plan found whose training step equals the model's: {'; '.join(notes[-3:])}; "
            "run the model without checkpointing or report the model"
        )
    return solution, notes


def _plan_out_of_memory(solution: Solution) -> str:
    return (f"the step that checks the plan (predicted {solution.peak_bytes / 1e9:.3f} GB) ran out of device "
            "memory: the caching allocator needs room beyond the tensors a plan counts; plan for a budget about "
            "10 % under the device's limit, set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, or pass "
            "check_step=False")

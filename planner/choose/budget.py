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
more than the peak of the step as given (which fits with no plan).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..errors import InputError
from ..solvers import Problem, simulate
from ..solvers.registry import get_solver

__all__ = ["optimizer_state_bytes", "budget_arg", "inner_budget", "smallest_budget", "deterministic_problem", "floor_plan", "peak_detail"]

Regions = tuple[tuple[int, int], ...]

# Solvers whose least-memory search is deterministic on deterministic costs; `auto` uses these
# for its floor (the MILP's least-peak search stops on a wall-clock limit).
_FLOOR_PORTFOLIO = ("uniform", "greedy", "dp")


def inner_budget(budget: int, fixed: int, margin: float) -> int:
    """The budget the solvers plan for: `budget` less `margin` x its activation part (bytes)."""
    return budget - max(0, int(margin * (budget - fixed)))


def smallest_budget(peak: int, fixed: int, margin: float) -> int:
    """The least budget B (bytes) with inner_budget(B) >= peak; inner_budget is non-decreasing in B."""
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


def deterministic_problem(problem: Problem) -> Problem:
    """The problem with each node's time replaced by its FLOPs plus one: the same on every profile."""
    nodes = tuple(dataclasses.replace(n, time=float(max(0.0, n.flops)) + 1.0) for n in problem.nodes)
    return dataclasses.replace(problem, nodes=nodes)


def floor_plan(
    problem: Problem,
    solver: str,
    options: dict[str, Any],
    finish: Callable[[Sequence[tuple[int, int]]], tuple[Regions, list[str]]],
    extra: Sequence[Regions] = (),
) -> tuple[int, Regions]:
    """(peak bytes, regions) of the least-memory plan `solver` finds on deterministic costs, finished.

    `extra`: plans that are candidates too (the model's own checkpoint regions).

    `finish` applies what happens to every plan after solving (in-place safety, own checkpointing);
    the peak is simulated on the real problem (bytes do not depend on the times).
    """
    det = deterministic_problem(problem)
    names = _FLOOR_PORTFOLIO if solver == "auto" else (solver,)
    opts = {k: v for k, v in options.items() if k not in ("time_limit", "solvers")} if solver == "auto" else options
    best: tuple[int, Regions] | None = None
    candidates: list[Regions] = [tuple(r) for r in extra]
    for name in names:
        fn = get_solver(name)
        result = fn(det, problem.fixed_bytes, **(opts if name == solver else {}))
        candidates.append(tuple(result.regions))
    for regions in candidates:
        finished, _ = finish(regions)
        peak = simulate(problem, finished).peak_bytes
        if best is None or (peak, len(finished)) < (best[0], len(best[1])):
            best = (peak, finished)
    assert best is not None
    return best


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


def optimizer_state_bytes(model: torch.nn.Module, optimizer: Any) -> int:
    """Bytes of optimizer state for the model's trainable parameters.

    optimizer: None/'none', 'sgd' (no momentum), 'sgd-momentum', 'adam', 'adamw',
    or a torch.optim.Optimizer instance (Adam-like state is assumed for unknown classes).
    """
    if optimizer is None:
        return 0
    per_param = {"none": 0, "sgd": 0, "sgd-momentum": 1, "adam": 2, "adamw": 2}
    if isinstance(optimizer, str):
        key = optimizer.lower()
        if key not in per_param:
            raise InputError(f"optimizer: {optimizer!r} is not one of {', '.join(per_param)}")
        states = per_param[key]
    elif isinstance(optimizer, torch.optim.SGD):
        states = 1 if optimizer.defaults.get("momentum", 0) else 0
    else:
        states = 2
    return states * sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def budget_arg(budget_gb: float | None, budget_bytes: int | None) -> int | None:
    """The budget in bytes from `budget_gb` or `budget_bytes` (at most one), or None."""
    if budget_gb is not None and budget_bytes is not None:
        raise InputError("budget: give budget_gb or budget_bytes, not both")
    if budget_gb is not None:
        if budget_gb <= 0:
            raise InputError(f"budget_gb: {budget_gb} must be positive")
        return int(budget_gb * 1e9)
    if budget_bytes is not None:
        if budget_bytes <= 0:
            raise InputError(f"budget_bytes: {budget_bytes} must be positive")
        return int(budget_bytes)
    return None


def check_budget_args(budget_gb: float | None, budget_bytes: int | None, activation_budget: float | None) -> int | None:
    """The budget in bytes from budget_gb/budget_bytes; InputError on a bad combination or fraction."""
    budget = budget_arg(budget_gb, budget_bytes)
    if activation_budget is not None:
        if budget is not None:
            raise InputError("activation_budget: give it or a budget in bytes/GB, not both")
        if not 0 < activation_budget <= 1:
            raise InputError(f"activation_budget: {activation_budget} must be in (0, 1]")
    return budget

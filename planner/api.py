"""optimize(): capture, profile, solve, rewrite — model + inputs + budget -> Plan."""

from __future__ import annotations

from typing import Any

import torch

import solvers
from solvers import Problem, Solution, simulate

from .capture import capture, flatten_for_graph
from .errors import InputError
from .graph import CostGraph
from .plan import Plan, Region, graph_fingerprint
from .profile import ProfileConfig, profile
from .rewrite import rewrite
from .state import ModelState

__all__ = ["optimize", "optimizer_state_bytes", "plan_from_solution"]


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


def _budget(budget_gb: float | None, budget_bytes: int | None) -> int | None:
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


def optimize(
    model: torch.nn.Module,
    example_inputs: Any = None,
    *,
    budget_gb: float | None = None,
    budget_bytes: int | None = None,
    solver: str = "auto",
    device: str | torch.device | None = None,
    optimizer: Any = None,
    capture_method: str = "auto",
    profile_config: ProfileConfig | None = None,
    solver_options: dict[str, Any] | None = None,
    activation_budget: float | None = None,
) -> Plan:
    """Plan activation checkpointing for one training step of `model` within a memory budget.

    example_inputs: a tuple of positional args, a dict of kwargs, or one tensor
    (default: `model.example_input_array`). The budget is the peak memory of
    one forward + backward: parameters, gradients, activations, temporaries,
    plus optimizer state when `optimizer` names one. With no budget, the plan
    is the fastest one that saves memory down to the knee of the trade-off curve.
    device='meta' (or a model on the meta device) plans on fake tensors without
    running anything. activation_budget=f (0 < f <= 1) sets the budget to the
    fixed memory plus f times the activation memory of the step without
    checkpointing (torch.compile's memory-budget knob, in our units).
    The model is left as it was found.
    """
    budget = _budget(budget_gb, budget_bytes)
    if activation_budget is not None:
        if budget is not None:
            raise InputError("activation_budget: give it or a budget in bytes/GB, not both")
        if not 0 < activation_budget <= 1:
            raise InputError(f"activation_budget: {activation_budget} must be in (0, 1]")
    solvers.get_solver(solver)  # unknown names fail before any work
    config = profile_config or ProfileConfig()
    if device is not None and torch.device(device).type == "meta":
        config = ProfileConfig(**{**config.__dict__, "meta": True})
    with ModelState(model).preserved():
        cap = capture(model, example_inputs, method=capture_method)
        cost = profile(cap, config)
    problem = cost.to_problem(optimizer_bytes=optimizer_state_bytes(model, optimizer), name=type(model).__name__)
    options = dict(solver_options or {})
    if activation_budget is not None:
        base_peak = simulate(problem, ()).peak_bytes
        budget = int(problem.fixed_bytes + activation_budget * (base_peak - problem.fixed_bytes))
    solution, notes = _solve(problem, budget, solver, options)
    plan = plan_from_solution(cost, problem, solution, cap, notes=notes, solver_options=options)
    plan.model_name = type(model).__name__
    plan.module = rewrite(cap.graph_module, plan.spans(), model=model)
    return plan


def _solve(problem: Problem, budget: int | None, solver: str, options: dict[str, Any]) -> tuple[Solution, list[str]]:
    notes: list[str] = []
    base = simulate(problem, ())
    if budget is not None and base.peak_bytes <= budget:
        notes.append(
            f"the step fits the budget without checkpointing (predicted peak {base.peak_bytes / 1e9:.3f} GB): no-op plan"
        )
        return solvers.solve(problem, budget, "none"), notes
    if budget is None:
        sweep = getattr(solvers, "sweep", None)
        knee = getattr(solvers, "knee", None)
        if sweep is not None and knee is not None:
            fixed = problem.fixed_bytes
            act = base.peak_bytes - fixed
            budgets = [int(fixed + act * f / 20) for f in range(1, 21)]
            curve = [s for s in sweep(problem, budgets, solver=solver, **options) if s is not None]
            if curve:
                chosen = knee(curve)
                notes.append(
                    f"no budget given: chose the knee of the memory/recompute curve "
                    f"({chosen.peak_bytes / 1e9:.3f} GB, {len(curve)} points swept)"
                )
                return chosen, notes
        notes.append("no budget given: solver default plan")
    return solvers.solve(problem, budget, solver, **options), notes


def plan_from_solution(
    cost: CostGraph,
    problem: Problem,
    solution: Solution,
    cap,
    *,
    notes: list[str] | tuple[str, ...] = (),
    solver_options: dict[str, Any] | None = None,
    activation_budget: float | None = None,
) -> Plan:
    """Wrap a solver's Solution as a Plan (no module yet)."""
    base = simulate(problem, ())
    sim = simulate(problem, solution.regions)
    saved = cost.saved_bytes
    depth_of: list[int] = []
    stack: list[tuple[int, int]] = []
    for s, e in solution.regions:
        while stack and stack[-1][1] < s:
            stack.pop()
        depth_of.append(len(stack))
        stack.append((s, e))
    regions = []
    for (s, e), depth in zip(solution.regions, depth_of):
        mods: list[str] = []
        for n in cost.nodes[s : e + 1]:
            top = n.module
            if top and top not in mods:
                mods.append(top)
        regions.append(
            Region(
                start=s,
                end=e,
                first_node=cost.nodes[s].name,
                last_node=cost.nodes[e].name,
                modules=tuple(_collapse(mods)),
                depth=depth,
                recompute_s=sum(n.time for n in cost.nodes[s : e + 1]),
                saved_bytes=sum(saved[s : e + 1]),
            )
        )
    gm = cap.graph_module
    return Plan(
        solver=solution.solver,
        budget_bytes=solution.budget_bytes,
        baseline_peak_bytes=base.peak_bytes,
        predicted_peak_bytes=sim.peak_bytes,
        predicted_recompute_s=sim.recompute_time,
        baseline_step_s=cost.total_time,
        regions=tuple(regions),
        fingerprint=graph_fingerprint(gm, flatten_for_graph(gm, cap.args, cap.kwargs)),
        capture_method=cap.method,
        solve_time_s=solution.solve_time,
        solver_options=dict(solver_options or {}),
        breakdown=dict(sim.breakdown),
        baseline_breakdown=dict(base.breakdown),
        notes=tuple(notes) + ((f"symbolic_trace failed ({cap.fallback_reason}); captured with torch.export",) if cap.fallback_reason else ()),
        stats={k: v for k, v in solution.stats.items() if k != "breakdown"},
        time_source=cost.time_source,
        num_nodes=len(cost.nodes),
    )


def _collapse(paths: list[str], limit: int = 8) -> list[str]:
    """Module paths with children of a listed parent dropped; at most `limit` shown."""
    out: list[str] = []
    for p in paths:
        if not any(p == q or p.startswith(q + ".") for q in out):
            out = [q for q in out if not q.startswith(p + ".")] + [p]
    return out[:limit] + ([f"... {len(out) - limit} more"] if len(out) > limit else [])

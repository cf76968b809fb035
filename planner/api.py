"""optimize(): capture, profile, solve, rewrite — model + inputs + budget -> Plan."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from . import solvers
from .capture import capture, flatten_for_graph
from .distributed import check_sharding, shard_problem
from .errors import InputError
from .graph import CostGraph
from .plan import Plan, Region, graph_fingerprint
from .profile import ProfileConfig, profile
from .rewrite import rewrite, safe_regions
from .solvers import Problem, Solution, simulate
from .solvers.simulate import normalize_regions
from .state import ModelState
from .timing import with_step_times

__all__ = ["optimize", "Planner", "optimizer_state_bytes", "plan_from_solution"]


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
    world_size: int = 1,
    sharding: str | None = None,
    safety_margin: float = 0.02,
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
    world_size/sharding ('ddp' or 'fsdp'): the budget is per rank, with parameters,
    gradients and optimizer state replicated (ddp) or divided by world_size (fsdp);
    example_inputs are one rank's batch (see planner/distributed.py).
    safety_margin (default 0.02) reserves that fraction of the budget's
    activation part for what the simulator does not see (the allocator's
    rounding on a GPU, kernels that pick other workspaces at other sizes). The model is left
    as it was found.
    """
    _check_budget_args(budget_gb, budget_bytes, activation_budget)
    solvers.get_solver(solver)  # unknown names fail before any work
    planner = Planner(
        model,
        example_inputs,
        device=device,
        optimizer=optimizer,
        capture_method=capture_method,
        profile_config=profile_config,
        world_size=world_size,
        sharding=sharding,
    )
    return planner.plan(
        budget_gb=budget_gb,
        budget_bytes=budget_bytes,
        activation_budget=activation_budget,
        solver=solver,
        solver_options=solver_options,
        safety_margin=safety_margin,
    )


def _check_budget_args(budget_gb: float | None, budget_bytes: int | None, activation_budget: float | None) -> int | None:
    budget = _budget(budget_gb, budget_bytes)
    if activation_budget is not None:
        if budget is not None:
            raise InputError("activation_budget: give it or a budget in bytes/GB, not both")
        if not 0 < activation_budget <= 1:
            raise InputError(f"activation_budget: {activation_budget} must be in (0, 1]")
    return budget


class Planner:
    """Capture and profile a model once, then plan it for any number of budgets.

        planner = Planner(model, example_inputs)
        plans = [planner.plan(activation_budget=f) for f in (0.25, 0.5, 0.75)]

    Arguments are those of `optimize()`; the model is left as it was found.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        example_inputs: Any = None,
        *,
        device: str | torch.device | None = None,
        optimizer: Any = None,
        capture_method: str = "auto",
        profile_config: ProfileConfig | None = None,
        world_size: int = 1,
        sharding: str | None = None,
    ) -> None:
        check_sharding(world_size, sharding)
        config = profile_config or ProfileConfig()
        if device is not None and torch.device(device).type == "meta":
            config = ProfileConfig(**{**config.__dict__, "meta": True})
        with ModelState(model).preserved():
            self.capture = capture(model, example_inputs, method=capture_method)
            self.cost = profile(self.capture, config)
            if config.overheads:
                self.cost = with_step_times(self.cost, model, self.capture.graph_module, self.capture.args, self.capture.kwargs)
        self.model = model
        problem = self.cost.to_problem(
            optimizer_bytes=optimizer_state_bytes(model, optimizer), name=type(model).__name__
        )
        self.problem, self.dist_notes = shard_problem(problem, model, world_size=world_size, sharding=sharding)

    @property
    def baseline_peak_bytes(self) -> int:
        return simulate(self.problem, ()).peak_bytes

    def plan(
        self,
        *,
        budget_gb: float | None = None,
        budget_bytes: int | None = None,
        activation_budget: float | None = None,
        solver: str = "auto",
        solver_options: dict[str, Any] | None = None,
        safety_margin: float = 0.02,
    ) -> Plan:
        """Solve for one budget and build the checkpointed module."""
        budget = _check_budget_args(budget_gb, budget_bytes, activation_budget)
        solvers.get_solver(solver)
        problem, cap, model = self.problem, self.capture, self.model
        options = dict(solver_options or {})
        if activation_budget is not None:
            base_peak = simulate(problem, ()).peak_bytes
            budget = int(problem.fixed_bytes + activation_budget * (base_peak - problem.fixed_bytes))
        solution, notes = _solve(problem, budget, solver, options, safety_margin)
        safe, moved = safe_regions(cap.graph_module, solution.regions)  # in-place ops at region boundaries
        if moved:
            regions = normalize_regions(problem, safe)
            solution = dataclasses.replace(solution, regions=regions, saved=kept_saved(regions, solution.saved))
            notes = list(notes) + moved
        plan = plan_from_solution(self.cost, problem, solution, cap, notes=notes + self.dist_notes, solver_options=options)
        plan.model_name = type(model).__name__
        plan.problem = problem
        plan.module = rewrite(cap.graph_module, plan.spans(), model=model, saved=plan.saved_indices())
        extra = []
        if cap.builtin_checkpointing:
            shown = ", ".join(cap.builtin_checkpointing[:4]) + (" ..." if len(cap.builtin_checkpointing) > 4 else "")
            extra.append(
                f"the model checkpoints itself ({len(cap.builtin_checkpointing)} modules: {shown}); "
                "this plan replaces that checkpointing (plan.module does not use it, the model keeps it)"
            )
        extra.extend(getattr(plan.module, "rewrite_notes", ()))
        if extra:
            plan.notes = tuple(plan.notes) + tuple(extra)
        return plan


def _solve(
    problem: Problem, budget: int | None, solver: str, options: dict[str, Any], margin: float = 0.0
) -> tuple[Solution, list[str]]:
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
    return _solve_with_margin(problem, budget, solver, options, margin), notes


def _solve_with_margin(problem: Problem, budget: int | None, solver: str, options: dict[str, Any], margin: float) -> Solution:
    """Solve for the budget less a reserve of `margin` x its activation part.

    The reserve covers what the simulator does not see (allocator rounding, workspaces),
    so that the measured peak stays within the budget the user gave.
    """
    if budget is None:
        return solvers.solve(problem, None, solver, **options)
    fixed = problem.fixed_bytes
    inner = budget - max(0, int(margin * (budget - fixed)))
    try:
        solution = solvers.solve(problem, inner, solver, **options)
    except solvers.InfeasibleBudgetError as e:
        smallest = fixed + int((e.smallest_bytes - fixed) / (1 - margin)) + 1 if e.smallest_bytes > fixed else fixed
        raise solvers.InfeasibleBudgetError(budget, smallest, solver, fixed) from None
    return dataclasses.replace(solution, budget_bytes=budget, stats={**solution.stats, "planned_for_bytes": inner})


def plan_from_solution(
    cost: CostGraph,
    problem: Problem,
    solution: Solution,
    cap,
    *,
    notes: list[str] | tuple[str, ...] = (),
    solver_options: dict[str, Any] | None = None,
) -> Plan:
    """Wrap a solver's Solution as a Plan (no module yet)."""
    base = simulate(problem, ())
    sim = simulate(problem, solution.regions, saved=solution.saved)
    saved = cost.saved_bytes
    kept = set(solution.saved)
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
                saved_ops=tuple(cost.nodes[i].name for i in range(s, e + 1) if i in kept),
                saved_positions=tuple(i for i in range(s, e + 1) if i in kept),
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
        eager_step_s=problem.base_step_s - problem.graph_overhead_s,
        predicted_step_s=problem.base_step_s + sim.recompute_time,
        call_overhead_s=sim.call_time,
        graph_overhead_s=problem.graph_overhead_s,
    )


def kept_saved(regions, saved) -> tuple[int, ...]:
    """Saved ops still inside a region after the regions moved (a moved region's cache may not reach them)."""
    return tuple(i for i in saved if any(s <= i <= e for s, e in regions))


def _collapse(paths: list[str], limit: int = 8) -> list[str]:
    """Module paths with children of a listed parent dropped; at most `limit` shown."""
    out: list[str] = []
    for p in paths:
        if not any(p == q or p.startswith(q + ".") for q in out):
            out = [q for q in out if not q.startswith(p + ".")] + [p]
    return out[:limit] + ([f"... {len(out) - limit} more"] if len(out) > limit else [])

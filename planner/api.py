"""optimize(): capture, profile, solve, rewrite — model + inputs + budget -> Plan."""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

from . import solvers
from .capture.exported import accept_exported
from .capture.frozen import ValueGuard, frozen_values, stale_note
from .capture.own_checkpoint import own_spans
from .capture.preflight import nothing_to_plan
from .capture.shapes import ON_LARGER_SHAPE, ShapeGuard, input_shapes
from .capture.trace import capture
from .choose.autotune import WHOLE_MODULES, autotune_solution, device_measure, steps_for
from .choose.budget import check_budget_args as _check_budget_args
from .choose.budget import floor_plan, inner_budget, optimizer_state_bytes, peak_detail, smallest_budget
from .choose.cost_refit import learned
from .choose.partial import PartialPlanner, guard_model
from .choose.plan_store import plan_key, steady
from .choose.safety_net import inexact_parts, step_differences
from .choose.solve import (
    kept_saved,
    laminar,
    merge_own,
    plan_from_solution,
    solve_partial,
    solve_unbudgeted,
    with_regions,
)
from .distributed import check_sharding, plan_collectively, planning_is_collective, shard_problem
from .errors import CaptureError, InexactPlanError, InputError, UnplannableError
from .lower.apply import checkpointed_copy, whole_module_spans
from .lower.chunk import ChunkSpec, chunk_capture
from .lower.rewrite import rewrite, safe_regions
from .model_state import ModelState
from .plan import Plan
from .profile.bytes_pass import PROFILES, bytes_config, needs_bytes_pass
from .profile.profiler import ProfileConfig, profile
from .profile.timing import with_step_times
from .profile.timing_store import open_store
from .progress import logger, progress_enabled, stage
from .solvers import Solution, simulate
from .solvers.simulate import normalize_regions

__all__ = ["optimize", "Planner", "optimizer_state_bytes", "plan_from_solution"]


def _with_progress(fn: Callable[..., Plan]) -> Callable[..., Plan]:
    """Adds the keyword `progress` (bool): show the stages' log records on stderr during the call."""

    @functools.wraps(fn)
    def wrapper(*args: Any, progress: bool = False, **kwargs: Any) -> Plan:
        with progress_enabled(progress):
            return fn(*args, **kwargs)

    sig = inspect.signature(fn)
    flag = inspect.Parameter("progress", inspect.Parameter.KEYWORD_ONLY, default=False, annotation="bool")
    wrapper.__signature__ = sig.replace(parameters=[*sig.parameters.values(), flag])  # type: ignore[attr-defined]
    return wrapper


@_with_progress
def optimize(
    model: torch.nn.Module | torch.export.ExportedProgram,
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
    own_checkpointing: str = "replace",
    on_larger_shape: str = "error",
    partial: bool = True,
    compile: bool = False,
    lowering: str = "best",
    exact_check: bool = True,
    exact: bool = True,
    autotune: bool | int | None = None,
) -> Plan:
    """Plan activation checkpointing for one training step of `model` within a memory budget.

    model: an nn.Module, a torch.export ExportedProgram or its `.module()`.
    example_inputs: a tuple of positional args, a dict of kwargs, or one tensor
    (default: `model.example_input_array`, or an ExportedProgram's own example inputs).
    The budget is the peak memory of one forward + backward: parameters, gradients, activations, temporaries,
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
    rounding on a GPU, kernels that pick other workspaces at other sizes): the
    solvers plan for `budget - floor(margin * (budget - fixed))`, fixed being
    parameters, inputs and optimizer state. A budget the step as given already
    fits gets no plan and no margin (nothing is recomputed).
    Every plan is re-simulated after its last change (cuts moved off in-place
    writes, the model's own regions merged in) and re-solved tighter, or replaced
    by the least-memory plan, when that change left it over the planned budget.
    An infeasible budget raises InfeasibleBudgetError naming the smallest
    feasible one, margin included: a call at exactly that budget succeeds, a
    lower one is refused, and it is never above the peak of the step as given.
    Feasibility is decided from bytes alone (see planner/budget.py), so a fresh
    call, which re-times the model, accepts it too.
    own_checkpointing: a model that checkpoints itself (torch.utils.checkpoint in
    its forward, HF `gradient_checkpointing_enable()`, timm `grad_checkpointing`)
    is measured as given: the baseline and the memory saved are against it.
    'replace' (default) plans the plain graph freely (with no budget given, the
    budget is the model's own peak, so the plan is never worse than it); 'keep'
    keeps its checkpoint regions and adds regions where the budget needs them.
    Called under torch.no_grad() or torch.inference_mode(), or on an eval-mode
    export, it raises UnplannableError: there is no training step to plan.
    A module in eval mode is planned for its training step (train mode), with a note; plan.module
    checks before each training call that the Python values the graph holds as constants (scalar
    globals and attributes the forward reads; capture/frozen.py) are unchanged, else StaleGraphError.
    The model is left as it was found.
    Under torch.distributed (initialized, more than one rank) planning is collective: rank 0 plans and
    broadcasts, every rank checks the plan against its own model and runs the same one (distributed.py).
    The example inputs are the largest shape: plan.module runs any smaller batch or sequence
    length with the same plan; a larger one raises ShapeError, or with on_larger_shape='replan'
    is planned again at its shape (same budget and settings, cached per shape).
    partial (default True): when the whole model cannot be captured, plan its largest
    capturable submodules and run the rest eagerly (see planner/partial.py; the plan's
    notes name what was left out and what it costs).
    progress=True shows each stage (capture, profile, solve, rewrite) and the solver's steps
    on stderr; without it they go to the "ckpt_planner" logger (planner/progress.py).
    compile=True: plan.module runs its training step under torch.compile (inductor, fullgraph) and
    the budget is the compiled step's measured allocator peak (see planner/compile/compiled.py). lowering:
    "regions" (whole checkpoint regions), "knapsack" (our knapsack picks the ops compile's partitioner
    recomputes, planner/compile/knapsack.py) or "best" (both; the faster compiled step that fits).
    exact_check (default True): before a plan is returned, one training step of its module is compared
    with one of the model (outputs, every gradient, buffers; bitwise on the CPU). A plan that differs
    is never returned: its kept ops, else the regions that differ, are forbidden and the budget solved
    again, and the plan's notes say so (planner/exactness.py). Not on fake tensors (nothing runs).
    exact=False also admits plans that run token-wise work (MLPs, the LM head and its loss) in chunks of
    tokens or samples (planner/lower/chunk.py): used only where the exact plan cannot fit the budget; the
    gradients are then allclose to the model's (sums over chunks), not bitwise.
    autotune (default: on when the profile's times are measured on the device, off on FLOP times, on
    fake tensors and under compile=True): the solver's plan, its runners-up and the hand-written plans
    that fit run a few interleaved steps each; the fastest measured within the budget is returned, and
    kept in the timing store for the next run (planner/profile/autotune.py). True, False, or a cap on
    the model steps it runs (default 30); the plan's stats["autotune"] and summary show every figure.
    """
    call = dict(locals())  # the arguments, for the collective call below
    if planning_is_collective():  # torch.distributed: rank 0 plans, every rank runs its plan (distributed.py)
        return plan_collectively(lambda: optimize(**call), Plan.from_dict, model, example_inputs, on_larger_shape)
    _check_budget_args(budget_gb, budget_bytes, activation_budget)
    if not exact:
        if compile or world_size != 1:
            raise InputError("exact: exact=False (chunked token-wise work) is planned eagerly on one rank; "
                             "drop compile=True / world_size or keep exact=True")
        return _optimize_inexact(model, example_inputs, dict(
            device=device, optimizer=optimizer, profile_config=profile_config, exact_check=exact_check,
        ), dict(
            budget_gb=budget_gb, budget_bytes=budget_bytes, activation_budget=activation_budget, solver=solver,
            solver_options=solver_options, safety_margin=safety_margin, own_checkpointing=own_checkpointing,
            on_larger_shape=on_larger_shape, autotune=autotune,
        ), capture_method)
    if lowering != "best" and not compile:
        raise InputError(f"lowering: {lowering!r} applies to compiled plans only; pass compile=True or drop lowering")
    if compile:
        return optimize_compiled(
            model, example_inputs,
            dict(device=device, optimizer=optimizer, capture_method=capture_method, profile_config=profile_config,
                 world_size=world_size, sharding=sharding),
            dict(budget_gb=budget_gb, budget_bytes=budget_bytes, activation_budget=activation_budget, solver=solver,
                 solver_options=solver_options, safety_margin=safety_margin, own_checkpointing=own_checkpointing,
                 on_larger_shape=on_larger_shape),
            lowering,
        )
    solvers.get_solver(solver)  # unknown names fail before any work
    if on_larger_shape not in ON_LARGER_SHAPE:
        raise InputError(f"on_larger_shape: {on_larger_shape!r} is not one of {', '.join(ON_LARGER_SHAPE)}")
    if own_checkpointing not in OWN_CHECKPOINTING:
        raise InputError(f"own_checkpointing: {own_checkpointing!r} is not one of {', '.join(OWN_CHECKPOINTING)}")
    try:
        planner = Planner(
            model,
            example_inputs,
            device=device,
            optimizer=optimizer,
            capture_method=capture_method,
            profile_config=profile_config,
            world_size=world_size,
            sharding=sharding,
            exact_check=exact_check,
            feasible_for=dict(
                budget_gb=budget_gb, budget_bytes=budget_bytes, activation_budget=activation_budget, solver=solver,
                solver_options=solver_options, safety_margin=safety_margin, own_checkpointing=own_checkpointing,
            ) if (budget_gb, budget_bytes, activation_budget) != (None, None, None) else None,
        )
    except CaptureError as e:
        if not partial or world_size != 1 or (device is not None and torch.device(device).type == "meta"):
            raise
        with ModelState(model).preserved():
            part = PartialPlanner(
                model, example_inputs, reason=str(e), optimizer_bytes=optimizer_state_bytes(model, optimizer),
                capture_method=capture_method, profile_config=profile_config,
            )
        budget = _check_budget_args(budget_gb, budget_bytes, activation_budget)
        if activation_budget is not None:
            budget = int(part.problem.fixed_bytes + activation_budget * (part.baseline_peak_bytes - part.problem.fixed_bytes))
        solution, notes = solve_partial(part.problem, budget, solver, dict(solver_options or {}), safety_margin)
        settings = dict(
            budget_gb=budget_gb, budget_bytes=budget_bytes, activation_budget=activation_budget, solver=solver,
            device=device, optimizer=optimizer, capture_method=capture_method, profile_config=profile_config,
            solver_options=solver_options, safety_margin=safety_margin, own_checkpointing=own_checkpointing,
        )

        def replan(args: tuple, kwargs: dict[str, Any]) -> torch.nn.Module:
            if args and kwargs:
                raise InputError("inputs: a call with both positional and keyword tensors cannot be re-planned")
            return optimize(model, dict(kwargs) if kwargs else tuple(args), **settings).module

        return part.plan(solution, notes, on_larger_shape=on_larger_shape, replan=replan)
    return planner.plan(
        budget_gb=budget_gb,
        budget_bytes=budget_bytes,
        activation_budget=activation_budget,
        solver=solver,
        solver_options=solver_options,
        safety_margin=safety_margin,
        own_checkpointing=own_checkpointing,
        on_larger_shape=on_larger_shape,
        autotune=autotune,
    )


OWN_CHECKPOINTING = ("replace", "keep")
EVAL_NOTE = (
    "the model was in eval mode: planned for its training step (train mode: dropout on, BatchNorm on batch "
    "statistics), which plan.module runs in train mode; in eval mode plan.module runs the model as given"
)


def _refuse_grad_mode() -> None:
    """Planning profiles one training step: under no_grad/inference_mode nothing is saved for backward."""
    if torch.is_inference_mode_enabled():
        raise UnplannableError(
            "optimize: called inside torch.inference_mode(), where nothing is saved for backward, so there is "
            "no training step to plan; call it outside that context"
        )
    if not torch.is_grad_enabled():
        raise UnplannableError(
            "optimize: called under torch.no_grad(), where nothing is saved for backward, so there is no "
            "training step to plan; call it outside that context (or inside torch.enable_grad())"
        )


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
        exact_check: bool = True,
        exact: bool = True,
        feasible_for: dict[str, Any] | None = None,
    ) -> None:
        _refuse_grad_mode()
        check_sharding(world_size, sharding)
        model, example_inputs, exported = accept_exported(model, example_inputs)
        if exported and capture_method == "auto":
            capture_method = "export"
        config = profile_config or ProfileConfig()
        if device is not None and torch.device(device).type == "meta":
            config = ProfileConfig(**{**config.__dict__, "meta": True})
        self.capture_notes: list[str] = []
        with ModelState(model).preserved():
            if not model.training:  # plan the step a training loop takes (verify() and plan.module run train mode)
                model.train()
                self.capture_notes.append(EVAL_NOTE)
            with stage("capture", f"{type(model).__name__}, method {capture_method}"):
                self.capture = capture(model, example_inputs, method=capture_method)
            self.exact = exact
            self.chunks: list[ChunkSpec] = []
            if not exact:  # token-wise groups run in chunks (planner/lower/chunk.py)
                self.capture, self.chunks = chunk_capture(self.capture)
            logger.info("capture: %s, %d graph nodes", self.capture.method, len(self.capture.graph_module.graph.nodes))
            self.model, self._floors = model, {}
            memo = PROFILES.key(model, self.capture, config)
            self.cost = PROFILES.get(memo)
            if self.cost is None and feasible_for is not None and needs_bytes_pass(config):
                # Bytes first (planner/profile/first_pass.py): an infeasible budget is refused before any timing.
                with stage("bytes", "one recorded step, no timing: can the budget be met?"):
                    self._set_cost(profile(self.capture, bytes_config(config)), optimizer, world_size, sharding, config)
                    self.check_feasible(**feasible_for)
                self.cost = None
            if self.cost is not None:
                with stage("profile", "reused: this process measured the same graph, weights and inputs"):
                    pass
            else:
                with stage("profile", "meta tensors" if config.meta else "running each node"):
                    self.cost = profile(self.capture, config)
                logger.info(
                    "profile: %d nodes, %.1f MB saved for backward, forward %.1f ms (%s)",
                    len(self.cost.nodes), self.cost.total_saved_bytes / 1e6, self.cost.total_time * 1e3,
                    self.cost.time_source,
                )
                if config.overheads and self.cost.time_source != "flops":  # FLOP times have no step to time
                    with stage("step times", "the eager step, the captured graph and one calibration step"):
                        self.cost = with_step_times(
                            self.cost, model, self.capture.graph_module, self.capture.args, self.capture.kwargs,
                            timing_store=config.timing_store,
                        )
                PROFILES.put(memo, self.cost)
        self.values = ValueGuard(frozen_values(model, self.capture.graph_module, self.capture.method))
        self.capture_notes += [self.values.note()] if self.values.values else []
        self.capture_notes += stale_note(self.capture.graph_module)
        self._settings = dict(
            device=device, optimizer=optimizer, capture_method=capture_method, profile_config=profile_config,
            world_size=world_size, sharding=sharding, exact_check=exact_check, exact=exact,
        )
        self._real = not config.meta and not any(
            t.device.type == "meta" for t in list(model.parameters()) + list(model.buffers())
        )
        self._check = exact_check and self._real
        self._set_cost(self.cost, optimizer, world_size, sharding, config)
        self.sharding = {"world_size": world_size, "sharding": sharding} if sharding else None
        """What a loaded plan needs to re-simulate its figures (Plan.check_figures)."""
        self.autotune: bool | int | None = None
        """`plan(autotune=None)` takes this (None: on where times are on the clock); compiled plans set False."""

    def _set_cost(self, cost: Any, optimizer: Any, world_size: int, sharding: str | None,
                  config: ProfileConfig) -> None:
        """The problem, the model's own regions and the floors, from one profile (bytes pass or timed)."""
        model = self.model
        self.cost = cost
        problem = self.cost.to_problem(
            optimizer_bytes=optimizer_state_bytes(model, optimizer), name=type(model).__name__
        )
        self.problem, self.dist_notes = shard_problem(problem, model, world_size=world_size, sharding=sharding)
        if self.cost.time_source == "fitted":  # the device's refit from earlier autotune rounds (costfit.py)
            self.problem, fit = learned(self.problem, open_store(self.cost.device, config.timing_store))
            if fit is not None:
                self.dist_notes = [*self.dist_notes, (
                    f"times refit on this device from {fit.rows} measured plans: node times x{fit.scale:.2f}, "
                    f"{fit.per_region_s * 1e6:.0f} us per region")]
        nodes = self.cost.nodes
        spans, self.own_unplaced = own_spans(
            self.capture.own_checkpoints,
            [n.name for n in nodes],
            [n.module for n in nodes],
            [n.recomputable for n in nodes],
        )
        self.own_regions = laminar(self.problem, spans)
        """Node spans of the model's own checkpoint calls (the model as given recomputes these)."""
        self._floors: dict[tuple, tuple[int, tuple[tuple[int, int], ...]]] = {}

    @property
    def baseline_peak_bytes(self) -> int:
        """Predicted peak of one step of the model as given (its own checkpointing included)."""
        return simulate(self.problem, self.own_regions).peak_bytes

    @property
    def no_checkpoint_peak_bytes(self) -> int:
        """Predicted peak of one step with no checkpointing at all."""
        return simulate(self.problem, ()).peak_bytes

    def check_feasible(
        self,
        *,
        budget_gb: float | None = None,
        budget_bytes: int | None = None,
        activation_budget: float | None = None,
        solver: str = "auto",
        solver_options: dict[str, Any] | None = None,
        safety_margin: float = 0.02,
        own_checkpointing: str = "replace",
        **_: Any,
    ) -> None:
        """Raise InfeasibleBudgetError when no plan can meet the budget; bytes alone decide (planner/budget.py),
        so this holds on the byte pass's profile as on the timed one. Other arguments of `plan` are ignored."""
        budget = _check_budget_args(budget_gb, budget_bytes, activation_budget)
        if nothing_to_plan(self.model, self.capture.graph_module, self.cost.total_saved_bytes) is not None:
            return  # plan() says why
        if activation_budget is not None:
            budget = int(self.problem.fixed_bytes + activation_budget * (self.baseline_peak_bytes - self.problem.fixed_bytes))
        if budget is None or solver not in solvers.SOLVERS:
            return
        keep = own_checkpointing == "keep" and bool(self.own_regions)
        self._refuse(budget, solver, dict(solver_options or {}), safety_margin, keep)

    def _refuse(self, budget: int, solver: str, options: dict[str, Any], margin: float, keep: bool) -> None:
        """InfeasibleBudgetError naming the smallest feasible budget when neither a plan nor the step as given fits."""
        problem = self.problem
        given = self._finish(self.own_regions, False)[0] if self.own_regions else ()
        given_peak = simulate(problem, given).peak_bytes
        plain_peak = self.no_checkpoint_peak_bytes
        if plain_peak <= budget and not keep:
            return
        fixed = problem.fixed_bytes
        floor_peak, _ = self._floor(solver, options, keep)
        as_is = given_peak if keep else min(plain_peak, given_peak)
        if floor_peak > inner_budget(budget, fixed, margin) and as_is > budget:
            smallest = min(as_is, smallest_budget(floor_peak, fixed, margin))
            detail = ""
            if smallest == as_is:
                regions = given if given_peak <= plain_peak or keep else ()
                detail = peak_detail(problem, regions, [n.name for n in self.cost.nodes])
            raise solvers.InfeasibleBudgetError(budget, smallest, solver, fixed, detail=detail)

    def plan(
        self,
        *,
        budget_gb: float | None = None,
        budget_bytes: int | None = None,
        activation_budget: float | None = None,
        solver: str = "auto",
        solver_options: dict[str, Any] | None = None,
        safety_margin: float = 0.02,
        on_larger_shape: str = "error",
        own_checkpointing: str = "replace",
        autotune: bool | int | None = None,
    ) -> Plan:
        """Solve for one budget and build the checkpointed module (see `optimize()` for the arguments)."""
        if on_larger_shape not in ON_LARGER_SHAPE:
            raise InputError(f"on_larger_shape: {on_larger_shape!r} is not one of {', '.join(ON_LARGER_SHAPE)}")
        budget = _check_budget_args(budget_gb, budget_bytes, activation_budget)
        empty = nothing_to_plan(self.model, self.capture.graph_module, self.cost.total_saved_bytes)
        if empty is not None:  # frozen, or no tensor output: no budget could be "infeasible" here
            raise empty
        if own_checkpointing not in OWN_CHECKPOINTING:
            raise InputError(f"own_checkpointing: {own_checkpointing!r} is not one of {', '.join(OWN_CHECKPOINTING)}")
        if not 0 <= safety_margin < 1:
            raise InputError(f"safety_margin: {safety_margin} must be in [0, 1)")
        solvers.get_solver(solver)
        steps = steps_for(self.autotune if autotune is None else autotune, self.cost.time_source == "fitted")
        problem, cap, model = self.problem, self.capture, self.model
        options = dict(solver_options or {})
        given = self.baseline_peak_bytes
        keep = own_checkpointing == "keep" and bool(self.own_regions)
        own_notes = self._own_notes(own_checkpointing)
        if activation_budget is not None:
            budget = int(problem.fixed_bytes + activation_budget * (given - problem.fixed_bytes))
        elif budget is None and self.own_regions:
            budget = given
            own_notes.append("no budget given: the budget is the peak of the model as given, with its own checkpointing")
        with stage("solve", f"solver {solver}, budget "
                   + (f"{budget / 1e6:.1f} MB" if budget is not None else "none (knee of the curve)")):
            solution, notes = self._solve(budget, solver, options, safety_margin, keep)
        if self._check and (solution.regions or self.chunks):
            with stage("check", "one step of the plan against the model's own"):
                solution, notes = self._exact(solution, notes, (budget, solver, options, safety_margin, keep))
        if steps and budget is not None and solution.regions and not keep and self._real:
            with stage("autotune", f"the best plans that fit, timed on the device, at most {steps} steps"):
                solution, tuned = self._autotune(solution, budget, solver, options, safety_margin, steps)
            notes = notes + tuned
        logger.info(
            "solve: %s chose %d regions, predicted peak %.1f MB, recompute %.1f ms",
            solution.solver, len(solution.regions), solution.peak_bytes / 1e6, solution.recompute_time * 1e3,
        )
        if not self.exact:
            notes = notes + [f"chunked region ({c.chunks} chunks): {c.why}" for c in self.chunks]
        plan = plan_from_solution(
            self.cost,
            problem,
            solution,
            cap,
            notes=notes + self.capture_notes + self.dist_notes + own_notes,
            solver_options=options,
            baseline_regions=self.own_regions,
        )
        if self.own_regions or cap.builtin_checkpointing:
            plan.stats["own_checkpointing"] = "kept" if keep else "replaced"
            plan.stats["no_checkpoint_peak_bytes"] = self.no_checkpoint_peak_bytes
        plan.model_name = type(model).__name__
        plan.problem = problem
        if self.sharding:
            plan.stats["sharding"] = dict(self.sharding)
        if not self.exact:
            plan.stats["exact"] = False
            plan.stats["chunks"] = [c.to_dict() for c in self.chunks]
        if not plan.regions and not self.chunks and on_larger_shape == "error":
            # Nothing to recompute: the model itself, not its captured graph (which costs time of its own).
            plan.module, plan.graph_overhead_s, plan.predicted_step_s = model, 0.0, plan.eager_step_s
            plan.notes = (*plan.notes, "no checkpoint regions: plan.module is the model itself, unchanged")
            return plan
        whole = solution.stats.get(WHOLE_MODULES)
        if whole:  # autotune measured the model's own code, with these modules checkpointed, fastest
            plan.module = checkpointed_copy(model, whole)
            # the model's own code: no captured graph to pay for
            plan.predicted_step_s, plan.graph_overhead_s = plan.predicted_step_s - plan.graph_overhead_s, 0.0
            plan.notes = (*plan.notes, f"plan.module is the model's own code with {len(whole)} whole modules "
                          f"checkpointed ({', '.join(whole[:3])}{' ...' if len(whole) > 3 else ''}), as Plan.apply "
                          "does, on a shallow copy: autotune measured it faster than the captured graph")
            guard_model(plan.module, input_shapes(cap.args, cap.kwargs), on_larger_shape, self._replan(dict(
                budget_gb=budget_gb, budget_bytes=budget_bytes, activation_budget=activation_budget, solver=solver,
                solver_options=solver_options, safety_margin=safety_margin, own_checkpointing=own_checkpointing,
            )))
            return plan
        with stage("rewrite", f"{len(plan.regions)} checkpoint regions"):
            plan.module = rewrite(cap.graph_module, plan.spans(), model=model, saved=plan.saved_indices())
        extra = tuple(getattr(plan.module, "rewrite_notes", ()))
        extra += (self._guard_shapes(plan.module, on_larger_shape, dict(
            budget_gb=budget_gb, budget_bytes=budget_bytes, activation_budget=activation_budget, solver=solver,
            solver_options=solver_options, safety_margin=safety_margin, own_checkpointing=own_checkpointing,
        )),)
        if extra:
            plan.notes = tuple(plan.notes) + extra
        return plan

    def _own_notes(self, mode: str) -> list[str]:
        cap = self.capture
        if not (self.own_regions or cap.builtin_checkpointing or self.own_unplaced):
            return []
        paths = list(dict.fromkeys(c.module or "a function" for c in cap.own_checkpoints)) or list(cap.builtin_checkpointing)
        shown = ", ".join(paths[:4]) + (" ..." if len(paths) > 4 else "")
        how = (
            "this plan keeps it and adds regions where the budget needs them"
            if mode == "keep" and self.own_regions
            else "this plan replaces it (plan.module does not use it; the model keeps it)"
        )
        notes = [
            f"the model checkpoints itself ({len(self.own_regions)} regions: {shown}); {how}; the baseline and "
            "the memory saved are those of the model as given"
        ]
        if self.own_unplaced:
            notes.append(
                f"{len(self.own_unplaced)} of the model's own checkpoint calls could not be located in the graph "
                f"({', '.join(dict.fromkeys(self.own_unplaced))}): the baseline counts them as not checkpointed"
            )
        return notes

    def _replan(self, plan_args: dict[str, Any]) -> Callable[[tuple, dict[str, Any]], torch.nn.Module]:
        """The plan's module planned again at another shape (on_larger_shape='replan')."""
        model, settings = self.model, self._settings

        def replan(args: tuple, kwargs: dict[str, Any]) -> torch.nn.Module:
            if args and kwargs:
                raise InputError("inputs: a call with both positional and keyword tensors cannot be re-planned")
            planner = Planner(model, dict(kwargs) if kwargs else tuple(args), **settings)
            return planner.plan(**plan_args, on_larger_shape="error").module

        return replan

    def _guard_shapes(self, module: torch.nn.Module, on_larger_shape: str, plan_args: dict[str, Any]) -> str:
        """Attach the ShapeGuard to the checkpointed module; return the summary's note about shapes."""
        cap = self.capture
        replan = self._replan(plan_args)
        planned = input_shapes(cap.args, cap.kwargs)
        guard = ShapeGuard(planned, on_larger_shape, replan, dynamic_dims=cap.dynamic_dims)
        guard.values = self.values
        object.__setattr__(module, "shape_guard", guard)
        larger = "re-planned per shape" if on_larger_shape == "replan" else "raise ShapeError"
        if not cap.dynamic_dims:
            return f"planned for inputs {planned}; the capture pinned every dimension, so any other shape is re-planned"
        return f"planned for inputs {planned}: smaller shapes run this plan, larger ones {larger}"


    def _exact(self, solution: Solution, notes: list[str], solve_args: tuple) -> tuple[Solution, list[str]]:
        """The safety net (planner/exactness.py): `solution` when its step equals the model's, else the
        plan solved again with what differed forbidden (kept ops, else regions), and a note that says so."""
        gm, model, cap = self.capture.graph_module, self.model, self.capture

        def differs(regions, saved) -> bool | None:
            found = step_differences(model, rewrite(gm, regions, model=model, saved=saved), cap.args, cap.kwargs,
                                     bitwise=None if self.exact else False)
            return None if found is None else bool(found)

        names = [n.name for n in self.problem.nodes]
        if self.chunks and differs((), ()):
            raise InexactPlanError("exact=False: the chunked step's gradients are not allclose to the model's; "
                                   "plan with exact=True or report the model")
        for _ in range(3):
            verdict = differs(solution.regions, solution.saved) if solution.regions else False
            if verdict is None:
                note = "not checked against the model's own step: that step raises as given (its backward fails)"
                return solution, [*notes, note]
            if not verdict:
                return solution, notes
            kept_only, bad = inexact_parts(solution.regions, solution.saved, differs)
            nodes = list(self.problem.nodes)
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
            self.problem = dataclasses.replace(self.problem, nodes=tuple(nodes))
            self._floors.clear()
            try:
                solution, more = self._solve(*solve_args)
            except solvers.InfeasibleBudgetError as e:
                raise InexactPlanError(f"{notes[-1]}; without them: {e}") from e
            notes += more
        if solution.regions and differs(solution.regions, solution.saved):
            raise InexactPlanError(
                f"no plan found whose training step equals the model's: {'; '.join(notes[-3:])}; "
                "run the model without checkpointing or report the model"
            )
        return solution, notes

    def _autotune(self, solution: Solution, budget: int, solver: str, options: dict[str, Any], margin: float,
                  steps: int) -> tuple[Solution, list[str]]:
        """Measured choice among the plans that fit (planner/profile/autotune.py), kept in the timing store."""
        gm, model, cap = self.capture.graph_module, self.model, self.capture
        inner = inner_budget(budget, self.problem.fixed_bytes, margin)
        config = self._settings["profile_config"] or ProfileConfig()
        store = open_store(self.cost.device, config.timing_store)

        def build(regions, saved, paths) -> torch.nn.Module:
            return checkpointed_copy(model, paths) if paths else rewrite(gm, regions, model=model, saved=saved)

        def differs(regions, saved, paths) -> bool | None:
            if not self._check:
                return False
            found = step_differences(model, build(regions, saved, paths), cap.args, cap.kwargs)
            return None if found is None else bool(found)

        measure = device_measure(model, gm, cap.args, cap.kwargs, torch.device(self.cost.device), build)
        with ModelState(model).preserved():
            return autotune_solution(
                self.problem, solution, budget, inner, steps=steps, measure=measure, differs=differs, store=store,
                key=plan_key(self.problem, inner, solver, options, False) + "|autotune",
                finish=lambda r: self._finish(r, False)[0], learn=self.cost.time_source == "fitted",
                modules=self._whole_modules() and (lambda r: whole_module_spans(self.problem, model, r)),
            )

    def _whole_modules(self) -> bool:
        """Whether hand-written plans may race as the model's own code (`checkpointed_copy`): not where
        that code differs from the planned step (its own checkpointing, eval mode, chunked groups)."""
        cap = self.capture
        own = self.own_regions or cap.builtin_checkpointing or self.own_unplaced or any(
            getattr(m, "gradient_checkpointing", False) is True for m in self.model.modules())
        return not own and EVAL_NOTE not in self.capture_notes and not self.chunks

    # -- solving, with every plan re-simulated after its last change ----------------------------
    def _finish(self, regions, keep: bool) -> tuple[tuple[tuple[int, int], ...], list[str]]:
        """A solver's regions after what happens to every plan: the model's own regions merged in
        (keep), cuts moved off in-place writes (safe_regions)."""
        regions = list(regions)
        if keep:
            regions = merge_own(self.own_regions, regions)
        notes: list[str] = []
        for _ in range(4):  # until stable: rewrite() runs safe_regions again on what it is given
            safe, moved = safe_regions(self.capture.graph_module, regions)
            notes += moved
            if sorted(safe) == sorted(tuple(r) for r in regions):
                break
            regions = safe
        return normalize_regions(self.problem, safe), notes

    def _floor(self, solver: str, options: dict[str, Any], keep: bool) -> tuple[int, tuple[tuple[int, int], ...]]:
        key = (solver, keep, repr(sorted(options.items())))
        if key not in self._floors:
            # The model's own regions are a plan too: replacing them never needs more memory than keeping them.
            extra = [self.own_regions] if self.own_regions else []
            self._floors[key] = floor_plan(self.problem, solver, options, lambda r: self._finish(r, keep), extra)
        return self._floors[key]

    def _steady(self, solution: Solution, inner: int, solver: str, options: dict[str, Any], keep: bool):
        """The plan an earlier run chose for this graph and budget where the new one does not clearly beat
        it (planner.steady); measured times only: FLOP times repeat by themselves."""
        if self.cost.time_source != "fitted":
            return solution, []
        config = self._settings["profile_config"] or ProfileConfig()
        store = open_store(self.cost.device, config.timing_store)
        return steady(self.problem, solution, inner, plan_key(self.problem, inner, solver, options, keep), store)

    def _solve(
        self, budget: int | None, solver: str, options: dict[str, Any], margin: float, keep: bool
    ) -> tuple[Solution, list[str]]:
        problem = self.problem
        if budget is None:
            solution, notes = solve_unbudgeted(problem, solver, options)
            regions, moved = self._finish(solution.regions, keep)
            return with_regions(problem, solution, regions), notes + moved
        # The model as given (its own regions, moved off in-place writes like any plan) and, when
        # replacing them, the plain step: either fits a budget at or above its peak with no margin.
        given = self._finish(self.own_regions, False)[0] if self.own_regions else ()
        given_peak = simulate(problem, given).peak_bytes
        plain_peak = self.no_checkpoint_peak_bytes
        if plain_peak <= budget and not keep:
            note = f"the step fits the budget without checkpointing (predicted peak {plain_peak / 1e9:.3f} GB): no-op plan"
            return with_regions(problem, solvers.solve(problem, None, "none"), (), budget), [note]
        fixed = problem.fixed_bytes
        inner = inner_budget(budget, fixed, margin)
        floor_peak, floor_regions = self._floor(solver, options, keep)
        self._refuse(budget, solver, options, margin, keep)
        stats = {"planned_for_bytes": inner}
        if floor_peak > inner or (keep and given_peak <= budget):
            note = f"the model as given fits the budget (predicted peak {given_peak / 1e9:.3f} GB): its own checkpointing, unchanged"
            none = solvers.solve(problem, None, "none")
            return with_regions(problem, none, given, budget, {**stats, "as_given": True}), [note]
        target = inner
        for attempt in range(4):  # the measured-time plan, tightened while its last change leaves it over
            try:
                solution = solvers.solve(problem, target, solver, **options)
            except solvers.InfeasibleBudgetError:
                break
            regions, moved = self._finish(solution.regions, keep)
            peak = simulate(problem, regions, saved=kept_saved(regions, solution.saved)).peak_bytes
            if peak <= inner:
                if attempt:
                    moved.append(f"re-solved {attempt}x at a lower internal budget: moved regions had left it over")
                solution = with_regions(problem, solution, regions, budget, {**stats, "tightened": attempt})
                solution, kept = self._steady(solution, inner, solver, options, keep)
                return solution, moved + kept
            target -= peak - inner
            if target <= fixed:
                break
        note = (
            f"the {solver!r} plan on measured times did not fit once its regions were finished: this is the "
            "least-memory plan on FLOP costs"
        )
        floor = Solution(regions=(), solver=solver, peak_bytes=0, recompute_time=0.0, budget_bytes=budget)
        return with_regions(problem, floor, floor_regions, budget, {**stats, "floor_plan": True}), [note]


def _optimize_inexact(model: Any, example_inputs: Any, planner_args: dict[str, Any], plan_args: dict[str, Any],
                      capture_method: str) -> Plan:
    def make(exact: bool) -> Planner:
        method = capture_method if exact else "export"  # the token-wise analysis reads aten ops
        return Planner(model, example_inputs, capture_method=method, exact=exact, **planner_args)

    return plan_inexact(make, plan_args)[0]


def plan_inexact(make: Callable[[bool], Planner], plan_args: dict[str, Any]) -> tuple[Plan, Planner]:
    """optimize(..., exact=False): the exact plan where it fits the budget; else the plan on the graph whose
    token-wise groups run in chunks. `make(exact)` builds the Planner; returns the plan and its planner."""
    planner = make(True)
    try:
        plan = planner.plan(**plan_args)
    except solvers.InfeasibleBudgetError as e:
        exact_error = e
    else:
        plan.stats["exact"] = False
        plan.stats["chunks"] = []
        plan.notes = (*plan.notes, "exact=False: the exact plan fits the budget, so no token-wise work is chunked")
        return plan, planner
    planner = make(False)
    if not planner.chunks:
        raise exact_error
    plan = planner.plan(**plan_args)
    plan.notes = (*plan.notes, f"exact=False: token-wise work is chunked because the exact plan does not fit ({exact_error})")
    return plan, planner


def optimize_compiled(model: Any, example_inputs: Any, planner_args: dict[str, Any], plan_args: dict[str, Any],
                      lowering: str = "best") -> Plan:
    """optimize(..., compile=True): one whole graph planned, compiled, measured and re-planned to fit."""
    from .compile.compiled import LOWERINGS, CompiledPlanner

    if planner_args.get("world_size", 1) != 1:
        raise InputError("compile: sharded plans (world_size > 1) are not measured under torch.compile; "
                         "drop compile=True or plan one rank with world_size=1")
    if lowering not in LOWERINGS:
        raise InputError(f"lowering: {lowering!r} is not one of {', '.join(LOWERINGS)}")
    device = planner_args.get("device")
    if device is not None and torch.device(device).type == "meta":
        raise InputError("compile: a plan made on the meta device cannot be compiled and measured; "
                         "plan on cpu/cuda or drop compile=True")
    try:
        planner = Planner(model, example_inputs, **planner_args)
    except CaptureError as e:
        raise InputError(f"compile: torch.compile(fullgraph=True) needs the whole model as one graph, and it "
                         f"could not be captured ({str(e).splitlines()[0]}); drop compile=True to plan it in parts") from e
    return CompiledPlanner(planner, lowering=lowering).plan(**plan_args)

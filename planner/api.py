"""optimize(): the pipeline in one screen.

    model + inputs -> capture/ (a graph) -> profile/ (bytes and times per node)
                   -> choose/ (solve the budget, check the step, race the best plans) -> lower/ (the module)

`optimize` turns its keywords into typed settings (settings.py) and runs `plan_model`; a `Planner`
captures and profiles once and plans any number of budgets. Whole models that cannot be captured go
to `PartialPlanner`, compiled plans to `CompiledPlanner`: all three answer the same `plan()`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .capture.exported import accept_exported
from .capture.frozen import ValueGuard, frozen_values, stale_note
from .capture.preflight import nothing_to_plan, refuse_grad_mode
from .capture.trace import capture
from .choose.assemble import plan_record
from .choose.autotune import steps_for
from .choose.base import BasePlanner
from .choose.budget import ResolvedBudget, budget_of
from .choose.choice import choose_solution, judges, planning_clock
from .choose.inexact import inexact_setup, plan_inexact
from .choose.partial import PartialPlanner
from .choose.profiled import EVAL_NOTE, Profiled, profiled
from .choose.race.calibration import with_step_times
from .choose.race.rules import WHOLE_MODULES
from .distributed import plan_collectively, planning_is_collective
from .errors import CaptureError, InputError
from .lower.build import lower_plan
from .lower.chunk import ChunkSpec, chunk_capture
from .lower.outputs import loss_outputs
from .model_state import ModelState
from .plan import Plan
from .profile.bytes_pass import profile_for_planning
from .profile.profiler import ProfileConfig
from .progress import logger, progress_enabled, stage
from .settings import PlanRequest, Setup

__all__ = ["optimize", "plan_model", "Planner", "plan_compiled"]


def optimize(
    model: torch.nn.Module | torch.export.ExportedProgram, example_inputs: Any = None, *,
    budget_gb: float | None = None, budget_bytes: int | None = None, solver: str = "auto",
    device: str | torch.device | None = None, optimizer: Any = None, capture_method: str = "auto",
    profile_config: ProfileConfig | None = None, solver_options: Mapping[str, Any] | None = None,
    activation_budget: float | None = None, world_size: int = 1, sharding: str | None = None,
    safety_margin: float = 0.02, own_checkpointing: str = "replace", on_larger_shape: str = "error",
    partial: bool = True, compile: bool = False, lowering: str = "best", check_step: bool = True, exact: bool = True,
    autotune: bool | int | None = None, progress: bool = False, exact_check: bool | None = None,
    outputs: str = "all", host_budget_gb: float | None = None, offload_bandwidth: tuple[float, ...] | None = None,
) -> Plan:
    """Plan activation checkpointing for one training step of `model` within a memory budget.

    model: an nn.Module, a torch.export ExportedProgram or its `.module()`. example_inputs: a tuple of
    positional args, a dict of kwargs, or one tensor (default: `model.example_input_array`, or an
    ExportedProgram's own). The budget is the peak memory of one forward + backward: parameters,
    gradients, activations, temporaries, plus optimizer state when `optimizer` names one; with none, the
    plan is the fastest that saves memory down to the knee of the trade-off curve. An infeasible budget
    raises InfeasibleBudgetError naming the smallest feasible one (a call at exactly that budget succeeds).

    Each keyword fills one typed setting, documented field by field in planner/settings.py:
    `Budget` (budget_gb, budget_bytes, activation_budget, safety_margin), `SolveConfig` (solver,
    solver_options, own_checkpointing), `PlanRequest` (on_larger_shape, autotune), `Setup` (device,
    optimizer, capture_method, profile_config, partial, outputs), `ExactnessConfig` (exact, check_step),
    `DistributedConfig` (world_size, sharding), `CompileConfig` (compile, lowering) and `OffloadConfig`
    (host_budget_gb; offload_bandwidth, for simulation and testing).
    `exact_check` is check_step's former name, kept as an alias. progress=True shows each stage on stderr.
    outputs="loss": plan.module returns the model's output with `loss` alone set (its logits and every other
    field None), so the logits are not kept for the backward; refused when the model computes no loss.

    Called under torch.no_grad() or inference_mode() it raises UnplannableError (no training step to plan).
    Under torch.distributed, rank 0 plans and broadcasts (distributed.py). The model is left as it was found.
    """
    setup = Setup.of(
        device=device, optimizer=optimizer, capture_method=capture_method, profile_config=profile_config,
        partial=partial, exact=exact, check_step=check_step, world_size=world_size, sharding=sharding,
        compile=compile, lowering=lowering, outputs=outputs, host_budget_gb=host_budget_gb,
        offload_bandwidth=offload_bandwidth, exact_check=exact_check,
    )
    request = PlanRequest.of(
        budget_gb=budget_gb, budget_bytes=budget_bytes, activation_budget=activation_budget, solver=solver,
        solver_options=solver_options, safety_margin=safety_margin, on_larger_shape=on_larger_shape,
        own_checkpointing=own_checkpointing, autotune=autotune,
    )
    with progress_enabled(progress):
        return plan_model(model, example_inputs, setup, request)


def plan_model(model: Any, example_inputs: Any, setup: Setup, request: PlanRequest) -> Plan:
    """capture -> profile -> choose -> lower, for one model and one request."""
    if planning_is_collective():  # torch.distributed: rank 0 plans, every rank runs its plan
        return plan_collectively(lambda: plan_model(model, example_inputs, setup, request), Plan.from_dict,
                                 model, example_inputs, request.on_larger_shape)
    if not setup.exactness.exact:
        return plan_inexact(lambda exact: Planner(model, example_inputs, setup=inexact_setup(setup, exact)), request,
                            lambda: plan_model(model, example_inputs, inexact_setup(setup, True), request))[0]
    if setup.compile.enabled:
        return plan_compiled(model, example_inputs, setup, request)
    try:
        planner = Planner(model, example_inputs, setup=setup, feasible_for=request if request.budget.given else None)
    except CaptureError as e:
        if not setup.partial or setup.distributed.world_size != 1 or setup.meta:
            raise
        return _plan_in_parts(model, example_inputs, setup, request, reason=str(e))
    return planner.plan_for(request)


class Planner(BasePlanner):
    """Capture and profile a model once, then plan it for any number of budgets.

        planner = Planner(model, example_inputs)
        plans = [planner.plan(activation_budget=f) for f in (0.25, 0.5, 0.75)]

    `setup`, or `optimize()`'s keywords that make one (device, optimizer, capture_method, profile_config,
    world_size, sharding, check_step, exact). `feasible_for`: a request (or `plan()` keywords) whose budget
    is refused from a bytes-only pass, before any timing, when no plan can meet it.
    """

    def __init__(self, model: Any, example_inputs: Any = None, *, setup: Setup | None = None,
                 feasible_for: PlanRequest | Mapping[str, Any] | None = None, **keywords: Any) -> None:
        setup = setup or Setup.of(**keywords)
        if isinstance(feasible_for, Mapping):
            feasible_for = PlanRequest.of(**feasible_for)
        started = time.perf_counter()
        refuse_grad_mode()
        model, example_inputs, exported = accept_exported(model, example_inputs)
        if setup.outputs == "loss":  # the loss alone (lower/outputs.py)
            model = loss_outputs(model, example_inputs)
        if exported and setup.capture_method == "auto":
            setup = dataclasses.replace(setup, capture_method="export")
        profile_config = ProfileConfig.or_default(setup.profile)
        setup = dataclasses.replace(setup, profile=dataclasses.replace(profile_config, meta=True) if setup.meta else profile_config)
        self.model, self.setup = model, setup
        self.autotune: bool | int | None = None
        """`plan(autotune=None)` takes this (None: on where times are on the clock); compiled plans set False."""
        notes: list[str] = []
        with ModelState(model).preserved():
            if not model.training:  # plan the step a training loop takes (verify() and plan.module run train mode)
                model.train()
                notes.append(EVAL_NOTE)
            with stage("capture", f"{type(model).__name__}, method {setup.capture_method}"):
                cap = capture(model, example_inputs, method=setup.capture_method)
            chunks: list[ChunkSpec] = []
            if not setup.exactness.exact:  # token-wise groups run in chunks (lower/chunk.py)
                cap, chunks = chunk_capture(cap)
            logger.info("capture: %s, %d graph nodes", cap.method, len(cap.graph_module.graph.nodes))
            check, fits = judges(model, cap, setup, chunks, notes, feasible_for)  # on bytes, before any timing
            cost = profile_for_planning(model, cap, setup.profile, check, fits, with_step_times)  # calibrated on a lowered step
        values = ValueGuard(frozen_values(model, cap.graph_module, cap.method))
        notes += ([values.note()] if values.values else []) + stale_note(cap.graph_module)
        self.profiled: Profiled = profiled(model, cap, cost, setup, chunks=chunks, capture_notes=notes)
        self.profiled.values = values
        self.prepared_s = time.perf_counter() - started
        """Seconds the capture and the profile took: part of the planning the default race is held to."""

    def plan_for(self, request: PlanRequest, budget: ResolvedBudget | None = None) -> Plan:
        """Solve one budget, check the plan's step against the model's, race the best plans, lower it.
        `budget`: the request's budget already resolved for this planner's profile (`budget_of`)."""
        p, clock = self.profiled, planning_clock(self.prepared_s)
        empty = nothing_to_plan(p.model, p.capture.graph_module, p.cost.total_saved_bytes)
        if empty is not None:  # frozen, or no tensor output: no budget could be "infeasible" here
            raise empty
        steps = steps_for(self.autotune if request.autotune is None else request.autotune, p.cost.time_source == "fitted")
        budget = budget or budget_of(p, request)  # resolved once: every step of choosing reads this record
        default_race = request.autotune is None and self.autotune is None  # held to the planning's time
        solution, notes = choose_solution(p, request, budget, steps=steps, planning_s=clock if default_race else None)
        plan = plan_record(p, solution, notes, request, list(budget.notes))
        lower_plan(plan, p.model, p.capture, chunked=bool(p.chunks), whole_modules=solution.stats.get(WHOLE_MODULES),
                   on_larger_shape=request.on_larger_shape, replan=self._replan(request), values=p.values)
        return plan

    def _replan(self, request: PlanRequest) -> Callable[[tuple, dict[str, Any]], torch.nn.Module]:
        """The plan's module planned again at another shape (on_larger_shape='replan')."""
        model, setup, again = self.model, self.setup, request.replace(on_larger_shape="error", autotune=None)

        def replan(args: tuple, kwargs: dict[str, Any]) -> torch.nn.Module:
            return Planner(model, _call_inputs(args, kwargs), setup=setup).plan_for(again).module

        return replan

    # What a Planner's users read (the benchmarks, the CLI, CompiledPlanner): the profile's figures.
    capture = property(lambda self: self.profiled.capture)
    cost = property(lambda self: self.profiled.cost)
    problem = property(lambda self: self.profiled.problem)
    own_regions = property(lambda self: self.profiled.own_regions)
    chunks = property(lambda self: self.profiled.chunks)
    sharding = property(lambda self: self.setup.distributed.sharding)
    baseline_peak_bytes = property(lambda self: self.profiled.baseline_peak_bytes)
    no_checkpoint_peak_bytes = property(lambda self: self.profiled.no_checkpoint_peak_bytes)


def _call_inputs(args: tuple, kwargs: dict[str, Any]) -> Any:
    if args and kwargs:
        raise InputError("inputs: a call with both positional and keyword tensors cannot be re-planned")
    return dict(kwargs) if kwargs else tuple(args)


def _plan_in_parts(model: Any, example_inputs: Any, setup: Setup, request: PlanRequest, *, reason: str) -> Plan:
    """A model the capture cannot take whole: its largest capturable submodules (choose/partial.py)."""
    def replan(args: tuple, kwargs: dict[str, Any], again: PlanRequest) -> torch.nn.Module:
        return plan_model(model, _call_inputs(args, kwargs), setup, again).module

    if setup.outputs == "loss" and isinstance(model, torch.nn.Module):  # the loss alone, as Planner plans it
        model = loss_outputs(model, example_inputs)
    with ModelState(model).preserved():
        part = PartialPlanner(model, example_inputs, setup=setup, reason=reason, replan=replan)
    return part.plan_for(request)


def plan_compiled(model: Any, example_inputs: Any, setup: Setup, request: PlanRequest) -> Plan:
    """optimize(..., compile=True): one whole graph planned, compiled, measured and re-planned to fit."""
    from .compile.compiled import CompiledPlanner  # loads inductor's pieces only when asked for

    try:
        planner = Planner(model, example_inputs, setup=setup)
    except CaptureError as e:
        raise InputError(f"compile: torch.compile(fullgraph=True) needs the whole model as one graph, and it "
                         f"could not be captured ({str(e).splitlines()[0]}); drop compile=True to plan it in parts") from e
    return CompiledPlanner(planner, lowering=setup.compile.lowering).plan_for(request.replace(autotune=None))

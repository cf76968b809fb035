"""Plans for the stages of a `torch.distributed.pipelining` pipeline, each within the per-GPU budget.

    stages = [PipelineStage(sp.module, s, p, device) for s, sp in enumerate(pipeline.stages)]

`plan_stage` plans one stage (stage.py says how its peak is counted); `plan_pipeline` plans every stage
from the first stage's microbatch, each stage's inputs being the previous one's outputs, and reports
the predicted step of the whole pipeline against per-layer checkpointing on every stage. Under
torch.distributed, `plan_pipeline` is collective: rank 0 plans every stage and broadcasts the plans,
each rank rebuilds its own stage's plan on its module.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..api import Planner
from ..distributed import _INSIDE
from ..errors import InputError, PlanMismatchError
from ..plan import Plan
from ..profile.memory import LiveMemory
from ..settings import PlanRequest
from .schedule import pipeline_step_s
from .stage import (
    StageFigures,
    StageSpec,
    chosen_solver,
    layer_subsets,
    per_layer_regions,
    search_inner_budget,
    stage_figures,
)

__all__ = ["StagePlan", "PipelinePlan", "plan_stage", "plan_pipeline", "check_stage_plan"]


@dataclass
class StagePlan:
    """One stage's plan and its figures under the schedule, beside per-layer checkpointing's."""

    spec: StageSpec
    plan: Plan
    figures: StageFigures
    budget_bytes: int
    inner_budget_bytes: int
    forward_s: float
    backward_s: float
    """One microbatch's backward under the plan, recompute included (seconds)."""
    per_layer: StageFigures | None = None
    per_layer_backward_s: float = 0.0

    @property
    def module(self) -> torch.nn.Module:
        return self.plan.module


@dataclass
class PipelinePlan:
    stages: list[StagePlan]
    schedule: type
    n_microbatches: int
    step_s: float = 0.0
    per_layer_step_s: float = 0.0
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        rows = [f"{self.schedule.__name__}, {len(self.stages)} stages, {self.n_microbatches} microbatches",
                "stage  in-flight  budget MB  planned peak MB  recompute ms  per-layer peak MB  per-layer recompute ms"]
        for sp in self.stages:
            pl = sp.per_layer
            rows.append(f"{sp.spec.stage:5d}  {sp.figures.in_flight:9d}  {sp.budget_bytes / 1e6:9.2f}  "
                        f"{sp.figures.peak_bytes / 1e6:15.2f}  {sp.figures.recompute_s * 1e3:12.3f}  "
                        + (f"{pl.peak_bytes / 1e6:17.2f}  {pl.recompute_s * 1e3:22.3f}" if pl else "-"))
        if self.per_layer_step_s:
            rows.append(f"predicted step: {self.step_s * 1e3:.2f} ms planned, {self.per_layer_step_s * 1e3:.2f} ms "
                        f"per-layer ({self.per_layer_step_s / self.step_s:.2f}x)")
        return "\n".join(rows + self.notes)


def _nbytes(tree: Any) -> int:
    """Bytes of the tensors in `tree` as the stage sends or receives them: a microbatch sliced from a batch
    (a view of its storage) counts its own elements, as the receive buffer made for it does."""
    return sum(t.numel() * t.element_size() for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor))


def measure_loss(loss_fn: Any, output: Any, target: Any) -> tuple[int, int]:
    """The most bytes `loss_fn(output, target)` and its backward hold at once beyond `output` and `target`
    (live tensors, `LiveMemory`), the gradient of `output` included, and the bytes it leaves alive once
    its backward is done, that gradient excluded (the loss, which the schedule keeps): the loss is the
    schedule's, outside the stage's module and its plan."""
    out = pytree.tree_map(lambda t: t.detach().requires_grad_(t.is_floating_point()) if isinstance(t, torch.Tensor) else t, output)
    meter = LiveMemory()
    with meter:
        loss = loss_fn(out, target)
        loss.backward()
    grads = _nbytes([t.grad for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.grad is not None])
    kept = max(0, meter.current - grads)
    del loss
    return meter.peak, kept


def _as_tuple(inputs: Any) -> tuple:
    return inputs if isinstance(inputs, tuple) else (inputs,)


def plan_stage(module: torch.nn.Module, example_inputs: Any, *, schedule: type, n_microbatches: int, stage: int,
               n_stages: int, budget_bytes: int, loss_fn: Any = None, target: Any = None, solver: str = "auto",
               solver_options: dict[str, Any] | None = None, per_layer: str | None = None, **setup: Any) -> StagePlan:
    """Plan `module`, stage `stage` of `n_stages`, for one microbatch `example_inputs`, so that the stage's
    peak over a step of `schedule` with `n_microbatches` stays within `budget_bytes`.

    `loss_fn`, `target`: the schedule's loss and one microbatch's target (the last stage's loss step and
    targets count in its memory). `per_layer`: the module path whose children are the layers (e.g. 'blocks') for the per-layer
    checkpointing figures beside the plan's. `setup`: Planner keywords (profile_config, optimizer, ...)."""
    if budget_bytes is None or budget_bytes <= 0:
        raise InputError(f"budget_bytes: {budget_bytes} is not a positive number of bytes")
    inputs = _as_tuple(example_inputs)
    token = _INSIDE.set(True)  # one stage planned alone: the stages differ, so no rank plans "for all"
    try:
        with torch.no_grad():
            output = module(*inputs)
        loss_peak, loss_kept = (measure_loss(loss_fn, output, target) if loss_fn is not None and
                                stage == n_stages - 1 else (0, 0))
        spec = StageSpec(stage, n_stages, schedule, n_microbatches, _nbytes(inputs), _nbytes(output),
                         n_microbatches * _nbytes(target), loss_peak, loss_kept)
        planner = Planner(module, inputs, **setup)
        problem = planner.problem
        candidates = layer_subsets(per_layer_regions(problem, per_layer)) if per_layer else ()
        inner, chosen, _ = search_inner_budget(problem, spec, budget_bytes, solver, solver_options, candidates=candidates)
        # the chosen plan lowered as it is (solver 'pipeline_stage'), at the single-microbatch peak it has
        with chosen_solver():
            request = PlanRequest.of(budget_bytes=chosen.peak_bytes, solver="pipeline_stage", safety_margin=0.0,
                                     solver_options={"regions": [list(r) for r in chosen.regions],
                                                     "saved": list(chosen.saved)}, autotune=False)
            plan = planner.plan_for(request)
        figs = stage_figures(plan.problem, spec, plan.spans(), plan.saved_indices())
        if figs.peak_bytes > budget_bytes:
            raise InputError(f"budget: stage {stage}'s lowered plan peaks at {figs.peak_bytes} bytes, over {budget_bytes}")
    finally:
        _INSIDE.reset(token)
    plan.stats["pipeline"] = {"stage": stage, "n_stages": n_stages, "schedule": schedule.__name__,
                              "n_microbatches": n_microbatches, "in_flight": figs.in_flight,
                              "stage_peak_bytes": figs.peak_bytes, "stage_budget_bytes": budget_bytes}
    forward_s = problem.total_time
    backward_s = problem.base_step_s - forward_s
    result = StagePlan(spec, plan, figs, budget_bytes, inner, forward_s, backward_s + figs.recompute_s)
    if per_layer:
        regions = per_layer_regions(problem, per_layer)
        result.per_layer = stage_figures(problem, spec, regions)
        result.per_layer_backward_s = backward_s + result.per_layer.recompute_s
    return result


def check_stage_plan(plan: Plan, *, stage: int, schedule: type, n_microbatches: int) -> Plan:
    """`plan` when it was made for this stage, schedule and microbatch count; PlanMismatchError otherwise."""
    made = plan.stats.get("pipeline")
    if not isinstance(made, dict):
        raise PlanMismatchError("plan: not made for a pipeline stage (no stats.pipeline); plan it with plan_stage")
    want = {"stage": stage, "schedule": schedule.__name__, "n_microbatches": n_microbatches}
    for key, value in want.items():
        if made.get(key) != value:
            raise PlanMismatchError(f"plan: made for {key} {made.get(key)!r}, loaded for {key} {value!r}")
    return plan


def plan_pipeline(stages: list[torch.nn.Module], example_inputs: Any, *, schedule: type, n_microbatches: int,
                  budget_bytes: int | list[int], loss_fn: Any = None, target: Any = None, per_layer: str | None = None,
                  **keywords: Any) -> PipelinePlan:
    """Plan every stage of a pipeline for one per-GPU budget (or one per stage).

    `example_inputs`: one microbatch of the first stage; each later stage is planned on the outputs of
    the one before. Under torch.distributed (one stage per rank) rank 0 plans every stage and
    broadcasts; each rank's StagePlan then carries its own stage's module, the others' plans as records."""
    p = len(stages)
    budgets = list(budget_bytes) if isinstance(budget_bytes, (list, tuple)) else [budget_bytes] * p
    if len(budgets) != p:
        raise InputError(f"budget_bytes: {len(budgets)} budgets for {p} stages")
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized() and \
        torch.distributed.get_world_size() > 1
    rank = torch.distributed.get_rank() if distributed else 0
    inputs = [_as_tuple(example_inputs)]
    with torch.no_grad():
        for module in stages[:-1]:
            inputs.append(_as_tuple(module(*inputs[-1])))
    inputs = [tuple(t.detach().requires_grad_(t.is_floating_point() and s > 0) if isinstance(t, torch.Tensor) else t
                    for t in xs) for s, xs in enumerate(inputs)]
    box: list[Any] = [None]
    result = None
    if rank == 0:
        plans = [plan_stage(m, inputs[s], schedule=schedule, n_microbatches=n_microbatches, stage=s, n_stages=p,
                            budget_bytes=budgets[s], loss_fn=loss_fn, target=target, per_layer=per_layer, **keywords)
                 for s, m in enumerate(stages)]
        result = PipelinePlan(plans, schedule, n_microbatches)
        result.step_s = pipeline_step_s(schedule, n_microbatches, [sp.forward_s for sp in plans],
                                        [sp.backward_s for sp in plans])
        if per_layer:
            result.per_layer_step_s = pipeline_step_s(schedule, n_microbatches, [sp.forward_s for sp in plans],
                                                      [sp.per_layer_backward_s for sp in plans])
        box[0] = json.dumps([sp.plan.to_dict() for sp in plans])
    if not distributed:
        return result
    torch.distributed.broadcast_object_list(box, src=0)
    refused = None
    if rank != 0:  # this rank's stage: its plan rebuilt on its own module; the figures stay rank 0's
        token = _INSIDE.set(True)  # the verdicts are gathered below: a rank refusing alone would hang the rest
        try:
            mine = Plan.from_dict(json.loads(box[0])[rank], "the pipeline plan rank 0 broadcast")
            check_stage_plan(mine, stage=rank, schedule=schedule, n_microbatches=n_microbatches)
            mine.rebuild(stages[rank], inputs[rank], check_step=False)
            result = _record_only(json.loads(box[0]), stages, schedule, n_microbatches, rank, mine)
        except Exception as e:  # noqa: BLE001 - raised on every rank below
            refused = f"rank {rank}: {type(e).__name__}: {e}"
        finally:
            _INSIDE.reset(token)
    verdicts: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(verdicts, refused)
    bad = [v for v in verdicts if v]
    if bad:
        raise PlanMismatchError(f"the stage plans rank 0 made do not fit every rank's stage: {'; '.join(bad)}")
    return result


def _record_only(dicts: list[dict], stages: list, schedule: type, n_microbatches: int, rank: int, mine: Plan) -> PipelinePlan:
    """The pipeline plan as a rank other than 0 knows it: its own stage's plan built, every stage's figures."""
    plans = []
    for s, d in enumerate(dicts):
        plan = mine if s == rank else Plan.from_dict(d, "the pipeline plan rank 0 broadcast")
        made = plan.stats["pipeline"]
        figs = StageFigures(made["stage_peak_bytes"], made["in_flight"], 0, 0, 0, plan.predicted_recompute_s)
        spec = StageSpec(s, len(stages), schedule, n_microbatches, 0, 0)
        plans.append(StagePlan(spec, plan, figs, made["stage_budget_bytes"], 0, 0.0, 0.0))
    return PipelinePlan(plans, schedule, n_microbatches)

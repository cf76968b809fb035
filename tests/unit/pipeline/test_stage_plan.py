"""A stage planned for its schedule: the in-flight microbatches' saved bytes count, and the plan file
records the stage, the schedule and the microbatch count."""

import pytest
import torch
from ckpt_planner import Plan, PlanMismatchError, ProfileConfig
from ckpt_planner.pipeline import check_stage_plan, plan_stage, stage_figures
from ckpt_planner.pipeline.stage import layer_subsets, per_layer_regions
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

from benchmarks.pipeline import llama_stages

FAST = ProfileConfig(warmup=0, repeats=1, flop_times=True)  # deterministic costs


@pytest.fixture(scope="module")
def first_stage():
    stages, batch, _ = llama_stages(4, d=16, hidden=32, batch=8, seq=8)
    return plan_stage(stages[0], (batch[:2],), schedule=Schedule1F1B, n_microbatches=8, stage=0, n_stages=4,
                      budget_bytes=1 << 30, per_layer="blocks", profile_config=FAST, check_step=False, solver="greedy")


def test_each_microbatch_in_flight_adds_what_its_forward_leaves_saved(first_stage):
    problem, spec = first_stage.plan.problem, first_stage.spec
    one = stage_figures(problem, spec)  # 1F1B, stage 0 of 4: four in flight
    gpipe = stage_figures(problem, type(spec)(**{**spec.__dict__, "schedule": ScheduleGPipe}))  # all eight
    assert one.in_flight == 4 and gpipe.in_flight == 8
    assert one.held_bytes > 0
    assert gpipe.peak_bytes - one.peak_bytes == 4 * one.held_bytes
    # per-layer checkpointing leaves only the blocks' inputs saved: less held per microbatch
    assert first_stage.per_layer.held_bytes < one.held_bytes


def test_plan_file_records_its_stage_and_refuses_another(first_stage, tmp_path):
    first_stage.plan.save(tmp_path / "stage0.json")
    loaded = Plan.load(tmp_path / "stage0.json")
    assert loaded.stats["pipeline"]["stage"] == 0 and loaded.stats["pipeline"]["schedule"] == "Schedule1F1B"
    assert check_stage_plan(loaded, stage=0, schedule=Schedule1F1B, n_microbatches=8) is loaded
    with pytest.raises(PlanMismatchError, match="made for stage 0, loaded for stage 1"):
        check_stage_plan(loaded, stage=1, schedule=Schedule1F1B, n_microbatches=8)
    with pytest.raises(PlanMismatchError, match="made for schedule 'Schedule1F1B', loaded for schedule 'ScheduleGPipe'"):
        check_stage_plan(loaded, stage=0, schedule=ScheduleGPipe, n_microbatches=8)


def test_a_tighter_budget_recomputes_on_the_stage_that_holds_more():
    stages, batch, _ = llama_stages(4, d=16, hidden=32, batch=8, seq=8)
    x = batch[:2]
    with torch.no_grad():
        x3 = stages[2](stages[1](stages[0](x)))
    kw = dict(schedule=Schedule1F1B, n_microbatches=8, n_stages=4, profile_config=FAST, check_step=False, solver="greedy")
    free = plan_stage(stages[0], (x,), stage=0, budget_bytes=1 << 30, **kw)
    budget = free.figures.peak_bytes - free.figures.held_bytes  # one in-flight microbatch's saved bytes short
    tight = plan_stage(stages[0], (x,), stage=0, budget_bytes=budget, **kw)
    assert tight.figures.peak_bytes <= budget and tight.figures.recompute_s > 0
    last = plan_stage(stages[3], (x3.requires_grad_(),), stage=3, budget_bytes=budget, **kw)
    assert last.figures.in_flight == 1 and last.figures.recompute_s == 0


def test_a_stage_keeps_inside_its_checkpointed_layers_what_its_budget_has_room_for():
    # stage 0 holds four microbatches: checkpointing whole layers throws room away, a solver's plan cut for
    # one microbatch's peak leaves too much saved per microbatch; keeping the costliest nodes per byte
    # inside the checkpointed layers fills the room
    stages, batch, _ = llama_stages(4, d=16, hidden=32, batch=8, seq=8)
    kw = dict(schedule=Schedule1F1B, n_microbatches=8, stage=0, n_stages=4, profile_config=FAST, check_step=False,
              solver="greedy")
    free = plan_stage(stages[0], (batch[:2],), budget_bytes=1 << 30, per_layer="blocks", **kw)
    layer, none = free.per_layer.peak_bytes, free.figures.peak_bytes
    budget = (layer + none) // 2
    solver_only = plan_stage(stages[0], (batch[:2],), budget_bytes=budget, **kw)
    planned = plan_stage(stages[0], (batch[:2],), budget_bytes=budget, per_layer="blocks", **kw)
    problem, spec = planned.plan.problem, planned.spec
    subsets = [stage_figures(problem, spec, r) for r in layer_subsets(per_layer_regions(problem, "blocks"))]
    best_subset = min(f.recompute_s for f in subsets if f.peak_bytes <= budget)
    assert planned.plan.saved_indices() and planned.figures.peak_bytes <= budget
    assert planned.figures.recompute_s < min(best_subset, solver_only.figures.recompute_s)
    # the lowered plan keeps what the search kept: its own figures, re-simulated, are the same
    again = stage_figures(problem, spec, planned.plan.spans(), planned.plan.saved_indices())
    assert again.peak_bytes == planned.figures.peak_bytes and again.recompute_s == planned.figures.recompute_s



def test_a_probes_regions_are_filled_with_what_the_stage_has_room_to_keep(monkeypatch):
    # no per-layer candidates: the search judges dp's probes and uniform's plans, each cut for one
    # microbatch's peak; stage 0 holds four microbatches, and the room they leave is filled inside each
    # probe's regions
    import ckpt_planner.pipeline.stage as stage

    stages, batch, _ = llama_stages(4, d=16, hidden=32, batch=8, seq=8)
    kw = dict(schedule=Schedule1F1B, n_microbatches=8, stage=0, n_stages=4, profile_config=FAST, check_step=False,
              solver="dp")
    free = plan_stage(stages[0], (batch[:2],), budget_bytes=1 << 30, per_layer="blocks", **kw)
    budget = (free.per_layer.peak_bytes + free.figures.peak_bytes) // 2
    planned = plan_stage(stages[0], (batch[:2],), budget_bytes=budget, **kw)
    monkeypatch.setattr(stage, "fill_kept", lambda *a, **k: None)  # the probes as solved, nothing filled
    solved = plan_stage(stages[0], (batch[:2],), budget_bytes=budget, **kw)
    assert planned.figures.peak_bytes <= budget and solved.figures.peak_bytes <= budget
    assert planned.figures.recompute_s < solved.figures.recompute_s
    # the lowered plan keeps what the search kept
    again = stage_figures(planned.plan.problem, planned.spec, planned.plan.spans(), planned.plan.saved_indices())
    assert again.recompute_s == planned.figures.recompute_s

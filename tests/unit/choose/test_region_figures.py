"""A plan's figures tell one story: the recompute of its regions adds up to the plan's total, priced on
the same node times (refit included) and without the ops a selective region keeps."""

import dataclasses

import pytest
import torch
import torch.nn as nn
from ckpt_planner.api import Planner
from ckpt_planner.profile.profiler import ProfileConfig

FLOPS = ProfileConfig(warmup=0, repeats=1, flop_times=True)


def _model() -> tuple[nn.Module, tuple]:
    torch.manual_seed(0)
    model = nn.Sequential(*(m for _ in range(6) for m in (nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))))
    return model, (torch.randn(512, 64),)


@pytest.mark.parametrize("solver, fraction", [("uniform", 0.5), ("dp", 0.5), ("greedy", 0.7)])
def test_region_recompute_adds_up_to_the_plans(solver, fraction):
    model, inputs = _model()
    planner = Planner(model, inputs, profile_config=FLOPS)
    plan = planner.plan(solver=solver, activation_budget=fraction)
    assert plan.regions and all(r.depth == 0 for r in plan.regions)
    assert sum(r.recompute_s for r in plan.regions) == pytest.approx(plan.predicted_recompute_s, rel=1e-9)


def test_region_recompute_is_priced_on_the_problems_times():
    model, inputs = _model()
    planner = Planner(model, inputs, profile_config=FLOPS)
    p = planner.profiled
    slower = tuple(dataclasses.replace(n, time=3 * n.time) for n in p.problem.nodes)
    p.narrowed(dataclasses.replace(p.problem, nodes=slower))  # the problem's times, not the profile's
    plan = planner.plan(solver="uniform", activation_budget=0.5)
    assert sum(r.recompute_s for r in plan.regions) == pytest.approx(plan.predicted_recompute_s, rel=1e-9)


def test_autotune_rows_name_the_step_their_percentages_are_of():
    """The summary's step-time row is against eager; the race's rows are against the captured graph's own
    step: each says which, so +15.6 % and +11.6 % for one plan are not read as a contradiction."""
    from ckpt_planner.plan_summary import autotune_rows

    stats = {"autotune": {"chosen": "dp", "steps": 12, "rounds": 3, "band": 0.05, "graph_step_s": 0.2, "candidates": [
        {"label": "dp", "chosen": True, "predicted_extra_s": 0.02, "measured_extra_s": 0.03,
         "predicted_peak_bytes": 10**6, "measured_peak_bytes": 10**6, "fits": True}]}}
    rows = autotune_rows(stats)
    assert "captured graph's step without checkpointing, measured at 200.0 ms" in rows[0][1]
    assert "predicted +10.0 %" in rows[1][1] and "measured +15.0 %" in rows[1][1]

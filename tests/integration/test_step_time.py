"""The step-time benchmark (benchmarks/step_time.py): a plan's regions found again by node name in another profile
of the same graph, the overhead figure computed as the Plan computes its own, and (slow) one held-out model run
end to end in a forked process as the benchmark runs it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn

step_time = pytest.importorskip("benchmarks.step_time")


def _mlp():
    torch.manual_seed(0)
    layers = []
    for _ in range(6):
        layers += [nn.Linear(32, 32), nn.GELU()]
    return nn.Sequential(*layers), torch.randn(64, 32)


@pytest.fixture(scope="module")
def planned():
    from ckpt_planner.api import Planner
    from ckpt_planner.profile.profiler import ProfileConfig
    from ckpt_planner.solvers.registry import InfeasibleBudgetError

    model, x = _mlp()
    planner = Planner(model, x, profile_config=ProfileConfig(warmup=0, repeats=1, flop_times=True))
    try:
        plan = planner.plan(activation_budget=0.4, autotune=False)
    except InfeasibleBudgetError as e:  # as the matrix does: at the smallest budget named
        plan = planner.plan(budget_bytes=e.smallest_bytes, autotune=False)
    assert plan.regions  # a plan with something to find again
    return planner, plan


def test_regions_are_found_by_name_and_the_overhead_is_the_plans_own(planned):
    planner, plan = planned
    names = [n.name for n in planner.cost.nodes]
    spans, saved = step_time.plan_on(planner.problem, names, plan)
    assert spans == plan.spans() and saved == sorted(plan.saved_indices())
    pred = step_time.predicted(planner.problem, spans, saved)
    assert pred["overhead"] == pytest.approx(plan.predicted_overhead, rel=1e-12)
    # the parts add up to the whole: graph, recompute, calls and hooks over the eager step
    assert pred["graph"] + pred["recompute"] + pred["calls"] + pred["hooks"] == pytest.approx(pred["overhead"])
    assert len(pred["regions"]) == len(plan.regions)


def test_a_region_not_in_the_other_graph_is_an_error(planned):
    planner, plan = planned
    names = [n.name for n in planner.cost.nodes]
    first = plan.regions[0]
    renamed = [("other" if n == first.first_node else n) for n in names]
    with pytest.raises(LookupError, match=first.first_node):
        step_time.plan_on(planner.problem, renamed, plan)
    shifted = dataclasses.replace(plan, regions=(dataclasses.replace(first, end=first.end + 1),))
    with pytest.raises(LookupError):  # the same names, another number of nodes between them
        step_time.plan_on(planner.problem, names, shifted)


def test_ratios_leave_out_overheads_too_small_to_compare():
    assert step_time.ratio(0.3, 0.6) == pytest.approx(0.5)
    assert step_time.ratio(0.3, 0.01) is None and step_time.ratio(None, 0.5) is None
    rows = [{"flop_over_cpu": 0.5, "default_over_cpu": 1.2, "flop_over_wall": None, "default_over_wall": 0.6},
            {"error": "timed out"}]
    s = step_time.summary(rows)
    assert s["flop_cpu"] == {"measured": 1, "within": 0, "median_ratio": 0.5}
    assert s["default_cpu"]["within"] == 1 and s["default_wall"]["within"] == 0 and s["flop_wall"]["measured"] == 0


@pytest.mark.slow  # one held-out model planned, profiled and measured: about half a minute on 2 cores
def test_one_held_out_model_end_to_end():
    row = step_time.run_one("tv_vgg", repeats=1, timeout=240, store=None)
    assert "error" not in row, row.get("error")
    assert row["regions"] > 0 and row["time_source"] == "fitted"
    for key in ("flop", "default", "measured_cpu", "measured_wall", "measured_graph_cpu"):
        assert isinstance(row[key], float)
    assert row["default_parts"]["eager_step_s"] > 0


def test_the_region_fit_recovers_a_fixed_cost_per_region():
    regions = [{"recompute_s": rc, "call_s": c, "hook_s": 0.0, "measured_cpu_s": 0.5 * rc + 2 * c + 7e-4}
               for rc, c in ((1e-3, 1e-4), (2e-3, 2e-4), (5e-4, 3e-4), (3e-3, 1e-4), (1e-4, 5e-4))]
    fit = step_time.region_fit([{"default_parts": {"regions": regions}}, {"error": "timed out"}])
    assert fit["regions"] == 5
    assert fit["recompute"] == pytest.approx(0.5) and fit["calls_hooks"] == pytest.approx(2.0)
    assert fit["per_region_s"] == pytest.approx(7e-4)
    assert step_time.region_fit([{"default_parts": {"regions": regions[:2]}}]) is None  # too few to fit three terms

"""No plan is returned whose own prediction is over its budget, whichever solver or race candidate made it:
the plan is re-simulated at one gate (`choose/choice.py` `held_to_budget`), and the race admits no candidate
predicted over the budget, even one inside the safety margin that would measure within it.

Costs are deterministic (hand-made problems; node times from FLOPs), measurements injected."""

from __future__ import annotations

import dataclasses

import pytest
from ckpt_planner import api
from ckpt_planner.choose import autotune as at
from ckpt_planner.choose import choice
from ckpt_planner.choose.race import rules
from ckpt_planner.errors import PlannerError
from ckpt_planner.profile.profiler import ProfileConfig
from ckpt_planner.profile.timing_store import TimingStore
from ckpt_planner.solvers import simulate, solve

from tests.models.small import mlp
from tests.unit.choose.test_autotune import blocks_problem

FLOPS = ProfileConfig(warmup=0, repeats=1, flop_times=True)  # deterministic costs


def _dp_over_budget_within_margin():
    """(problem, budget, inner, the dp plan at budget + margin) where that plan is predicted over the budget."""
    problem = blocks_problem(layers=6)
    fixed, base = problem.fixed_bytes, simulate(problem, ()).peak_bytes
    for f in range(20, 95):
        budget = fixed + (base - fixed) * f // 100
        inner = budget - (budget - fixed) // 10  # a margin of 10 % of the activations
        wide = solve(problem, budget + (budget - inner), "dp")  # what dp makes for the margin over the budget
        if wide.peak_bytes > budget and solve(problem, inner, "dp").regions != wide.regions:
            return problem, budget, inner, wide
    raise AssertionError("no budget puts dp's widest variant over it")


def test_a_named_solvers_variant_over_the_budget_never_wins_however_it_measures(tmp_path):
    problem, budget, inner, wide = _dp_over_budget_within_margin()
    solution = solve(problem, inner, "dp")

    def measure(cands, rounds, racing=None):  # every plan measures within the budget; the widest is fastest
        return ([rules.Measured(min(c.predicted_peak_bytes, budget), tuple([1.0 if c.regions == wide.regions else 2.0] * rounds))
                 for c in cands], [0.5] * rounds)

    result, _ = at.autotune_solution(problem, solution, budget, inner, steps=30, key="k", store=TimingStore(tmp_path / "t.json"),
                                     measure=measure, differs=lambda *a: False, learn=False, solver="dp")
    assert simulate(problem, result.regions, saved=result.saved).peak_bytes <= budget
    assert result.regions != wide.regions


def test_the_gate_resimulates_a_plan_whose_solvers_own_estimate_is_under_the_budget():
    problem, budget, inner, wide = _dp_over_budget_within_margin()
    fits = solve(problem, inner, "dp")
    # the solver's own estimate says it fits; the simulator says it does not
    claims = dataclasses.replace(wide, peak_bytes=budget - 1)
    kept, notes = choice.held_to_budget(problem, claims, budget, fallback=fits)
    assert kept is fits and len(notes) == 1 and "over the budget" in notes[0]
    assert choice.held_to_budget(problem, fits, budget) == (fits, [])
    with pytest.raises(PlannerError) as info:
        choice.held_to_budget(problem, claims, budget)
    assert "\n" not in str(info.value)


def test_a_planner_never_returns_a_raced_plan_over_its_budget(monkeypatch, tmp_path):
    monkeypatch.setenv("CKPT_PLANNER_TIMINGS", str(tmp_path))
    model, inputs = mlp()
    planner = api.Planner(model, inputs, profile_config=FLOPS)
    base, fixed = planner.no_checkpoint_peak_bytes, planner.problem.fixed_bytes
    budget = int(fixed + 0.45 * (base - fixed))
    over = simulate(planner.problem, [(0, 0)]).peak_bytes
    assert over > budget

    def raced(p, solution, resolved, request, steps):  # a race that returns a plan over the budget
        return dataclasses.replace(solution, regions=((0, 0),), saved=(), peak_bytes=resolved.nbytes - 1), ["raced"]

    monkeypatch.setattr(choice, "autotuned", raced)
    plan = planner.plan(budget_bytes=budget, autotune=True, solver="dp")
    assert plan.predicted_peak_bytes <= budget and plan.spans() != [(0, 0)]
    assert any("over the budget" in n and "the plan before it was kept" in n for n in plan.notes)

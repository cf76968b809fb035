"""CompiledPlanner.sweep asks `plan_for` with the typed request, one budget at a time; `plan()`'s keywords
still build that request. No compile here: `plan_for` is recorded, so the test reads what sweep asks."""

from types import SimpleNamespace

import pytest
from ckpt_planner.compile.compiled import CompiledPlanner
from ckpt_planner.errors import InputError
from ckpt_planner.settings import PlanRequest
from ckpt_planner.solvers.registry import InfeasibleBudgetError

SMALLEST = 150  # bytes: the recorded planner refuses budgets below it


class _Recorded(CompiledPlanner):
    """The requests sweep makes; each plan measures half its budget (so no looser plan is kept instead)."""

    def __init__(self) -> None:  # no planner, nothing compiled
        self.asked: list[PlanRequest] = []

    def plan_for(self, request: PlanRequest) -> SimpleNamespace:
        self.asked.append(request)
        budget = request.budget.nbytes
        if budget < SMALLEST:
            raise InfeasibleBudgetError(budget, SMALLEST, request.solve.solver)
        return SimpleNamespace(budget_bytes=budget, measured_peak_bytes=budget // 2)


def test_sweep_takes_a_plan_request_and_replaces_only_its_budget():
    request = PlanRequest.of(budget_gb=7.0, solver="greedy", safety_margin=0.1, autotune=False)
    cp = _Recorded()
    plans = cp.sweep([300, 100, 200], request)
    assert [p and p.budget_bytes for p in plans] == [300, None, 200]  # in the order asked; None: infeasible
    assert [r.budget.nbytes for r in cp.asked] == [300, 200, 100]  # loosest first
    assert all(r.replace(budget=request.budget) == request for r in cp.asked)
    assert {(r.budget.gb, r.budget.safety_margin) for r in cp.asked} == {(None, 0.1)}


def test_sweep_keywords_build_the_same_request():
    cp = _Recorded()
    cp.sweep([300], solver="greedy", safety_margin=0.1)
    assert cp.asked == [PlanRequest.of(budget_bytes=300, solver="greedy", safety_margin=0.1)]


@pytest.mark.parametrize("call", [
    lambda cp: cp.sweep([300], PlanRequest.of(), solver="dp"),
    lambda cp: cp.sweep([300], budget_gb=1.0),
], ids=["request and keywords", "a budget keyword"])
def test_sweep_refuses_what_it_cannot_read_in_one_line(call):
    cp = _Recorded()
    with pytest.raises(InputError, match="^sweep: "):
        call(cp)
    assert cp.asked == []

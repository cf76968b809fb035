"""exact=False refuses a budget that neither the exact plan nor the chunked one meets, naming the smaller of
the two smallest budgets: at that budget the planner of that graph plans (the exact one is tried first)."""

import pytest
from ckpt_planner.choose.inexact import plan_inexact
from ckpt_planner.errors import InfeasibleBudgetError
from ckpt_planner.settings import PlanRequest


class _Refusing:
    """A planner of one graph whose every budget is below its floor (`smallest`, bytes)."""

    def __init__(self, smallest: int, chunks: tuple = ()) -> None:
        self.smallest, self.chunks = smallest, list(chunks)

    def plan_for(self, request: PlanRequest):
        raise InfeasibleBudgetError(1_000_000, self.smallest, "auto", 400_000)


@pytest.mark.parametrize(("exact_floor", "chunked_floor"), [(2_000_000, 3_000_000), (3_000_000, 2_000_000)])
def test_the_refusal_names_the_smaller_floor(exact_floor, chunked_floor):
    planners = {True: _Refusing(exact_floor), False: _Refusing(chunked_floor, chunks=("chunked_0",))}
    with pytest.raises(InfeasibleBudgetError) as e:
        plan_inexact(lambda exact: planners[exact], PlanRequest.of(budget_bytes=1_000_000))
    assert e.value.smallest_bytes == min(exact_floor, chunked_floor)
    assert f"({min(exact_floor, chunked_floor)} bytes" in str(e.value)


def test_a_model_the_capture_cannot_take_whole_is_planned_in_parts_as_exact_plans_it():
    """exact=False tries the exact plan first, the way exact=True plans it: a model with a branch on its values
    (no whole graph) is planned in parts, where it used to be refused with the capture's error."""
    import torch
    from ckpt_planner import optimize, verify

    from tests.support.profiles import FLOP_TIMES
    from tests.unit.choose.test_partial import Branchy

    torch.manual_seed(0)
    model, x = Branchy(d=32, blocks=3), torch.randn(64, 16)
    with pytest.raises(InfeasibleBudgetError) as refused:  # below every plan: the smallest budget is named
        optimize(model, x, budget_bytes=1, profile_config=FLOP_TIMES, autotune=False, exact=False)
    budget = refused.value.smallest_bytes
    exact = optimize(model, x, budget_bytes=budget, profile_config=FLOP_TIMES, autotune=False)
    plan = optimize(model, x, budget_bytes=budget, profile_config=FLOP_TIMES, autotune=False, exact=False)
    assert plan.capture_method == exact.capture_method == "partial"
    assert plan.stats["exact"] is False and plan.stats["chunks"] == []
    assert plan.predicted_peak_bytes == exact.predicted_peak_bytes
    report = verify(model, plan, x, repeats=1)
    assert report.grads_equal and report.measured_peak_bytes <= plan.budget_bytes

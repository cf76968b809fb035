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

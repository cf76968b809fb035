"""The partial path takes the same Setup as a whole graph's: the step check reaches it, and a model that
refuses its inputs when run eagerly is named in one line."""

import numpy as np
import pytest
import torch
from ckpt_planner import InfeasibleBudgetError, InputError, optimize
from ckpt_planner.choose import partial as partial_mod
from ckpt_planner.choose.partial import PartialPlanner
from ckpt_planner.errors import InexactPlanError
from ckpt_planner.settings import PlanRequest, Setup
from ckpt_planner.verification import step_differences

from tests.support.profiles import TIMED_ONCE
from tests.unit.choose.test_partial import Branchy


def _budget(model, x) -> int:
    """Halfway between the smallest feasible budget and the plain step's peak (bytes)."""
    part = PartialPlanner(model, (x,), setup=Setup.of(profile_config=TIMED_ONCE))
    with pytest.raises(InfeasibleBudgetError) as info:
        part.plan_for(PlanRequest.of(budget_bytes=1, solver="uniform"))
    low = info.value.smallest_bytes
    return int(low + 0.5 * (part.baseline_peak_bytes - low))


def test_check_step_runs_on_partial_plans_and_refuses_one_that_differs(monkeypatch):
    torch.manual_seed(0)
    model, x = Branchy(d=32, blocks=4), torch.randn(128, 16)
    budget = _budget(model, x)
    real, calls = partial_mod.step_differences, []

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(partial_mod, "step_differences", counted)
    plan = optimize(model, (x,), budget_bytes=budget, solver="uniform", profile_config=TIMED_ONCE)
    assert plan.capture_method == "partial" and plan.regions and len(calls) == 1  # checked, and exact
    assert optimize(model, (x,), budget_bytes=budget, solver="uniform", profile_config=TIMED_ONCE,
                    check_step=False).regions and len(calls) == 1  # check_step=False: not run

    monkeypatch.setattr(partial_mod, "step_differences", lambda *a, **k: ["output", "stack.0.up.weight"])
    with pytest.raises(InexactPlanError, match="differs from the model's in output, stack.0.up.weight"):
        optimize(model, (x,), budget_bytes=budget, solver="uniform", profile_config=TIMED_ONCE)
    plan = optimize(model, (x,), budget_bytes=budget, solver="uniform", profile_config=TIMED_ONCE, check_step=False)
    assert plan.regions


def test_partial_planner_takes_a_setup_and_a_request():
    torch.manual_seed(0)
    model, x = Branchy(d=32, blocks=4), torch.randn(128, 16)
    with_adam = PartialPlanner(model, (x,), setup=Setup.of(profile_config=TIMED_ONCE, optimizer="adam"))
    plain = PartialPlanner(model, (x,), setup=Setup.of(profile_config=TIMED_ONCE))
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert with_adam.problem.fixed_bytes - plain.problem.fixed_bytes == 2 * params  # Adam's two moments
    plan = plain.plan_for(PlanRequest.of(budget_bytes=_budget(model, x), solver="uniform"))
    assert plan.regions and plan.predicted_peak_bytes <= plan.budget_bytes


def test_a_model_that_refuses_its_inputs_on_the_partial_path_is_one_input_error():
    model = Branchy(d=32, blocks=2)
    with pytest.raises(InputError) as info:
        optimize(model, (torch.randn(8, 7),), budget_bytes=10**6, profile_config=TIMED_ONCE)
    message = str(info.value)
    assert "\n" not in message and message.startswith("inputs: Branchy raised RuntimeError on the example inputs")
    assert info.value.__cause__ is None and info.value.__suppress_context__


class NumpyMasked(torch.nn.Module):
    """Eager code that draws from numpy's global generator, as transformers' SpecAugment masks do."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = torch.from_numpy(np.random.rand(*x.shape) > 0.5)
        return (self.lin(x) * keep).sum()


def test_the_step_check_draws_numpy_alike_in_both_steps():
    model, x = NumpyMasked(), torch.randn(4, 8)
    assert step_differences(model, model, (x,), {}) == []  # the model's own step against itself

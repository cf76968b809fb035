"""The typed settings `optimize()` builds (planner/settings.py) and the one `plan()` every planner answers."""

from __future__ import annotations

import pytest
from ckpt_planner import Budget, InputError, Planner, PlanRequest, ProfileConfig, optimize
from ckpt_planner.choose.base import BasePlanner
from ckpt_planner.choose.partial import PartialPlanner
from ckpt_planner.compile.compiled import CompiledPlanner
from ckpt_planner.settings import Setup

from tests.models.small import mlp

FLOPS = ProfileConfig(flop_times=True)


def test_the_budget_has_one_conversion_to_bytes():
    fixed, as_given = 1_000, 3_000  # bytes
    assert Budget(gb=1.5).in_bytes(fixed, as_given) == 1_500_000_000
    assert Budget(nbytes=1_234).in_bytes(fixed, as_given) == 1_234
    assert Budget(activation_fraction=0.5).in_bytes(fixed, as_given) == 2_000
    assert Budget(activation_fraction=1.0).in_bytes(fixed, as_given) == as_given
    assert Budget().in_bytes(fixed, as_given) is None and not Budget().given


@pytest.mark.parametrize("kwargs, field", [
    (dict(budget_gb=1, budget_bytes=10), "budget"),
    (dict(budget_gb=0), "budget_gb"),
    (dict(budget_bytes=-5), "budget_bytes"),
    (dict(activation_budget=0), "activation_budget"),
    (dict(activation_budget=1.5), "activation_budget"),
    (dict(activation_budget=0.5, budget_bytes=10), "activation_budget"),
    (dict(safety_margin=1.0), "safety_margin"),
])
def test_a_bad_budget_names_its_field(kwargs, field):
    with pytest.raises(InputError, match=f"^{field}:"):
        Budget.of(**kwargs)


def test_a_request_round_trips_through_its_keywords():
    request = PlanRequest.of(budget_bytes=10**6, solver="dp", solver_options={"time_limit": 3}, safety_margin=0.1,
                             on_larger_shape="replan", own_checkpointing="keep", autotune=3)
    assert PlanRequest.of(**request.keywords()) == request
    with pytest.raises(InputError, match="^on_larger_shape:"):
        PlanRequest.of(on_larger_shape="grow")
    with pytest.raises(InputError, match="^own_checkpointing:"):
        PlanRequest.of(own_checkpointing="merge")


def test_a_setup_refuses_what_cannot_go_together():
    with pytest.raises(InputError, match="^exact:"):
        Setup.of(exact=False, compile=True)
    with pytest.raises(InputError, match="^sharding:"):
        Setup.of(world_size=2)
    with pytest.raises(InputError, match="^world_size:"):
        Setup.of(world_size=0)
    with pytest.raises(InputError, match="^lowering:"):
        Setup.of(lowering="knapsack")
    assert Setup.of(device="meta").meta and not Setup.of(device="cpu").meta


def test_every_planner_answers_the_same_plan_call():
    for cls in (Planner, PartialPlanner, CompiledPlanner):
        assert issubclass(cls, BasePlanner) and cls.plan is BasePlanner.plan, cls


def test_exact_check_is_check_steps_former_name():
    model, x = mlp()
    with pytest.warns(DeprecationWarning, match="check_step"):
        old = optimize(model, x, activation_budget=0.5, solver="dp", profile_config=FLOPS, exact_check=False)
    new = optimize(model, x, activation_budget=0.5, solver="dp", profile_config=FLOPS, check_step=False)
    assert old.to_dict()["regions"] == new.to_dict()["regions"] and old.regions


def test_a_planner_plans_a_request_as_optimize_does():
    model, x = mlp()
    planner = Planner(model, x, profile_config=FLOPS)
    by_keywords = planner.plan(activation_budget=0.5, solver="dp")
    by_request = planner.plan_for(PlanRequest.of(activation_budget=0.5, solver="dp"))
    by_optimize = optimize(model, x, activation_budget=0.5, solver="dp", profile_config=FLOPS)
    assert by_keywords.spans() == by_request.spans() == by_optimize.spans() and by_keywords.spans()

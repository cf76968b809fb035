"""A checking step that runs out of device memory is not an inexact plan.

Under a device memory cap, the safety net's step of a plan can run out of memory (the caching allocator
needs room beyond the tensors a plan counts), and so can the steps that look for the region at fault one
region at a time (each keeps nearly the plain step's activations). Neither says the plan differs from the
model: each raises one line that names the way out, where regions were forbidden as inexact before."""

import pytest
import torch
from ckpt_planner import optimize
from ckpt_planner.choose import safety_net
from ckpt_planner.errors import CheckOutOfMemoryError, PlannerError
from ckpt_planner.profile.profiler import ProfileConfig
from ckpt_planner.verification import OUT_OF_MEMORY, step_differences

from tests.models.small import LOCAL

FLOPS = ProfileConfig(warmup=0, repeats=1, flop_times=True)


class RunsOutOfMemory(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")


def test_a_step_out_of_memory_is_reported_as_such():
    model, inputs = LOCAL["mlp"]()
    assert step_differences(model, RunsOutOfMemory(model), inputs, {}) == [OUT_OF_MEMORY]
    assert step_differences(model, model, inputs, {}) == []




def test_the_plans_check_out_of_memory_names_the_way_out(monkeypatch):
    model, inputs = LOCAL["mlp"]()
    calls = []

    def fake(model_, module, args, kwargs, **kw):
        calls.append(module)
        return [OUT_OF_MEMORY]

    monkeypatch.setattr(safety_net, "step_differences", fake)
    with pytest.raises(CheckOutOfMemoryError) as info:
        optimize(model, inputs, activation_budget=0.5, profile_config=FLOPS, autotune=False)
    text = str(info.value)
    assert calls and "\n" not in text and "ran out of device memory" in text
    assert "expandable_segments" in text and "check_step=False" in text
    assert isinstance(info.value, PlannerError)


def test_regions_checked_alone_out_of_memory_are_not_forbidden_as_inexact(monkeypatch):
    """The plan differs (its first check), then every region alone runs out of memory: before, each was
    forbidden as inexact and the budget became infeasible under a misleading message."""
    model, inputs = LOCAL["mlp"]()
    calls = []

    def fake(model_, module, args, kwargs, **kw):
        calls.append(module)
        return ["output"] if len(calls) == 1 else [OUT_OF_MEMORY]

    monkeypatch.setattr(safety_net, "step_differences", fake)
    with pytest.raises(CheckOutOfMemoryError) as info:
        optimize(model, inputs, activation_budget=0.5, profile_config=FLOPS, autotune=False)
    assert "one region at a time" in str(info.value) and "\n" not in str(info.value)
    assert len(calls) >= 2

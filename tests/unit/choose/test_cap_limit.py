"""A budget beyond what the device lets the process's tensors take is planned for that limit, with room
left for the caching allocator, and the plan says so (a plan made right up to a per-process memory cap ran
out of memory in its own check on an H100: the allocator reserves more than the step allocates)."""

from __future__ import annotations

import types

import ckpt_planner.choose.budget as budget_module
import pytest
import torch
from ckpt_planner.api import Planner
from ckpt_planner.errors import InfeasibleBudgetError
from ckpt_planner.profile import memory
from ckpt_planner.profile.profiler import ProfileConfig
from torch import nn

FLOPS = ProfileConfig(warmup=0, repeats=1, flop_times=True)


def _stack() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32)]
    return nn.Sequential(*layers), torch.randn(128, 32)


def _fake_cuda(monkeypatch, total: int, fraction: float) -> None:
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(total_memory=total))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda i: fraction, raising=False)


def test_no_limit_off_cuda():
    assert memory.allocator_limit("cpu") is None
    assert memory.allocator_limit("meta") is None


@pytest.mark.parametrize("conf, overhead", [("", memory.ALLOCATOR_OVERHEAD),
                                            ("expandable_segments:True", memory.EXPANDABLE_OVERHEAD),
                                            ("max_split_size_mb:128, expandable_segments:true", memory.EXPANDABLE_OVERHEAD)])
def test_the_limit_is_the_process_share_less_the_allocators_overhead(monkeypatch, conf, overhead):
    _fake_cuda(monkeypatch, total=80_000_000_000, fraction=0.05)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", conf)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    assert memory.allocator_limit("cuda") == int(4_000_000_000 / (1 + overhead))
    assert memory.allocator_limit(torch.device("cuda", 0)) == int(4_000_000_000 / (1 + overhead))


@pytest.fixture(scope="module")
def planner() -> Planner:
    model, x = _stack()
    planner = Planner(model, (x,), profile_config=FLOPS)
    planner.autotune = False
    return planner


def test_a_budget_over_the_limit_is_planned_for_the_limit(monkeypatch, planner):
    free = planner.plan(activation_budget=0.7)
    budget = free.budget_bytes
    with pytest.raises(InfeasibleBudgetError) as e:
        planner.plan(budget_bytes=planner.problem.fixed_bytes + 1)
    limit = (e.value.smallest_bytes + budget) // 2
    assert e.value.smallest_bytes < limit < budget
    monkeypatch.setattr(budget_module, "allocator_limit", lambda device: limit)
    plan = planner.plan(budget_bytes=budget)
    assert plan.budget_bytes == limit
    assert plan.predicted_peak_bytes <= limit
    assert any("caching allocator's overhead" in n and f"{limit / 1e6:.1f} MB" in n for n in plan.notes)
    # a limit at or above the budget changes nothing
    monkeypatch.setattr(budget_module, "allocator_limit", lambda device: budget)
    again = planner.plan(budget_bytes=budget)
    assert again.budget_bytes == budget
    assert [r.start for r in again.regions] == [r.start for r in free.regions]
    assert not any("caching allocator's overhead" in n for n in again.notes)


def test_a_limit_no_plan_fits_is_refused_naming_it(monkeypatch, planner):
    plain = planner.no_checkpoint_peak_bytes
    monkeypatch.setattr(budget_module, "allocator_limit", lambda device: planner.problem.fixed_bytes + 1)
    with pytest.raises(InfeasibleBudgetError) as e:
        planner.plan(budget_bytes=plain)
    assert "caching allocator's overhead" in str(e.value) and "which no plan fits" in str(e.value)
    assert e.value.smallest_bytes > planner.problem.fixed_bytes + 1


def test_a_model_planned_in_parts_is_held_to_the_limit_too(monkeypatch):
    from ckpt_planner.choose.partial import PartialPlanner

    from tests.support.profiles import TIMED_ONCE
    from tests.unit.choose.test_partial import Branchy

    torch.manual_seed(0)
    model, x = Branchy(d=32, blocks=4), torch.randn(64, 16)
    part = PartialPlanner(model, (x,), profile_config=TIMED_ONCE)
    budget = part.baseline_peak_bytes
    with pytest.raises(InfeasibleBudgetError) as e:
        part.plan(budget_bytes=part.problem.fixed_bytes + 1, solver="uniform")
    limit = (e.value.smallest_bytes + budget) // 2
    monkeypatch.setattr(budget_module, "allocator_limit", lambda device: limit)
    plan = part.plan(budget_bytes=budget, solver="uniform")
    assert plan.budget_bytes == limit and plan.predicted_peak_bytes <= limit
    assert any("caching allocator's overhead" in n for n in plan.notes)

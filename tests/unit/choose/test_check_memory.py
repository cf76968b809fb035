"""The step that checks a plan fits where the plan does: bytes counted on the CPU allocator.

The safety net runs the reference step (the model's, or the step checkpointed per block), then the plan's,
and compares them. Each step may hold on the device only what a step of its own holds: the reference's
outputs, gradients and buffers wait off the device (digests, or host bytes outside torch's allocator) while
the plan's step runs, and the comparison goes a slice at a time. Measured here with the allocator meter that
judges budgets (`AllocatorMeter`), each step marked where it starts.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from ckpt_planner.api import Planner
from ckpt_planner.choose import safety_net
from ckpt_planner.errors import CheckOutOfMemoryError, InfeasibleBudgetError
from ckpt_planner.profile.memory import AllocatorMeter
from ckpt_planner.profile.profiler import ProfileConfig
from ckpt_planner.verification import COMPARED_ELEMENTS, REFERENCE_OUT_OF_MEMORY, step_differences

from tests.models.small import LOCAL
from tests.models.zoo import build

FLOPS = ProfileConfig(warmup=0, repeats=1, flop_times=True)

TOLERANCE = 64 * 1024
"""Bytes a checking step may hold beyond its own step's predicted peak: the generator states and buffer
snapshots that make both steps start alike (about 10 KB here), not a tensor of the model's size."""


class _Marked(torch.nn.Module):
    """`inner`, marking the meter where its step starts."""

    def __init__(self, inner: torch.nn.Module, meter: AllocatorMeter, name: str) -> None:
        super().__init__()
        self.inner = inner
        self._mark = lambda: meter.mark(name)

    def forward(self, *args, **kwargs):
        self._mark()
        return self.inner(*args, **kwargs)


def _checks(monkeypatch) -> list[tuple[dict, list | None]]:
    """Every checking call of the safety net from here on: {window name: peak bytes above the meter's start}
    (the 'plan' window runs from the plan's step to the end of the comparison), and what it found."""
    calls = []
    real = safety_net.step_differences

    def measured(model, module, args, kwargs, **kw):
        with AllocatorMeter("cpu") as meter:
            meter.mark("before")
            kw["reference"] = _Marked(kw.get("reference") or model, meter, "reference")
            found = real(model, _Marked(module, meter, "plan"), args, kwargs, **kw)
        calls.append(({w.name: w.peak for w in meter.windows()}, found))
        return found

    monkeypatch.setattr(safety_net, "step_differences", measured)
    return calls


def _resident(model: torch.nn.Module, inputs) -> int:
    """Bytes allocated before the check starts, as the plan's prediction counts them: parameters, buffers, inputs."""
    tensors = [*model.parameters(), *model.buffers(), *(inputs.values() if isinstance(inputs, dict) else inputs)]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


# dp, not the default auto: what is measured is the checking step, whichever solver chose the plan, and
# auto's MILP was a fifth of these tests' time.
SOLVER = "dp"


def _at_the_floor(planner: Planner):
    with pytest.raises(InfeasibleBudgetError) as info:
        planner.plan(budget_bytes=1, solver=SOLVER, autotune=False)
    return planner.plan(budget_bytes=info.value.smallest_bytes, solver=SOLVER, autotune=False)


@pytest.mark.parametrize("exact", [True, False])
def test_the_plans_checking_step_holds_no_more_than_the_plan_predicts(monkeypatch, exact):
    """At the least budget that plans (token-wise chunks under exact=False), the plan's step in the check,
    comparison included, peaks within its predicted peak (10 KB over it here, the snapshots). Under exact=False
    the reference's outputs and gradients once stayed on the device beside the plan's step, and float64 copies of
    both beside them while comparing: 0.83 MB over a predicted 1.55 MB here."""
    model, inputs = build("llama")
    planner = Planner(model, inputs, profile_config=FLOPS, exact=exact)
    calls = _checks(monkeypatch)
    plan = _at_the_floor(planner)
    assert calls and all(found == [] for _, found in calls)
    resident = _resident(model, inputs)
    for windows, _ in calls:
        assert resident + windows["plan"] <= plan.predicted_peak_bytes + TOLERANCE, (windows, plan.predicted_peak_bytes)


def test_the_reference_step_holds_no_more_than_its_own_prediction(monkeypatch):
    """Profiled a stage at a time, the check's reference is the step checkpointed per block: it runs first,
    with nothing of the check's on the device but the snapshots that start both steps alike."""
    model, inputs = build("llama")
    planner = Planner(model, inputs, profile_config=dataclasses.replace(FLOPS, bounded=True))
    p = planner.profiled
    assert p.reference_paths  # the per-block reference, not the model's plain step
    calls = _checks(monkeypatch)
    plan = planner.plan(budget_bytes=int(p.reference_peak_bytes * 1.02), solver=SOLVER, autotune=False)
    assert calls and all(found == [] for _, found in calls)
    assert not any("the check ran" in n for n in plan.notes)  # the reference fits this budget
    resident = _resident(model, inputs)
    for windows, _ in calls:
        assert resident + windows["reference"] <= p.reference_peak_bytes * 1.01 + TOLERANCE
        assert resident + windows["plan"] <= plan.predicted_peak_bytes + TOLERANCE


def test_allclose_is_judged_over_every_slice():
    """exact=False compares a slice of COMPARED_ELEMENTS at a time: a difference in the last slice is found,
    one within the dtype's tolerance is not, and NaN equals NaN."""
    torch.manual_seed(0)
    n = 2 * COMPARED_ELEMENTS + 7

    class Scaled(torch.nn.Module):
        def __init__(self, weight: torch.nn.Parameter, at: int | None = None, by: float = 0.0) -> None:
            super().__init__()
            self.weight, self.at, self.by = weight, at, by

        def forward(self, x):
            y = self.weight * x
            if self.at is not None:
                bump = torch.zeros_like(y)
                bump[self.at] = self.by
                y = y + bump
            return y

    weight = torch.nn.Parameter(torch.randn(n))
    x = torch.randn(n)
    x[3] = float("nan")
    model = Scaled(weight)
    assert step_differences(model, Scaled(weight), (x,), {}, bitwise=False) == []
    assert step_differences(model, Scaled(weight, n - 1, 1e-6), (x,), {}, bitwise=False) == []
    assert step_differences(model, Scaled(weight, n - 1, 1e-6), (x,), {}) == ["output"]  # bitwise on the CPU
    assert step_differences(model, Scaled(weight, n - 1, 1.0), (x,), {}, bitwise=False) == ["output"]


class _ReferenceOutOfMemory(torch.nn.Module):
    def forward(self, *args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")


def test_a_reference_out_of_memory_is_said_so_not_taken_for_a_model_that_cannot_train(monkeypatch):
    model, inputs = LOCAL["mlp"]()
    assert step_differences(model, model, inputs, {}, reference=_ReferenceOutOfMemory()) == [REFERENCE_OUT_OF_MEMORY]
    monkeypatch.setattr(safety_net, "step_differences", lambda *a, **k: [REFERENCE_OUT_OF_MEMORY])
    planner = Planner(model, inputs, profile_config=FLOPS)
    with pytest.raises(CheckOutOfMemoryError) as info:
        planner.plan(activation_budget=0.5, autotune=False)
    text = str(info.value)
    assert "\n" not in text and "the step the plan is checked against" in text and "check_step=False" in text

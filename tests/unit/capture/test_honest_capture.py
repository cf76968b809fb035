"""Honest capture: an eval-mode model is planned for the training step it will take, and Python values the
captured graph holds as constants (scalar globals and attributes the forward reads) are named in the plan
and checked before each training call of plan.module."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from ckpt_planner import optimize, verify
from ckpt_planner.errors import StaleGraphError
from ckpt_planner.profile.profiler import ProfileConfig

from tests.models.small import mlp

FLOPS = ProfileConfig(warmup=0, repeats=1, flop_times=True)  # deterministic costs
SCALE = 2.0  # read by Scaled.forward: a trace bakes in its value


class BNDrop(nn.Module):
    def __init__(self, d: int = 64, n: int = 6) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[
            nn.Sequential(nn.Linear(d, 4 * d), nn.BatchNorm1d(4 * d), nn.ReLU(), nn.Dropout(0.3), nn.Linear(4 * d, d))
            for _ in range(n)
        ])

    def forward(self, x):
        return self.blocks(x)


@pytest.mark.parametrize("check_step", [True, False])
def test_eval_mode_model_is_planned_for_its_training_step(check_step):
    """Planned in eval mode, the plan once held dropout off and BatchNorm on running statistics: in train
    mode its step differed from the model's (the safety net refused every region), and unchecked it measured
    over the budget (4.56 MB against 4.50 MB)."""
    torch.manual_seed(0)
    model, x = BNDrop(), torch.randn(256, 64)
    model.eval()
    budget = 4_500_000  # bytes: below the step without checkpointing in train mode
    plan = optimize(model, (x,), budget_bytes=budget, solver="dp", profile_config=FLOPS, check_step=check_step)
    assert not model.training and not any(m.training for m in model.modules())  # left as found
    assert any("eval mode" in n and "training step" in n for n in plan.notes), plan.notes
    assert "eval mode" in plan.summary()
    assert plan.regions
    report = verify(model, plan, (x,), repeats=1)  # one training step, in train mode
    assert report.exact, report.mismatch()
    assert report.measured_peak_bytes <= budget, report.measured_peak_bytes
    assert not model.training


class Scaled(nn.Module):
    def __init__(self, d: int = 32, n: int = 4) -> None:
        super().__init__()
        self.fc = nn.ModuleList(nn.Linear(d, d) for _ in range(n))
        self.drop = nn.Dropout(0.0)
        self.temperature = 0.5  # a Python float the forward reads

    def forward(self, x):
        for fc in self.fc:
            x = torch.tanh(fc(x) * SCALE)
        return self.drop(x) / self.temperature


def _out(module, x):
    torch.manual_seed(0)
    return module(x)


@pytest.mark.parametrize("method", ["symbolic_trace", "export"])
def test_values_the_graph_holds_are_named_and_checked(method, monkeypatch):
    """The finding: after SCALE or model.temperature changes, the model follows it and plan.module kept the
    old value (outputs 2.75x off) without a word. Now the plan names both, and plan.module raises."""
    torch.manual_seed(0)
    model, x = Scaled(), torch.randn(256, 32)
    plan = optimize(model, (x,), solver="dp", capture_method=method, profile_config=FLOPS)
    assert plan.regions
    note = next(n for n in plan.notes if "as constants" in n)
    assert "global SCALE=2.0" in note and "attribute temperature=0.5" in note
    planned = _out(model, x)
    assert torch.equal(_out(plan.module, x), planned)
    for owner, name, value in ((globals(), "SCALE", 3.0), (model, "temperature", 0.25)):
        with monkeypatch.context() as m:
            if isinstance(owner, dict):
                m.setitem(owner, name, value)
            else:
                m.setattr(owner, name, value)
            assert not torch.equal(_out(model, x), planned)  # the value matters to the model's outputs
            with pytest.raises(StaleGraphError, match=f"{name}.*now {value}"):
                plan.module(x)
        assert torch.equal(_out(plan.module, x), _out(model, x))  # restored: runs again
    # torch.nn's own layers are configuration, and symbolic_trace calls them live: not named
    assert "drop.p" not in note


def test_a_plain_model_has_no_values_note():
    model, inputs = mlp()
    plan = optimize(model, inputs, activation_budget=0.5, solver="dp", profile_config=FLOPS)
    assert not any("as constants" in n for n in plan.notes)

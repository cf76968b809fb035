"""The smallest budget a refusal names is one the planner then meets: planned again at exactly that budget,
in the same process or a fresh one, it plans, within it.

An LSTM's backward is the peak of its step, and no plan lowers it, so the floor named is the step's own
peak. Below that peak the profile is stage-wise, and each stage's own step misses 2-3 KB of the LSTM's
backward workspace; at the named budget the plain step fits, so the step is profiled whole and measured
again. A floor named without the margin plans keep was refused again there, naming a floor 3 KB higher.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from ckpt_planner import optimize
from ckpt_planner.api import Planner
from ckpt_planner.choose.budget import as_is_floor, budget_of
from ckpt_planner.errors import InfeasibleBudgetError
from ckpt_planner.profile.bytes_pass import PROFILES
from ckpt_planner.profile.profiler import ProfileConfig
from ckpt_planner.settings import PlanRequest
from ckpt_planner.verification import verify
from torch import nn

FLOPS = ProfileConfig(warmup=0, repeats=1, flop_times=True)


class _LSTMLM(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.lstm = nn.LSTM(d, d, batch_first=True)
        self.head = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, vocab))

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm(self.emb(ids))  # [B, T, d]
        return F.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())


def _lstm_lm() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    return _LSTMLM(), (torch.randint(0, 64, (4, 16)), torch.randint(0, 64, (4, 16)))


def _refused(model, inputs) -> InfeasibleBudgetError:
    with pytest.raises(InfeasibleBudgetError) as info:
        optimize(model, inputs, activation_budget=0.5, profile_config=FLOPS, autotune=False)
    return info.value


@pytest.mark.parametrize("fresh", [False, True], ids=["same-process", "fresh-process"])
def test_lstm_floor_named_plans_there(fresh):
    PROFILES.clear()
    model, inputs = _lstm_lm()
    named = _refused(model, inputs).smallest_bytes
    if fresh:  # as the CLI plans: nothing this process measured before
        PROFILES.clear()
    plan = optimize(model, inputs, budget_bytes=named, profile_config=FLOPS, autotune=False)
    assert plan.predicted_peak_bytes <= named
    report = verify(model, plan, inputs, repeats=1)  # the allocator's peak of the planned step
    assert report.measured_peak_bytes <= named


def test_as_is_floor_keeps_the_margin_only_where_the_step_never_ran_whole():
    PROFILES.clear()
    model, inputs = _lstm_lm()
    whole = Planner(model, inputs, profile_config=FLOPS).profiled
    staged = Planner(model, inputs, profile_config=ProfileConfig(warmup=0, repeats=1, flop_times=True,
                                                                 bounded=True)).profiled
    assert not whole.cost.stages and staged.cost.stages
    peak, request = staged.no_checkpoint_peak_bytes, PlanRequest.of(budget_bytes=1, safety_margin=0.02)
    on_whole, on_staged = budget_of(whole, request), budget_of(staged, request)
    assert as_is_floor(whole, whole.no_checkpoint_peak_bytes, on_whole) == whole.no_checkpoint_peak_bytes
    named = as_is_floor(staged, peak, on_staged)
    assert named == on_staged.smallest(peak) > peak
    # the least budget whose inner budget (less 2 % of its activation part) holds the peak
    fixed = staged.problem.fixed_bytes
    assert named - int(0.02 * (named - fixed)) >= peak > (named - 1) - int(0.02 * (named - 1 - fixed))
    # the stage-wise estimate of the plain step is under the whole step's measured peak; the margin covers it
    assert peak <= whole.no_checkpoint_peak_bytes <= named

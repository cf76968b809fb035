"""A LoRA-wrapped CNN's refusal names a floor that a fresh planner meets, and asked exactly there, the
floor it would name is the same one: the floor does not move with the budget asked or with the process.

peft's LoRA layers multiply their branch by a Python number (`scaling`, lora_alpha / r), which autograd
keeps as a 0-dim tensor that no saved-tensor hook sees (profile/backward.py counts them: 8 B each). The
floor is counted with them in the fixed bytes on the stage-wise profile (the refusal, below the plain
step) as on the one at the named budget. The conformance matrix's `tv_vgg` (conv-BN-ReLU(inplace) stacks)
is refused at half its activation memory.
"""

from __future__ import annotations

import pytest
import torch
from ckpt_planner import optimize
from ckpt_planner.errors import InfeasibleBudgetError
from ckpt_planner.profile.bytes_pass import PROFILES
from ckpt_planner.profile.profiler import ProfileConfig
from ckpt_planner.verification import verify
from torch import nn

from benchmarks.conformance_models import TVVGG

peft = pytest.importorskip("peft")

FLOPS = ProfileConfig(warmup=0, repeats=1, flop_times=True)


def _lora_vgg() -> tuple[nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    model = TVVGG()
    names = [n for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=names, lora_dropout=0.0))
    return model.train(), (torch.randn(4, 3, 32, 32),)


def _named(model, inputs, **budget) -> int:
    with pytest.raises(InfeasibleBudgetError) as info:
        optimize(model, inputs, profile_config=FLOPS, autotune=False, **budget)
    return info.value.smallest_bytes


def test_lora_floor_plans_in_a_fresh_planner_and_stays_put():
    PROFILES.clear()
    model, inputs = _lora_vgg()
    named = _named(model, inputs, activation_budget=0.5)
    PROFILES.clear()  # as a fresh process: nothing measured before
    plan = optimize(model, inputs, budget_bytes=named, profile_config=FLOPS, autotune=False)
    assert plan.predicted_peak_bytes <= named
    assert verify(model, plan, inputs, repeats=1).measured_peak_bytes <= named  # the allocator's peak
    PROFILES.clear()
    # one byte below, the floor named is the same: it is the model's, not the budget's or the profile's
    assert _named(model, inputs, budget_bytes=named - 1) == named

"""A step under an outer bf16 autocast: its casts of parameters are predicted and measured where they live.

Autocast keeps each trainable parameter's cast to bf16 in a cache from its first use until the outermost
autocast context exits. Inside the context that memory is held through the whole step whatever a plan
recomputes, and a second step in the same context (the plan's, after the model's own) finds the casts
made already, before any meter started.
"""

import pytest
import torch
from ckpt_planner import ProfileConfig
from ckpt_planner.api import Planner
from ckpt_planner.errors import InfeasibleBudgetError
from ckpt_planner.profile.loss import default_loss
from ckpt_planner.profile.memory import measure_step_peaks
from ckpt_planner.verification import verify

FLOPS = ProfileConfig(flop_times=True)  # deterministic plan costs
BOUND = 0.03  # prediction error, on each meter


class MLP(torch.nn.Module):
    """Residual Linear-GELU-Linear blocks: under CPU autocast every Linear casts its weight and bias to bf16."""

    def __init__(self, d: int = 128, h: int = 512, blocks: int = 4) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(d, h), torch.nn.GELU(), torch.nn.Linear(h, d)) for _ in range(blocks)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)  # [B, d] float32: the block's bf16 output promoted by the add
        return x.float().square().mean()


def bf16() -> torch.autocast:
    return torch.autocast("cpu", dtype=torch.bfloat16)


def cast_bytes(model: torch.nn.Module) -> int:
    """Bytes of the bf16 casts of every parameter (CPU autocast casts a Linear's weight and bias)."""
    return sum(p.numel() * 2 for p in model.parameters())


def test_casts_are_resident_with_the_parameters():
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(128, 128)
    with bf16():
        cost = Planner(model, (x,), profile_config=FLOPS).cost
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    # Every cast counted once and for the whole step, the first block's weight included: its input needs no
    # gradient, so autograd saves no cast there and the cache alone holds it.
    assert cost.param_bytes == params + cast_bytes(model)


def test_a_second_step_in_the_context_is_measured_like_the_first():
    """The cast cache of an earlier step was allocated before the meter: measured, the step makes its own."""
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(128, 128)
    params = list(model.parameters())

    def peaks():
        return measure_step_peaks(model, (x,), {}, params, params, default_loss, torch.device("cpu"))[0]

    with bf16():
        first, second = peaks(), peaks()
    assert second == first
    # Both meters see the step's own casts (1 MB of bf16 weights). The allocator may see a little more: on a
    # CPU with native bf16 products (AVX512-BF16) oneDNN packs its operands in a workspace (17.5 KB here).
    casts = sum(p.numel() * 2 for p in params)
    assert 0 <= first.allocator - first.live < casts / 8


@pytest.mark.parametrize("solver", ["dp", "uniform"])
def test_plans_under_autocast_are_predicted_and_within_budget_on_both_meters(solver):
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(256, 128)
    with bf16():  # planned and stepped in one context, as a training script wrapping both would
        planner = Planner(model, (x,), profile_config=FLOPS)
        base = planner.plan(solver="none")
        report = verify(model, base, (x,), repeats=1)
        for measured in (report.measured_peak_bytes, report.measured_live_peak_bytes):
            assert abs(base.predicted_peak_bytes - measured) <= BOUND * measured, (base.predicted_peak_bytes, measured)
        try:
            planner.plan(solver=solver, budget_bytes=1)
        except InfeasibleBudgetError as e:
            least = e.smallest_bytes
        budget = least + (planner.baseline_peak_bytes - least) // 3
        plan = planner.plan(solver=solver, budget_bytes=budget)
        assert plan.regions
        report = verify(model, plan, (x,), repeats=1)
    assert report.exact
    for measured in (report.measured_peak_bytes, report.measured_live_peak_bytes):
        assert measured <= plan.budget_bytes, (measured, plan.budget_bytes)
        assert abs(plan.predicted_peak_bytes - measured) <= BOUND * measured, (plan.predicted_peak_bytes, measured)

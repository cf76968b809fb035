"""In-place ops on a value that begins a stage, profiled a stage at a time: an in-place activation after
BatchNorm, `+=` on a residual, an MoE's `index_add_`, `masked_fill_`, `copy_` through a view. The stage
reads its input as a checkpoint region does in the planned step (a tensor made by an op, not a leaf
asking for a gradient), so the write runs, in place, and the figures are the whole step's."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn
from ckpt_planner import optimize
from ckpt_planner.capture.trace import capture
from ckpt_planner.errors import InfeasibleBudgetError
from ckpt_planner.profile.profiler import ProfileConfig, fake_profile, profile
from ckpt_planner.profile.stagewise import measure_stages, stage_spans
from ckpt_planner.solvers import simulate
from ckpt_planner.verification import verify

FLOPS = ProfileConfig(flop_times=True)


def _conv_bn_relu(cin: int, cout: int) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]


class TinyUNet(nn.Module):
    """Two levels, BatchNorm then ReLU(inplace=True), dropout, a long skip from each level to its decoder."""

    def __init__(self, c: int = 4) -> None:
        super().__init__()
        self.enc = nn.ModuleList([nn.Sequential(*_conv_bn_relu(3, c), nn.Dropout2d(0.1), *_conv_bn_relu(c, c)),
                                  nn.Sequential(*_conv_bn_relu(c, 2 * c), nn.Dropout2d(0.1),
                                                *_conv_bn_relu(2 * c, 2 * c))])
        self.mid = nn.Sequential(*_conv_bn_relu(2 * c, 4 * c), *_conv_bn_relu(4 * c, 4 * c))
        self.up = nn.ModuleList([nn.ConvTranspose2d(4 * c, 2 * c, 2, 2), nn.ConvTranspose2d(2 * c, c, 2, 2)])
        self.dec = nn.ModuleList([nn.Sequential(*_conv_bn_relu(4 * c, 2 * c), *_conv_bn_relu(2 * c, 2 * c)),
                                  nn.Sequential(*_conv_bn_relu(2 * c, c), *_conv_bn_relu(c, c))])
        self.head, self.pool = nn.Conv2d(c, 2, 1), nn.MaxPool2d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for block in self.enc:
            x = block(x)
            skips.append(x)  # [B, C_i, H_i, W_i], kept until its decoder level
            x = self.pool(x)
        x = self.mid(x)
        for up, dec, skip in zip(self.up, self.dec, reversed(skips)):
            x = dec(torch.cat([up(x), skip], dim=1))
        return self.head(x)


class BasicBlock(nn.Module):
    """torchvision's BasicBlock: `out += identity` and ReLU(inplace=True)."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += x
        return self.relu(out)


class TinyResNet(nn.Module):
    """A stem of conv, BatchNorm and ReLU(inplace=True), then BasicBlocks, pooled into a linear head."""

    def __init__(self, c: int = 8, blocks: int = 3) -> None:
        super().__init__()
        self.stem = nn.Sequential(*_conv_bn_relu(3, c))
        self.layers = nn.Sequential(*(BasicBlock(c) for _ in range(blocks)))
        self.fc = nn.Linear(c, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.layers(self.stem(x)).mean((2, 3)))


class Writes(nn.Module):
    """Blocks that each begin by writing into their input (the previous block's output) in place."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.proj = nn.Linear(d, d)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d)) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [N, d]
        x, n = self.proj(x), x.shape[0]  # the caller's tensor is not written
        rows = torch.arange(0, n, 2)
        for i, block in enumerate(self.blocks):
            if i == 0:
                x.index_add_(0, rows, x[1::2].detach() * 0.5)  # an MoE's gather of expert outputs
            elif i == 1:
                x.masked_fill_(x.detach() > 2.0, 2.0)
            elif i == 2:
                x[:, :8].copy_(x[:, 8:16] * 0.25)  # through a view
            else:
                x.mul_(0.5)
            x = x + block(x)
        return x


def unet():
    torch.manual_seed(0)
    return TinyUNet().train(), (torch.randn(2, 3, 16, 16),)


def resnet():
    torch.manual_seed(0)
    return TinyResNet().train(), (torch.randn(4, 3, 16, 16),)


def writes():
    torch.manual_seed(0)
    return Writes().train(), (torch.randn(256, 64),)


def mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                        num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
                        max_position_embeddings=32, use_cache=False)
    ids = torch.randint(0, 128, (2, 16))
    return MixtralForCausalLM(cfg).train(), {"input_ids": ids, "labels": ids}


MODELS = {"unet": unet, "resnet": resnet, "writes": writes, "mixtral": mixtral}


@pytest.mark.parametrize("name", ["unet", "resnet", "writes"])
def test_inplace_on_a_stage_input_profiles_as_the_whole_step(name):
    model, inputs = MODELS[name]()
    cap = capture(model, inputs)
    whole = profile(cap, dataclasses.replace(FLOPS, bounded=False))
    staged = profile(cap, dataclasses.replace(FLOPS, bounded=True))
    assert len(staged.stages) > 1
    assert [(s.producer, s.nbytes, s.saved_by, s.last_use) for s in staged.storages] == [
        (s.producer, s.nbytes, s.saved_by, s.last_use) for s in whole.storages]
    # the in-place writes allocate nothing a stage at a time either: the plain step's predicted peak is the
    # whole profile's (within the 2 % that the stages' own gradient seeds may move it)
    pw, ps = simulate(whole.to_problem(), ()).peak_bytes, simulate(staged.to_problem(), ()).peak_bytes
    assert abs(ps - pw) <= 0.02 * pw, (pw, ps)


def test_a_stage_that_writes_its_input_runs_from_the_same_values_each_time():
    """Timed runs of a stage that writes into its input start from the value the first run read, and the
    profile leaves the value written once, as one step does (not once per run)."""

    class Doubles(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x.mul_(2.0)  # [N, 16], the graph's input written in place, by the first stage
            for b in self.blocks:
                x = b(x)
            return x

    torch.manual_seed(0)
    model, x = Doubles(), torch.randn(8, 16)
    cap = capture(model, (x.clone(),))
    fake, _ = fake_profile(cap, FLOPS)
    assert len(stage_spans(fake)) > 1
    given = x.clone()
    measure_stages(cap.graph_module, [given], fake, device=torch.device("cpu"), warmup=1, repeats=3, timed=True,
                   allocator=True)
    assert torch.equal(given, 2.0 * x)


@pytest.mark.parametrize("name,fraction", [("unet", 0.5), ("unet", 0.9), ("resnet", 0.5), ("resnet", 0.8),
                                           ("writes", 0.5), ("mixtral", 0.5)])
def test_planned_below_the_plain_step_with_inplace_ops(name, fraction):
    model, inputs = MODELS[name]()
    try:
        plan = optimize(model, inputs, activation_budget=fraction, solver="dp", profile_config=FLOPS, autotune=False)
    except InfeasibleBudgetError as e:  # the fraction is below the floor: the floor, still below the plain step
        plan = optimize(model, inputs, budget_bytes=e.smallest_bytes, solver="dp", profile_config=FLOPS,
                        autotune=False)
    assert plan.stats.get("profile") == "stages"  # the budget is below the plain step: profiled a stage at a time
    report = verify(model, plan, inputs, repeats=1)
    assert report.grads_equal and report.outputs_equal and report.buffers_equal, report.differences
    assert report.measured_peak_bytes <= report.budget_bytes < report.baseline_measured_peak_bytes

"""A whole model in bf16, profiled a stage at a time (the budget is below the plain step): each Linear's
backward counts the same as in the whole step's profile. A backward's `t()` of a weight is a view of a
parameter; the stage's live-tensor meter did not know the parameters, so it counted the weight as a new
tensor, and the allocator's rise above the live tensors (oneDNN's bf16 matmul workspace) came out one weight
short: GPT-2's MLP projection by 32 KB, and its plans measured up to 2.3 % over their budget."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
from ckpt_planner.capture.trace import capture
from ckpt_planner.profile.profiler import ProfileConfig, profile

FLOPS = ProfileConfig(flop_times=True)  # deterministic times: the byte figures are what is checked
N, D, H = 128, 64, 256  # tokens, width, MLP width


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.act, self.down = nn.Linear(D, H), nn.GELU(), nn.Linear(H, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.act(self.up(x)))


class MLPStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x.float().square().mean()


def test_a_bf16_linear_backward_counts_the_same_a_stage_at_a_time():
    torch.manual_seed(0)
    model = MLPStack().to(torch.bfloat16)
    cap = capture(model, (torch.randn(N, D, dtype=torch.bfloat16),))
    whole = profile(cap, dataclasses.replace(FLOPS, bounded=False))
    staged = profile(cap, dataclasses.replace(FLOPS, bounded=True))
    assert len(staged.stages) > 1
    linears = [n.name for n in whole.nodes if n.name.endswith(("_up", "_down"))]  # the Linears
    assert linears
    temps = {c: {n.name: n.backward_temp_bytes for n in nodes.nodes} for c, nodes in (("w", whole), ("s", staged))}
    for name in linears:
        # the weight the stages used to subtract is H * D * 2 bytes; allow a few bytes of scalars
        assert abs(temps["w"][name] - temps["s"][name]) < H * D * 2 // 4, (name, temps["w"][name], temps["s"][name])

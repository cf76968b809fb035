"""A model planned in captured pieces keeps the hooks other code reads: a piece is one graph in place of
its module, so a module carrying a hook, or holding one that does, runs its own code and only its
hook-free children are captured. transformers collects MoE router logits this way and its loss reads them."""

import torch
import torch.nn as nn
from ckpt_planner import optimize, verify
from ckpt_planner.choose.partial import PartialPlanner

from tests.support.profiles import TIMED_ONCE


class Gate(nn.Module):
    """A router: its logits are read by the loss through a forward hook, never returned."""

    def __init__(self, d: int, experts: int = 4) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(experts, d) / d**0.5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = torch.nn.functional.linear(x, self.weight)
        return logits, logits.softmax(-1)


class MLP(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.gate = Gate(d)
        self.mlp = MLP(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        _, probs = self.gate(h)
        return x + self.mlp(h) * probs.max(-1, keepdim=True).values


class Routed(nn.Module):
    """A data-dependent branch (no whole capture) around blocks whose gates' logits feed an auxiliary loss."""

    def __init__(self, d: int = 32, blocks: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(16, d)
        self.stack = nn.Sequential(*[Block(d) for _ in range(blocks)])
        self.head = nn.Linear(d, 4)
        self.blocks, self.collected = blocks, []
        for block in self.stack:
            block.gate.register_forward_hook(lambda _m, _a, out: self.collected.append(out[0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.collected.clear()
        h = self.embed(x)
        h = self.stack(h if h.mean() > 0 else -h)  # on the values: a graph break
        aux = torch.stack([self.collected[k] for k in range(self.blocks)]).logsumexp(-1).pow(2).mean()
        return self.head(h).logsumexp(-1).mean() + 0.01 * aux


def test_a_hooked_submodule_is_never_inside_a_piece():
    torch.manual_seed(0)
    model, x = Routed(), torch.randn(128, 16)
    part = PartialPlanner(model, (x,), profile_config=TIMED_ONCE)
    paths = [p.path for p in part.pieces]
    assert "stack" not in paths and not any(p.endswith("gate") for p in paths)
    assert paths == [f"stack.{k}.mlp" for k in range(4)]  # the hook-free children are still planned
    assert "stack.0 (own code: hooks on stack.0.gate)" in part.left_out
    assert "stack.0.gate (own code: hooks on stack.0.gate)" in part.left_out


def test_the_loss_reads_what_the_hooks_collect_and_the_plan_is_exact():
    torch.manual_seed(0)
    model, x = Routed(), torch.randn(128, 16)
    gates = [block.gate for block in model.stack]
    part = PartialPlanner(model, (x,), profile_config=TIMED_ONCE)
    budget = int(part.problem.fixed_bytes + 0.8 * (part.baseline_peak_bytes - part.problem.fixed_bytes))
    plan = optimize(model, (x,), budget_bytes=budget, solver="dp", profile_config=TIMED_ONCE)
    assert plan.capture_method == "partial"
    calls = []
    handle = gates[0].register_forward_hook(lambda m, _a, _o: calls.append(m))
    try:
        plan.module(x).backward()  # before the fix: IndexError, the hooks never ran inside the captured stack
    finally:
        handle.remove()
    assert calls == [gates[0]]  # the model's own gate object ran, with a hook added after planning
    model.zero_grad(set_to_none=True)
    report = verify(model, plan, (x,), repeats=1)
    assert report.outputs_equal and report.grads_equal and report.buffers_equal, report
    assert report.max_abs_grad_diff == 0.0
    assert report.measured_peak_bytes <= plan.budget_bytes, report


def test_a_piece_output_the_eager_code_saves_is_counted_once():
    """The head's matmul saves the stack's output for its backward: that storage is counted with the
    stack, alive for the whole step, and not again as the eager code's saved activation."""
    from ckpt_planner.choose.partial import _eager_costs

    torch.manual_seed(0)
    stack, head = nn.Sequential(MLP(32), MLP(32)), nn.Linear(32, 4)
    model, x = nn.Sequential(stack, head), torch.randn(512, 32)
    eager = _eager_costs(model, (x,), {}, ["0"])
    piece_output = 512 * 32 * 4  # bytes, float32
    assert eager.saved[1] < piece_output, eager  # before: the head's saved input, 65,536 B, counted twice

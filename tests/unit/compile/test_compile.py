"""torch.compile (inductor, fullgraph) of checkpointed modules: no graph break, same gradients, memory kept low.

One small model with BatchNorm; compiling is slow on CPU, so every compile here
is shared by the tests that need it.
"""

import copy

import pytest
import torch
import torch.nn as nn
from ckpt_planner import optimize
from ckpt_planner.profile.memory import storage_key

from tests.support.profiles import FLOP_TIMES

TOL = {"rtol": 1e-4, "atol": 1e-5}  # inductor fuses and reorders float math


class BNChain(nn.Module):
    def __init__(self, d: int = 32, blocks: int = 4) -> None:
        super().__init__()
        self.blocks = nn.Sequential(
            *[nn.Sequential(nn.Linear(d, 4 * d), nn.BatchNorm1d(4 * d), nn.GELU(), nn.Linear(4 * d, d)) for _ in range(blocks)]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


def _saved_bytes_and_grads(module, params, x):
    """Bytes autograd keeps for backward (each storage once), and the gradients of one step."""
    seen: dict[int, int] = {}

    def pack(t):
        seen[storage_key(t)] = t.untyped_storage().nbytes()
        return t

    for p in params:
        p.grad = None
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(x)
    out.square().mean().backward()
    return sum(seen.values()), [p.grad.clone() for p in params]


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    model = BNChain()
    x = torch.randn(256, 32)
    plan = optimize(model, (x,), activation_budget=0.85, solver="uniform", profile_config=FLOP_TIMES)
    assert plan.regions
    eager = copy.deepcopy(model)
    eager_saved, eager_grads = _saved_bytes_and_grads(eager, list(eager.parameters()), x)
    baseline = copy.deepcopy(model)
    compiled_saved, _ = _saved_bytes_and_grads(torch.compile(baseline, fullgraph=True), list(baseline.parameters()), x)
    return model, x, plan, eager, eager_grads, eager_saved, compiled_saved


def test_compiled_plan_module_matches_eager_and_saves_memory(setup):
    model, x, plan, eager, eager_grads, eager_saved, compiled_saved = setup
    params = list(model.parameters())
    compiled = torch.compile(plan.module, fullgraph=True)  # fullgraph: any graph break raises
    saved, grads = _saved_bytes_and_grads(compiled, params, x)
    for g, ref in zip(grads, eager_grads):
        torch.testing.assert_close(g, ref, **TOL)
    for b, ref in zip(model.buffers(), eager.buffers()):  # BatchNorm statistics updated once
        torch.testing.assert_close(b, ref, **TOL)
    assert saved < compiled_saved, (saved, compiled_saved, eager_saved)


def test_compiled_applied_model_matches_eager_and_saves_memory(setup):
    _, x, plan, eager, eager_grads, eager_saved, compiled_saved = setup
    torch.manual_seed(0)
    model = BNChain()  # same initial state as the planned model
    app = plan.apply(model)
    assert app.modules
    compiled = torch.compile(model, fullgraph=True)
    saved, grads = _saved_bytes_and_grads(compiled, list(model.parameters()), x)
    for g, ref in zip(grads, eager_grads):
        torch.testing.assert_close(g, ref, **TOL)
    for b, ref in zip(model.buffers(), eager.buffers()):
        torch.testing.assert_close(b, ref, **TOL)
    assert saved < compiled_saved, (saved, compiled_saved, eager_saved)

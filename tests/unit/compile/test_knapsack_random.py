"""The knapsack lowering never recomputes a random draw (planner/compile/knapsack.py, `KeepRandomDraws`).

Compile's partitioner counts dropout among the ops a memory budget lets it recompute; outside checkpoint regions
nothing replays the forward's random state, so a recomputed dropout draws a second mask in the backward and the
gradient is not the forward's. With inductor's `fallback_random` the compiled forward draws the eager step's
masks, so the compiled gradients are compared with the eager ones.
"""

import pytest
import torch
import torch._inductor.config as inductor_config
import torch.nn as nn
from ckpt_planner.compile.knapsack import KnapsackSolver, draws_random, inductor_backend

TOL = {"rtol": 1e-4, "atol": 1e-6}


@pytest.fixture(autouse=True)
def _dynamo_clean():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Dropout(0.5), nn.Linear(64, 16))
                           for _ in range(2)])


def _grads(module: nn.Module, model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """Parameter gradients of one step of `module` (running `model`'s parameters), its masks drawn from seed 1."""
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(1)
    module(x).square().mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    return grads


def test_seeded_ops_draw_unless_their_probability_is_zero():
    aten = torch.ops.aten
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    sdpa = aten._scaled_dot_product_flash_attention_for_cpu.default
    calls = {  # op, args, kwargs -> draws random numbers
        "dropout": (aten.native_dropout.default, (x, 0.5, True), {}, True),
        "bernoulli": (aten.bernoulli.default, (x,), {}, True),
        "attention_dropout": (sdpa, (x, x, x, 0.1), {}, True),
        "attention_dropout_kw": (sdpa, (x, x, x), {"dropout_p": 0.1}, True),
        "attention_no_dropout": (sdpa, (x, x, x, 0.0), {}, False),
        "attention_default": (sdpa, (x, x, x), {}, False),  # dropout_p left at its default, 0.0
        "bernoulli_zero": (aten.bernoulli.p, (x, 0.0), {}, False),
        "linear": (aten.addmm.default, (x, x, x), {}, False),
    }
    for name, (op, args, kwargs, draws) in calls.items():
        assert draws_random(graph.call_function(op, args, kwargs)) is draws, name
    assert not draws_random(x)


@pytest.mark.parametrize("fallback_random", [True, False])
def test_knapsack_that_recomputes_everything_keeps_dropouts_masks(fallback_random):
    """fallback_random: the masks are aten's, the eager step's; without it, inductor draws them from a seed node,
    and the reference is the step compiled without a memory budget (whose partitioner recomputes no draw)."""
    model, x = _model(), torch.randn(32, 64, 16)
    solver = KnapsackSolver(0)  # no candidate kept saved: the partitioner may recompute each one
    with inductor_config.patch(fallback_random=fallback_random):
        ref = _grads(model if fallback_random else torch.compile(model, fullgraph=True), model, x)
        torch._dynamo.reset()
        got = _grads(torch.compile(model, backend=inductor_backend(solver), fullgraph=True), model, x)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, **TOL)
    assert solver.calls and solver.calls[0].candidates  # the partitioner asked, with ops it may recompute
    marked = solver.keep_random.marked
    assert marked and all(marked), marked  # the draws (or inductor's seeds) are marked must-save: no candidates
    drawn = set(marked[0])
    assert not any(c.name in drawn or "dropout" in c.op for call in solver.calls for c in call.candidates)

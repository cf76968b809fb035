"""The checkpointed module runs its aten calls bound to their operators, and torch.compile still traces it.

`planner/lower/fastcode.py` rewrites fx's `torch.ops.aten.x.default(...)` calls to the operator itself, so a
step pays no `OpOverload.__call__` frame per op. These tests count those frames in one training step
of a planned, exported GPT (dropout on, so regions replay the generator), check outputs and every
gradient bitwise against the model and against fx's own code, and compile the module with
`fullgraph=True`, which fails on a call dynamo cannot trace.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.fx as fx
from ckpt_planner.capture.trace import capture
from ckpt_planner.lower.fastcode import bound_forward
from ckpt_planner.lower.rewrite import CheckpointRegion, rewrite

from tests.models.examples import TinyGPT

LAYERS, SEQ, VOCAB = 2, 16, 64


@functools.cache
def _model_and_inputs():
    """One model for the whole file, captured once (`_captured`): the export was most of each test's time.
    The tests only read the model (each step clears the gradients and seeds the generator first), and every
    `_planned` call rewrites a copy of the captured graph into a new module."""
    torch.manual_seed(0)
    model = TinyGPT(vocab=VOCAB, d=32, layers=LAYERS, heads=2, seq=SEQ, dropout=0.1).train()
    idx = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    return model, (idx, idx)


@functools.cache
def _captured():
    model, inputs = _model_and_inputs()
    return capture(model, inputs, method="export")


def _planned(model, inputs):
    assert model is _model_and_inputs()[0]
    cap = _captured()
    n = sum(1 for node in cap.graph_module.graph.nodes if node.op == "call_function")
    third = n // 3
    return rewrite(cap.graph_module, [(third, 2 * third)], model=model)


def _with_fx_code(module):
    """The same module running fx's own code (OpOverload calls) in its regions and at the top."""
    for m in module.modules():
        if isinstance(m, CheckpointRegion):
            object.__setattr__(m, "_fn", m._traced_fn)
    fx.GraphModule.recompile(module)
    return module


def _step(module, params, inputs):
    for p in params:
        p.grad = None
    torch.manual_seed(7)
    out = module(*inputs)
    out.backward()
    return out.detach(), [p.grad.clone() for p in params]


class _CountOverloadCalls:
    def __init__(self, monkeypatch):
        self.calls = 0
        original = torch._ops.OpOverload.__call__

        def counted(op, *args, **kwargs):
            self.calls += 1
            return original(op, *args, **kwargs)

        monkeypatch.setattr(torch._ops.OpOverload, "__call__", counted)


def test_a_step_makes_no_overload_calls_and_matches_fx_code_bitwise(monkeypatch):
    model, inputs = _model_and_inputs()
    params = list(model.parameters())
    expected_out, expected_grads = _step(model, params, inputs)
    fast = _planned(model, inputs)
    assert any(isinstance(m, CheckpointRegion) for m in fast.modules())
    slow = _with_fx_code(_planned(model, inputs))
    counter = _CountOverloadCalls(monkeypatch)
    out, grads = _step(fast, params, inputs)
    fast_calls, counter.calls = counter.calls, 0
    slow_out, slow_grads = _step(slow, params, inputs)
    assert fast_calls == 0
    assert counter.calls > 50  # fx's code goes through OpOverload.__call__ once per aten call
    for got in ((out, grads), (slow_out, slow_grads)):
        assert torch.equal(got[0], expected_out)
        assert all(torch.equal(a, b) for a, b in zip(got[1], expected_grads))


def test_a_deep_copy_and_a_recompile_keep_the_bound_code(monkeypatch):
    model, inputs = _model_and_inputs()
    twin = copy.deepcopy(_planned(model, inputs))
    twin.recompile()
    counter = _CountOverloadCalls(monkeypatch)
    _step(twin, list(twin.parameters()), inputs)
    assert counter.calls == 0


def test_aten_calls_are_bound_and_other_calls_run_as_fx_wrote_them(monkeypatch):
    """A symbolically traced graph mixes an aten overload with torch functions and methods: only the
    overload is bound, and the rest still run (same result as fx's code)."""

    class Small(torch.nn.Module):
        def forward(self, x):
            return torch.relu(x) + torch.ops.aten.sin.default(x) * x.cos()

    gm = fx.symbolic_trace(Small())
    forward = bound_forward(gm.graph)
    x = torch.randn(5)
    counter = _CountOverloadCalls(monkeypatch)
    expected = gm(x)
    assert counter.calls == 1  # fx's code: the one aten overload goes through OpOverload.__call__
    counter.calls = 0
    assert torch.equal(forward(gm, x), expected)
    assert counter.calls == 0


def test_torch_compile_traces_the_checkpointed_module_whole():
    model, inputs = _model_and_inputs()
    params = list(model.parameters())
    expected_out, expected_grads = _step(model, params, inputs)
    compiled = torch.compile(_planned(model, inputs), backend="aot_eager", fullgraph=True)
    out, grads = _step(compiled, params, inputs)
    torch.testing.assert_close(out, expected_out)
    for a, b in zip(grads, expected_grads):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("grad", [False, True])
def test_no_grad_and_grad_calls_give_the_models_output(grad):
    model, inputs = _model_and_inputs()
    module = _planned(model, inputs)
    with torch.set_grad_enabled(grad):
        torch.manual_seed(3)
        expected = model(*inputs)
        torch.manual_seed(3)
        got = module(*inputs)
    assert torch.equal(got, expected)


def test_each_checkpointed_module_is_its_own_code_to_dynamo():
    """Dynamo keeps compiled code per code object: were the forward one function shared by every
    checkpointed module, each new module would count as a recompile of it (`compile=True` compiles each
    plan's forward, and its sweeps compile dozens of plans of one model)."""
    model, inputs = _model_and_inputs()
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=2):
        for _ in range(4):
            compiled = torch.compile(_planned(model, inputs).forward, backend="eager", fullgraph=True)
            with torch.no_grad():
                compiled(*inputs)
    torch._dynamo.reset()

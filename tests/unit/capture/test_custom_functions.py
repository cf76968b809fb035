"""Custom autograd.Functions captured by torch.export stay one node each, running their own backward.

Before, export traced into a Function's forward (its backward lost), so such models were refused
whenever symbolic_trace could not take them (BLOOM's GeLUFunction), and planned in eager pieces.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from ckpt_planner.api import Planner
from ckpt_planner.capture.trace import capture
from ckpt_planner.lower.rewrite import rewrite
from ckpt_planner.profile.profiler import ProfileConfig, profile
from ckpt_planner.solvers.heuristics.basic import segment_runs

FLOPS = ProfileConfig(warmup=0, repeats=1, flop_times=True)  # deterministic costs


class SaveInput(torch.autograd.Function):
    """Saves its input; its backward is a straight-through clamp, not the autograd of its forward
    (round's gradient is 0), so a graph that traced into it would give other gradients."""

    @staticmethod
    def forward(ctx, x, scale: int):
        ctx.save_for_backward(x)
        ctx.scale = scale
        return torch.round(x * scale) / scale

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * (x.abs() <= 1).to(grad.dtype), None


class SaveIntermediate(torch.autograd.Function):
    """Saves a tensor it makes (tanh of its input), 2 outputs; a backward written by hand."""

    @staticmethod
    def forward(ctx, x):
        t = torch.tanh(x)
        ctx.save_for_backward(t)
        return t * 2, t.sum(-1)

    @staticmethod
    def backward(ctx, g2, gs):
        (t,) = ctx.saved_tensors
        return (g2 * 2 + gs.unsqueeze(-1)) * (1 - t * t) * 0.5  # scaled by half: not the true derivative


class TwoFunctions(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.ModuleList(nn.Linear(32, 32) for _ in range(3))

    def forward(self, x):
        for _ in range(x.size(0) // x.size(0)):  # a loop over a size: symbolic_trace cannot, export can
            pass
        for fc in self.fc:
            h = SaveInput.apply(fc(x), x.size(-1) // 8)
            y, s = SaveIntermediate.apply(h)
            x = y + s.unsqueeze(-1) * 0.01
        return x.square().mean()


def _grads(module, params, x):
    for p in params:
        p.grad = None
    loss = module(x)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in params]


def test_export_keeps_each_function_as_one_node_with_its_backward():
    torch.manual_seed(0)
    model, x = TwoFunctions(), torch.randn(16, 32)
    cap = capture(model, (x,))
    assert cap.method == "export"
    targets = [getattr(n.target, "__name__", "") for n in cap.graph_module.graph.nodes if n.op == "call_function"]
    assert targets.count("apply_SaveInput") == 3 and targets.count("apply_SaveIntermediate") == 3
    assert not any("round" in t or "tanh" in t for t in targets)  # the forwards are not traced into
    params = list(model.parameters())
    want_loss, want = _grads(model, params, x)
    got_loss, got = _grads(cap.graph_module, params, x)
    assert torch.equal(want_loss, got_loss)
    assert all(torch.equal(a, b) for a, b in zip(want, got))


def test_profile_counts_what_each_function_saves():
    torch.manual_seed(0)
    model, x = TwoFunctions(), torch.randn(16, 32)
    cap = capture(model, (x,))
    cost = profile(cap, FLOPS)
    names = [n.name for n in cost.nodes]
    inter = [i for i, n in enumerate(names) if "save_intermediate" in n]
    save_in = [i for i, n in enumerate(names) if "save_input" in n]
    assert len(inter) == 3 and len(save_in) == 3
    act = 16 * 32 * 4  # one fp32 activation of the model (bytes)
    for i in inter:  # tanh's output, made inside the Function and saved by it
        assert any(st.producer == i and i in st.saved_by and st.nbytes == act for st in cost.storages)
    for i in save_in:  # its input, made by the Linear before it
        assert any(st.producer == i - 1 and i in st.saved_by and st.nbytes == act for st in cost.storages)


def test_checkpointed_functions_give_the_same_gradients():
    torch.manual_seed(0)
    model, x = TwoFunctions(), torch.randn(16, 32)
    planner = Planner(model, (x,), capture_method="export", profile_config=FLOPS)
    regions = segment_runs(planner.problem)
    assert regions
    module = rewrite(planner.capture.graph_module, regions, model=model)
    params = list(model.parameters())
    want_loss, want = _grads(model, params, x)
    got_loss, got = _grads(module, params, x)
    assert torch.equal(want_loss, got_loss)
    assert all(torch.equal(a, b) for a, b in zip(want, got))


def test_bloom_captures_whole_with_its_gelu_function():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.BloomConfig(vocab_size=256, hidden_size=64, n_layer=3, n_head=4, use_cache=False)
    model = transformers.BloomForCausalLM(cfg).train()
    ids = torch.randint(0, 256, (2, 16))
    cap = capture(model, {"input_ids": ids, "labels": ids})
    assert cap.method == "export"
    code = cap.graph_module.code
    assert code.count("apply_GeLUFunction") == 3
    params = list(model.parameters())
    torch.manual_seed(1)
    want = model(input_ids=ids, labels=ids).loss
    want.backward()
    want_grads = [p.grad.clone() for p in params]
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    got = cap.graph_module(input_ids=ids, labels=ids).loss
    got.backward()
    assert torch.equal(want, got)
    assert all(torch.equal(a, p.grad) for a, p in zip(want_grads, params))


class _WritesInPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.mark_dirty(x)
        return x.mul_(2)

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


class _InPlaceModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        for _ in range(x.size(0) // x.size(0)):  # export only
            pass
        return _WritesInPlace.apply(self.fc(x)).sum()


def test_function_writing_in_place_is_refused_not_planned_as_out_of_place():
    # One opaque node would hide the write from the planner, which could then recompute it twice.
    from ckpt_planner.errors import CaptureError

    with pytest.raises(CaptureError, match=r"_WritesInPlace writes into its input in place"):
        capture(_InPlaceModel(), (torch.randn(4, 8),))

"""One training step of a model or its checkpointed module from a fixed state, and the bitwise comparison
of two such steps (outputs, every gradient, every buffer): what the hazard and selective tests assert."""

from __future__ import annotations

import contextlib

import torch
from ckpt_planner.profile.loss import default_loss
from torch.utils import _pytree as pytree

METHODS = ["symbolic_trace", "export"]
"""Both capture paths."""


def as_call(inputs):
    if isinstance(inputs, dict):
        return (), inputs
    if isinstance(inputs, torch.Tensor):
        return (inputs,), {}
    return tuple(inputs), {}


def step(module, model, inputs, *, seed=0, ctx=contextlib.nullcontext):
    """One forward + backward of `module` from a fixed RNG seed; (output, grads, buffers) of `model`."""
    args, kwargs = as_call(inputs)
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(seed)
    with ctx():
        out = module(*args, **kwargs)
        loss = default_loss(out)
    loss.backward()
    grads = {n: (None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()}
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    out = pytree.tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, out)
    for p in model.parameters():
        p.grad = None
    return out, grads, buffers


def same(a, b) -> bool:
    la, sa = pytree.tree_flatten(a)
    lb, sb = pytree.tree_flatten(b)
    if len(la) != len(lb):
        return False
    for x, y in zip(la, lb):
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
                return False
            if x.shape != y.shape or x.dtype != y.dtype or not torch.equal(x, y):
                return False
        elif x != y:
            return False
    return True


def compare(model, module, inputs, **kw) -> tuple[bool, bool, bool]:
    """(outputs, grads, buffers) equal after one step of each, both starting from the same buffers."""
    start = {n: b.clone() for n, b in model.named_buffers()}
    ref = step(model, model, inputs, **kw)
    with torch.no_grad():
        for n, b in model.named_buffers():
            b.copy_(start[n])
    got = step(module, model, inputs, **kw)
    return same(ref[0], got[0]), same(ref[1], got[1]), same(ref[2], got[2])

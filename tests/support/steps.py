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


def as_on_a_backward_thread(loss_fn=default_loss):
    """`loss_fn` whose loss's backward sees autocast as autograd's device thread does on CUDA: outside any
    autocast context of its own, so that a recompute entering and leaving autocast empties the cache of
    parameter casts the whole process shares. The caller's nesting is taken down to zero when the backward
    starts (a hook on the loss) and restored when it ends (an engine callback); nothing else changes."""

    def loss_of(out):
        loss = loss_fn(out)

        def outside_autocast(grad):
            levels = 1
            while torch.autocast_decrement_nesting() > 0:
                levels += 1

            def restore():
                for _ in range(levels):
                    torch.autocast_increment_nesting()

            torch.autograd.Variable._execution_engine.queue_callback(restore)
            return grad

        loss.register_hook(outside_autocast)
        return loss

    return loss_of

"""Checks shared by the compiled-plan tests: gradients of one step, and that a compiled module trains."""

import torch


def step_grads(module, model, x) -> list[torch.Tensor]:
    """The parameter gradients of one step of `module` (which runs `model`'s parameters) on `x`."""
    for p in model.parameters():
        p.grad = None
    module(x).square().mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    return grads


def assert_trains(module, model, x) -> None:
    """An optimizer made on `model`'s parameters steps them through `module` and the loss falls; the
    parameters are put back afterwards."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    losses = []
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        loss = module(x).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    with torch.no_grad():
        for p, b in zip(model.parameters(), before):
            p.copy_(b)

"""Snapshot and restore what planning must not change: buffers, grads, mode, RNG."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["ModelState", "rng_preserved", "step_undone"]


@contextlib.contextmanager
def rng_preserved() -> Iterator[None]:
    """Restore the CPU and CUDA generators afterwards (profiling runs dropout), and numpy's and Python's
    global generators (model code may draw from them: transformers' SpecAugment masks use numpy)."""
    import random

    import numpy as np

    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    host = (np.random.get_state(), random.getstate())
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        np.random.set_state(host[0])
        random.setstate(host[1])


class ModelState:
    """Buffers (values), parameter grads, train/eval flags of every submodule, and RNG."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    @contextlib.contextmanager
    def preserved(self) -> Iterator[None]:
        model = self.model
        buffers = [
            (b, b.detach().clone()) for b in model.buffers() if b.device.type != "meta" and not _is_fake(b)
        ]
        grads = [(p, p.grad) for p in model.parameters()]
        modes = [(m, m.training) for m in model.modules()]
        with rng_preserved():
            try:
                for p, _ in grads:  # a backward inside would accumulate into the user's grad tensors in place
                    p.grad = None
                yield
            finally:
                with torch.no_grad():
                    for b, saved in buffers:
                        if b.shape == saved.shape:
                            b.copy_(saved)
                for p, g in grads:
                    p.grad = g
                for m, mode in modes:
                    m.training = mode


@contextlib.contextmanager
def step_undone(module: object, params: list[torch.nn.Parameter], state: list[torch.Tensor]) -> Iterator[None]:
    """Put back what a training step run inside changes: the buffers (BatchNorm's statistics; those in
    `state` that are not `params`, and `module`'s where it is a module), the generators, and the gradients
    of `params` (None). For a step run twice, once per meter, that must leave one step's effects."""
    owned = list(module.buffers()) if isinstance(module, torch.nn.Module) else []
    trained = {id(p) for p in params}
    buffers = {id(t): t for t in [*state, *owned] if not isinstance(t, torch.nn.Parameter) and id(t) not in trained
               and t.device.type != "meta" and not _is_fake(t)}
    saved = [(t, t.detach().clone()) for t in buffers.values()]
    with rng_preserved():
        try:
            yield
        finally:
            with torch.no_grad():
                for t, value in saved:
                    if t.shape == value.shape:
                        t.copy_(value)
            for p in params:
                p.grad = None


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)

"""The loss a measured step takes its backward from, when the caller gives none.

Profiling (the backward's temporaries), verification and the compiled step's measurement all
train one step the same way; this is that step's loss, in a module of its own so that none of
them imports another for it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["default_loss"]


def default_loss(output: Any) -> torch.Tensor:
    """The model's `loss` when it returns one, else the sum of its floating outputs."""
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        return loss
    terms = [
        t.sum()
        for t in pytree.tree_leaves(output)
        if isinstance(t, torch.Tensor) and t.requires_grad and (t.is_floating_point() or t.is_complex())
    ]
    if not terms:
        raise ValueError("output: no floating tensor that requires grad, nothing to train")
    total = terms[0]
    for t in terms[1:]:
        total = total + t
    return total

"""A chosen plan run in place: the model object stays, its forward runs the plan's own module.

`Plan.apply` checkpoints whole submodules, which is the plan only when its regions follow module
boundaries. Training loops that own the model object (HF Trainer, Lightning) can run the plan
itself instead: `run_in_place` swaps the forward of that one instance for a call to `plan.module`,
which shares every parameter and buffer with it (same tensor objects), so the optimizer, the
`state_dict` keys, `save_pretrained` and the hooks on the model itself see the same model. The
swapped forward runs the plan only in training with grad enabled (the capture baked the training
flags of dropout and BatchNorm in); eval and no-grad calls run the model's own forward.
`restore_forward` undoes it.

Where only whole modules can be checkpointed, the plans to choose from are searched in
`choose/regions.py` (`module_candidates`, `best_module_plan`).

`executed_regions` reads back what a checkpointed module runs (each region's first and last node
and its kept ops), to hold against the plan's regions.
"""

from __future__ import annotations

import operator
import types
from collections.abc import Callable
from typing import Any

import torch

from .rewrite import CheckpointRegion
from .selective import keep_begin, keep_end

__all__ = [
    "run_in_place", "restore_forward", "running_module", "executed_regions",
]

_PLANNED = "_ckpt_planner_planned"  # instance attribute: (the planned module, the forward it replaced)


def run_in_place(model: torch.nn.Module, planned: torch.nn.Module,
                 call: Callable[..., Any] | None = None) -> None:
    """Make `model`'s forward (this instance only) run `planned` in training, its own forward otherwise.

    `call(planned, previous, args, kwargs)` replaces the plain `planned(*args, **kwargs)` (the callbacks
    use it to bind arguments and measure). Raises ValueError when `model` already runs a plan.
    """
    if _PLANNED in model.__dict__:
        raise ValueError(f"{type(model).__name__} already runs a plan in place; restore_forward(model) first")
    previous = model.__dict__.get("forward")
    own = previous if previous is not None else type(model).forward.__get__(model, type(model))

    def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if not (self.training and torch.is_grad_enabled()):
            return own(*args, **kwargs)
        if call is not None:
            return call(planned, own, args, kwargs)
        return planned(*args, **kwargs)

    model.__dict__[_PLANNED] = (planned, previous)
    model.forward = types.MethodType(forward, model)


def restore_forward(model: torch.nn.Module) -> bool:
    """Undo `run_in_place`; True when there was something to undo."""
    entry = model.__dict__.pop(_PLANNED, None)
    if entry is None:
        return False
    previous = entry[1]
    if previous is not None:
        model.forward = previous
    else:
        model.__dict__.pop("forward", None)
    return True


def running_module(model: torch.nn.Module) -> torch.nn.Module | None:
    """The planned module `model`'s forward runs in training (None when it runs its own code)."""
    entry = model.__dict__.get(_PLANNED)
    return entry[0] if entry is not None else None


# -- what a checkpointed module runs ---------------------------------------------------


def _ends(region: CheckpointRegion, regions: dict[str, CheckpointRegion], last: bool) -> str:
    """Name of the region's first (or last) graph node, looking through nested regions and their unpacking."""
    nodes = [n for n in region.graph.nodes if n.op in ("call_function", "call_method", "call_module")
             and n.target not in (keep_begin, keep_end)]  # a kept node's markers are not the plan's nodes
    if last:
        nodes.reverse()
    for node in nodes:
        if last and node.op == "call_function" and node.target is operator.getitem:
            source = node.args[0]
            if isinstance(source, torch.fx.Node) and source.op == "call_module" and source.target in regions:
                continue  # unpacking a nested region's outputs
        if node.op == "call_module" and node.target in regions:
            return _ends(regions[node.target], regions, last)
        return node.name
    return ""


def executed_regions(module: torch.nn.Module) -> list[tuple[str, str, frozenset[str]]]:
    """(first node, last node, kept nodes) of each checkpoint region `module` runs, sorted; the kept nodes
    by name, as a plan's `saved_ops` names them (those its graph marks with `keep_begin`).

    Region submodules are looked up by their name on the checkpointed root (nested ones included), so
    the result reads the graph that runs, not the plan it came from.
    """
    regions = {name: m for name, m in module.named_modules() if isinstance(m, CheckpointRegion)}
    by_target = {name.rsplit(".", 1)[-1]: m for name, m in regions.items()}
    out = [(_ends(m, by_target, False), _ends(m, by_target, True), _kept(m)) for m in regions.values()]
    return sorted(out, key=lambda r: (r[0], r[1], sorted(r[2])))


def _kept(region: CheckpointRegion) -> frozenset[str]:
    """Names of the nodes a region's graph keeps: each follows a `keep_begin` marker."""
    return frozenset(n.next.name for n in region.graph.nodes if n.op == "call_function" and n.target is keep_begin)

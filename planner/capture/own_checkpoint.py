"""What a model does on its own that planning must know: its own checkpointing, an eval-mode export.

A model may call `torch.utils.checkpoint.checkpoint` in its forward, or switch
it on through a library flag (HF `gradient_checkpointing_enable()`, timm
`grad_checkpointing`). Capture inlines those calls (symbolic_trace and
torch.export both trace through them), so the captured graph is the model
*without* its checkpointing. Here the calls are found, with the graph nodes
they covered where that is known, so that the baseline is the model as given
and a plan can keep or replace them.

An `ExportedProgram` keeps the train/eval mode it was exported in: dropout
and BatchNorm in inference form in its graph mean there is no training step
to plan.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.utils.checkpoint as torch_checkpoint
from torch.utils import _pytree as pytree

from ..errors import UnplannableError

__all__ = ["OwnCheckpoint", "recording_checkpoints", "check_training_graph", "own_spans"]


@dataclass(frozen=True)
class OwnCheckpoint:
    """One `torch.utils.checkpoint` call the model makes by itself."""

    module: str
    """Path of the module the checkpointed function belongs to ('' for the root or a plain function)."""
    first_node: str = ""
    last_node: str = ""
    """First and last compute node of the captured graph the call covered ('' when not known)."""


def _owner_path(fn: Any, paths: dict[int, str]) -> str | None:
    """Path of the module a checkpointed callable runs: the module itself, a bound method of it, or
    a partial of either, or of a function whose first bound argument is the module (HF layers)."""
    f = fn
    while isinstance(f, functools.partial):
        if f.args and isinstance(f.args[0], torch.nn.Module):
            return paths.get(id(f.args[0]))
        f = f.func
    owner = f if isinstance(f, torch.nn.Module) else getattr(f, "__self__", None)
    return paths.get(id(owner)) if owner is not None else None


def _graph_of(values: Any) -> fx.Graph | None:
    proxy = next((a for a in pytree.tree_leaves(values) if isinstance(a, fx.Proxy)), None)
    return proxy.tracer.graph if proxy is not None else None


_COMPUTE = ("call_function", "call_method", "call_module")


@contextlib.contextmanager
def recording_checkpoints(model: torch.nn.Module, calls: list[OwnCheckpoint]) -> Iterator[None]:
    """Within: every checkpoint call (non-reentrant and reentrant) is appended to `calls`.

    While symbolic_trace runs, the graph nodes a non-reentrant call adds are recorded too.
    """
    paths = {id(m): p for p, m in model.named_modules()}
    generator = torch_checkpoint._checkpoint_without_reentrant_generator
    reentrant = torch_checkpoint.CheckpointFunction
    had_apply = "apply" in reentrant.__dict__
    old_apply = reentrant.__dict__.get("apply")

    def recorded(fn, *args: Any, **kwargs: Any):
        graph = _graph_of((args, kwargs))
        before = set(graph.nodes) if graph is not None else set()
        yield from generator(fn, *args, **kwargs)
        first = last = ""
        if graph is not None:
            added = [n for n in graph.nodes if n not in before and n.op in _COMPUTE]
            if added:
                first, last = added[0].name, added[-1].name
        calls.append(OwnCheckpoint(module=_owner_path(fn, paths) or "", first_node=first, last_node=last))

    def apply(cls, function, *args: Any):
        calls.append(OwnCheckpoint(module=_owner_path(function, paths) or ""))
        return torch.autograd.Function.apply.__func__(cls, function, *args)

    torch_checkpoint._checkpoint_without_reentrant_generator = recorded
    reentrant.apply = classmethod(apply)
    try:
        yield
    finally:
        torch_checkpoint._checkpoint_without_reentrant_generator = generator
        if had_apply:
            reentrant.apply = old_apply
        else:
            del reentrant.apply


def own_spans(
    calls: Sequence[OwnCheckpoint], names: Sequence[str], modules: Sequence[str], recomputable: Sequence[bool]
) -> tuple[list[tuple[int, int]], list[str]]:
    """Node spans (first, last) of the model's own checkpoint calls, and the calls that could not be placed.

    names/modules/recomputable: per compute node of the captured graph. A call is placed by the
    nodes it covered when known, else by its module's nodes when they form one contiguous run.
    """
    index = {n: i for i, n in enumerate(names)}
    spans: list[tuple[int, int]] = []
    unplaced: list[str] = []
    for call in dict.fromkeys(calls):
        span = None
        if call.first_node in index and call.last_node in index:
            span = (index[call.first_node], index[call.last_node])
        elif call.module:
            idx = [i for i, m in enumerate(modules) if m == call.module or m.startswith(call.module + ".")]
            if idx and idx[-1] - idx[0] + 1 == len(idx):
                span = (idx[0], idx[-1])
        if span is None or not all(recomputable[span[0] : span[1] + 1]):
            unplaced.append(call.module or "a function")
            continue
        if span not in spans:
            spans.append(span)
    return spans, unplaced


# Ops whose inference form in an exported graph shows it was exported in eval mode: op -> index of
# the `training`/`train` argument (None: the op exists only in inference form).
_EVAL_FORMS = {
    "aten.batch_norm.default": 5,
    "aten.dropout.default": 2,
    "aten.native_dropout.default": 2,
    "aten.feature_dropout.default": 2,
    "aten.alpha_dropout.default": 2,
    "aten.feature_alpha_dropout.default": 2,
    "aten._native_batch_norm_legit_no_training.default": None,
}


def check_training_graph(model: torch.nn.Module) -> None:
    """Refuse a GraphModule (an `ExportedProgram.module()`) whose graph was exported in eval mode.

    The graph keeps the mode it was exported in: dropout off and BatchNorm on running statistics
    cannot be switched back by `train()`, so the step it runs is not a training step. Refused when
    every dropout/BatchNorm op of the graph is in inference form (a model exported in training mode
    with some BatchNorm frozen on purpose keeps the others in training form).
    """
    if not isinstance(model, fx.GraphModule):
        return
    first = None
    for node in model.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        key = f"aten.{node.target._opname}.{node.target._overloadname}" if node.target.namespace == "aten" else ""
        if key not in _EVAL_FORMS:
            continue
        pos = _EVAL_FORMS[key]
        if pos is not None:
            train = node.args[pos] if len(node.args) > pos else node.kwargs.get("training", node.kwargs.get("train"))
            if train is not False:
                return  # a training-form op: the graph was exported in training mode
        first = first or (node, key)
    if first is not None:
        node, key = first
        what = "BatchNorm uses running statistics" if "batch_norm" in key else "dropout is off"
        raise UnplannableError(
            f"model: the graph was exported in eval mode (node {node.name}: {what}), so it has no training step "
            "to plan; call model.train() before torch.export.export and plan the new file"
        )

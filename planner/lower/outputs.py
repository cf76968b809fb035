"""optimize(..., outputs="loss"): the planned model returns its loss and none of its other outputs.

A model that returns its logits (transformers' `CausalLMOutput.logits`: sequence x vocabulary, fp32)
keeps them alive through the whole backward, and a chunked cross-entropy (chunk.py) must still make them
whole to return them. Liger and Cut-Cross-Entropy users train on the loss alone; `loss_outputs` gives
the planner that model: a shallow copy of it (the same parameters, buffers, submodules and state_dict
keys) whose forward returns the model's output with `loss` alone set. It is what is captured, profiled,
checked and lowered, so the graph's outputs are the loss only, and every step compared is the loss's.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import torch

from ..capture.trace import normalize_inputs
from ..errors import InputError

__all__ = ["loss_outputs", "loss_only", "returns_loss_only", "no_loss"]

_CLASSES: dict[type, type] = {}
"""Model class -> its loss-only subclass (one per class, so two plans of one model see the same type)."""



def no_loss() -> InputError:
    """The one-line refusal of outputs="loss" for a model that computes no loss (a function, not a module
    constant: the capture would record a constant the forward reads as a value to guard)."""
    return InputError('outputs="loss": the model returned no loss (a transformers model computes one when given '
                      '`labels`); pass the labels or keep outputs="all"')


def _loss_of(output: Any) -> torch.Tensor | None:
    """The loss a model's output carries: its `loss` field, or the output itself when it is a 0-dim tensor."""
    if isinstance(output, torch.Tensor):
        return output if output.dim() == 0 else None
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    return loss if isinstance(loss, torch.Tensor) else None


def loss_only(output: Any) -> Any:
    """`output` with every field other than `loss` None: a ModelOutput or dataclass of the same type (its
    other fields at their None default), a dict with the same keys, or a 0-dim tensor as it is. Raises
    InputError (no_loss) when the output carries no loss."""
    loss = _loss_of(output)
    if loss is None:
        raise no_loss()
    if output is loss:
        return loss
    if isinstance(output, Mapping) and not dataclasses.is_dataclass(output):
        return type(output)({k: (loss if k == "loss" else None) for k in output})
    try:
        return type(output)(loss=loss)  # ModelOutput: the fields left None are not even keys
    except TypeError:
        return loss  # a type whose other fields are required: the loss alone


def returns_loss_only(model: torch.nn.Module) -> bool:
    """Whether `model` is a `loss_outputs` copy."""
    return type(model) in _CLASSES.values()


def _loss_class(cls: type) -> type:
    sub = _CLASSES.get(cls)
    if sub is None:
        # functools.wraps keeps the model's forward signature (export binds keyword inputs by it)
        @functools.wraps(cls.forward)
        def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            return loss_only(cls.forward(self, *args, **kwargs))

        sub = type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__,
                                          "__qualname__": cls.__qualname__})
        _CLASSES[cls] = sub
    return sub


def _check_loss(model: torch.nn.Module, example_inputs: Any) -> None:
    """Refuse (no_loss) a model whose output on the example carries no loss, judged by one forward on fake
    tensors (nothing runs, nothing of the model changes); a forward that cannot run there is not judged
    here: the capture runs it and reports its own error."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    args, kwargs = normalize_inputs(example_inputs, model)
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad():
            output = model(*args, **kwargs)
    except Exception:  # noqa: BLE001 - not every forward runs on fake tensors; the capture judges those
        return
    if _loss_of(output) is None:
        raise no_loss()


def loss_outputs(model: torch.nn.Module, example_inputs: Any = None) -> torch.nn.Module:
    """A shallow copy of `model` whose forward returns `loss_only` of the model's output: the same parameter,
    buffer and submodule objects (and state_dict keys), an instance of a subclass of the model's class
    with its name. The model itself is left as it was. A copy is returned as it is. Raises InputError
    (no_loss) when the model's output on `example_inputs` carries no loss."""
    if returns_loss_only(model):
        return model
    _check_loss(model, example_inputs)
    twin = copy.copy(model)
    for field in ("_parameters", "_buffers", "_modules"):  # own dicts of the same objects: a change to the
        twin.__dict__[field] = dict(model.__dict__[field])  # copy's attributes leaves the model's as they are
    twin.__class__ = _loss_class(type(model))
    return twin

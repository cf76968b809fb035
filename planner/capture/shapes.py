"""Input shapes other than the planned one.

A plan is made for the example inputs, taken as the largest shape the model
will see. The capture marks every tensor dimension dynamic (`Dim.AUTO`:
torch.export keeps a dimension symbolic unless the model pins it), so the
checkpointed module runs any smaller batch or sequence length with the
same regions; activations only shrink, so the peak stays under the budget
(peak memory is monotone in batch and sequence length for these models).

A call with a larger dimension is refused with `ShapeError`, naming the
planned shape, or, with `on_larger_shape="replan"`, planned again at that
shape with the same budget and settings, cached per shape. A smaller shape
the captured graph cannot take (a capture whose dimensions stayed static)
is planned again the same way, whatever the setting.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import io
import logging
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.utils import _pytree as pytree

from ..errors import InputError, ShapeError
from ..settings import ON_LARGER_SHAPE

__all__ = ["ShapeError", "ShapeGuard", "InputShapes", "input_shapes", "dynamic_shapes_for", "export_dynamic", "ON_LARGER_SHAPE", "guard_model"]



@dataclass(frozen=True)
class InputShapes:
    """The tensor shapes of one call, by input path (`input_ids`, `[0]`, `['pixel_values']`)."""

    shapes: tuple[tuple[str, tuple[int, ...]], ...]

    def __str__(self) -> str:
        return ", ".join(f"{path} {list(shape)}" for path, shape in self.shapes)

    def larger_than(self, planned: InputShapes) -> list[str]:
        """Inputs with a dimension above the planned one (or a different rank, or not planned at all)."""
        known = dict(planned.shapes)
        out = []
        for path, shape in self.shapes:
            ref = known.get(path)
            if ref is None or len(ref) != len(shape) or any(a > b for a, b in zip(shape, ref)):
                out.append(f"{path} {list(shape)} (planned {list(ref) if ref is not None else 'none'})")
        return out


def input_shapes(args: tuple, kwargs: dict[str, Any]) -> InputShapes:
    """The shapes of every tensor in (args, kwargs), keyed by where it sits (`args[0]`, `input_ids`)."""
    named = [(f"args[{i}]", a) for i, a in enumerate(args)] + list(kwargs.items())
    out = []
    for name, value in named:
        leaves, _ = pytree.tree_flatten_with_path(value)
        for path, t in leaves:
            if isinstance(t, torch.Tensor):
                out.append((name + pytree.keystr(path), tuple(int(d) for d in t.shape)))
    return InputShapes(tuple(out))


def dynamic_shapes_for(model: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """A `dynamic_shapes` for torch.export: every dimension of every tensor input `Dim.AUTO`, but those of
    size 0 or 1, which export specializes anyway (and warns about, once per dimension, when marked AUTO).

    Keyed by the forward's parameter names (torch.export's convention when keyword inputs are given).
    """
    auto = torch.export.Dim.AUTO
    bound = inspect.signature(model.forward).bind(*args, **kwargs)

    def spec(value: Any) -> Any:
        return pytree.tree_map(
            lambda t: {i: auto for i in range(t.dim()) if t.shape[i] > 1} if isinstance(t, torch.Tensor) else None,
            value,
        )

    return {name: spec(value) for name, value in bound.arguments.items()}


def export_dynamic(model: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[Any, bool]:
    """torch.export with every tensor dimension dynamic; (program, True), else static (program, False).

    A model that pins a size in a way export cannot express symbolically is exported static; its plan
    then re-plans for any other shape. Inputs on the meta device are exported static: their module never
    runs a step, so dynamic sizes would buy nothing, and symbolic shapes about double the time export
    takes on a large model.
    """
    dynamic = None
    if not _on_meta(args, kwargs):
        try:
            dynamic = dynamic_shapes_for(model, args, kwargs)
        except TypeError:  # a forward whose signature the inputs do not bind to: let export report it
            pass
    with _quiet_symbolic_shapes():
        if dynamic is not None:
            try:
                return torch.export.export(model, args, kwargs, strict=False, dynamic_shapes=dynamic), True
            except GuardOnDataDependentSymNode:
                raise  # branching on tensor values: static sizes would not help
            except Exception:  # noqa: BLE001 - any other failure: the static export below reports its own
                pass
        return torch.export.export(model, args, kwargs, strict=False), False


def _on_meta(args: tuple, kwargs: dict[str, Any]) -> bool:
    return any(t.device.type == "meta" for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))


@contextlib.contextmanager
def _quiet_symbolic_shapes() -> Iterator[None]:
    """On a data-dependent failure torch logs a warning and prints the partial graph to stderr; the
    CaptureError says what failed, so both are dropped then (what a successful export writes is kept)."""
    logger = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    level = logger.level
    logger.setLevel(logging.ERROR)
    held = io.StringIO()
    try:
        with contextlib.redirect_stderr(held):
            yield
    except BaseException:
        raise
    else:
        sys.stderr.write(held.getvalue())
    finally:
        logger.setLevel(level)


class ShapeGuard:
    """Checks each training call of a checkpointed module against the planned input shapes.

    `replan(args, kwargs)` builds a checkpointed module for another shape; its results are
    cached by shape. Calls at or under the planned shape run the planned module.
    """

    def __init__(
        self,
        planned: InputShapes,
        on_larger_shape: str,
        replan: Callable[[tuple, dict[str, Any]], torch.nn.Module] | None,
        *,
        dynamic_dims: bool = True,
        signature: inspect.Signature | None = None,
    ) -> None:
        if on_larger_shape not in ON_LARGER_SHAPE:
            raise InputError(f"on_larger_shape: {on_larger_shape!r} is not one of {', '.join(ON_LARGER_SHAPE)}")
        self.planned = planned
        self.on_larger_shape = on_larger_shape
        self._replan = replan
        self.dynamic_dims = dynamic_dims
        self.signature = signature
        """Set for a captured submodule (choose/partial.py): calls are passed by keyword, as it was captured."""
        """False: the graph takes only the planned shape; any other is planned again."""
        self.replanned: dict[InputShapes, torch.nn.Module] = {}
        """Checkpointed modules planned for other shapes, by shape."""
        self.values: Any = None
        """frozen.ValueGuard: the Python values the graph holds as constants, checked before each call."""

    def bind(self, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        """The call as the graph takes it: by keyword when the capture was made that way."""
        if self.signature is None:
            return args, kwargs
        try:
            return (), dict(self.signature.bind(*args, **kwargs).arguments)
        except TypeError as e:
            raise InputError(f"inputs: the call does not match the captured forward {self.signature}: {e}") from None

    def module_for(self, args: tuple, kwargs: dict[str, Any]) -> torch.nn.Module | None:
        """None to run the planned module; else the module planned for this call's shape."""
        if self.values is not None:
            self.values.check()
        shapes = input_shapes(args, kwargs)
        if shapes in self.replanned:
            return self.replanned[shapes]
        if shapes == self.planned:
            return None
        over = shapes.larger_than(self.planned)
        if not over:
            return None if self.dynamic_dims else self.rebuilt(shapes, args, kwargs)
        if self.on_larger_shape != "replan" or self._replan is None:
            hint = "pass on_larger_shape='replan' to optimize()" if self._replan is not None else "plan it again"
            raise ShapeError(
                f"input shape: {'; '.join(over)} is larger than the plan was made for ({self.planned}); "
                f"plan with the largest inputs, or {hint}"
            )
        return self.rebuilt(shapes, args, kwargs)

    def rebuilt(self, shapes: InputShapes, args: tuple, kwargs: dict[str, Any]) -> torch.nn.Module:
        """Plan again at this call's shape (cached); the graph could not take it, or it is larger."""
        if self._replan is None:
            raise ShapeError(f"input shape: the captured graph cannot take {shapes} (planned {self.planned})")
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():  # planning is not part of the step a memory meter around the call measures
            module = self._replan(args, kwargs)
        self.replanned[shapes] = module
        return module


def guard_model(
    module: torch.nn.Module,
    planned,
    on_larger_shape: str,
    replan: Callable[[tuple, dict[str, Any]], torch.nn.Module] | None,
) -> None:
    """Check a partial plan's training calls at the model's own inputs: a larger one raises ShapeError,
    or with on_larger_shape='replan' runs the model planned again at its shape (cached per shape)."""
    guard = ShapeGuard(planned, on_larger_shape, replan)
    forward = module.forward

    @functools.wraps(forward)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        if module.training and input_shapes(args, kwargs).larger_than(planned):
            other = guard.module_for(args, kwargs)
            if other is not None:
                return other(*args, **kwargs)
        return forward(*args, **kwargs)

    module.forward = guarded
    object.__setattr__(module, "shape_guard", guard)

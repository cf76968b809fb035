"""Custom `torch.autograd.Function`s kept whole through torch.export, so their own backward runs.

torch.export traces into a Function's forward and records its ops: the graph's autograd would then be
the forward ops' own, not the Function's `backward` (a straight-through estimator's gradient, BLOOM's
hand-written GeLU backward). While exporting, each `Function.apply` whose inputs need gradients is
recorded instead as one call of an opaque operator, `ckpt_planner::autograd_function`, whose fake
kernel runs the Function's forward on fake tensors for the output shapes. After export, each such
node is replaced by a call of the Function's own `apply` on the same inputs: at run time the
Function runs as written, its `ctx.save_for_backward` seen by saved-tensor hooks like any op's.

Supported: tensor, int (also symbolic) and constant (float, bool, None, str, dtype) arguments; a
tensor or a flat tuple/list of tensors out. A Function that returns one of its inputs (in place,
`ctx.mark_dirty`) or something else is left to the caller to refuse (`Unsupported`).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

__all__ = ["Unsupported", "opaque_functions", "function_node", "restore_functions"]

_NS, _NAME = "ckpt_planner", "autograd_function"


class Unsupported(Exception):
    """A Function call the opaque operator cannot stand for; the caller refuses the capture."""


@dataclass
class _Call:
    cls: type
    run: Any  # the original apply, bound to cls
    in_spec: pytree.TreeSpec
    slots: list[tuple[str, Any]]  # per input leaf: ('t', i) tensor, ('i', i) int, ('c', value) constant
    out_spec: pytree.TreeSpec | None = None
    out_is_tensor: bool = False


@dataclass
class _Recording:
    calls: dict[int, _Call] = field(default_factory=dict)
    error: str | None = None


_ACTIVE: list[_Recording] = []
_KEYS = itertools.count()
_LIB: torch.library.Library | None = None


def _op() -> Any:
    """`ckpt_planner::autograd_function(Tensor[] tensors, SymInt[] ints, int key) -> Tensor[]`, defined once."""
    global _LIB
    if _LIB is None:
        _LIB = torch.library.Library(_NS, "FRAGMENT")
        _LIB.define(f"{_NAME}(Tensor[] tensors, SymInt[] ints, int key) -> Tensor[]")
        torch.library.register_fake(f"{_NS}::{_NAME}", _fake, lib=_LIB)
    return getattr(getattr(torch.ops, _NS), _NAME).default


def _call_of(key: int) -> _Call:
    for rec in reversed(_ACTIVE):
        if key in rec.calls:
            return rec.calls[key]
    raise RuntimeError(f"{_NS}::{_NAME}: no Function recorded under key {key} (it only stands in during export)")


def _inputs(call: _Call, tensors: list, ints: list) -> tuple[tuple, dict]:
    leaves = [tensors[v] if kind == "t" else ints[v] if kind == "i" else v for kind, v in call.slots]
    return pytree.tree_unflatten(leaves, call.in_spec)


def _fake(tensors: list, ints: list, key: int) -> list[torch.Tensor]:
    """The Function's forward on fake tensors, without gradients: its outputs' shapes and dtypes."""
    call = _call_of(key)
    args, kwargs = _inputs(call, tensors, ints)
    versions = [t._version for t in tensors]
    with torch.no_grad():
        out = call.run(*args, **kwargs)
    if any(t._version != v for t, v in zip(tensors, versions)):
        raise Unsupported(f"{call.cls.__qualname__} writes into its input in place")
    leaves, spec = pytree.tree_flatten(out)
    ok = isinstance(out, torch.Tensor) or (
        isinstance(out, (tuple, list)) and all(isinstance(o, torch.Tensor) for o in out)
    )
    if not ok or not leaves:
        raise Unsupported(f"{call.cls.__qualname__} returns {type(out).__name__}, not a tensor or tuple of tensors")
    if any(o is t for o in leaves for t in tensors):
        raise Unsupported(f"{call.cls.__qualname__} returns one of its inputs (it writes in place)")
    call.out_spec, call.out_is_tensor = spec, isinstance(out, torch.Tensor)
    # An operator's outputs may not alias its inputs; a view the Function returns is copied here only.
    return [o.clone() for o in leaves]


@contextlib.contextmanager
def opaque_functions(patch) -> Iterator[_Recording]:
    """Within (torch.export): each user Function.apply with inputs needing gradients is one opaque node.

    `patch(on_call)` is the context that routes every `Function.apply` through on_call(cls, run, args, kwargs).
    """
    op = _op()
    rec = _Recording()

    def on_call(cls: type, run, a: tuple, k: dict) -> Any:
        leaves, spec = pytree.tree_flatten((a, k))
        if (cls.__module__.startswith("torch.") or not torch.is_grad_enabled()
                or not any(isinstance(t, torch.Tensor) and t.requires_grad for t in leaves)):
            return run(*a, **k)  # torch's own (custom ops' registered autograd) stay ops; no backward: no loss
        tensors, ints, slots = [], [], []
        for x in leaves:
            if isinstance(x, torch.Tensor):
                slots.append(("t", len(tensors)))
                tensors.append(x)
            elif type(x) is int or isinstance(x, torch.SymInt):
                slots.append(("i", len(ints)))
                ints.append(x)
            elif isinstance(x, (torch.SymFloat, torch.SymBool)):
                rec.error = rec.error or f"{cls.__module__}.{cls.__qualname__} takes a symbolic {type(x).__name__}"
                return run(*a, **k)
            else:
                slots.append(("c", x))
        key = next(_KEYS)
        rec.calls[key] = call = _Call(cls, run, spec, slots)
        try:
            outs = op(tensors, ints, key)
        except Unsupported as e:
            rec.error = rec.error or f"{cls.__module__}.{cls.__qualname__}: {e}"
            del rec.calls[key]
            return run(*a, **k)
        if call.out_is_tensor:
            return outs[0]
        return tuple(outs) if call.out_spec.type is tuple else list(outs)

    _ACTIVE.append(rec)
    try:
        with patch(on_call):
            yield rec
    finally:
        _ACTIVE.remove(rec)


def restore_functions(gm: fx.GraphModule, rec: _Recording) -> int:
    """Replace each opaque node of `gm` by a call of its Function's own apply; how many were replaced."""
    op = _op()
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is op]
    for node in nodes:
        tensors, ints, key = node.args
        call = rec.calls[key]
        args, kwargs = _inputs(call, list(tensors), list(ints))
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(function_node(call.cls), tuple(args), dict(kwargs))
        new.meta = dict(node.meta)
        vals = node.meta.get("val")
        for user in list(node.users):
            if user.op == "call_function" and user.target is _getitem and not call.out_is_tensor:
                continue  # getitem(outs, i) reads the i-th of the tuple apply returns, as before
            if user.op == "call_function" and user.target is _getitem and user.args[1] == 0:
                user.replace_all_uses_with(new)
                gm.graph.erase_node(user)
                continue
            raise RuntimeError(f"{call.cls.__qualname__}: its outputs are read by {user.format_node()}")
        if vals is not None:
            new.meta["val"] = vals[0] if call.out_is_tensor else tuple(vals)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
    if nodes:
        gm.graph.lint()
        gm.recompile()
    return len(nodes)


_APPLY: dict[type, Any] = {}


def _getitem_target() -> Any:
    import operator

    return operator.getitem


_getitem = _getitem_target()


def function_node(cls: type) -> Any:
    """The graph target that runs the autograd.Function `cls` (one per class, named after it)."""
    fn = _APPLY.get(cls)
    if fn is None:

        def fn(*args: Any, **kwargs: Any) -> Any:
            return cls.apply(*args, **kwargs)

        fn.__name__ = fn.__qualname__ = f"apply_{cls.__name__}"
        _APPLY[cls] = fn
    return fn

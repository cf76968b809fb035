"""Python values a captured graph holds as constants: the scalar globals and module attributes a forward reads.

Tracing runs the forward once: a module-level `SCALE = 2.0` or an attribute `self.temperature = 0.5`
that the forward reads becomes a constant of the graph. Change it later and the model follows the new
value while the checkpointed module keeps the old one, with no error. `frozen_values` finds them from
the forwards' code (the names a forward's code objects load, and those of the plain functions of its
own module that it calls), keeping the scalars (bool, int, float, complex, str) that the names resolve
to; `ValueGuard` compares them before each training call of the checkpointed module and raises
`StaleGraphError` naming the first that changed.

Not seen: values read through a container (`CONFIG["scale"]`), another module's globals, functions of
other modules, the attributes of torch.nn's own layers (their configuration: `eps`, `p`, `in_features`).
Modules that symbolic_trace keeps as calls run live and need no guard.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from ..errors import StaleGraphError
from .mutation import stale_reads

__all__ = ["FrozenValue", "ValueGuard", "frozen_values", "stale_note"]

_SCALARS = (bool, int, float, complex, str)
_SKIP_ATTRS = frozenset({"training"})  # the eval dispatch of the checkpointed module handles the mode


@dataclass(frozen=True)
class FrozenValue:
    where: str
    """What a person reads: `global SCALE (module my.models)` or `attribute blocks.0.temperature`."""
    owner: Any
    """The globals dict or the module that holds the value."""
    name: str
    value: Any
    """The value at planning time, which the graph holds."""

    def current(self) -> Any:
        if isinstance(self.owner, dict):
            return self.owner.get(self.name, _MISSING)
        return self.owner.__dict__.get(self.name, _MISSING)


_MISSING = object()


def _codes(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def _names(fn: Any, depth: int = 1) -> tuple[set[str], dict[str, Any]]:
    """(names the code of `fn` loads, its globals); plain functions of its own module that it calls count too."""
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None)
    if code is None:
        return set(), {}
    glob = getattr(fn, "__globals__", {})
    names = {n for c in _codes(code) for n in c.co_names}
    if depth:
        for n in list(names):
            helper = glob.get(n)
            if isinstance(helper, types.FunctionType) and helper.__globals__ is glob:
                names |= _names(helper, depth - 1)[0]
    return names, glob


def _is_scalar(value: Any) -> bool:
    return type(value) in _SCALARS


def frozen_values(model: torch.nn.Module, graph_module: fx.GraphModule, method: str) -> tuple[FrozenValue, ...]:
    """The scalar globals and attributes the forwards of `model` read, as they are now (after capture)."""
    live = (
        {str(n.target) for n in graph_module.graph.nodes if n.op == "call_module"} if method == "symbolic_trace" else set()
    )
    found: dict[tuple[int, str], FrozenValue] = {}
    for path, module in model.named_modules():
        if path in live:
            continue
        forward = type(module).forward
        if (getattr(forward, "__module__", None) or "").startswith("torch."):
            continue  # torch.nn's own layers: their attributes are their configuration
        names, glob = _names(forward)
        own = module.__dict__
        for name in sorted(names):
            if name in own and name not in _SKIP_ATTRS and _is_scalar(own[name]):
                found.setdefault((id(module), name), FrozenValue(f"attribute {path + '.' if path else ''}{name}", module, name, own[name]))
            elif name not in own and name in glob and _is_scalar(glob[name]) and not name.startswith("__"):
                where = f"global {name} (module {glob.get('__name__', '?')})"
                found.setdefault((id(glob), name), FrozenValue(where, glob, name, glob[name]))
    return tuple(found.values())


class ValueGuard:
    """Raises StaleGraphError when a value the graph holds as a constant has changed since planning."""

    def __init__(self, values: tuple[FrozenValue, ...]) -> None:
        self.values = values

    def check(self) -> None:
        for v in self.values:
            now = v.current()
            if type(now) is not type(v.value) or now != v.value:
                shown = "deleted" if now is _MISSING else repr(now)
                raise StaleGraphError(
                    f"{v.where}: the forward read {v.value!r} when the plan was made and the checkpointed module "
                    f"holds that value as a constant; it is now {shown}: plan again after changing it, or make it "
                    "a tensor (an input or a buffer) so the graph reads it"
                )

    def note(self) -> str:
        """The summary's line naming the values (empty when there are none)."""
        if not self.values:
            return ""
        shown = ", ".join(f"{v.where.split(' (')[0]}={v.value!r}" for v in self.values[:4])
        more = f" and {len(self.values) - 4} more" if len(self.values) > 4 else ""
        return (
            f"the captured graph holds {len(self.values)} Python value(s) the forward reads as constants "
            f"({shown}{more}): plan.module raises StaleGraphError if one changes"
        )


def stale_note(gm: fx.GraphModule) -> list[str]:
    """The plan's note on nodes kept outside regions because they read a buffer the forward writes later."""
    stale = stale_reads(gm)
    if not stale:
        return []
    nodes = ", ".join(n.name for n in list(stale)[:4]) + (" ..." if len(stale) > 4 else "")
    buffers = ", ".join(dict.fromkeys(stale.values()))
    return [
        f"{len(stale)} node(s) ({nodes}) read buffers the forward writes in place later ({buffers}; a routing "
        "bias updated every step, for one): a recompute would read the new value, so they stay outside "
        "checkpoint regions and what follows them is replayed from their saved outputs"
    ]

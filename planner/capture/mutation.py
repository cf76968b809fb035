"""Which graph nodes write in place, and into what: the analysis that profiling, rewriting and
selective regions all read.

A region that recomputes from a tensor written in place since would see another value, and a
cached output written in place later would be stale, so the profiler (which nodes may be
recomputed), the rewriter (where a region may start) and selective regions (which nodes may be
kept) each ask the same questions of the graph. The answers live here, so none of those stages
imports another for them.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

__all__ = ["COMPUTE_OPS", "compute_nodes", "mutated_inputs", "writes_by_schema", "written_roots", "view_root"]

COMPUTE_OPS = ("call_function", "call_method", "call_module")


def compute_nodes(graph: fx.Graph) -> list[fx.Node]:
    """The nodes that profiling and solvers index, in graph order."""
    return [n for n in graph.nodes if n.op in COMPUTE_OPS]


_VIEW_NAMES = frozenset(
    "view view_as reshape reshape_as transpose permute expand expand_as unsqueeze squeeze narrow select t flatten "
    "unflatten unbind split chunk contiguous detach as_strided diagonal movedim swapaxes swapdims alias unfold "
    "__getitem__ getitem real imag view_as_real view_as_complex".split()
)
_INPLACE_OPERATORS = (
    operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
    operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor, operator.ilshift, operator.irshift,
)


def _name(target: object) -> str:
    if isinstance(target, str):
        return target
    schema = getattr(target, "_schema", None)
    if schema is not None:
        return schema.name.split("::")[-1]
    return getattr(target, "__name__", "")


def mutated_inputs(gm: torch.nn.Module, n: fx.Node) -> list[fx.Node]:
    """The argument nodes that `n` writes into (in-place ops, `inplace=True` modules and functions, setitem)."""
    first = [n.args[0]] if n.args and isinstance(n.args[0], fx.Node) else []
    if n.op == "call_module":
        mod = gm.get_submodule(str(n.target))
        return first if getattr(mod, "inplace", False) is True else []
    if n.kwargs.get("inplace") is True:
        return first
    if n.op == "call_method":
        name = str(n.target)
        return first if name == "__setitem__" or (name.endswith("_") and not name.startswith("__")) else []
    if n.op != "call_function":
        return []
    if n.target in _INPLACE_OPERATORS:
        return first
    schema = getattr(n.target, "_schema", None)
    if schema is not None:
        out = []
        for i, a in enumerate(schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                value = n.args[i] if i < len(n.args) and not a.kwarg_only else n.kwargs.get(a.name)
                if isinstance(value, fx.Node):
                    out.append(value)
        return out
    name = _name(n.target)
    return first if name.endswith("_") and not name.startswith("_") else []


def writes_by_schema(node: fx.Node) -> bool:
    """True for aten ops whose schema writes into one of their arguments (add_, copy_, index_put_...)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return False
    return any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


def _is_view(n: fx.Node) -> bool:
    if n.op not in ("call_method", "call_function") or not n.args or not isinstance(n.args[0], fx.Node):
        return False
    schema = getattr(n.target, "_schema", None)
    if schema is not None:
        writes = any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
        return not writes and any(r.alias_info is not None for r in schema.returns)
    return _name(n.target) in _VIEW_NAMES


def view_root(n: fx.Node) -> fx.Node:
    """The node whose storage `n` views (itself when it is no view)."""
    while _is_view(n):
        n = n.args[0]
    return n


def written_roots(gm: torch.nn.Module, n: fx.Node) -> list[fx.Node]:
    """The nodes whose storage `n` writes into in place (through views resolved to their base)."""
    return [view_root(a) for a in mutated_inputs(gm, n)]

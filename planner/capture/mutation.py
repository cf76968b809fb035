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

__all__ = [
    "COMPUTE_OPS", "compute_nodes", "mutated_inputs", "stale_reads", "writes_by_schema", "written_roots", "view_root",
]

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
    inner = _subgraph_writes(gm, n)
    if inner is not None:
        return inner
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


def _subgraph_writes(gm: torch.nn.Module, n: fx.Node) -> list[fx.Node] | None:
    """For a higher-order op that runs a subgraph on the operands after it (`wrap_with_set_grad_enabled`:
    a `torch.no_grad()` block in an exported forward), the operands its subgraph writes into; else None."""
    subs = [
        (k, getattr(gm, str(a.target), None)) for k, a in enumerate(n.args) if isinstance(a, fx.Node) and a.op == "get_attr"
    ]
    k, sub = next(((k, m) for k, m in subs if isinstance(m, fx.GraphModule)), (-1, None))
    if sub is None:
        return None
    operands = n.args[k + 1 :]
    places = [p for p in sub.graph.nodes if p.op == "placeholder"]
    written = {r for m in compute_nodes(sub.graph) for r in written_roots(sub, m)}
    return [o for p, o in zip(places, operands) if p in written and isinstance(o, fx.Node)]


def stale_reads(gm: torch.nn.Module) -> dict[fx.Node, str]:
    """Compute nodes that read a buffer which a later node of the forward writes in place, with its name.

    A recompute runs after the whole forward, so such a node would read the buffer's new value (a routing
    bias nudged toward even load by every training step, as aux-loss-free MoE balancing does): it cannot be
    replayed and stays outside regions. Its output, saved as a region's input, replays what follows exactly.
    """
    compute = compute_nodes(gm.graph)
    last_write: dict[fx.Node, int] = {}  # buffer (get_attr node) -> position of the last node writing it
    for i, n in enumerate(compute):
        for r in written_roots(gm, n):
            if r.op == "get_attr":
                last_write[r] = i
    out: dict[fx.Node, str] = {}
    for i, n in enumerate(compute):
        if _is_view(n):
            continue  # a view reads nothing; the node that reads through it is the one that counts
        for a in n.all_input_nodes:
            root = view_root(a)
            if last_write.get(root, -1) > i:
                out[n] = str(root.target)
    return out

"""The Python code of a graph with its aten calls bound to the C++ operator, for running outside a tracer.

fx writes every aten call as `torch.ops.aten.linear.default(x, w, b)`: four attribute
lookups and `OpOverload.__call__`, a Python frame, before the dispatcher. On a small model on the
CPU, a few hundred aten calls a forward, that makes the captured graph's step a few per cent slower
than eager; binding the calls to the operator itself (`OpOverload._op`, the same dispatcher entry, so
the same kernels and bitwise the same results) removes most of it. A recomputed region runs its code
twice, so regions gain twice.

`torch.compile` cannot trace the bound operators, so the checkpointed module and its regions keep
fx's own code for tracing (`torch.compiler.is_compiling()`) and run this one otherwise.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch.fx.graph_module import _forward_from_src

__all__ = ["bound_forward", "switched_forward"]

# `torch.ops.<namespace>.<op>.<overload>(` as fx writes an OpOverload call.
_CALL = re.compile(r"\btorch\.ops\.([A-Za-z_][A-Za-z0-9_]*)\.([A-Za-z_][A-Za-z0-9_]*)\.([A-Za-z_][A-Za-z0-9_]*)\(")


def _overload(namespace: str, op: str, overload: str) -> torch._ops.OpOverload | None:
    try:
        obj = getattr(getattr(getattr(torch.ops, namespace), op), overload)
    except (AttributeError, RuntimeError):
        return None
    return obj if isinstance(obj, torch._ops.OpOverload) and callable(getattr(obj, "_op", None)) else None


def bound_forward(graph: fx.Graph) -> Callable[..., Any]:
    """`forward(self, *args)` from `graph`'s Python code (root module `self`), aten calls bound to their operators.

    A call the pattern does not match, or that does not resolve to an `OpOverload`, stays as fx wrote it.
    """
    code = graph.python_code(root_module="self")
    scope = dict(code.globals)
    bound: dict[str, str] = {}

    def bind(m: re.Match) -> str:
        path = m.group(0)[:-1]
        name = bound.get(path)
        if name is None:
            op = _overload(*m.groups())
            if op is None:
                return m.group(0)
            name = f"_aten_op_{len(bound)}"
            while name in scope:
                name += "_"
            scope[name] = op._op
            bound[path] = name
        return name + "("

    return _forward_from_src(_CALL.sub(bind, code.src), scope)


def switched_forward(traced: Callable[..., Any], fast: Callable[..., Any]) -> Callable[..., Any]:
    """`forward(self, ...)` that runs `traced` while torch.compile traces it and `fast` otherwise.

    Made from its own source on every call: dynamo keeps its compiled code per code object, so one wrapper
    shared by every checkpointed module would count each new module as a recompile of the last and hit
    dynamo's recompile limit after eight. The signature is `traced`'s, for callers that bind to it.
    """
    src = (
        "def forward(self, *args, **kwargs):\n"
        "    if _is_compiling():\n"
        "        return _traced(self, *args, **kwargs)\n"
        "    return _fast(self, *args, **kwargs)\n"
    )
    forward = _forward_from_src(src, {"_is_compiling": torch.compiler.is_compiling, "_traced": traced, "_fast": fast})
    forward.__signature__ = inspect.signature(traced)
    return forward

"""The custom operators a `.pt2` program calls, registered before torch loads it, or named in one line.

A program that calls a custom operator (``torch.ops.NAMESPACE.OP``) loads only where that operator is
registered: torch.export.load resolves each node's target by name and fails on one it cannot find, with a
SerializeError that prints the whole node. transformers registers its own (its MoE layers call
``torch.ops.transformers.grouped_mm_fallback``) when the module that defines them is imported. Here the
operators a graph names are looked up; for one that `KNOWN` lists, the installed library module that
registers it is imported. Which module that is comes from this table, never from the file: a file only
chooses among trusted installed code, and only by naming an operator of it. Any other operator that is
not registered is refused in one line that names it and says what to do.
"""

from __future__ import annotations

import importlib
import importlib.util
import re

import torch

from ...errors import InputError

__all__ = ["KNOWN", "graph_operators", "register_operators"]

KNOWN = {
    "transformers::grouped_mm_fallback": "transformers.integrations.moe",
    "transformers::grouped_mm_fallback_backward": "transformers.integrations.moe",
    "transformers_msa::sparse_atten": "transformers.integrations.msa_attention",
}
"""Custom operator -> the installed module whose import registers it (transformers 5: its MoE experts'
grouped matmul, and the sparse attention of its MSA models)."""

# a node's target as torch serializes it: torch.ops.<namespace>.<operator>.<overload>; dunder names never
_TARGET = re.compile(rb'"target":\s*"torch\.ops\.([A-Za-z][A-Za-z0-9_]{0,99})\.([A-Za-z][A-Za-z0-9_]{0,199})\.')
_BUILT_IN = {"aten", "prims", "higher_order", "_c10d_functional", "c10d_functional", "quantized", "profiler"}


def graph_operators(graph: bytes) -> set[str]:
    """The custom operators (``namespace::name``) that a serialized graph's nodes call (its JSON bytes)."""
    return {f"{ns.decode()}::{op.decode()}" for ns, op in _TARGET.findall(graph) if ns.decode() not in _BUILT_IN}


def _registered(qualified: str) -> bool:
    # the dispatcher's schema table: a lookup, nothing imported or run
    return bool(torch._C._jit_get_schemas_for_operator(qualified))


def _first_line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    return next((ln.strip() for ln in text.splitlines() if ln.strip()), type(e).__name__)[:200]


def register_operators(operators: set[str]) -> None:
    """Register what `operators` need from `KNOWN`'s installed modules; InputError (one line, to be prefixed
    with the file's name) for the first one that stays unregistered."""
    for qualified in sorted(operators):
        if _registered(qualified):
            continue
        module = KNOWN.get(qualified)
        library = module.split(".", 1)[0] if module else None
        if module is not None and importlib.util.find_spec(library) is not None:
            try:
                importlib.import_module(module)
            except Exception as e:  # noqa: BLE001 - a library that fails to import: say so, in one line
                raise InputError(f"its program calls the operator {qualified}, which {module} registers, and "
                                 f"importing it failed ({_first_line(e)}); repair that install of {library}") from None
            if _registered(qualified):
                continue
        if library is not None:
            raise InputError(f"its program calls the operator {qualified}, which {library} registers ({module}), "
                             f"and {library} is not installed here (or this version has no such operator); "
                             f"install the {library} version the model was exported with")
        raise InputError(
            f"its program calls the operator {qualified}, which no library imported here registers, and the "
            "command line imports no code a file names; in Python, import the library that defines it, then "
            "plan `torch.export.load(path)` with ckpt_planner.optimize"
        )

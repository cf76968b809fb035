"""Selective regions: one checkpoint call whose policy keeps some ops' outputs and recomputes the rest.

The lowering of a plan's saved ops. A region with saved nodes runs under
`torch.utils.checkpoint.checkpoint(..., use_reentrant=False, context_fn=...)`
with the contexts of `create_selective_checkpoint_contexts`. Ops are told
apart by position, not by type: the region's graph calls `enter_node(i)`
before its i-th compute node, and the policy returns MUST_SAVE for every
non-view aten op that runs while a saved node is current, PREFER_RECOMPUTE
for the others. A counter over the aten calls of the region's forward checks
that the recompute replays the same ops in the same order; a mismatch (a
data-dependent op) is an error, not a silent wrong gradient.

Which nodes may be kept (`saveable_flags`): ops that write nothing in place,
whose outputs nothing writes in place later (a cached output would be
stale), with a tensor output, and not random ops (dropout fills its mask in
place inside the op). Within a kept node, views, in-place ops and the empty
buffers they fill are recomputed (cheap); the other ops' outputs are cached.
"""

from __future__ import annotations

import contextlib
import functools
import re
import threading
from collections.abc import Iterator, Sequence

import torch
import torch.fx as fx
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from .errors import SelectiveReplayError
from .rewrite import compute_nodes, mutated_inputs, written_roots

__all__ = ["enter_node", "selective_contexts", "mark_positions", "saveable_flags", "policy_costs", "try_policy_costs", "SelectiveReplayError"]

_CURRENT = threading.local()


def enter_node(position: int) -> None:
    """Called by a selective region's graph before its `position`-th compute node."""
    if torch.compiler.is_compiling():
        return
    _CURRENT.node = position


def mark_positions(graph: fx.Graph) -> int:
    """Insert `enter_node(i)` before each compute node of a region's graph; returns how many."""
    nodes = compute_nodes(graph)
    for i, n in enumerate(nodes):
        with graph.inserting_before(n):
            graph.call_function(enter_node, (i,))
    return len(nodes)


def selective_contexts(saved_positions: frozenset[int], recompute_context=None):
    """The (forward, recompute) contexts of one checkpoint call of a selective region."""
    trace: list[tuple[int, object]] = []
    replayed = [0]

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        node = getattr(_CURRENT, "node", -1)
        if ctx.is_recompute:
            k = replayed[0]
            replayed[0] += 1
            if k >= len(trace) or trace[k] != (node, op):
                raise SelectiveReplayError(
                    f"position {k}: the recompute ran {op} at node {node}, the forward "
                    f"{trace[k] if k < len(trace) else 'nothing'}; the region's ops depend on data"
                )
        else:
            trace.append((node, op))
        if node in saved_positions and _cacheable(op):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    forward, recompute = create_selective_checkpoint_contexts(policy)
    if recompute_context is None:
        return forward, recompute
    return forward, _both(recompute_context, recompute)  # buffers saved and put back outside the policy


_FACTORIES = ("empty", "empty_like", "new_empty", "zeros", "zeros_like", "ones", "ones_like", "full", "full_like")
_RANDOM = re.compile(r"dropout|bernoulli|rand", re.IGNORECASE)


@functools.cache
def _cacheable(op) -> bool:
    """Ops whose outputs a saved node keeps: not views, not in-place, not buffers filled in place later."""
    if getattr(op, "is_view", False):
        return False
    schema = getattr(op, "_schema", None)
    if schema is not None and schema.is_mutable:
        return False
    return getattr(getattr(op, "overloadpacket", None), "__name__", "") not in _FACTORIES


@contextlib.contextmanager
def _both(first, second) -> Iterator[None]:
    with first, second:
        yield


def saveable_flags(gm: fx.GraphModule) -> list[bool]:
    """Per compute node: a selective region may keep its output (see the module docstring)."""
    nodes = compute_nodes(gm.graph)
    written: set[fx.Node] = set()
    for n in nodes:
        written.update(written_roots(gm, n))
        written.update(mutated_inputs(gm, n))
    out = []
    for n in nodes:
        value = n.meta.get("val", n.meta.get("example_value"))
        tensor_out = value is None or isinstance(value, torch.Tensor) or (
            isinstance(value, Sequence) and any(isinstance(v, torch.Tensor) for v in value)
        )
        random = bool(_RANDOM.search(_kind(gm, n)))  # fills a buffer in place inside the op (a mask)
        out.append(tensor_out and not random and not mutated_inputs(gm, n) and n not in written)
    return out


def _kind(gm: fx.GraphModule, n: fx.Node) -> str:
    if n.op == "call_module":
        return type(gm.get_submodule(str(n.target))).__name__
    return str(getattr(n.target, "__name__", n.target))


class _CacheCounter(TorchDispatchMode):
    """Per current fx node: bytes of new storages made by the ops a selective policy would cache, and
    how many aten ops the policy would be asked about."""

    def __init__(self) -> None:
        super().__init__()
        self.node: str | None = None
        self.bytes: dict[str, int] = {}
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.node is not None:
            self.ops[self.node] = self.ops.get(self.node, 0) + 1
        if self.node is not None and _cacheable(func):
            before = {_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            new = {_key(t): t.untyped_storage().nbytes() for t in tree_leaves(out) if isinstance(t, torch.Tensor)}
            self.bytes[self.node] = self.bytes.get(self.node, 0) + sum(b for k, b in new.items() if k not in before)
        return out


def _key(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage()._cdata
    except (NotImplementedError, RuntimeError):  # a tensor without storage (sparse, nested)
        return id(t)


class _NodeTracker(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, counter: _CacheCounter, convert) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.counter = counter
        self.convert = convert

    def call_function(self, target, args, kwargs):
        if self.convert is not None:
            args, kwargs = self.convert(args, kwargs)
        return super().call_function(target, args, kwargs)

    def run_node(self, n: fx.Node):
        self.counter.node = n.name
        try:
            return super().run_node(n)
        finally:
            self.counter.node = None


def policy_costs(gm: fx.GraphModule, flat: Sequence, convert=None) -> tuple[dict[str, int], dict[str, int]]:
    """Per compute node: (the bytes a selective region that keeps the node caches in its forward, the
    aten ops that run under it, each a call of the selective policy).

    The policy caches the output of every cacheable op that runs under the node, so a composite node
    (an attention in decomposed form, a fused block) may cache intermediates that eager frees at once.
    One forward of the graph, run by the caller under preserved state (buffers, RNG); `convert`
    rewrites each call's (args, kwargs) first (the profiler's meta-to-cpu constants).
    """
    counter = _CacheCounter()
    with torch.set_grad_enabled(torch.is_grad_enabled()), counter:  # grad mode as it was, even on an error
        _NodeTracker(gm, counter, convert).run(*flat, enable_io_processing=False)
    return counter.bytes, counter.ops


def try_policy_costs(gm: fx.GraphModule, flat: Sequence, convert=None) -> tuple[dict[str, int] | None, dict[str, int] | None]:
    """`policy_costs`, or (None, None) where the graph cannot be run op by op this way (a higher-order op
    whose body holds meta-device constants on a fake run): the caller then keeps single-op nodes only."""
    try:
        return policy_costs(gm, flat, convert)
    except Exception:  # noqa: BLE001 - counting is a refinement; planning goes on without it
        return None, None

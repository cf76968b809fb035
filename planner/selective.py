"""Selective regions: one checkpoint call whose policy keeps some ops' outputs and recomputes the rest.

The lowering of a plan's saved ops. A region with saved nodes runs under
`torch.utils.checkpoint.checkpoint(..., use_reentrant=False, context_fn=...)`.
Its graph calls `keep_begin(i)` before and `keep_end(i)` after each kept
node (`i`: the node's position among the region's compute nodes), and only
there is a selective-checkpoint mode of
`create_selective_checkpoint_contexts` active: the caching one in the
forward, the cached one in the recompute, one pair per kept node and call.
The policy returns MUST_SAVE for every non-view, non-mutating aten op of a
kept node and PREFER_RECOMPUTE for its views and in-place ops. The other
ops of the region run as in any checkpoint region, below no Python dispatch
mode: a policy active over the whole region costs every op 10-30 us on a
CPU, forward and recompute, more than most ops take. Nodes are told apart by
position, not by type. Where the policy is called again in the recompute
(torch before 2.13), a counter over the kept nodes' aten calls checks that
the recompute replays the forward's; torch 2.13 checks its own cache keys.
A mismatch (a data-dependent op) is an error, not a silent wrong gradient.

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

__all__ = [
    "keep_begin", "keep_end", "selective_contexts", "dispatch_probe_contexts", "mark_kept", "saveable_flags",
    "policy_costs", "try_policy_costs", "SelectiveReplayError",
]

_CURRENT = threading.local()  # .kept: the _KeptOps of the selective region call running on this thread


def keep_begin(position: int) -> None:
    """Called by a selective region's graph before its kept node at `position`."""
    if torch.compiler.is_compiling():
        return
    kept = getattr(_CURRENT, "kept", None)
    if kept is not None:
        kept.enter(position)


def keep_end(position: int) -> None:
    """Called by a selective region's graph after its kept node at `position`."""
    if torch.compiler.is_compiling():
        return
    kept = getattr(_CURRENT, "kept", None)
    if kept is not None:
        kept.leave()


def mark_kept(graph: fx.Graph, positions: frozenset[int]) -> None:
    """Put `keep_begin(i)` / `keep_end(i)` around the compute nodes of a region's graph at `positions`."""
    for i, n in enumerate(compute_nodes(graph)):
        if i in positions:
            with graph.inserting_before(n):
                graph.call_function(keep_begin, (i,))
            with graph.inserting_after(n):
                graph.call_function(keep_end, (i,))


class _KeptOps:
    """One checkpoint call of a selective region: per kept node, the pair of selective-checkpoint modes
    (caching in the forward, cached in the recompute) entered around that node alone."""

    def __init__(self, positions: frozenset[int]) -> None:
        self.positions = positions
        self.pairs: dict[int, tuple[TorchDispatchMode, TorchDispatchMode]] = {}
        self.trace: list[tuple[int, object]] = []  # (position, aten op) of the forward, in order
        self.replayed = [0]
        self.recompute = False
        self.active: list[TorchDispatchMode] = []

    def enter(self, position: int) -> None:
        if position not in self.positions:
            return
        if self.recompute:
            pair = self.pairs.get(position)
            if pair is None:
                raise SelectiveReplayError(f"the recompute reached kept node {position}, which its forward did not run")
            mode = pair[1]
        else:
            pair = self.pairs[position] = create_selective_checkpoint_contexts(_policy(self.trace, self.replayed, position))
            mode = pair[0]
        mode.__enter__()
        self.active.append(mode)

    def leave(self) -> None:
        if self.active:
            self.active.pop().__exit__(None, None, None)

    @contextlib.contextmanager
    def phase(self, recompute: bool) -> Iterator[None]:
        before = getattr(_CURRENT, "kept", None)
        _CURRENT.kept, self.recompute = self, recompute
        try:
            yield
        finally:
            while self.active:  # left by an error or by the recompute's early stop inside a kept node
                self.leave()
            _CURRENT.kept = before


def _policy(trace: list[tuple[int, object]], replayed: list[int], position: int):
    """The policy of one kept node. It holds the call's trace, not the _KeptOps: a cycle through the
    modes' storage would keep the cached outputs alive until the garbage collector runs."""

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if ctx.is_recompute:  # torch before 2.13 asks again in the recompute
            k = replayed[0]
            replayed[0] += 1
            if k >= len(trace) or trace[k] != (position, op):
                raise SelectiveReplayError(
                    f"position {k}: the recompute ran {op} at node {position}, the forward "
                    f"{trace[k] if k < len(trace) else 'nothing'}; the region's ops depend on data"
                )
        else:
            trace.append((position, op))
        return CheckpointPolicy.MUST_SAVE if _cacheable(op) else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def selective_contexts(saved_positions: frozenset[int], recompute_context=None):
    """The (forward, recompute) contexts of one checkpoint call of a selective region."""
    kept = _KeptOps(frozenset(saved_positions))
    forward, recompute = kept.phase(False), kept.phase(True)
    if recompute_context is None:
        return forward, recompute
    return forward, _both(recompute_context, recompute)  # buffers saved and put back outside the policy


def dispatch_probe_contexts(recompute_context=None):
    """Contexts that run a whole region, forward and recompute, under a selective policy keeping nothing:
    what the policy's dispatch costs per op on a graph's own ops (the timing calibration)."""
    forward, recompute = create_selective_checkpoint_contexts(lambda ctx, op, *a, **k: CheckpointPolicy.PREFER_RECOMPUTE)
    if recompute_context is None:
        return forward, recompute
    return forward, _both(recompute_context, recompute)


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

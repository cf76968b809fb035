"""Selective regions: one checkpoint call whose policy keeps some ops' outputs and recomputes the rest.

The lowering of a plan's saved ops. A region with saved nodes runs under
`torch.utils.checkpoint.checkpoint(..., use_reentrant=False, context_fn=...)`.
Its graph calls `keep_begin(i)` before and `keep_end(i)` after each kept
node (`i`: the node's position among the region's compute nodes), and only
there is a dispatch mode active (`_KeepMode`, one cache per kept node and
call): in the forward it keeps a detached alias of the output of every
non-view, non-mutating aten op the node runs; in the recompute it hands those
back in the same order instead of running the ops, and runs the node's views
and in-place ops again. This is what `create_selective_checkpoint_contexts`
does with a policy, without its per-op bookkeeping. The other ops of the
region run as in any checkpoint region, below no Python dispatch mode: a mode
over the whole region costs every op 10-30 us on a CPU, forward and
recompute, more than most ops take. Nodes are told apart by position, not by
type. The recompute must ask for the ops the forward cached, in order, and a
cached output must not have been written in place since: otherwise (a
data-dependent op) it is an error, not a silent wrong gradient.

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
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.utils.checkpoint as torch_checkpoint
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves, tree_map_only

from ..capture.export_exact import eager_attention_mask
from ..capture.mutation import compute_nodes, mutated_inputs, written_roots
from ..capture.rng import RANDOM_META, uses_rng
from ..errors import SelectiveReplayError

__all__ = [
    "keep_begin", "keep_end", "selective_contexts", "dispatch_probe_contexts", "mark_kept", "saveable_flags",
    "policy_costs", "try_policy_costs", "PolicyCounter", "SelectiveReplayError", "known_masks", "call_target",
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


class _KeepMode(TorchDispatchMode):
    """One kept node's ops, forward (`replay=False`: run, and cache what they make) or recompute
    (`replay=True`: hand the cached outputs back in order). `cache=None`: the timing calibration's
    probe, which does the forward's work on every op and keeps nothing."""

    def __init__(self, cache: list[tuple[object, Any, tuple[int, ...]]] | None, position: int, replay: bool) -> None:
        super().__init__()
        self.cache, self.position, self.replay = cache, position, replay

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _IGNORED or not _cacheable(func) or _cast_cached(func, args):
            return func(*args, **(kwargs or {}))
        if not self.replay or self.cache is None:
            out = func(*args, **(kwargs or {}))
            kept = _detached(out) if isinstance(out, torch.Tensor) else tree_map_only(torch.Tensor, _detached, out)
            versions = _versions(kept)
            if self.cache is not None:
                self.cache.append((func, kept, versions))
            return out
        if not self.cache or self.cache[0][0] is not func:
            raise SelectiveReplayError(
                f"kept node {self.position}: the recompute ran {func}, the forward cached "
                f"{self.cache[0][0] if self.cache else 'nothing more'}; the region's ops depend on data"
            )
        _, kept, versions = self.cache.pop(0)
        if versions != _versions(kept):
            raise SelectiveReplayError(
                f"kept node {self.position}: the output of {func} was written in place after the forward cached it"
            )
        return kept


def _cast_cached(func, args: tuple) -> bool:
    """A cast autocast keeps in its cache: a parameter (a leaf that requires grad) cast to the autocast
    dtype. It runs in the first forward of an autocast context and not in the next ones, nor in a
    recompute inside the same context, while a recompute in the backward (autocast re-entered
    fresh) runs it again: it is run wherever it is asked for and never cached, so the kept ops'
    order does not depend on that cache. The cast is exact, so running it again gives the same."""
    if func is not _TO_COPY or not args:
        return False
    t = args[0]
    return isinstance(t, torch.Tensor) and t.is_leaf and t.requires_grad


def _versions(kept: Any) -> tuple[int, ...]:
    if isinstance(kept, torch.Tensor):  # the common case, without walking a tree
        return (kept._version,)
    return tuple(t._version for t in tree_leaves(kept) if isinstance(t, torch.Tensor))


def _detached(t: torch.Tensor) -> torch.Tensor:
    """An alias of an op's output without autograd history (no cycle through the graph) that shares its
    version counter, so a later in-place write shows. Below autograd, `detach` leaves the counter
    behind unless the in-place/view key is let through, as torch's own selective checkpointing does."""
    with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False):
        return t.detach()


class _KeptOps:
    """One checkpoint call of a selective region: per kept node, its cache and the mode entered around it."""

    def __init__(self, positions: frozenset[int]) -> None:
        self.positions = positions
        self.caches: dict[int, list] = {}
        self.recompute = False
        self.active: list[TorchDispatchMode] = []

    def enter(self, position: int) -> None:
        if position not in self.positions:
            return
        if self.recompute:
            cache = self.caches.get(position)
            if cache is None:
                raise SelectiveReplayError(f"the recompute reached kept node {position}, which its forward did not run")
        else:
            cache = self.caches[position] = []
        mode = _KeepMode(cache, position, self.recompute)
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


def selective_contexts(saved_positions: frozenset[int], recompute_context=None):
    """The (forward, recompute) contexts of one checkpoint call of a selective region."""
    kept = _KeptOps(frozenset(saved_positions))
    forward, recompute = kept.phase(False), kept.phase(True)
    if recompute_context is None:
        return forward, recompute
    return forward, _both(recompute_context, recompute)  # buffers saved and put back outside the policy


def dispatch_probe_contexts(recompute_context=None):
    """Contexts that run a whole region, forward and recompute, under the kept-node mode keeping nothing:
    what that mode costs per op on a graph's own ops (the timing calibration)."""
    forward, recompute = _KeepMode(None, -1, False), _KeepMode(None, -1, True)
    if recompute_context is None:
        return forward, recompute
    return forward, _both(recompute_context, recompute)


# Ops a cache must not hold: metadata queries and detach, which checkpointing itself runs a different
# number of times in the forward and the recompute (torch's own selective checkpointing skips them too).
_IGNORED = frozenset(
    getattr(torch_checkpoint, "SAC_IGNORED_OPS", ())
    or (torch.ops.aten.detach.default, torch.ops.aten.size.default, torch.ops.aten.stride.default, torch.ops.aten.dim.default)
)
_TO_COPY = torch.ops.aten._to_copy.default
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
        # fills a buffer in place inside the op (a mask); by what the profile saw it draw, else by name
        random = uses_rng(gm, n) if RANDOM_META in n.meta else bool(_RANDOM.search(_kind(gm, n)))
        out.append(tensor_out and not random and not mutated_inputs(gm, n) and n not in written)
    return out


def _kind(gm: fx.GraphModule, n: fx.Node) -> str:
    if n.op == "call_module":
        return type(gm.get_submodule(str(n.target))).__name__
    return str(getattr(n.target, "__name__", n.target))


class PolicyCounter(TorchDispatchMode):
    """Per current fx node: bytes of new storages made by the ops a selective policy would cache, and
    how many aten ops the policy would be asked about. A run it watches goes on when counting fails:
    `error` says why (a message: the exception itself would keep the op's tensors alive through its
    traceback), and the counts are incomplete."""

    def __init__(self) -> None:
        super().__init__()
        self.node: str | None = None
        self.bytes: dict[str, int] = {}
        self.ops: dict[str, int] = {}
        self.error: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.node is not None and self.error is None:
            try:
                self._count(self.node, func, args, kwargs, out)
            except Exception as e:  # noqa: BLE001 - counting is a refinement: the op's result stands
                self.error = f"{type(e).__name__}: {e}"
        return out

    def _count(self, node: str, func, args, kwargs, out) -> None:
        self.ops[node] = self.ops.get(node, 0) + 1
        if _cacheable(func) and not _cast_cached(func, args):
            before = {_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            new = {_key(t): t.untyped_storage().nbytes() for t in tree_leaves(out) if isinstance(t, torch.Tensor)}
            self.bytes[node] = self.bytes.get(node, 0) + sum(b for k, b in new.items() if k not in before)


def _key(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage()._cdata
    except (NotImplementedError, RuntimeError):  # a tensor without storage (sparse, nested)
        return id(t)


class _NodeTracker(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, counter: PolicyCounter, convert) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.counter = counter
        self.convert = convert

    def call_function(self, target, args, kwargs):
        if self.convert is not None:
            args, kwargs = self.convert(args, kwargs)
        return call_target(target, args, kwargs)

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
    counter = PolicyCounter()
    with torch.set_grad_enabled(torch.is_grad_enabled()), counter:  # grad mode as it was, even on an error
        _NodeTracker(gm, counter, convert).run(*flat, enable_io_processing=False)
    if counter.error is not None:
        raise RuntimeError(f"counting the policy's figures failed: {counter.error}")
    return counter.bytes, counter.ops


def try_policy_costs(gm: fx.GraphModule, flat: Sequence, convert=None) -> tuple[dict[str, int] | None, dict[str, int] | None]:
    """`policy_costs`, or (None, None) where the graph cannot be run op by op this way (a higher-order op
    whose body holds meta-device constants on a fake run): the caller then keeps single-op nodes only."""
    try:
        return policy_costs(gm, flat, convert)
    except Exception:  # noqa: BLE001 - counting is a refinement; planning goes on without it
        return None, None


# -- eager's attention-mask decision on fake tensors -------------------------------------------------------

_MASKS = threading.local()  # .values: a fake mask -> its real value (None: unknown), while a fake run knows them


@contextlib.contextmanager
def known_masks(values: Callable[[torch.Tensor], torch.Tensor | None]) -> Iterator[None]:
    """While a run on fake tensors can give the example's real mask values (`values`): `call_target` takes
    eager's mask decision on them."""
    before = getattr(_MASKS, "values", None)
    _MASKS.values = values
    try:
        yield
    finally:
        _MASKS.values = before


def call_target(target: Any, args: tuple, kwargs: dict) -> Any:
    """`target(*args, **kwargs)`, as an fx interpreter calls a node's function. On a fake mask
    `eager_attention_mask` plans as for a batch without padding (the mask dropped where eager could drop
    it); where the run knows the example's mask (`known_masks`), eager's decision is taken on those values:
    a padded example keeps its mask [B, 1, Q, K], so the attention after it repeats the key/value heads
    and makes SDPA's float mask, the bytes its real step holds and a kept attention node caches."""
    out = target(*args, **kwargs)
    values = getattr(_MASKS, "values", None)
    if target is not eager_attention_mask or out is not None or values is None or not args:
        return out
    real = values(args[0])
    if real is None:
        return out
    with _disable_current_modes(), torch.no_grad():
        kept = eager_attention_mask(real, **kwargs) is not None
    return args[0] if kept else out

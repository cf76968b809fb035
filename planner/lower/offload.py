"""Offload: the plan's offloaded activations copied to host memory in the forward and fetched back for
their backward, through `torch.autograd.graph.saved_tensors_hooks`.

Which tensors: a plan offloads storages (`Problem.storages` indices). The profile records, per storage,
the node that made it and which of its outputs holds it (`Problem.meta[STORAGE_OUTPUTS]`), so each
offloaded storage is an `OffloadTarget`: a node output of the captured graph. The rewriter puts two calls
in the checkpointed graph's top level around each such node: `offload_begin()` before it and
`offload_mark(value, ((output, slot), ...))` after it. At run time the mark names the storage (by its
StorageImpl, held by weak reference while it is this step's), starts its copy to host, and from then on
every tensor autograd saves that views this storage (the node's own output, a view of it that a later
node saves, a transpose) is packed as a handle to that one copy: a storage is copied once however many
views of it are saved, and each view is rebuilt on unpack (`set_` with its own offset, sizes, strides).
What the node saved for itself while it ran (an exp's output) is packed before the mark: tensors packed
inside the begin..mark window are held as deferred handles, and the mark moves those of its storage to
the copy. A producer inside a checkpoint region is marked on the region's output (the storage itself, or
a view of it, leaving the region); one that never leaves its region is not offloaded (nothing outside
saves it), and the rewriter says so in its notes.

Nesting with checkpoint regions: saved-tensor hooks stack and only the innermost pair applies, so inside a
region torch.utils.checkpoint's own hooks take every saved tensor: tensors inside recomputed regions are
never offloaded. The hooks are pushed for the forward only; the recompute runs in the backward, outside them.

Copies: on CUDA into pinned host buffers on a side stream (it waits for the compute stream, an event marks
the copy's end, and `record_stream` keeps the device block from reuse until then); fetched back on the same
stream, after the compute work queued so far (the new device tensor's block may have been freed by it), into
a new device tensor that the compute stream waits for. When the backward unpacks one offloaded
storage, the fetches of every copy the simulator brings back by that backward step start at once (each
target's `fetch_step`, from `solvers.copies.timing`), and none sooner: the device bytes are held no
longer than the plan's peak counts. On the CPU the same hooks run with numpy host buffers (plain host memory, which no
torch meter counts, as the simulator does not count host memory) and synchronous copies, so tests run them:
a copy is exact, so gradients stay bitwise. Host buffers are kept per slot and size and reused step after step.

torch's own alternative: this torch has `torch.utils.checkpoint.CheckpointPolicy.MUST_CPU_OFFLOAD` (and
PREFER_CPU_OFFLOAD), a selective-checkpoint policy that torch.compile's partitioner honours for ops it
compiles; eager plans do not run under it, so offload here is these hooks, not that policy.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree

from ..errors import PlannerError

__all__ = ["OffloadTarget", "OffloadHooks", "OffloadError", "StepStats", "offload_begin", "offload_mark",
           "targets_of", "STORAGE_OUTPUTS"]

STORAGE_OUTPUTS = "storage_outputs"
"""`Problem.meta` key: per storage, (producer node name, output position or -1: made inside the op)."""


class OffloadError(PlannerError):
    """An offloaded activation could not be copied back for the backward."""


@dataclass(frozen=True)
class OffloadTarget:
    """One offloaded storage, as the graph finds it: the `output`-th strided tensor of node `node`."""

    storage: int
    """Its index in the Problem's storages."""
    node: str
    output: int
    """Position among the node's strided output tensors (the pytree leaves of its value)."""
    nbytes: int
    fetch_step: int = -1
    """The backward step (node index) at whose start the simulator brings it back (`solvers.copies.timing`);
    the hooks never fetch it earlier, so its device bytes are never held longer than predicted. -1: unknown,
    fetched when the backward first needs it."""
    use_step: int = -1
    """The backward step that first reads it (-1: unknown)."""

    def to_dict(self) -> dict[str, Any]:
        steps = {"fetch_step": self.fetch_step, "use_step": self.use_step} if self.fetch_step >= 0 else {}
        return {"storage": self.storage, "node": self.node, "output": self.output, "bytes": self.nbytes, **steps}


def targets_of(problem: Any, offloaded: Sequence[int], regions: Sequence[tuple[int, int]] = (),
               saved: Sequence[int] = ()) -> tuple[OffloadTarget, ...]:
    """The node outputs of a Problem's offloaded storages under the plan (`regions`, `saved`), with the
    backward steps the simulator fetches and first uses each at. A storage made inside an op (no output
    holds it) or one the problem has no record of has no target: it stays on the device."""
    from ..solvers.copies import normalize_offloaded, timing
    from ..solvers.plans import normalize_regions, normalize_saved
    from ..solvers.problem import ProblemError

    sources = problem.meta.get(STORAGE_OUTPUTS) or ()
    chosen = sorted(set(int(i) for i in offloaded))
    fetch: dict[int, int] = {}
    uses: dict[int, tuple[int, int]] = {}
    try:  # the schedule the plan was priced at; a set the plan does not keep (tests offload any) has none
        spans = normalize_regions(problem, regions)
        kept = normalize_saved(problem, spans, saved)
        _, uses = normalize_offloaded(problem, spans, kept, chosen)
        fetch = timing(problem, spans, kept, uses).fetch
    except ProblemError:
        fetch, uses = {}, {}
    out = []
    for s in chosen:
        if 0 <= s < len(sources) and sources[s][1] >= 0:
            out.append(OffloadTarget(s, str(sources[s][0]), int(sources[s][1]), int(problem.storages[s].nbytes),
                                     fetch.get(s, -1), uses[s][1] if s in uses else -1))
    return tuple(out)


# -- run time --------------------------------------------------------------------------------------------

_local = threading.local()


def _current() -> _Step | None:
    stack = getattr(_local, "stack", None)
    return stack[-1] if stack else None


@torch.fx.node.has_side_effect
def offload_begin() -> None:
    """Before an offloaded node: hold what it saves for itself until its mark names its storage."""
    step = _current()
    if step is not None and step.window is None:
        step.window = []


@torch.fx.node.has_side_effect
def offload_mark(value: Any, outputs: tuple[tuple[int, int], ...]) -> None:
    """After an offloaded node: start the copy of each `(output position, slot)` of `value` (position -1:
    `value` is the tensor) and offload every saved view of it from now on."""
    step = _current()
    if step is not None:
        step.mark(value, outputs)


@dataclass
class StepStats:
    """What the hooks did in one forward (tests and the benchmark count through it)."""

    slots: list[int] = field(default_factory=list)
    """Slots (positions in the plan's offloaded list) copied to host, in order."""
    tensors: int = 0
    """Saved tensors packed as handles to a host copy (views included)."""
    bytes: int = 0
    """Bytes copied to host."""
    kept: int = 0
    """Saved views of an offloaded storage kept on the device (written in place since its copy)."""
    fetches: list[tuple[int, int]] = field(default_factory=list)
    """(slot, backward step) of each fetch in the backward after this forward, in order: the step is the
    first use of the copy whose unpack started it (-1: unknown)."""


class _HostPool:
    """Host buffers per (slot, bytes), reused step after step: pinned on CUDA, numpy on the CPU."""

    def __init__(self) -> None:
        self.free: dict[tuple[int, int], list[Any]] = {}

    def take(self, slot: int, nbytes: int, pinned: bool) -> Any:
        bufs = self.free.get((slot, nbytes))
        if bufs:
            return bufs.pop()
        if pinned:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return np.empty(nbytes, dtype=np.uint8)

    def give(self, slot: int, nbytes: int, buf: Any) -> None:
        self.free.setdefault((slot, nbytes), []).append(buf)


def hooks_step_copies(hooks: OffloadHooks) -> list:
    """The copy list of the forward under way (`_Step.copies`), which every copy of that step shares."""
    step = _current()
    return step.copies if step is not None and step.hooks is hooks else []


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """The whole storage behind `t` as one uint8 tensor."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


class _Copy:
    """One offloaded storage of one step: its host copy and, once fetched, its device copy. Alive while a
    handle to it is (autograd's saved tensors); its host buffer goes back to the pool when it dies."""

    def __init__(self, hooks: OffloadHooks, slot: int, t: torch.Tensor) -> None:
        src = _bytes_of(t)
        self.hooks, self.slot, self.device, self.nbytes = hooks, slot, t.device, src.numel()
        self.cuda = t.device.type == "cuda"
        self.host = hooks.pool.take(slot, self.nbytes, self.cuda)
        weakref.finalize(self, hooks.pool.give, slot, self.nbytes, self.host)
        step = _current()
        self.stats = step.stats if step is not None else None
        target = hooks.targets[slot]
        self.fetch_step, self.use_step = target.fetch_step, target.use_step
        self.fetched: torch.Tensor | None = None
        self.ready: Any = None  # the CUDA event that ends the fetch; None once the compute stream waited
        self.others: list[weakref.ref[_Copy]] = hooks_step_copies(hooks)
        """The step's copies, one list shared by all (the backward fetches those due when it first needs this one)."""
        if self.cuda:
            side = hooks.stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))  # the values are written on the compute stream
            with torch.cuda.stream(side):
                self.host.copy_(src, non_blocking=True)
            src.record_stream(side)  # the device block is not reused before the copy has read it
        else:
            self.host[...] = src.numpy()  # numpy: no torch op, so no meter counts host memory

    def fetch(self, at: int = -1) -> torch.Tensor:
        """The device copy, its fetch started if it has not been (no wait here); `at`: the backward step."""
        if self.fetched is None:
            if self.stats is not None:
                self.stats.fetches.append((self.slot, at))
            try:
                dev = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
                if self.cuda:
                    side = self.hooks.stream(self.device)
                    # `dev` comes from the compute stream's pool: its block may have been freed by compute work
                    # still queued, so the copy waits for that work; the simulator starts it here too
                    side.wait_stream(torch.cuda.current_stream(self.device))
                    with torch.cuda.stream(side):  # after this storage's own copy to host, on the same stream
                        dev.copy_(self.host, non_blocking=True)
                    self.ready = torch.cuda.Event()
                    self.ready.record(side)
                    dev.record_stream(side)
                else:
                    dev.numpy()[...] = self.host
            except RuntimeError as e:
                raise OffloadError(f"offload: fetching an offloaded activation ({self.nbytes} bytes, slot "
                                   f"{self.slot}) back to {self.device} failed: {str(e).splitlines()[0][:200]}") from None
            self.fetched = dev
        return self.fetched

    def tensor(self, dtype: torch.dtype, size: tuple[int, ...], stride: tuple[int, ...], offset: int) -> torch.Tensor:
        dev = self.fetch(self.use_step)
        if self.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(self.ready)
            self.ready = None
        if self.hooks.prefetch and self.use_step >= 0:
            # The backward is at this copy's first use: every copy the simulator fetches at this step or an
            # earlier one of the backward (a higher node index) is due, and only those (a fetch issued sooner
            # would hold device bytes the plan's peak does not count). Their copies overlap this step's work.
            for ref in self.others:
                other = ref()
                if other is not None and other is not self and other.fetched is None and other.fetch_step >= self.use_step:
                    other.fetch(self.use_step)
        return torch.empty(0, dtype=dtype, device=self.device).set_(dev.untyped_storage(), offset, size, stride)


class _Saved:
    """What autograd keeps for a saved tensor in an offloading forward: the tensor itself until (if ever)
    its storage's mark moves it to a host copy, then the copy and the view's geometry."""

    __slots__ = ("tensor", "copy", "geometry", "__weakref__")

    def __init__(self, tensor: torch.Tensor | None, copy: _Copy | None = None) -> None:
        self.tensor, self.copy, self.geometry = tensor, None, None
        if copy is not None:
            self.offload(tensor, copy)

    def offload(self, t: torch.Tensor, copy: _Copy) -> None:
        self.copy, self.tensor = copy, None
        self.geometry = (t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset())

    def get(self) -> torch.Tensor:
        if self.tensor is not None:
            return self.tensor
        return self.copy.tensor(*self.geometry)


def _unpack(packed: Any) -> torch.Tensor:
    return packed if isinstance(packed, torch.Tensor) else packed.get()


@dataclass
class _Registered:
    copy: _Copy
    ref: StorageWeakRef
    version: int


class _Step:
    """One forward under the hooks: the storages marked so far and the window of the node being marked."""

    def __init__(self, hooks: OffloadHooks) -> None:
        self.hooks = hooks
        self.registered: dict[int, _Registered] = {}
        self.window: list[tuple[_Saved, torch.Tensor]] | None = None
        self.copies: list[weakref.ref[_Copy]] = []
        """This step's copies, by weak reference: autograd's handles keep them alive, nothing else."""
        self.stats = StepStats()

    def pack(self, t: torch.Tensor) -> Any:
        plain = t.detach()  # never the tensor itself: a saved output would hold its own grad_fn (a cycle)
        if t.layout != torch.strided or t.device.type == "meta":
            return plain
        if self.registered:
            hit = self.registered.get(t.untyped_storage()._cdata)
            if hit is not None and not hit.ref.expired():  # alive, so the address is this very storage
                if t._version == hit.version:
                    self.stats.tensors += 1
                    return _Saved(plain, hit.copy)
                self.stats.kept += 1  # written in place after its copy: the device value is the one to keep
        if self.window is not None:
            saved = _Saved(plain)
            self.window.append((saved, plain))
            return saved
        return plain

    def mark(self, value: Any, outputs: tuple[tuple[int, int], ...]) -> None:
        window, self.window = self.window or [], None
        if not torch.is_grad_enabled():
            return
        leaves = [x for x in pytree.tree_leaves(value) if isinstance(x, torch.Tensor) and x.layout == torch.strided]
        for position, slot in outputs:
            t = value if position < 0 else (leaves[position] if position < len(leaves) else None)
            if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.device.type == "meta":
                continue
            key = t.untyped_storage()._cdata
            if key in self.registered and not self.registered[key].ref.expired():
                continue  # two names for one storage: copied once
            copy = _Copy(self.hooks, slot, t)
            self.copies.append(weakref.ref(copy))
            self.registered[key] = _Registered(copy, StorageWeakRef(t.untyped_storage()), t._version)
            self.stats.slots.append(slot)
            self.stats.bytes += copy.nbytes
            for saved, plain in window:  # what the node saved for itself before its storage was named
                if saved.tensor is not None and plain.untyped_storage()._cdata == key and plain._version == t._version:
                    saved.offload(plain, copy)
                    self.stats.tensors += 1


class OffloadHooks:
    """The offload of one checkpointed module: `with hooks.step(): forward` offloads the plan's targets."""

    def __init__(self, targets: Sequence[OffloadTarget], *, prefetch: bool | None = None) -> None:
        self.targets = tuple(targets)
        self.prefetch_setting = prefetch
        self.pool = _HostPool()
        self._streams: dict[torch.device, Any] = {}
        self.last: StepStats | None = None
        """What the last forward offloaded."""

    @property
    def prefetch(self) -> bool:
        """Fetch copies when the simulator does, ahead of their use: on CUDA, where the copy overlaps
        compute; on the CPU only when asked (a copy is synchronous there, so an early fetch gains nothing)."""
        return self.prefetch_setting if self.prefetch_setting is not None else bool(self._streams)

    def stream(self, device: torch.device) -> Any:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        if not torch.is_grad_enabled() or not self.targets:  # nothing is saved: nothing to offload
            yield
            return
        step = _Step(self)
        stack = getattr(_local, "stack", None)
        if stack is None:
            stack = _local.stack = []
        stack.append(step)
        try:
            with torch.autograd.graph.saved_tensors_hooks(step.pack, _unpack):
                yield
        finally:
            stack.pop()
            step.registered.clear()  # handles hold the copies from here on; nothing else may match
            step.window, step.copies = None, []
            self.last = step.stats

    def __deepcopy__(self, memo: dict) -> OffloadHooks:
        return OffloadHooks(self.targets, prefetch=self.prefetch_setting)


# -- in the graph ----------------------------------------------------------------------------------------

def place_marks(graph: fx.Graph, original: Sequence[fx.Node], env: dict[fx.Node, fx.Node],
                in_regions: set[fx.Node], targets: Sequence[OffloadTarget]) -> list[str]:
    """Put `offload_begin` / `offload_mark` in `graph` (the checkpointed module's top level) for each target:
    around its node where that node runs at the top level, else after the region output that is its storage
    (or a view of it). `env`: original node -> its value in `graph`; `in_regions`: the original nodes run
    inside checkpoint regions. Returns notes for targets no node outside a region can see (kept on the device)."""
    by_name = {n.name: n for n in original}
    marks: dict[fx.Node, list[tuple[int, int]]] = {}
    begins: set[fx.Node] = set()
    notes = []
    for slot, target in enumerate(targets):
        producer = by_name.get(target.node)
        if producer is None:
            notes.append(f"offload: node {target.node} is not in the graph; its storage stays on the device")
            continue
        if producer not in in_regions and producer in env:
            marks.setdefault(env[producer], []).append((target.output, slot))
            begins.add(env[producer])
            continue
        seen = next((o for o in env if o in in_regions and _holds(o, producer, target.output)), None)
        if seen is None:
            notes.append(f"offload: {target.node}'s output never leaves its checkpoint region, so nothing outside "
                         "saves it; it stays on the device")
            continue
        marks.setdefault(env[seen], []).append((target.output if seen is producer else -1, slot))
    for node, pairs in marks.items():
        if node in begins:
            with graph.inserting_before(node):
                graph.call_function(offload_begin, ())
        with graph.inserting_after(node):
            graph.call_function(offload_mark, (node, tuple(pairs)))
    return notes


def _holds(o: fx.Node, producer: fx.Node, output: int) -> bool:
    """Whether node `o`'s value is `producer`'s `output`-th output tensor or a view of it."""
    from ..capture.mutation import view_root

    if o is producer:
        return True
    chain = [o]
    while chain[-1] is not producer:
        n = chain[-1]
        if view_root(n) is n or not n.args or not isinstance(n.args[0], fx.Node):
            return False
        chain.append(n.args[0])
    first = chain[-2]  # the node that reads the producer
    if first.op == "call_function" and getattr(first.target, "__name__", "") == "getitem":
        return len(first.args) > 1 and first.args[1] == output
    return output == 0

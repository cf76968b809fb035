"""The profiler's recording run: one forward of the graph, node by node, that records what each
node makes, saves for backward, and costs.

`CostProfiler` is the `fx.Interpreter` both runs use: untimed recording (a `saved_tensors_hooks`
pack hook around each node, a live-storage counter, optionally an allocator meter and a FLOP
counter) and the plain timed runs. Its record (`events`, `grad_fns`, `step_output`) is what
`profile.py` builds the CostGraph from and what `backward.py` measures the backward on; both read
it here, so neither imports the other for it.

On fake tensors (meta mode) one dispatch mode, `FakeRecorder`, counts storages and FLOPs together,
and tensors on the meta device become fake CPU tensors (see `fake_of`).

FLOPs come from torch's formulas (torch.utils.flop_counter) with two changes (see `flop_formulas`):
fused attention with fewer key/value heads than query heads (grouped-query attention, `enable_gqa`)
is counted on the expanded heads, where torch's formula asserts equal heads in the versions before
its GQA support (2.11 among them: flash attention takes GQA under bf16 on CUDA); and a formula that
still raises counts 0 FLOPs for its op, with a warning (`op_flops`): a FLOP count is an estimate,
never a reason for profiling to fail.
"""

from __future__ import annotations

import contextlib
import time
import warnings
import weakref
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree
from torch.utils import flop_counter as torch_flops
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from ..capture.rng import SeededOps, generator_states, mark_random, moved
from ..errors import ProfileError
from ..lower.selective import call_target, known_masks
from .backward import KeptScalars
from .memory import (
    AllocatorMeter,
    LiveMemory,
    as_eager_storage,
    autocast_dtypes,
    fresh_autocast_cache,
    storage_key,
    tensor_block_bytes,
)

__all__ = [
    "AutocastCasts", "CostProfiler", "FakeRecorder", "run_recording", "device_of", "fake_of", "meta_to_cpu",
    "flop_counter", "flop_formulas", "op_flops", "strided_tensors",
]


def strided_tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor) and t.layout == torch.strided]


class CostProfiler(fx.Interpreter):
    """Runs the graph and records, per node, storages made, storages saved and time."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm, garbage_collect_values=False)
        self.extra_traceback = False  # a failure reads as one line naming the node (run_node), not the graph's code
        self.record = False
        self.times: dict[str, list[float]] = {}
        self.sync = None
        self.meta_to_cpu = False
        """Fake runs of a graph captured on the meta device: its `device=meta` constants mean cpu."""
        self.grad_fns: dict[Any, str] = {}
        """Autograd node -> name of the fx node whose forward made it (recording runs)."""
        self.step_output: Any = None
        """The graph's output of the recording run, for the backward that follows it."""
        self.meter: AllocatorMeter | None = None
        """The allocator meter of the recording run (real tensors only): a window per node."""
        self.seeded: SeededOps | None = None
        """The recording run's record of which nodes drew random numbers (rng.py)."""
        self.watch_generators = False
        """Recording on real tensors: also compare the generators' states around each node."""
        self._generators: tuple[str | None, list[torch.Tensor]] | None = None
        self.casts: AutocastCasts | None = None
        """The recording run's casts of parameters that autocast keeps in its cache (None outside autocast)."""
        self.watch: Any = None
        """A dispatch mode that watches the recording run (`run_recording`); its `node` is the running node's name."""
        self.sizes: Any = None
        """On fake tensors: the mode that sizes the ops whose output size depends on values (dynamic_shapes.py)."""
        self.real: Any = None
        """On fake tensors: the real values of nodes from the example inputs, where cheap (`RealValues.of`)."""
        self.running: fx.Node | None = None
        self.scalars: Any = None
        """The recording run's count of the Python numbers autograd keeps as tensors (backward.KeptScalars)."""

    def check_generators(self, following: str | None) -> None:
        """Close the generator watch of the node that ran last (its states against those before it) and
        start one for `following`. The snapshots are taken in a meter window of their own, so no node's
        allocator window sees them made or freed."""
        if not self.watch_generators:
            return
        if self.meter is not None:
            self.meter.mark(_GENERATOR_WINDOW)
        if self._generators is not None:
            node, before = self._generators
            if node is not None and moved(before):  # drew without a tagged op (a custom kernel)
                self.seeded.random.add(node)
        self._generators = (following, generator_states())

    def call_function(self, target: Any, args: tuple, kwargs: dict) -> Any:
        if self.meta_to_cpu:
            args, kwargs = meta_to_cpu(args, kwargs)
        return call_target(target, args, kwargs)  # eager's mask decision on the example's values (fake runs)

    def real_of(self, t: torch.Tensor, *, parameters: bool = False) -> torch.Tensor | None:
        """The real value of `t`, a fake tensor the running node was handed by one of its input nodes; None
        where that node has none (see `real`; `parameters`: computing it may read them) or `t` is not such a
        tensor (one made inside the node)."""
        n = self.running
        if n is None or self.real is None:
            return None
        for a in n.all_input_nodes:
            for i, leaf in enumerate(pytree.tree_leaves(self.env.get(a))):
                if leaf is t:
                    value = self.real.of(a, parameters=parameters)
                    return None if value is None else pytree.tree_leaves(value)[i]
        return None

    def _own_grad_fns(self, n: fx.Node, out: Any) -> None:
        """Attribute the autograd nodes this node's forward made (reachable, not yet owned) to it."""
        stack = [t.grad_fn for t in strided_tensors(out) if t.grad_fn is not None]
        while stack:
            fn = stack.pop()
            if fn is None or fn in self.grad_fns or type(fn).__name__ == "AccumulateGrad":
                continue
            self.grad_fns[fn] = n.name
            stack.extend(f for f, _ in fn.next_functions)

    def run_node(self, n: fx.Node) -> Any:
        if not self.record:
            t0 = time.perf_counter()
            try:
                out = super().run_node(n)
            except Exception as e:
                raise ProfileError(f"node {n.name!r} ({n.op} {n.target}) failed: {e}") from e
            if self.sync is not None:
                self.sync()
            self.times.setdefault(n.name, []).append(time.perf_counter() - t0)
            return out
        # Weak references: every autograd node saving through this hook keeps the hook (and what
        # it refers to) alive until its own backward, so a strong list would hold all of the fx
        # node's saved tensors until its last autograd node ran, where a real step frees each
        # one after its own (a decomposed attention's probabilities: Wav2Vec2's would be over-counted).
        packed: list[weakref.ref] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            packed.append(weakref.ref(t))
            return t

        self.check_generators(n.name)
        if self.meter is not None:
            self.meter.mark(n.name)
        before = self.mem.current
        self.mem.reset_peak()
        flops0 = self.flops.get_total_flops() if self.flops is not None else 0
        for watcher in (self.seeded, self.watch, self.casts, self.sizes, self.scalars):
            if watcher is not None:
                watcher.node = n.name
        self.running = n
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = super().run_node(n)
        except Exception as e:  # one line: fx appends the graph's code and a traceback to the message
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ProfileError(f"node {n.name!r} ({n.op} {n.target}) failed: {first}") from e
        finally:
            self.running = None
            for watcher in (self.seeded, self.watch, self.casts, self.sizes, self.scalars):
                if watcher is not None:
                    watcher.node = None
        flops = (self.flops.get_total_flops() - flops0) if self.flops is not None else 0
        self._own_grad_fns(n, out)
        self.mem.track(out)
        self.events[n.name] = (packed, self.mem.peak - before, self.mem.current - before, flops)
        if self.scalars is not None and self.scalars.waiting:
            if self.meter is not None:
                self.meter.mark(_PROBE_WINDOW)  # the probes' own scalars in no node's window
            self.scalars.settle()
        return out


def run_recording(gm: fx.GraphModule, flat: list[Any], *, count_flops: bool, allocator: bool, fake_mode=None,
                  watch: TorchDispatchMode | None = None, sizes: Any = None, real: Any = None) -> CostProfiler:
    """The recording run (see the module docstring); `allocator`: meter the allocator too (real tensors).
    Marks the graph's random nodes as it goes (rng.mark_random).

    `watch`: a dispatch mode that sees every op the nodes call, as they call it (it is entered above the
    recorder, before any op is decomposed for its FLOPs), told the running node's name through `node`:
    what another forward of the graph would count, counted in this one.

    `sizes`: on fake tensors, the mode that sizes ops whose output size depends on values, entered directly
    above the fake mode, and `real` what gives it the real values of nodes; on real tensors, the mode that
    notes the sizes the example's values made (dynamic_shapes.py)."""
    prof = CostProfiler(gm)
    prof.record = True
    prof.events = {}
    prof.meta_to_cpu = fake_mode is not None
    dtypes = autocast_dtypes()
    fresh_autocast_cache()  # every cast is made, and seen, in this run (emptied before any meter starts)
    with contextlib.ExitStack() as stack:
        if fake_mode is not None:
            # One dispatch mode that counts storages and FLOPs: on fake tensors the
            # mode layers are most of the cost, and the figures are the same.
            stack.enter_context(fake_mode)
            if sizes is not None:
                prof.sizes, prof.real = stack.enter_context(sizes), real
                sizes.values = prof.real_of if real is not None else None
                stack.enter_context(known_masks(sizes.mask_value))
            prof.seeded = stack.enter_context(SeededOps())
            prof.mem = FakeRecorder(count_flops=count_flops)
            prof.flops = prof.mem if count_flops else None
        else:
            prof.seeded = stack.enter_context(SeededOps())
            prof.watch_generators = True
            prof.mem = LiveMemory()
            prof.flops = flop_counter() if count_flops else None
            if prof.flops is not None:
                stack.enter_context(prof.flops)
            if allocator:
                prof.meter = stack.enter_context(AllocatorMeter(device_of(gm, flat)))
            if sizes is not None:  # watching for sizes that depend on values, below the counters
                prof.sizes = stack.enter_context(sizes)
        stack.enter_context(prof.mem)
        if dtypes:
            prof.casts = stack.enter_context(AutocastCasts(dtypes))
        if watch is not None:
            prof.watch = stack.enter_context(watch)
        prof.scalars = stack.enter_context(KeptScalars())  # sees each call as the graph makes it
        prof.step_output = prof.run(*flat, enable_io_processing=False)
        prof.check_generators(None)
    mark_random(gm, prof.seeded.random, prof.seeded.unreplayable)
    return prof


class AutocastCasts(TorchDispatchMode):
    """The casts autocast keeps in its cache: a trainable float32 parameter (a leaf that requires grad, not
    a view) cast to the autocast dtype of its device. Autocast makes each once, at its first use in a
    context, and holds it until the outermost context exits: through the whole step where the step runs
    inside the context, whatever a plan recomputes (a recompute in that context finds the cast cached).
    A region's checkpoint cannot free it, so it is not an activation; the profile counts it with the
    parameters. `dtypes`: device type -> autocast dtype where autocast and its cache are on."""

    def __init__(self, dtypes: dict[str, torch.dtype]) -> None:
        super().__init__()
        self.dtypes = dtypes
        self.made: dict[int, int] = {}
        """Storage key -> bytes of each cast made."""
        self.refs: list[weakref.ref] = []
        """The casts themselves (the backward's counter tracks them: the cache holds them through it)."""
        self.readers: dict[int, set[str]] = {}
        """Storage key -> the nodes whose ops took the cast (the one that made it, and those that found it cached)."""
        self.node: str | None = None
        """The running node's name (set by the recorder)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.made and self.node is not None:
            for t in pytree.tree_leaves((args, kwargs)):
                if isinstance(t, torch.Tensor) and t.layout == torch.strided and storage_key(t) in self.made:
                    self.readers.setdefault(storage_key(t), set()).add(self.node)
        out = func(*args, **kwargs)
        if func is _TO_COPY and args and isinstance(out, torch.Tensor) and out.layout == torch.strided:
            t = args[0]
            if (
                isinstance(t, torch.Tensor) and t.is_leaf and t.requires_grad and not t._is_view()
                and t.dtype == torch.float32 and out.dtype == self.dtypes.get(t.device.type)
            ):
                key = storage_key(out)
                if key not in self.made:
                    self.made[key] = tensor_block_bytes(out)
                    self.refs.append(weakref.ref(out))
                if self.node is not None:
                    self.readers.setdefault(key, set()).add(self.node)
        return out


_TO_COPY = torch.ops.aten._to_copy.default
_GENERATOR_WINDOW = "<generator states>"  # the allocator window of the generator snapshots (no node's)
_PROBE_WINDOW = "<kept scalar probes>"  # the allocator window of KeptScalars' probes (no node's)


def device_of(gm: fx.GraphModule, flat: list[Any]) -> torch.device:
    for t in strided_tensors(flat) + list(gm.parameters()) + list(gm.buffers()):
        return t.device
    return torch.device("cpu")


def fake_of(fake_mode: Any, t: torch.Tensor, memo: dict[int, torch.Tensor]) -> torch.Tensor:
    """A fake tensor standing for t; a meta tensor becomes a fake CPU tensor.

    On the meta device, scaled_dot_product_attention takes the float32 math path
    and saves [B, H, T, T] attention matrices; a fake CPU tensor dispatches to
    the fused kernel a real run uses (it saves the output and a [B, H, T]
    logsumexp), so the bytes are those of a real step. No memory is allocated.
    Tied tensors (one object under two names) get one fake (memo by id).
    """
    if t.device.type != "meta":
        return fake_mode.from_tensor(t)
    fake = memo.get(id(t))
    if fake is None:
        with fake_mode:
            fake = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
        fake.requires_grad_(t.requires_grad)
        memo[id(t)] = fake
    return fake


class FakeRecorder(LiveMemory):
    """LiveMemory that also counts FLOPs as torch's FlopCounterMode does (same formulas).

    Ops without a FLOP formula that decompose are run decomposed so their parts
    are counted; only the top-level op's storages are tracked, as with the two
    modes stacked. The CPU fused attention kernel is counted like CUDA flash attention.
    """

    def __init__(self, *, count_flops: bool = True) -> None:
        super().__init__()
        self.count_flops = count_flops
        self.total_flops = 0
        self._nested = False

    def get_total_flops(self) -> int:
        return self.total_flops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        args, kwargs = meta_to_cpu(args, kwargs)  # inside higher-order ops' subgraphs
        formula = flop_formulas().get(func._overloadpacket) if self.count_flops else None
        if self.count_flops and formula is None and func not in _NO_DECOMPOSE:
            nested, self._nested = self._nested, True
            try:
                with self:
                    out = func.decompose(*args, **kwargs)
            finally:
                self._nested = nested
            if out is not NotImplemented:
                if not nested:
                    out = as_eager_storage(func, args, out)
                    self._track_out(out)
                return out
            _NO_DECOMPOSE.add(func)
        out = func(*args, **kwargs)
        if formula is not None:
            self.total_flops += op_flops(func._overloadpacket, formula, args, kwargs, out)
        if not self._nested:
            out = as_eager_storage(func, args, out)
            self._track_out(out)
        return out

    def _track_out(self, out: Any) -> None:
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                self._add(t.untyped_storage())


_META, _CPU = torch.device("meta"), torch.device("cpu")


def meta_to_cpu(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """args and kwargs with torch.device('meta') replaced by cpu (see _fake_of)."""
    if not any(isinstance(a, torch.device) and a == _META for a in (*args, *kwargs.values())):
        return args, kwargs
    args = tuple(_CPU if isinstance(a, torch.device) and a == _META else a for a in args)
    kwargs = {k: _CPU if isinstance(v, torch.device) and v == _META else v for k, v in kwargs.items()}
    return args, kwargs


_NO_DECOMPOSE: set = set()  # ops found to have no decomposition (and metadata queries)
_FORMULAS: dict = {}  # op overload packet -> FLOP formula (the fake run's: torch's ops and the CPU fused attention)
_TORCH_FORMULAS: dict = {}  # op overload packet -> FLOP formula, for the ops torch's own registry has
_FAILED: set = set()  # ops whose formula raised (warned once each)

# Fused attention ops whose query, key and value are [B, H, S, D] at these argument positions (the
# forward's first three; the backward's after grad_out). Their kernels take key/value with fewer heads
# than the query (grouped-query attention), which torch's formula refuses before its GQA support.
_SDPA_FORWARD = (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
)
_SDPA_BACKWARD = (
    "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention_backward",
)


def flop_formulas() -> dict:
    """Op overload packet -> FLOP formula, called as torch's FLOP counter calls it:
    `formula(*args, out_val=out, **kwargs)`. torch's formulas, with grouped-query attention counted on
    the expanded heads, and the CPU fused attention kernel counted like CUDA flash attention. A formula
    may still raise (shapes it does not read): count through `op_flops`, which never does."""
    if not _FORMULAS:
        _NO_DECOMPOSE.add(torch.ops.prim.device.default)
        formulas = _torch_formulas()
        _FORMULAS.update(formulas)
        flash = formulas.get(torch.ops.aten._scaled_dot_product_flash_attention)
        cpu = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
        if flash is not None and cpu is not None:
            _FORMULAS[cpu] = flash
    return _FORMULAS


def _torch_formulas() -> dict:
    if not _TORCH_FORMULAS:
        _TORCH_FORMULAS.update(torch_flops.flop_registry)
        for names, backward in ((_SDPA_FORWARD, False), (_SDPA_BACKWARD, True)):
            for name in names:
                packet = getattr(torch.ops.aten, name, None)
                formula = _TORCH_FORMULAS.get(packet) if packet is not None else None
                if formula is not None:
                    _TORCH_FORMULAS[packet] = _gqa_expanded(formula, backward=backward)
    return _TORCH_FORMULAS


def _gqa_expanded(formula: Any, *, backward: bool) -> Any:
    """`formula` of a fused attention op, except where key/value have fewer heads than the query: there
    the FLOPs of the same attention with key/value repeated to the query's heads, which is the work the
    kernel does (and what torch's formula counts where it accepts GQA). `backward`: the op's arguments
    are (grad_out, query, key, value, ...), else (query, key, value, ...)."""
    first = 1 if backward else 0

    def flops(*args: Any, out_val: Any = None, **kwargs: Any) -> Any:
        shapes = _expanded_shapes(args[first:first + 3])
        if shapes is None:
            return formula(*args, out_val=out_val, **kwargs)
        if backward:
            return torch_flops.sdpa_backward_flop_count(tuple(args[0].shape), *shapes)
        return torch_flops.sdpa_flop_count(*shapes)

    flops._get_raw = True  # FlopCounterMode(custom_mapping=...) passes it the tensors, as torch's formula
    return flops


def _expanded_shapes(qkv: tuple) -> tuple[tuple, tuple, tuple] | None:
    """The shapes of query, key, value [B, H, S, D] with key/value's heads repeated to the query's; None
    unless key/value have fewer heads, a divisor of the query's (other calls keep torch's formula)."""
    if len(qkv) != 3 or not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in qkv):
        return None
    q, k, v = (tuple(t.shape) for t in qkv)
    heads, kv_heads = q[1], k[1]
    if kv_heads == heads or kv_heads != v[1] or kv_heads <= 0 or heads % kv_heads != 0:
        return None
    return q, (k[0], heads, *k[2:]), (v[0], heads, *v[2:])


def op_flops(op: Any, formula: Any, args: tuple, kwargs: dict, out: Any) -> Any:
    """`formula`'s FLOPs for one call of `op`; 0 where the formula raises (warned once per op). A FLOP
    count is an estimate: a node without one is timed by its bytes where times come from FLOPs, and
    the profile goes on."""
    try:
        return formula(*args, **kwargs, out_val=out)
    except Exception as e:  # noqa: BLE001 - any formula's failure: count nothing, never fail the profile
        if op not in _FAILED:
            _FAILED.add(op)
            first = (str(e).strip().splitlines() or [""])[0]
            warnings.warn(
                f"FLOPs of {op} not counted ({type(e).__name__}: {first}): counted as 0, so the time of "
                "its nodes follows their bytes where it is taken from FLOPs",
                stacklevel=2,
            )
        return 0


def flop_counter() -> FlopCounterMode:
    """torch's FLOP counter for the recording run on real tensors, with `flop_formulas`' formulas for
    torch's own ops (GQA attention on the expanded heads), each through `op_flops`, so no formula
    fails the run."""

    def safe(op: Any, formula: Any) -> Any:
        def flops(*args: Any, out_val: Any = None, **kwargs: Any) -> Any:
            return op_flops(op, formula, args, kwargs, out_val)

        flops._get_raw = True
        return flops

    return FlopCounterMode(display=False, custom_mapping={op: safe(op, f) for op, f in _torch_formulas().items()})

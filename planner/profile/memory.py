"""Two peak-memory meters: live tensor storages (`LiveMemory`) and the allocator (`AllocatorMeter`).

`LiveMemory` is a TorchDispatchMode: every storage an op creates is counted
until it is freed (a finalizer on the storage); tensors that exist already
(parameters, inputs) are added with `track`. `peak` is the most bytes live at
once. On CUDA, `torch.cuda.max_memory_allocated` is the measure instead.
"""

from __future__ import annotations

import contextlib
import gc
import os
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ..model_state import step_undone
from ..progress import native_stderr_dropped

__all__ = ["CUDA_BLOCK_BYTES", "ALLOCATOR_OVERHEAD", "EAGER_REDUCED_VIEWS", "EXPANDABLE_OVERHEAD", "SIZED_BY_KERNEL", "AllocatorMeter", "as_eager_storage", "allocator_limit", "block_bytes", "LiveMemory", "StepPeaks", "Window", "alive", "autocast_dtypes", "collections_of_new_objects", "device_room",
           "fresh_autocast_cache", "measure_step_peaks", "storage_key", "warm_device_libraries"]


CUDA_BLOCK_BYTES = 512
"""CUDA's caching allocator rounds every block up to a multiple of this (`kMinBlockSize`)."""


def block_bytes(nbytes: int, device: torch.device | str) -> int:
    """The bytes `nbytes` take on `device`'s allocator. On CUDA a block is a multiple of 512 bytes, which
    is most of a small tensor (a BatchNorm's per-channel statistics, a LayerNorm's row statistics): counted
    at their size alone, a small ResNet's CUDA step is predicted under its peak
    (benchmarks/results/gpu-h100.md)."""
    if nbytes <= 0 or torch.device(device).type != "cuda":
        return nbytes
    return -(-nbytes // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES


def tensor_block_bytes(t: torch.Tensor) -> int:
    """`block_bytes` of a tensor's whole storage."""
    return block_bytes(t.untyped_storage().nbytes(), t.device)


EAGER_REDUCED_VIEWS = frozenset({"mse_loss", "smooth_l1_loss", "binary_cross_entropy", "soft_margin_loss"})
"""Loss kernels whose reduced result (`reduction` mean or sum) is a 0-dim view of the unreduced loss they
computed (torch 2.13): the scalar keeps the whole broadcast input's elements alive for as long as it lives, the
step's loss through the backward. Their decompositions, which a fake-tensor run counts, make a scalar of
its own, so without this set such a step is predicted under its peak
(tests/unit/profile/test_reduced_loss_storage.py)."""


SIZED_BY_KERNEL = frozenset({"mkldnn_rnn_layer"})
"""Ops whose meta function gives an output of the wrong size: the CPU LSTM layer's workspace, which its
backward keeps, is empty there. oneDNN sizes it (padded to 4 KiB pages, 16 MB for 32 x 128 tokens of a 64-wide
LSTM, where the layer's output is 1 MB): sized by the meta function, an LSTM's step is predicted far under its
peak (tests/unit/profile/test_kernel_sized_outputs.py)."""

_KERNEL_RUNS: dict[tuple, tuple[int, ...]] = {}  # (op, argument shapes) -> the eager outputs' storage bytes


def _kernel_run(func: Any, args: tuple) -> tuple[int, ...]:
    """Storage bytes of each output of `func` run eagerly on zeros of its arguments' shapes (once per shape,
    outside every dispatch mode, on the CPU where these kernels are)."""

    def spec(a: Any) -> Any:
        return ("t", tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else repr(a)

    key = (str(func), *(spec(a) for a in args))
    if key not in _KERNEL_RUNS:
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes(), torch.enable_grad():  # the LSTM's workspace is made only where grad is on
            real = [torch.zeros(a.shape, dtype=a.dtype) if isinstance(a, torch.Tensor) else a for a in args]
            outs = func(*real)
            _KERNEL_RUNS[key] = tuple(
                o.untyped_storage().nbytes() if isinstance(o, torch.Tensor) else 0 for o in pytree.tree_leaves(outs)
            )
    return _KERNEL_RUNS[key]


def as_eager_storage(func: Any, args: tuple, out: Any) -> Any:
    """`out` of `func` as the eager kernel gives it: a 0-dim view of the unreduced buffer for the ops of
    `EAGER_REDUCED_VIEWS`, outputs of the kernel's own sizes for `SIZED_BY_KERNEL` (unchanged where the storage
    already is that large, as on real tensors)."""
    name = getattr(getattr(func, "_overloadpacket", None), "__name__", "")
    if name in SIZED_BY_KERNEL and isinstance(out, tuple):
        if all(isinstance(a, torch.Tensor) and a.device.type == "cpu" or not isinstance(a, torch.Tensor) for a in args):
            sizes = _kernel_run(func, args)
            if len(sizes) == len(out):
                return tuple(
                    o.new_empty((n // o.element_size(),)) if isinstance(o, torch.Tensor) and o.dim() == 1
                    and o.untyped_storage().nbytes() < n else o
                    for o, n in zip(out, sizes)
                )
        return out
    if name not in EAGER_REDUCED_VIEWS or not isinstance(out, torch.Tensor) or out.dim() != 0 or len(args) < 2:
        return out
    if not all(isinstance(a, torch.Tensor) for a in args[:2]):
        return out
    n = 1
    for d in torch.broadcast_shapes(args[0].shape, args[1].shape):
        n *= int(d)
    if out.untyped_storage().nbytes() >= n * out.element_size():
        return out
    unreduced = out.new_empty((n,))  # elements of the broadcast input, in the loss's dtype
    unreduced[:1].copy_(out.reshape(1))
    return unreduced.as_strided((), (), 0)


def alive(refs: list[weakref.ref]) -> list[torch.Tensor]:
    """The tensors behind weak references that are still alive."""
    return [t for t in (r() for r in refs) if t is not None]


def storage_key(t: torch.Tensor) -> int:
    """Identity of the storage behind t (unique while it lives; works for fake tensors)."""
    return t.untyped_storage()._cdata


class LiveMemory(TorchDispatchMode):
    """Live and peak bytes of tensor storages created while active, plus those tracked."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def track(self, *tensors: Any) -> None:
        for t in pytree.tree_leaves(tensors):
            if isinstance(t, torch.Tensor) and t.layout == torch.strided and not t.is_meta:
                self._add(t.untyped_storage())

    def _add(self, st: torch.UntypedStorage) -> None:
        key = st._cdata
        if key in self.live:
            return
        nbytes = st.nbytes()
        self.live[key] = nbytes
        self.current += nbytes
        self.peak = max(self.peak, self.current)
        weakref.finalize(st, self._free, key)

    def _free(self, key: int) -> None:
        nbytes = self.live.pop(key, 0)
        self.current -= nbytes

    def reset_peak(self) -> None:
        self.peak = self.current

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                self._add(t.untyped_storage())
        return out


@dataclass(frozen=True)
class Window:
    """The allocator between two marks: bytes relative to where the meter started."""

    name: str
    start: int
    """Bytes allocated when the window opened."""
    peak: int
    """Most bytes allocated at once inside the window."""
    end: int
    """Bytes allocated when the window closed."""


class AllocatorMeter:
    """The device allocator's bytes over a piece of code, optionally split into named windows.

    On CPU it is the running sum of `torch.profiler`'s allocator events (`profile_memory=True`):
    every allocation, tensor storages and kernel workspaces alike (oneDNN convolution, BLAS
    packing buffers), which a dispatch-level counter such as `LiveMemory` cannot see. On CUDA it
    is `torch.cuda.memory_allocated` / `max_memory_allocated`, the peak reset at every mark. All
    figures are bytes above the level when the meter started. `available` is False where there
    is no allocator to read (meta and fake tensors, other devices, or a profiler already running);
    then every figure is 0.

    On CPU only blocks the meter saw allocated, and the storages of `known` tensors (made while an
    earlier meter ran, alive when this one starts), count when they are freed. The profiler also
    reports frees of other blocks allocated before its session, at sizes it remembers by address
    from any earlier session (stale once the address is reused): counted, they made two readings
    of one step differ. (The free of a block allocated with no profiler running is never reported.)

        with AllocatorMeter(device) as meter:
            meter.mark("a"); ...; meter.mark("b"); ...
        meter.peak, meter.windows()  # windows: from each mark to the next (or to the end)
    """

    def __init__(self, device: torch.device | str = "cpu", *, known: Any = ()) -> None:
        self.device = torch.device(device)
        self._known = {
            t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in pytree.tree_leaves(known)
            if isinstance(t, torch.Tensor) and t.layout == torch.strided and t.device.type == "cpu"
        }  # address -> bytes of blocks allocated before the meter whose frees count
        self.available = self.device.type == "cuda" or (
            self.device.type == "cpu" and not torch.autograd.profiler._is_profiler_enabled
        )
        self._marks: list[str] = []
        self._cuda: list[Window] = []
        self._cuda_base = 0
        self._prof: Any = None
        self._windows: list[Window] | None = None
        self.peak = 0
        """Most bytes allocated at once while the meter ran (bytes above its start)."""

    def __enter__(self) -> AllocatorMeter:
        if not self.available:
            return self
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._cuda_base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return self
        from torch.profiler import ProfilerActivity, profile

        # Kineto prints a 'USDT: profiler_start/stop' line to stderr from C++ per session (its log level is
        # read once per process, so an earlier profiler session in the process keeps it talking); this meter
        # starts one per measured step, so the start and the stop, and nothing else, write to nowhere.
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        with native_stderr_dropped():
            self._prof.__enter__()
        return self

    def mark(self, name: str) -> None:
        """Close the open window (if any) and open one called `name`."""
        if not self.available:
            return
        if self.device.type == "cuda":
            self._close_cuda()
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            with torch.profiler.record_function(_MARK + str(len(self._marks))):
                pass
        self._marks.append(name)

    def _close_cuda(self) -> None:
        torch.cuda.synchronize(self.device)
        now = torch.cuda.memory_allocated(self.device) - self._cuda_base
        top = torch.cuda.max_memory_allocated(self.device) - self._cuda_base
        self.peak = max(self.peak, top)
        if self._marks:
            start = self._cuda[-1].end if self._cuda else 0
            self._cuda.append(Window(self._marks[-1], start, max(top, start, now), now))

    def __exit__(self, *exc: Any) -> None:
        if not self.available:
            return
        if self.device.type == "cuda":
            self._close_cuda()
            self._windows = self._cuda
            return
        with native_stderr_dropped():
            self._prof.__exit__(*exc)
        tree = self._prof.profiler.kineto_results.experimental_event_tree()
        self._prof = None
        marks = {}
        blocks = []  # (time ns, address, bytes; negative for a free)
        stack = list(reversed(tree))
        while stack:  # depth first, in the order things happened
            e = stack.pop()
            stack.extend(reversed(e.children))
            fields = e.typed[1]
            if isinstance(fields, torch._C._profiler._ExtraFields_Allocation):
                if fields.device.type == "cpu":
                    blocks.append((e.start_time_ns, fields.ptr, fields.alloc_size))
            elif e.name.startswith(_MARK):
                marks[int(e.name[len(_MARK):])] = e.start_time_ns
        starts = [marks.get(i) for i in range(len(self._marks))]
        blocks.sort(key=lambda b: b[0])  # stable: a block freed and allocated again at one time keeps its order
        live = dict(self._known)
        memory = []
        for ts, ptr, nbytes in blocks:
            if nbytes > 0:
                live[ptr] = nbytes
                memory.append((ts, nbytes))
            elif ptr in live:
                memory.append((ts, -live.pop(ptr)))
        windows: list[Window] = []
        level = peak = 0
        w, open_level, open_peak = -1, 0, 0
        for ts, nbytes in memory:
            while w + 1 < len(starts) and starts[w + 1] is not None and starts[w + 1] <= ts:
                if w >= 0:
                    windows.append(Window(self._marks[w], open_level, open_peak, level))
                w, open_level, open_peak = w + 1, level, level
            level += nbytes
            peak = max(peak, level)
            open_peak = max(open_peak, level)
        while w + 1 < len(starts):  # marks after the last allocator event
            if w >= 0:
                windows.append(Window(self._marks[w], open_level, open_peak, level))
            w, open_level, open_peak = w + 1, level, level
        if w >= 0:
            windows.append(Window(self._marks[w], open_level, open_peak, level))
        self.peak = peak
        self._windows = windows

    def windows(self) -> list[Window]:
        """One per mark, in order, after the meter has stopped ([] when not available)."""
        return list(self._windows or [])


_MARK = "ckpt_planner::mark::"


# -- autocast's cache of parameter casts ------------------------------------------------


def autocast_dtypes() -> dict[str, torch.dtype]:
    """Device type -> autocast dtype, for the devices where autocast is on and keeps its casts of parameters
    in its cache (empty outside autocast, or with `cache_enabled=False`)."""
    if not torch.is_autocast_cache_enabled():
        return {}
    out = {}
    for device_type in ("cpu", "cuda"):
        try:
            if torch.is_autocast_enabled(device_type):
                out[device_type] = torch.get_autocast_dtype(device_type)
        except (RuntimeError, TypeError, AttributeError):  # a device type this torch has no autocast for
            continue
    return out


def fresh_autocast_cache() -> None:
    """Start a step with autocast's cache empty, as the first step of an autocast context does.

    Under autocast, a trainable parameter cast to the autocast dtype is kept in a cache until the outermost
    autocast context exits: a step run inside a context that an earlier step (or the profile) already ran
    in finds its casts made, allocated before any meter started. The allocator would miss them while the
    live-tensor counter, meeting them through the views ops take of them, counts them. Emptied, the step
    makes its casts again and both meters see them allocated, as they are in a step of a fresh context.
    Dropping the cache changes no value (each cast is redone from the same parameter)."""
    if autocast_dtypes():
        torch.clear_autocast_cache()


# -- one training step on both meters ---------------------------------------------------


@dataclass(frozen=True)
class StepPeaks:
    """Peak memory of one training step on the two meters (bytes, resident state included)."""

    allocator: int
    """The allocator's peak: tensors and kernel workspaces. What runs out of memory."""
    live: int
    """The peak of live tensor storages (what autograd and the model hold)."""


@contextlib.contextmanager
def collections_of_new_objects() -> Iterator[None]:
    """Within: a garbage collection walks only the objects made inside, not the process's whole heap.

    The profile collects garbage before each allocator window (a stage's step, the backward), so that a
    tensor the collector frees inside a window was allocated in it. In a process that has imported torch and
    transformers, a full collection walks about half a million objects, a few tenths of a second each, a large
    share of a small model's planning (benchmarks/results/quickstart.md). What was alive on entry is collected
    once, then set aside (`gc.freeze`) until the exit, when it rejoins the oldest generation. Where the process has frozen objects
    already (its own `gc.freeze`), nothing changes: unfreezing on exit would release its objects too."""
    if gc.get_freeze_count() or not gc.isenabled():
        yield
        return
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


_WARMED: set[str] = set()


def warm_device_libraries(device: torch.device | str) -> None:
    """Make the workspaces CUDA's libraries keep for the life of the process before anything is measured.

    cuBLAS allocates a workspace per thread and stream on its first product and never frees it; the autograd
    engine runs the backward on a thread of its own, with its own. Made here, they are resident state, as they
    are in every training step after a user's first, instead of a one-off that a first measured step (a profile,
    a reference step) would price into every plan: 32 MiB per workspace under deterministic cuBLAS."""
    device = torch.device(device)
    if device.type != "cuda" or str(device) in _WARMED:
        return
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        a = torch.randn(16, 16, device=device, dtype=dtype, requires_grad=True)
        (a @ a).sum().backward()
    torch.cuda.synchronize(device)
    _WARMED.add(str(device))


def measure_step_peaks(
    module: torch.nn.Module,
    args: tuple,
    kwargs: dict,
    params: list[torch.nn.Parameter],
    state: list[torch.Tensor],
    loss_fn: Callable[[Any], torch.Tensor],
    device: torch.device,
) -> tuple[StepPeaks, Any]:
    """Run forward + backward once per meter; return (peaks, the second step's output).

    Both figures include the resident state and inputs (unique storages). The allocator's step runs with no
    dispatch mode on (under one, such as the live counter, a composite op's intermediates live longer: bf16
    attention's CPU math path keeps one more fp32 copy of an input, 33 KB on a small BEiT); what it changed
    (buffers, generators, gradients) is put back. No allocator to read (a profiler running): the live figure.
    """
    warm_device_libraries(device)
    mem = LiveMemory()
    mem.track(state, [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)])
    resident = mem.current  # bytes
    meter = AllocatorMeter(device)
    for counter in (meter, mem) if meter.available else (mem,):
        out = None  # the allocator's step's output is not held through the live counter's step
        with step_undone(module, params, state) if counter is meter else contextlib.nullcontext():
            for p in params:
                p.grad = None
            fresh_autocast_cache()
            with counter:
                out = module(*args, **kwargs)  # held through the backward, as the planner assumes
                loss_fn(out).backward()
    allocator = resident + meter.peak if meter.available else mem.peak
    return StepPeaks(allocator=int(allocator), live=int(mem.peak)), out


ALLOCATOR_OVERHEAD = 0.2
"""What CUDA's caching allocator may reserve beyond the bytes a step's tensors take, as a fraction of them:
free pieces of blocks split by earlier requests, too small for a later, larger one. A fifth is above what
split blocks held when a capped step ran out on an H100 (benchmarks/results/gpu-h100.md, "Planning under a
cap")."""

EXPANDABLE_OVERHEAD = 0.1
"""The same under `expandable_segments:True`, whose segments grow page by page instead of splitting fixed
blocks; small tensors still share 2 MB pages, so a plan predicted just under a cap can still run out: a tenth,
until measured closer (benchmarks/results/gpu-h100.md, "Planning under a cap
(expandable_segments:True)")."""


def _expandable_segments() -> bool:
    """Whether the CUDA allocator was configured to grow expandable segments (read when CUDA starts)."""
    conf = ",".join(os.environ.get(v, "") for v in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"))
    return "expandable_segments:true" in conf.replace(" ", "").lower()


def allocator_limit(device: torch.device | str) -> int | None:
    """The most bytes a step's tensors on `device` can take at once before the caching allocator reaches
    what the process may reserve (the device's memory times the process's memory fraction), leaving the
    allocator its overhead (`ALLOCATOR_OVERHEAD`, or `EXPANDABLE_OVERHEAD`). None off CUDA, or where it
    cannot be read: the CPU's allocator reserves what it allocates."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    try:
        index = device.index if device.index is not None else torch.cuda.current_device()
        total = torch.cuda.get_device_properties(index).total_memory
        fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # newer torch only
        share = fraction(index) if fraction is not None else 1.0
    except (RuntimeError, ValueError, AssertionError, AttributeError):
        return None
    overhead = EXPANDABLE_OVERHEAD if _expandable_segments() else ALLOCATOR_OVERHEAD
    return int(total * share / (1 + overhead))


def device_room(device: torch.device | str) -> int | None:
    """Bytes the device can still allocate to this process: on CUDA, the least of what is free and what
    the process's memory fraction leaves; on the CPU, the memory the system reports available. None
    where it cannot be read."""
    device = torch.device(device)
    try:
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # newer torch only
            if fraction is None:
                return free
            index = device.index if device.index is not None else torch.cuda.current_device()
            cap = int(fraction(index) * total) - torch.cuda.memory_reserved(device)
            return max(0, min(free, cap))
        if device.type == "cpu":
            try:
                with open("/proc/meminfo") as f:
                    for line in f:
                        if line.startswith("MemAvailable:"):
                            return int(line.split()[1]) * 1024
            except OSError:
                pass
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (RuntimeError, ValueError, OSError, AttributeError):
        return None
    return None

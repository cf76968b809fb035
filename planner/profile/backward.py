"""The backward's temporaries: what a node's backward step holds beyond the gradients the simulator counts.

After the profiler's recording run (planner/profile/record.py), one backward runs with a
live-storage counter (`LiveMemory`) and a pre-hook on every autograd node, each
attributed to the fx node whose forward made it. A node's `backward_temp_bytes`
is the peak its backward step reached over the simulator's figure for that step
without checkpointing: pow's and log-softmax's gradient temporaries, gradient
sums, a gradient kept alive by the narrow views cat's backward hands out.
Gradients do not depend on the plan, so the excess is the same under every plan.

One more thing the backward holds that no tensor counter sees: a Python number an op takes as a tensor
(`x * 0.5` is `aten.mul.Tensor(x, 0.5)`) whose op's gradient needs it (`KeptScalars`). Torch makes it a
0-dim tensor of its own before any dispatch mode sees the call, and autograd keeps it past every
saved-tensor hook, so a checkpoint region never frees it either: it is counted as resident.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import warnings
import weakref
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from ..capture.trace import _key_line
from ..solvers.simulate import simulate
from .graph import CostGraph
from .loss import default_loss
from .memory import AllocatorMeter, LiveMemory, alive, storage_key

__all__ = ["BackwardPeaks", "KeptScalars", "measure_backward", "with_backward_temps"]


class BackwardPeaks(dict):
    """Per fx node, the peak bytes live during its backward step; `handed_on`: the nodes whose output
    gradient is one storage with another node's gradient in the backward that was measured;
    `kept_scalars`: bytes of the numbers autograd keeps as tensors of their own (`KeptScalars`)."""

    def __init__(self) -> None:
        super().__init__()
        self.handed_on: set[str] = set()
        self.kept_scalars = 0


_NUMBER = (bool, int, float, complex, torch.SymInt, torch.SymFloat, torch.SymBool)
_KEPT: dict[tuple, int] = {}  # an op's signature -> bytes of the numbers its autograd node keeps


class _Like:
    """A tensor argument of a call, as its shape, dtype and requires_grad: what a probe makes on meta."""

    def __init__(self, t: torch.Tensor) -> None:
        self.shape = tuple(int(s.node.hint) if isinstance(s, torch.SymInt) else int(s) for s in t.shape)
        self.dtype, self.requires_grad = t.dtype, t.requires_grad

    def meta(self) -> torch.Tensor:
        m = torch.empty(self.shape, dtype=self.dtype, device="meta")
        return m.requires_grad_() if self.requires_grad and (m.is_floating_point() or m.is_complex()) else m


class KeptScalars(TorchDispatchMode):
    """Bytes per fx node of the Python numbers its ops take as tensors and autograd keeps for the backward.

    Torch wraps such a number in a 0-dim tensor of its own (8 bytes for a float or an int) before any
    dispatch mode sees the call (a mode is handed the number), and autograd saves it without calling any
    saved-tensor hook: the live-storage counter, the profiler's pack hook and a checkpoint region all miss
    it, and it stays until the node's backward. A GPT-J's tanh GELU keeps three per MLP (mul by 0.5,
    0.044715 and sqrt(2/pi)), a chunked one three per chunk: 48 of them put a chunked step 144 B over the
    prediction of a plan with no margin. Which arguments an op's gradient keeps is asked of autograd once
    per signature: the op run on meta tensors of the same shapes, its saved values read back (the number
    is the one saved tensor not on the meta device).

    The recorder sets `node`; `settle()` (after the node, outside every dispatch mode) asks autograd about
    the signatures seen for the first time."""

    def __init__(self) -> None:
        super().__init__()
        self.node: str | None = None
        self.bytes: dict[str, int] = {}
        """fx node name -> bytes of the numbers its ops' autograd nodes keep."""
        self._pending: list[tuple[str, Any, tuple, Any]] = []

    @property
    def total(self) -> int:
        return sum(self.bytes.values())

    @property
    def waiting(self) -> bool:
        """Calls seen for the first time wait for `settle()`."""
        return bool(self._pending)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.node is not None and torch.is_grad_enabled() and isinstance(func, torch._ops.OpOverload):
            key = _signature(func, args, kwargs)
            if key is not None:
                if key in _KEPT:
                    self.bytes[self.node] = self.bytes.get(self.node, 0) + _KEPT[key]
                else:  # the tensors as templates: holding them would keep them alive past their last use
                    like = pytree.tree_map_only(torch.Tensor, _Like, (args, kwargs))
                    self._pending.append((self.node, func, key, like))
        return func(*args, **kwargs)

    def settle(self) -> None:
        """Ask autograd what the calls seen for the first time keep (outside every dispatch mode)."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        with _disable_current_modes():
            for node, func, key, like in pending:
                if key not in _KEPT:
                    _KEPT[key] = _probe(func, key, like)
                self.bytes[node] = self.bytes.get(node, 0) + _KEPT[key]


def _signature(func: Any, args: tuple, kwargs: dict) -> tuple | None:
    """The call's signature where it hands a Python number to a tensor argument and some tensor argument
    needs a gradient (else autograd keeps nothing): the op, each argument's kind, dtype, requires_grad."""
    numbers, grads = False, False
    named = list(zip((a.name for a in func._schema.arguments), args)) + sorted(kwargs.items())
    types = {a.name: str(a.type) for a in func._schema.arguments}
    key: list[Any] = [func]
    for name, v in named:
        if isinstance(v, torch.Tensor):
            grads = grads or v.requires_grad
            key.append((v.dtype, v.requires_grad))
        elif types.get(name) == "Tensor" and isinstance(v, _NUMBER):
            numbers = True
            key.append(type(v).__name__)
        else:
            key.append(repr(v)[:80])
    return tuple(key) if numbers and grads else None


def _probe(func: Any, key: tuple, like: Any) -> int:
    """Bytes of the numbers `func`'s autograd node keeps for this signature (see KeptScalars). Where the op
    cannot run on meta tensors, every number it was handed counts (8 bytes each: the most a real one takes
    but a complex)."""
    args, kwargs = pytree.tree_map_only(_Like, _Like.meta, like)
    try:
        with torch.enable_grad():
            out = func(*args, **kwargs)
    except Exception:  # noqa: BLE001 - no meta kernel: count what it could keep
        return 8 * sum(1 for k in key[1:] if k in ("bool", "int", "float", "complex", "SymInt", "SymFloat", "SymBool"))
    kept = 0
    for fn in {t.grad_fn for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.grad_fn is not None}:
        for name in dir(fn):
            if not name.startswith("_saved_"):
                continue
            value = getattr(fn, name, None)
            for t in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(t, torch.Tensor) and t.device.type != "meta" and t.dim() == 0:
                    kept += t.element_size()
    return kept


def measure_backward(gm: fx.GraphModule, prof: Any, fake_mode=None) -> BackwardPeaks:
    """Run the step's backward once; per fx node, the peak bytes live during its backward step. `prof`:
    the recording run's `record.CostProfiler` (not imported: record.py imports `KeptScalars` from here).

    Call after `_build`: the interpreter's references to the activations are dropped first, so
    what is live is what a training step holds (state, inputs, outputs, saved activations until
    autograd releases them, gradients, the backward's temporaries). A node's step runs from the
    start of the first of its autograd nodes to the start of another node's. Parameters' `.grad`
    are left as they were. `handed_on` (`_watch_handed_on`) is recorded in the same backward.
    """
    out, prof.step_output = prof.step_output, None
    peaks = BackwardPeaks()
    kept = prof.scalars.total if getattr(prof, "scalars", None) is not None else 0
    peaks.kept_scalars = kept
    try:
        loss = default_loss(gm.graph.process_outputs(out))
    except (ValueError, TypeError, AttributeError):
        prof.grad_fns.clear()
        return peaks  # nothing to differentiate: no backward to measure
    mem = LiveMemory()
    mem.track(list(gm.parameters()), list(gm.buffers()), list(prof.env.values()), [alive(e[0]) for e in prof.events.values()])
    mem.track(out, loss)
    if prof.casts is not None:  # autocast's cache holds its casts of parameters through the backward
        mem.track(alive(prof.casts.refs))
    refs = [weakref.ref(t) for t in pytree.tree_leaves(list(prof.env.values())) if isinstance(t, torch.Tensor)]
    refs += [r for e in prof.events.values() for r in e[0]]
    prof.env, prof.events = {}, {}
    gc.collect()  # activations nothing saved are gone, as in a real step
    current: list[str | None] = [None]
    # The allocator counts the frees of what is live now (saved activations, outputs), made before it started.
    meter = (
        AllocatorMeter(prof.meter.device, known=[alive(refs), out, loss])
        if prof.meter is not None
        else AllocatorMeter("meta")
    )

    def enter(name: str) -> None:
        if current[0] is not None:
            peaks[current[0]] = max(peaks.get(current[0], 0), mem.peak)
        current[0] = name
        mem.reset_peak()
        meter.mark(name)

    handles = [fn.register_prehook(lambda _grads, name=name: enter(name)) for fn, name in prof.grad_fns.items()]
    handles += _watch_handed_on(prof.grad_fns, peaks.handed_on)
    params = [p for p in gm.parameters() if p.requires_grad]
    grads = [p.grad for p in params]
    try:
        for p in params:
            p.grad = None
        base = mem.current  # bytes live when the backward starts; the allocator's figures are above it
        with fake_mode if fake_mode is not None else contextlib.nullcontext(), mem, meter:
            try:
                loss.backward()
            except Exception as e:  # noqa: BLE001 - a plan is still possible, only less exact
                warnings.warn(
                    f"the backward's temporaries were not measured ({_key_line(e)}): "
                    "predicted peaks may be a few % low",
                    stacklevel=2,
                )
                unmeasured = BackwardPeaks()
                unmeasured.kept_scalars = kept
                return unmeasured
        if current[0] is not None:
            peaks[current[0]] = max(peaks.get(current[0], 0), mem.peak)
        for w in meter.windows():  # the allocator sees the backward's workspaces too
            peaks[w.name] = max(peaks.get(w.name, 0), base + w.peak)
    finally:
        for h in handles:
            h.remove()
        for p, g in zip(params, grads):
            p.grad = g
        prof.grad_fns.clear()
    return peaks


def _watch_handed_on(grad_fns: dict, handed_on: set[str]) -> list:
    """Hooks that add to `handed_on` each fx node whose output gradient is one storage with another
    node's: its backward hands the gradient it got to another node unchanged or as a view (add's to both
    inputs, a view's, sum's expand), or the gradient it gets is one another node got and handed on.

    Only a node's entry autograd nodes (those of its outputs, no other of its own autograd nodes leading
    to them) see its output gradient; a gradient handed from one of its autograd nodes to another of its
    own (a Linear's view before its addmm) stays inside the node.
    """
    inner = {f for fn, name in grad_fns.items() for f, _ in fn.next_functions if grad_fns.get(f) == name}
    got: dict[int, weakref.ref] = {}  # storage key of each gradient an entry got -> that gradient
    handles = []

    def arrived(grads, name: str) -> None:
        for g in grads:
            if isinstance(g, torch.Tensor):
                key = storage_key(g)
                seen = got.get(key)
                if seen is not None and seen() is not None:  # alive, so the key is still that storage
                    handed_on.add(name)
                got[key] = weakref.ref(g)

    def left(fn, grad_inputs, grad_outputs, name: str) -> None:
        keys = {storage_key(g) for g in grad_outputs if isinstance(g, torch.Tensor)}
        for g, (f, _) in zip(grad_inputs, fn.next_functions):
            if isinstance(g, torch.Tensor) and f is not None and grad_fns.get(f) != name and storage_key(g) in keys:
                handed_on.add(name)

    for fn, name in grad_fns.items():
        if fn in inner:
            continue
        handles.append(fn.register_prehook(lambda grads, name=name: arrived(grads, name)))
        handles.append(fn.register_hook(lambda gi, go, fn=fn, name=name: left(fn, gi, go, name)))
    return handles


def with_backward_temps(cost: CostGraph, peaks: dict[str, int]) -> CostGraph:
    """The cost graph with each node's backward_temp_bytes: what its measured backward step holds
    beyond the simulator's figure for that step without checkpointing (below 0 by at most its own gradient
    where that gradient is handed on, `BackwardPeaks.handed_on`; never below 0 elsewhere).

    Gradients do not depend on the plan, so the excess (temporaries, gradient sums, a gradient
    kept alive by views of it) is the same under any plan.

    Then the numbers autograd keeps as tensors of their own (`BackwardPeaks.kept_scalars`, see
    `KeptScalars`) are counted with the resident bytes: no checkpoint frees them, and neither the measured
    backward nor the figure it is compared with above counts them, so they are added after the comparison.
    """
    temps = _with_temps(cost, peaks)
    kept = getattr(peaks, "kept_scalars", 0)
    return dataclasses.replace(temps, param_bytes=temps.param_bytes + kept) if kept else temps


def _with_temps(cost: CostGraph, peaks: dict[str, int]) -> CostGraph:
    if not peaks:
        return cost
    sim = [0] * len(cost.nodes)
    for phase, k, total in simulate(cost.to_problem(), (), timeline=True).timeline:
        if phase == "backward":
            sim[k] = max(sim[k], total)
    # Below the figure by at most the node's own output gradient: a backward that hands its output's gradient
    # on unchanged (add's to both its inputs, a view's, clone's) makes no new tensor, while the simulator counts
    # the gradient again for an input from this step on; that input's gradient and the one handed on are one
    # storage. Freed at the end of the step, the own gradient is the most the step can hold less. A step
    # whose gradient is its own new tensor (a ReLU's below a Linear) is held to 0: what it measures below the
    # figure is some other gradient counted in full (a sum's [B, D] expand of one scalar), not its own.
    consumed = {j for n in cost.nodes for j in n.inputs}
    handed = getattr(peaks, "handed_on", set())
    nodes = tuple(
        dataclasses.replace(n, backward_temp_bytes=max(
            -(n.grad_bytes if i in consumed and n.name in handed else 0), peaks[n.name] - sim[i]))
        if n.name in peaks else n
        for i, n in enumerate(cost.nodes)
    )
    return dataclasses.replace(cost, nodes=nodes)

"""The backward's temporaries: what a node's backward step holds beyond the gradients the simulator counts.

After the profiler's recording run (planner/profile/record.py), one backward runs with a
live-storage counter (`LiveMemory`) and a pre-hook on every autograd node, each
attributed to the fx node whose forward made it. A node's `backward_temp_bytes`
is the peak its backward step reached over the simulator's figure for that step
without checkpointing: pow's and log-softmax's gradient temporaries, gradient
sums, a gradient kept alive by the narrow views cat's backward hands out.
Gradients do not depend on the plan, so the excess is the same under every plan.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import warnings
import weakref
from typing import TYPE_CHECKING

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from ..capture.trace import _key_line
from ..solvers.simulate import simulate
from .graph import CostGraph
from .loss import default_loss
from .memory import AllocatorMeter, LiveMemory, alive, storage_key

if TYPE_CHECKING:
    from .record import CostProfiler

__all__ = ["BackwardPeaks", "measure_backward", "with_backward_temps"]


class BackwardPeaks(dict):
    """Per fx node, the peak bytes live during its backward step; `handed_on`: the nodes whose output
    gradient is one storage with another node's gradient in the backward that was measured."""

    def __init__(self) -> None:
        super().__init__()
        self.handed_on: set[str] = set()


def measure_backward(gm: fx.GraphModule, prof: CostProfiler, fake_mode=None) -> BackwardPeaks:
    """Run the step's backward once; per fx node, the peak bytes live during its backward step.

    Call after `_build`: the interpreter's references to the activations are dropped first, so
    what is live is what a training step holds (state, inputs, outputs, saved activations until
    autograd releases them, gradients, the backward's temporaries). A node's step runs from the
    start of the first of its autograd nodes to the start of another node's. Parameters' `.grad`
    are left as they were. `handed_on` (`_watch_handed_on`) is recorded in the same backward.
    """
    out, prof.step_output = prof.step_output, None
    peaks = BackwardPeaks()
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
                return BackwardPeaks()
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
    """
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

"""Profiling a stage at a time: what the clock and the allocator say, in memory bounded by one stage's step.

The bytes of a profile (what every node makes, saves and frees, its gradients, the backward's tensor
temporaries) come from one run on fake tensors at the real shapes (profiler.py, meta mode): no memory.
What only real kernels show is measured here, a stage at a time:

- each node's time (timed runs, as the whole-graph profile times them);
- each stage's backward (its last timed runs run it, on the step clock): with the node times, the eager step;
- the allocator's peak while a node runs above what it leaves (kernel workspaces: oneDNN, BLAS packing);
- the allocator's peak in each node's backward step above the live tensors (the backward's workspaces);
- which nodes draw random numbers where fake tensors cannot show it (a custom kernel moving a generator).

A stage is a run of nodes of one numbered block (`model.layers.3`), or a piece of a run between blocks
(the embedding, the head and its loss), at most about n / sqrt(n) nodes long: a graph without blocks is
cut into about sqrt(n) even runs. Each
stage runs forward and backward on real tensors from its inputs detached, as a checkpointed block
does, with only its own activations alive: the rest of the step is not held. Its outputs, detached,
are what the next stages read; a value is dropped after the last stage that reads it.

A stage's input is what a non-reentrant checkpoint region's input is in the planned step: a tensor
made by an op, not a leaf, whose gradient goes back to its producer and is not kept. So an in-place op
on it (`ReLU(inplace=True)` after BatchNorm, `y += x` on a residual, an MoE's `index_add_`) writes
into its storage as in the step, with no copy the step would not make (a leaf asking for a gradient
would refuse the write). A stage that writes into an input runs from the same values each time: the
inputs it writes are put back before each of its runs after the first, and the next stages read them
written once, as the step leaves them.

Stages with the same structure (ops, shapes, dtypes, FLOPs, bytes, and where their inputs come from,
position for position) are measured once: the others only run forward, for the values the next
stages need, and take the first one's figures. A 32-layer model is measured in about the time of one
layer, the embedding and the head.
"""

from __future__ import annotations

import gc
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from ..capture.mutation import mutated_inputs, view_root
from ..capture.rng import RANDOM_META, UNREPLAYABLE_META, SeededOps, generator_states, moved, rng_state_bytes
from .graph import CostGraph
from .memory import AllocatorMeter, LiveMemory
from .record import CostProfiler, strided_tensors
from .timing import robust_times, step_clock, step_sync, with_fastest

__all__ = ["StageFigures", "stage_spans", "stage_key", "measure_stages", "with_stage_figures"]

Span = tuple[int, int]

_BLOCK = re.compile(r"^(.*?\.\d+)(\.|$)")  # the numbered module a node belongs to: "model.layers.3"


def stage_spans(cost: CostGraph) -> tuple[Span, ...]:
    """Node spans covering the graph in order: each numbered block's run, and the runs between blocks cut
    into pieces of at most about n / sqrt(n) nodes (a graph without blocks: about sqrt(n) even runs)."""
    n = len(cost.nodes)
    keys = []
    for node in cost.nodes:
        m = _BLOCK.match(node.module) if node.module else None
        keys.append(m.group(1) if m else None)
    if n == 0:
        return ()
    size = max(1, math.ceil(n / max(1, round(math.sqrt(n)))))  # about sqrt(n) even runs where no block is
    spans, start = [], 0
    for i in range(1, n + 1):
        if i == n or keys[i] != keys[start]:
            if keys[start] is None:  # between blocks (or no block at all): even runs of at most `size`
                spans += [(s, min(i, s + size) - 1) for s in range(start, i, size)]
            else:
                spans.append((start, i - 1))
            start = i
    return tuple(spans)


def stage_key(cost: CostGraph, span: Span) -> tuple:
    """What makes two stages measure the same: per node its op, shapes, dtype, FLOPs and bytes, and where
    each of its inputs comes from (a node of the stage, by distance; else the stage's n-th outside input)."""
    s, e = span
    rows, outside = [], {}
    for i in range(s, e + 1):
        n = cost.nodes[i]
        # an input from outside the stage by its order of first use: the rotary tables and the mask
        # every layer reads are further back for each layer, but first read at the same place
        wiring = tuple(("in", i - j) if j >= s else ("out", outside.setdefault(j, len(outside))) for j in n.inputs)
        target = re.sub(r"\d+", "#", n.target) if n.op == "call_module" else n.target
        rows.append((n.op, target, repr(n.shapes), n.dtype, n.flops, n.out_bytes, n.temp_bytes, n.grad_bytes,
                     n.param_grad_bytes, n.backward_temp_bytes, n.saved_tensors, wiring))
    return tuple(rows)


@dataclass
class StageFigures:
    """What the real runs of the stages measured, per node name."""

    times: dict[str, list[float]] = field(default_factory=dict)
    """Each node's timed runs (seconds); empty when the profile takes its times from FLOPs."""
    forward_temp: dict[str, int] = field(default_factory=dict)
    """The allocator's peak while the node ran, above what it left allocated (bytes)."""
    backward_extra: dict[str, int] = field(default_factory=dict)
    """The allocator's peak in the node's backward step above the live tensors then (bytes)."""
    measured: int = 0
    """Stages measured (the others repeat one of them)."""
    random: set[str] = field(default_factory=set)
    """Nodes seen drawing random numbers on real tensors."""
    unreplayable: set[str] = field(default_factory=set)
    """Nodes whose draw a recompute cannot replay (capture/rng.py)."""
    backward: dict[int, float | None] = field(default_factory=dict)
    """Per stage (its index in the spans): its backward from its boundary, the fastest of its timed runs on
    the step clock (seconds); None where it failed. Empty when the profile takes its times from FLOPs."""


def _detached(value: Any) -> Any:
    """A stage's output as the next stage reads it: detached, still asking for a gradient where it did."""
    def one(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        d = t.detach()
        return d.requires_grad_(True) if t.requires_grad and (t.is_floating_point() or t.is_complex()) else d

    return pytree.tree_map(one, value)


class _StageInput(torch.autograd.Function):
    """A stage's input as the stage reads it: the kept tensor itself (no copy), made the output of an
    autograd node, as a region's input is in the step, so that in-place ops may write into it. Its
    gradient stops here (the earlier stages are not held); `anchor` is a 0-d tensor asking for a
    gradient, which makes the output ask for one."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        ctx.mark_dirty(x)  # the output is `x` itself, with this node as its history
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None]:
        return None, None


class _StageRunner:
    """Runs the graph's compute nodes span by span, keeping only the values later spans read."""

    def __init__(self, gm: fx.GraphModule, flat: Sequence[Any], spans: Sequence[Span]) -> None:
        self.gm = gm
        self.compute = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
        self.interp = CostProfiler(gm)
        self.values: dict[fx.Node, Any] = {}
        flat_iter = iter(flat)
        for n in gm.graph.nodes:
            if n.op == "placeholder":
                self.values[n] = next(flat_iter, None)
            elif n.op == "get_attr":
                self.values[n] = self.interp.fetch_attr(n.target)
        stage_of = {}
        for k, (s, e) in enumerate(spans):
            for i in range(s, e + 1):
                stage_of[self.compute[i]] = k
        output = next(n for n in gm.graph.nodes if n.op == "output")
        self.last_reader: dict[fx.Node, int] = {}
        for n in self.compute:
            for a in n.all_input_nodes:
                if a in stage_of:
                    self.last_reader[a] = max(self.last_reader.get(a, -1), stage_of[n])
        self.outputs = set(output.all_input_nodes)
        self.anchor = torch.zeros((), requires_grad=True)
        self.begins: set[Any] = set()  # the _StageInput nodes of the current run: no node's backward

    def nodes(self, span: Span) -> list[fx.Node]:
        return self.compute[span[0]: span[1] + 1]

    def _input(self, value: Any) -> Any:
        """A kept value as a stage reads it: each tensor asking for a gradient made a non-leaf alias."""
        def one(t: Any) -> Any:
            if not (isinstance(t, torch.Tensor) and t.requires_grad):
                return t
            x = _StageInput.apply(t.detach(), self.anchor)
            self.begins.add(x.grad_fn)
            return x

        return pytree.tree_map(one, value)

    def _seeded(self, span: Span) -> list[fx.Node]:
        """The span's nodes, with the interpreter's environment holding the kept values they read (an
        earlier stage's outputs as non-leaf aliases; the graph's inputs, parameters and buffers as they are)."""
        nodes = self.nodes(span)
        inside = set(nodes)
        self.begins.clear()
        self.interp.env = {
            a: self._input(self.values[a]) if a in self.last_reader else self.values[a]
            for n in nodes for a in n.all_input_nodes if a not in inside
        }
        return nodes

    def written(self, span: Span) -> list[fx.Node]:
        """The values from outside the span that its nodes write in place (directly or through views made
        in the span), parameters and buffers aside: a BatchNorm's statistics are the profile's to restore."""
        inside = set(self.nodes(span))
        out: dict[fx.Node, None] = {}
        for n in inside:
            for a in mutated_inputs(self.gm, n):
                while a in inside and view_root(a) is not a:  # a view made in the span: what it views
                    a = a.args[0]
                if a not in inside and a.op != "get_attr":
                    out[a] = None
        return list(out)

    def snapshot(self, written: Sequence[fx.Node]) -> dict[fx.Node, Any]:
        """Copies of the values a span writes in place, as they are before its first run."""
        with torch.no_grad():
            return {a: pytree.tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t,
                                       self.values[a]) for a in written}

    def restore(self, snapshot: dict[fx.Node, Any]) -> None:
        """Put the values a span writes back as they were before its first run (into the same storage)."""
        with torch.no_grad():
            for a, saved in snapshot.items():
                for t, s in zip(pytree.tree_leaves(self.values[a]), pytree.tree_leaves(saved)):
                    if isinstance(t, torch.Tensor):
                        t.copy_(s)

    def run(self, span: Span, meter: AllocatorMeter | None = None, grad_fns: bool = False) -> dict[fx.Node, Any]:
        """One forward of the span from the kept values; the span's own values, by node."""
        nodes = self._seeded(span)
        for n in nodes:
            if meter is not None:
                meter.mark(n.name)
            out = self.interp.run_node(n)
            self.interp.env[n] = out
            if grad_fns:
                self.interp._own_grad_fns(n, out)
        for fn in self.begins:  # a stage input's gradient is its producer's, in an earlier stage
            self.interp.grad_fns.pop(fn, None)
        self.begins.clear()
        env, self.interp.env = self.interp.env, {}
        return {n: env[n] for n in nodes}

    def watched(self, span: Span, figures: StageFigures) -> dict[fx.Node, Any]:
        """One forward of the span that records which nodes draw random numbers on real tensors: an op
        tagged as seeded, or a generator whose state moves (a custom kernel's draw, which fake tensors
        cannot show)."""
        nodes = self._seeded(span)
        with SeededOps() as seeded:
            for n in nodes:
                seeded.node, before = n.name, generator_states()
                self.interp.env[n] = self.interp.run_node(n)
                seeded.node = None
                if moved(before):
                    figures.random.add(n.name)
        figures.random |= seeded.random
        figures.unreplayable |= seeded.unreplayable
        self.begins.clear()
        env, self.interp.env = self.interp.env, {}
        return {n: env[n] for n in nodes}

    def keep(self, k: int, span: Span, env: dict[fx.Node, Any]) -> None:
        """Keep what later spans read from this one (detached); drop what no later span reads."""
        for n in self.nodes(span):
            if self.last_reader.get(n, -1) > k or n in self.outputs:
                self.values[n] = _detached(env[n])
        for n in [n for n in self.values if n in self.last_reader and self.last_reader[n] <= k and n not in self.outputs]:
            del self.values[n]

    def boundary(self, k: int, span: Span, env: dict[fx.Node, Any]) -> list[torch.Tensor]:
        """The span's outputs that a later span or the graph's output reads, as tensors asking for a gradient."""
        seen, out = set(), []
        for n in self.nodes(span):
            if self.last_reader.get(n, -1) > k or n in self.outputs:
                for t in strided_tensors(env[n]):
                    if t.requires_grad and t.grad_fn is not None and id(t) not in seen:
                        seen.add(id(t))
                        out.append(t)
        return out


BACKWARD_ROUNDS = 3  # the last timed runs of a measured stage that also run its backward, timed
_BACKWARD = "backward of "  # the allocator window of a node's backward step
_SEEDS = "<the boundary's gradients>"  # the allocator window where the backward's seeds are made


def _seed(t: torch.Tensor) -> torch.Tensor:
    """A boundary output's gradient as the next stage's backward would hand it back: ones, laid out as
    the ops that make input gradients lay them out (a matmul's or a norm's: contiguous; a convolution's
    in channels-last where its input was), not with the output's own strides. A transposed output (an
    LSTM's batch-first [B, T, H], a view of its [T, B, H]) then reaches its op's backward transposed, and
    the copy that backward makes to read it (1 MB at [32, 128, 64] fp32) is counted, as in the step."""
    channels_last = {4: torch.channels_last, 5: torch.channels_last_3d}.get(t.dim())
    if channels_last is not None and t.is_contiguous(memory_format=channels_last) and not t.is_contiguous():
        return torch.ones_like(t, memory_format=channels_last)
    return torch.ones_like(t, memory_format=torch.contiguous_format)


def _seeded_loss(roots: list[torch.Tensor]) -> torch.Tensor:
    """A scalar whose backward hands each root the gradient `_seed` lays out, made by the backward itself
    (the product's backward: ones times the seed), not handed in. A gradient handed in is held by the
    backward call until it ends; the one a step's loss hands on goes once its last reader's backward is
    done. Held, a stage's first node saw that gradient still live where the step had freed it: a frozen
    convolution's backward, whose second input-sized buffer (oneDNN's, no tensor) the allocator shows at
    the same time, then rose by the same 256 KB in both meters ([4, 16, 32, 32] fp32 under a LoRA) and
    its workspace above the live tensors came out that much short."""
    loss = None
    for t in roots:
        part = (t * _seed(t).detach()).sum()  # [t's shape] -> []: the seed is saved by the product alone
        loss = part if loss is None else loss + part
    return loss


def _backward(runner: _StageRunner, k: int, span: Span, env: dict[fx.Node, Any], meter: AllocatorMeter) -> dict[str, int]:
    """The span's backward from its boundary (gradients of ones, as a summed loss gives), in the meter that
    saw its forward; per node, how far the live tensors rose in its backward step (bytes)."""
    roots = runner.boundary(k, span, env)
    if not roots:
        return {}
    meter.mark(_SEEDS)  # the seeds are no node's: the last node's window closes before them
    loss = _seeded_loss(roots)
    mem = LiveMemory()
    # Parameters and buffers are resident: a backward's view of a weight (a Linear's `t()`, 32 KB for a
    # 256 x 64 bf16 weight) is no new storage. Untracked, the live rise counted the weight, and the
    # allocator's workspace above it (oneDNN's bf16 matmul) came out that much short.
    mem.track(list(env.values()), loss, list(runner.gm.parameters()), list(runner.gm.buffers()))
    rise: dict[str, int] = {}
    current: list[tuple[str, int] | None] = [None]

    def close() -> None:
        if current[0] is not None:
            name, start = current[0]
            rise[name] = max(rise.get(name, 0), mem.peak - start)

    def enter(name: str) -> None:
        close()
        current[0] = (name, mem.current)
        mem.reset_peak()
        meter.mark(_BACKWARD + name)

    owners = runner.interp.grad_fns
    handles = [fn.register_prehook(lambda _g, name=name: enter(name)) for fn, name in owners.items()]
    try:
        with mem:
            loss.backward()
        close()
    except Exception:  # noqa: BLE001 - a stage whose backward fails here keeps its tensor figures
        return {}
    finally:
        for h in handles:
            h.remove()
        owners.clear()
    return rise


def _backward_time(runner: _StageRunner, k: int, span: Span, env: dict[fx.Node, Any], params: list[torch.Tensor],
                   device: torch.device) -> float | None:
    """Seconds of the span's backward from its boundary, on the step clock (the parameters' gradients made
    afresh, as a step's first backward makes them); 0 with no boundary to start from; None where it fails.

    Less what a stage's own backward pays and the step's does not: starting the engine once per stage, and
    the seeded loss's backward (a product and a sum per boundary output: tens of microseconds a stage on a
    1-thread CPU at GPT-2's layer outputs), timed alone on leaves of the same values."""
    roots = runner.boundary(k, span, env)
    if not roots:
        return 0.0
    sync, clock = step_sync(device), step_clock(device)

    def timed(loss: torch.Tensor) -> float:
        sync()
        t0 = clock()
        loss.backward()
        sync()
        return clock() - t0

    for p in params:
        p.grad = None
    try:
        whole = timed(_seeded_loss(roots))
        alone = timed(_seeded_loss([t.detach().requires_grad_(True) for t in roots]))
    except Exception:  # noqa: BLE001 - no backward time: the profile keeps the estimate without it
        return None
    return max(0.0, whole - alone)


def measure_stages(gm: fx.GraphModule, flat: Sequence[Any], bytes_cost: CostGraph, *, device: torch.device,
                   warmup: int, repeats: int, timed: bool, allocator: bool) -> StageFigures:
    """Run the graph a stage at a time on real tensors (see the module docstring). `bytes_cost`: the fake
    profile of the same graph (its nodes in compute order); `timed`: time each node (else FLOP times)."""
    spans = stage_spans(bytes_cost)
    runner = _StageRunner(gm, flat, spans)
    if device.type == "cuda":
        runner.interp.sync = lambda: torch.cuda.synchronize(device)
    figures = StageFigures()
    first: dict[tuple, tuple[int, Span]] = {}
    copies: list[tuple[list[fx.Node], list[fx.Node]]] = []
    params = [p for p in gm.parameters() if p.requires_grad]
    grads = [p.grad for p in params]
    try:
        for k, span in enumerate(spans):
            key = stage_key(bytes_cost, span)
            if key in first:  # measured already: forward only, for the values the next spans read
                env = runner.watched(span, figures)
                copies.append((runner.nodes(first[key][1]), runner.nodes(span)))
                figures.backward[k] = figures.backward.get(first[key][0])
                runner.keep(k, span, env)
                del env  # its graph and saved tensors: not held into the next stage
                continue
            first[key] = (k, span)
            figures.measured += 1
            # runs after the first start from the values the first read, where the span writes into them
            before = runner.snapshot(runner.written(span))
            runner.watched(span, figures)
            if timed:
                for i in range(warmup + repeats):
                    if i == warmup:
                        for n in runner.nodes(span):
                            runner.interp.times.pop(n.name, None)
                    runner.restore(before)
                    env = runner.run(span)
                    if i >= warmup + repeats - BACKWARD_ROUNDS:  # the stage's step: what its backward takes
                        t = _backward_time(runner, k, span, env, params, device)
                        was = figures.backward.get(k, t)
                        figures.backward[k] = None if t is None or was is None else min(was, t)
                    del env
            runner.restore(before)
            del before  # not held through the metered run
            # One meter for the stage's forward and backward: every block it sees freed, it saw allocated
            # (what earlier runs left for the collector is collected first).
            gc.collect()
            with AllocatorMeter(device if allocator else "meta") as meter:
                env = runner.run(span, meter, grad_fns=True)
                rise = _backward(runner, k, span, env, meter) if meter.available else {}
            for n in runner.nodes(span):  # the metered run is not one of the timed runs
                runner.interp.times[n.name].pop()
            for w in meter.windows():
                if w.name == _SEEDS:
                    continue
                if w.name.startswith(_BACKWARD):  # the allocator's rise above the live tensors': workspaces
                    name = w.name[len(_BACKWARD):]
                    if name in rise:
                        extra = (w.peak - w.start) - rise[name]
                        figures.backward_extra[name] = max(figures.backward_extra.get(name, 0), extra)
                else:
                    figures.forward_temp[w.name] = max(figures.forward_temp.get(w.name, 0), w.peak - w.end)
            runner.interp.grad_fns.clear()
            for p in params:
                p.grad = None
            runner.keep(k, span, env)
            del env
        figures.times = dict(runner.interp.times) if timed else {}
        _copy(figures, copies)
        for n in runner.compute:  # what the fake run could not see, seen here (a recompute saves the state)
            if n.name in figures.random:
                n.meta[RANDOM_META] = True
            if n.name in figures.unreplayable:
                n.meta[UNREPLAYABLE_META] = True
    finally:
        for p, g in zip(params, grads):
            p.grad = g
    return figures


def _copy(figures: StageFigures, copies: list[tuple[list[fx.Node], list[fx.Node]]]) -> None:
    """Each repeated stage takes its first instance's figures, node for node."""
    for source, target in copies:
        for a, b in zip(source, target):
            for table in (figures.times, figures.forward_temp, figures.backward_extra):
                if a.name in table:
                    table[b.name] = table[a.name]


def with_stage_figures(cost: CostGraph, figures: StageFigures, spans: tuple[Span, ...]) -> CostGraph:
    """The fake profile `cost` with the stages' real figures: measured times (where timed), forward
    temporaries at least the allocator's, and the backward's workspaces added to its temporaries.

    Where timed, the eager step (`step_time_s`) is the node times and every stage's measured backward,
    summed (no plain step runs; a backward is no fixed multiple of its forward). Where the device has room,
    choose/race/calibration.py puts the plain graph's forward under no_grad in the node times' place."""
    times = robust_times(figures.times) if figures.times else {}
    state = rng_state_bytes(torch.device(cost.device))
    nodes = tuple(
        replace(
            n,
            time=times.get(n.name, n.time),
            temp_bytes=max(n.temp_bytes, figures.forward_temp.get(n.name, 0)),
            backward_temp_bytes=n.backward_temp_bytes + max(0, figures.backward_extra.get(n.name, 0)),
            rng_state_bytes=state if n.name in figures.random else n.rng_state_bytes,
            recomputable=n.recomputable and n.name not in figures.unreplayable,
        )
        for n in cost.nodes
    )
    cost = replace(cost, nodes=nodes, stages=spans)
    if figures.times:
        cost = with_fastest(replace(cost, time_source="measured"), figures.times)
        backward = [figures.backward.get(k) for k in range(len(spans))]
        if all(t is not None for t in backward):  # the eager step, stage by stage: its forward and its backward
            cost = replace(cost, step_time_s=cost.total_time + sum(backward))
    return cost

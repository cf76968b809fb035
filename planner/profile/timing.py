"""The time side of the profile: robust per-node times, and the costs a plan pays besides recompute.

* Per-node times from several timed runs: the median of the fastest half
  (a loaded machine only ever adds time). With `anchor` (the default), each
  node's time is then the median over every node that runs the same op on
  the same sizes (a model's layers repeat them: 4 layers x 5 runs are 20
  samples), rounded to a geometric grid of 2^(1/4). A spike in one run of
  one layer moves neither the median nor the grid point, so two runs on a
  busy machine give the same times and the same plan.
* Where a key's timed runs disagree (their typical run more than twice the
  fastest, in the median node of the key), the key's time is estimated from
  its FLOPs, or the bytes it moves, at the seconds per FLOP (per byte) of the
  keys whose runs agree: the same op where there is one, else every op doing
  that kind of work. The runs still bracket it: the estimate is held between
  the fastest run and the typical one.
* `call_overheads`: the fixed cost of one non-reentrant checkpoint call, of its hooks per saved tensor,
  over a step (forward, recompute, backward) and of the selective policy per
  op, measured on the device on tiny regions (`call_timings`, kept in the
  timing store) and derived from those timings (`call_costs`). The calibration
  (choose/race/calibration.py) measures the policy's cost again on the model's own ops, which cost
  more per op.
* `step_times`: the eager model's step and the captured graph's (and the calibration's checkpointed
  graphs), so that the predicted step time counts the graph's own overhead. Whole steps and the call
  costs' tiny steps are timed on `step_clock`: on a one-thread CPU the thread's CPU time, which the
  machine's load does not inflate (per-node times, a fraction of a scheduler slice each, stay near it).
  A stage-wise profile, whose plain step does not fit, times only checkpointed graphs and the plain
  graph's forward under no_grad (`timed_steps`).

Nothing here lowers a plan: what runs a region under the selective policy (`probe`, lower/selective.py's
`dispatch_probe_contexts`) and which nodes a policy may keep (`flags`, its `saveable_flags`) are
handed in by the profiler.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.fx as fx
from torch.utils.checkpoint import checkpoint

from .graph import CostGraph, NodeCost
from .timing_store import TimingStore, open_store

__all__ = [
    "robust_times",
    "with_fastest",
    "estimated_times",
    "anchor_times",
    "call_overheads",
    "call_timings",
    "call_costs",
    "step_times",
    "timed_steps",
    "step_sync",
    "step_clock",
    "quantize",
    "finish_profile",
    "node_kind",
]

ContextFn = Callable[[], tuple[Any, Any]]
"""A checkpoint `context_fn`: the (forward, recompute) contexts of one call."""

GRID = 4  # steps per doubling of the time grid
DISAGREE = 2.0  # a key whose typical run is slower than this times its fastest is estimated (anchor_times)
HEAL = 2.0 ** (-2 / GRID)  # a stored node time gives way to one two grid steps lower (timing_store)
TINY_OPS = 16  # ops in the regions timed by call_overheads
TIMED_STEPS = 7  # timed repeats of each overhead measurement (the fastest is kept)
STEP_ROUNDS = 5  # interleaved rounds of whole-step timings (eager, graph, checkpointed graphs)


def quantize(seconds: float) -> float:
    """Round to the nearest point of a geometric grid of 2^(1/GRID); 0 stays 0."""
    if seconds <= 0 or not math.isfinite(seconds):
        return 0.0
    return 2.0 ** (round(math.log2(seconds) * GRID) / GRID)


def robust_times(samples: dict[str, list[float]]) -> dict[str, float]:
    """Per node: the median of the fastest half of its timed runs. # seconds"""
    out = {}
    for name, ts in samples.items():
        fastest = sorted(ts)[: max(1, (len(ts) + 1) // 2)]
        out[name] = statistics.median(fastest)
    return out


def with_fastest(cost: CostGraph, samples: dict[str, list[float]]) -> CostGraph:
    """`cost` with each node's fastest timed run (`NodeCost.time_min`), from the per-node samples."""
    nodes = tuple(replace(n, time_min=min(samples.get(n.name) or [0.0])) for n in cost.nodes)
    return replace(cost, nodes=nodes)


def op_key(cost: CostGraph, n) -> str:
    """What a node's time is taken to depend on: the op, its FLOPs, the bytes it makes and reads, the dtype."""
    reads = ",".join(str(b) for b in sorted(cost.storages[t].nbytes for t in n.reads))
    return f"{n.kind or n.target}|{n.dtype}|{n.flops:.0f}|{n.out_bytes}|{reads}"


def anchor_times(cost: CostGraph, store: TimingStore | None = None) -> CostGraph:
    """Each node's time: the median over the nodes that run the same op on the same sizes (the layers
    of a model repeat them), rounded to the time grid; where those runs disagree, the FLOP/bytes
    estimate (`estimated_times`). See the module docstring.

    `store`: the device's timing store (profile/timing_store.py); a key it holds takes the stored time,
    a key it lacks is stored with this run's."""
    nodes = cost.nodes
    if not nodes or cost.time_source != "measured":
        return cost
    groups: dict[str, list[NodeCost]] = {}
    keys = []
    for n in nodes:
        key = op_key(cost, n)
        keys.append(key)
        groups.setdefault(key, []).append(n)
    typical = {key: statistics.median(n.time for n in ns) for key, ns in groups.items()}
    doubtful = {
        key for key, ns in groups.items()
        if all(n.time_min > 0 for n in ns) and statistics.median(n.time / n.time_min for n in ns) > DISAGREE
    }
    estimates = estimated_times(cost, groups, typical, doubtful)
    typical.update(estimates)
    doubtful = set(estimates)  # with no op whose runs agree there is nothing to estimate by: measured times stand
    typical = {key: quantize(t) for key, t in typical.items()}
    if store is not None:
        for key, t in typical.items():
            stored = store.get("ops", key)
            if key in doubtful and stored is not None:  # an estimate heals nothing: the stored time stands
                typical[key] = float(stored)
                doubtful.discard(key)
            else:
                typical[key] = store.settle("ops", key, t, HEAL)
    fitted = tuple(replace(n, time=typical[key], time_estimated=key in doubtful) for n, key in zip(nodes, keys))
    return replace(cost, nodes=fitted, time_source="fitted")


def _work(cost: CostGraph, n: NodeCost) -> tuple[str, float]:
    """What a node's time scales with: ('flops', FLOPs), else ('bytes', bytes made and read); a node that
    makes no storage (a view, a metadata op) does no work to scale by: 0."""
    if n.flops > 0:
        return "flops", n.flops
    if n.out_bytes <= 0:
        return "bytes", 0.0
    return "bytes", float(n.out_bytes + sum(cost.storages[t].nbytes for t in n.reads))


def estimated_times(
    cost: CostGraph, groups: dict[str, list[NodeCost]], typical: dict[str, float], doubtful: set[str]
) -> dict[str, float]:
    """The FLOP/bytes estimate of each doubtful key (seconds): its work at the median seconds per FLOP
    (or per byte) of the trusted keys of the same op, else of every trusted key doing that kind of work
    (none such: no estimate); a key with no work to scale by takes the median of the trusted keys of its
    op, else the fastest trusted key (the dispatch floor). Held between the key's fastest run and its typical one: load only
    adds time, so the fastest run is reachable, and the typical one already counts the load."""
    trusted = [k for k in typical if k not in doubtful and typical[k] > 0]
    if not doubtful or not trusted:
        return {}
    first = {k: ns[0] for k, ns in groups.items()}
    kind = {k: n.kind or n.target for k, n in first.items()}
    work = {k: _work(cost, n) for k, n in first.items()}

    def rate(unit: str, op: str | None) -> float | None:
        rates = [
            typical[k] / work[k][1] for k in trusted
            if work[k][0] == unit and work[k][1] > 0 and (op is None or kind[k] == op)
        ]
        return statistics.median(rates) if rates else None

    floor = min(typical[k] for k in trusted)
    out = {}
    for key in doubtful:
        unit, amount = work[key]
        if amount > 0:
            per = rate(unit, kind[key]) or rate(unit, None)
            if per is None:  # no op doing this kind of work agreed: its measured time stands
                continue
            guess = max(floor, per * amount)
        else:
            same = [typical[k] for k in trusted if kind[k] == kind[key]]
            guess = statistics.median(same) if same else floor
        fastest = statistics.median(n.time_min for n in groups[key])
        out[key] = min(typical[key], max(fastest, guess))
    return out


def step_clock(device: torch.device) -> Callable[[], float]:
    """The clock whole steps are timed on (seconds): on a CPU running torch on one thread, the calling thread's
    CPU time, since the forward and the backward both run on that thread and other processes' load adds
    little to it (it adds two to four times the step's own work in wall time on a shared 2-core machine, while the
    per-node times, each a fraction of a scheduler slice, stay near it); else the wall clock (a device runs
    asynchronously, and torch's worker threads do work this thread's clock does not see)."""
    if device.type == "cpu" and torch.get_num_threads() == 1:
        return time.thread_time
    return time.perf_counter


def _timed(fn: Callable[[], Any], sync: Callable[[], None], clock: Callable[[], float] = time.perf_counter) -> float:
    best = math.inf
    fn()
    for _ in range(TIMED_STEPS):
        sync()
        t0 = clock()
        fn()
        sync()
        best = min(best, clock() - t0)
    return best


def _sync_for(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def call_timings(device: torch.device | str, probe: ContextFn) -> dict[str, float]:
    """The steps `call_costs` derives the call costs from, seconds, the least of two passes (the first pass
    in a process also pays one-off initialisation): `region`, one checkpoint region of TINY_OPS tiny ops;
    `each`, a region per op; `selective`, the one region under the kept-node mode keeping nothing (`probe`:
    checkpoint's context_fn that runs it so); `plain`, the ops without checkpointing; `forward`, their
    forward alone."""
    device = torch.device(device)
    sync, clock = _sync_for(device), step_clock(device)
    x = torch.randn(8, device=device, requires_grad=True)

    def chain(t: torch.Tensor) -> torch.Tensor:
        for _ in range(TINY_OPS):
            t = torch.sin(t)  # saves its input: the recompute runs
        return t

    def step(wrap) -> Callable[[], None]:
        return lambda: wrap(x).sum().backward()

    def each(t: torch.Tensor) -> torch.Tensor:
        for _ in range(TINY_OPS):
            t = checkpoint(torch.sin, t, use_reentrant=False)
        return t

    def one(t: torch.Tensor) -> torch.Tensor:
        return checkpoint(chain, t, use_reentrant=False)

    def one_selective(t: torch.Tensor) -> torch.Tensor:
        return checkpoint(chain, t, use_reentrant=False, context_fn=probe)

    def once() -> dict[str, float]:
        return {
            "region": _timed(step(one), sync, clock),
            "each": _timed(step(each), sync, clock),
            "selective": _timed(step(one_selective), sync, clock),
            "plain": _timed(step(chain), sync, clock),
            "forward": _timed(lambda: chain(x), sync, clock),
        }

    first, second = once(), once()
    x.grad = None
    return {k: min(first[k], second[k]) for k in first}


def call_costs(t: dict[str, float]) -> tuple[float, float, float]:
    """Seconds, from `call_timings`: (per checkpoint call per step, per op run under a selective policy,
    per tensor saved inside a region: its pack hook in the forward and the recompute, its unpack in the
    backward)."""
    # TINY_OPS regions against one region of the same ops: the same recompute, TINY_OPS - 1 more calls.
    per_call = max(0.0, (t["each"] - t["region"]) / (TINY_OPS - 1))
    per_op = max(0.0, (t["selective"] - t["region"]) / (2 * TINY_OPS))
    # One region against no checkpointing: one call, the recompute of the chain, and the hooks on each of
    # its TINY_OPS saved tensors.
    per_saved = max(0.0, (t["region"] - t["plain"] - t["forward"] - per_call) / TINY_OPS)
    return quantize(per_call), quantize(per_op), quantize(per_saved)


def call_overheads(device: torch.device | str, probe: ContextFn) -> tuple[float, float, float]:
    """`call_costs` measured now on `device`, seconds."""
    return call_costs(call_timings(device, probe))


def _loss(out: Any) -> torch.Tensor | None:
    leaves = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    leaves = [t for t in leaves if t.is_floating_point() or t.is_complex()]
    if not leaves:
        return None
    return sum(t.float().sum() if t.is_floating_point() else t.real.float().sum() for t in leaves)


def step_times(
    model: torch.nn.Module, graph: torch.nn.Module, args: tuple, kwargs: dict, device: torch.device,
    *checkpointed: torch.nn.Module,
) -> tuple[float, ...]:
    """(eager step, captured graph's step, then each checkpointed graph's step) in seconds, the fastest of
    a few interleaved runs; zeros when a step cannot be run this way. The caller restores the model's
    state (gradients, buffers, RNG). Timed on `step_clock(device)`."""
    return timed_steps((model, graph, *checkpointed), args, kwargs, device)


def timed_steps(modules: Sequence[torch.nn.Module], args: tuple, kwargs: dict, device: torch.device) -> tuple[float, ...]:
    """Each module's training step (forward, summed loss, backward) in seconds, the fastest of STEP_ROUNDS
    interleaved rounds after one untimed round; zeros when a step cannot be run. A stage-wise profile times
    only the checkpointed graphs here: the plain step is the one that does not fit."""
    sync, clock = _sync_for(device), step_clock(device)

    def run(mod) -> None:
        loss = _loss(mod(*args, **kwargs))
        if loss is not None:
            loss.backward()

    best = [math.inf] * len(modules)
    try:
        for mod in modules:
            run(mod)
        for _ in range(STEP_ROUNDS):
            for k, mod in enumerate(modules):
                sync()
                t0 = clock()
                run(mod)
                sync()
                best[k] = min(best[k], clock() - t0)
    except Exception:  # noqa: BLE001 - a model whose step we cannot run here is planned without these figures
        return (0.0,) * len(modules)
    return tuple(best)


def step_sync(device: torch.device) -> Callable[[], None]:
    """What waits for the device before a step's clock is read (nothing on the CPU)."""
    return _sync_for(device)


def node_kind(gm: fx.GraphModule, n: fx.Node) -> str:
    """The op a node runs, for policies: 'aten.mm.default', 'matmul', 'Linear', 'Conv2d'."""
    if n.op == "call_module":
        return type(gm.get_submodule(str(n.target))).__name__
    if n.op == "call_method":
        return str(n.target)
    if isinstance(n.target, torch._ops.OpOverload):
        return str(n.target)
    return getattr(n.target, "__name__", str(n.target))


def finish_profile(
    cost: CostGraph, gm: fx.GraphModule, flags: list[bool], probe: ContextFn, *, anchor: bool, overheads: bool,
    device: torch.device,
    cache: dict[str, int] | None = None,
    ops: dict[str, int] | None = None,
    timing_store: bool = True,
) -> CostGraph:
    """Kinds and saveable flags per node, fitted times (`anchor`), measured call costs (`overheads`).

    `flags`: per compute node, whether a selective region may keep its output (selective.saveable_flags).
    `probe`: the context_fn the call costs time the selective policy with (selective.dispatch_probe_contexts).
    `cache`, `ops`: per node, the bytes a selective policy keeping it would cache and the aten ops it
    dispatches (selective.policy_costs).
    A node is saveable only when that is no more than the storages the profile gives it: a composite
    node whose policy would also cache intermediates that eager frees at once is recomputed instead,
    so the simulator's figure for a kept node is the allocator's.
    """
    from ..capture.mutation import compute_nodes

    compute = compute_nodes(gm.graph)
    produced = [0] * len(cost.nodes)
    for st in cost.storages:
        produced[st.producer] += st.nbytes

    def fits(i: int, c, n: fx.Node) -> bool:
        if cache is None:  # not counted: only a node that is one aten op caches just its own outputs
            return isinstance(n.target, torch._ops.OpOverload)
        return cache.get(c.name, 0) <= produced[i]

    nodes = tuple(
        replace(
            c, kind=node_kind(gm, n), saveable=flag and c.recomputable and c.out_bytes > 0 and fits(i, c, n),
            dispatch_ops=ops.get(c.name, 0) if ops is not None else c.dispatch_ops,
        )
        for i, (c, n, flag) in enumerate(zip(cost.nodes, compute, flags))
    )
    cost = replace(cost, nodes=nodes)
    store = open_store(device, timing_store and anchor and cost.time_source == "measured")
    if anchor:
        forward_s = cost.total_time
        cost = anchor_times(cost, store)
        if cost.stages and cost.step_time_s > 0:  # a stage-wise profile's eager step: the node times and the
            # stages' measured backwards (profile/stagewise.py), its forward now the fitted times
            cost = replace(cost, step_time_s=max(0.0, cost.step_time_s - forward_s) + cost.total_time)
    if overheads and device.type != "meta" and cost.time_source != "flops":
        region_s, op_s, saved_s = call_costs(store.settle("overheads", "call", call_timings(device, probe), HEAL))
        cost = replace(cost, region_overhead_s=region_s, op_overhead_s=op_s, saved_overhead_s=saved_s)
    store.save()
    return cost

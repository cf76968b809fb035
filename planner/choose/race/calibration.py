"""The profile calibrated on real steps: the eager step, the captured graph's, and one step of the graph
checkpointed per block, timed side by side before any plan is chosen.

The profile times each node alone; a recompute inside a real step pays more (cold caches, fresh
allocations, a loaded machine). So the graph is lowered with one region per repeated block (else
about sqrt(n) even runs) and stepped beside the plain graph: the extra seconds, less the checkpoint
calls and hooks, over the summed times of the nodes it recomputes, is the factor every node time is
scaled by. The same regions once more under the kept-node mode keeping nothing give the selective
policy's cost per op on the model's own ops. It lowers and simulates a plan, so it lives above the
profile stage; the spine hands `with_step_times` to `profile/bytes_pass.py`, which calls it after the
timed profile, where the whole step was profiled.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch

from ...lower.rewrite import CheckpointRegion, rewrite
from ...profile.graph import CostGraph
from ...profile.memory import device_room
from ...profile.timing import HEAL, op_key, quantize, step_times, timed_steps
from ...profile.timing_store import open_store, signature
from ...solvers.costs import trim_flat_regions
from ...solvers.heuristics.basic import uniform
from ...solvers.heuristics.selective import block_regions
from ...solvers.simulate import simulate

__all__ = ["CALIBRATION_STEPS", "SPLIT_STEPS", "STAGEWISE_STEPS", "with_step_times", "calibration_plan", "split_plan"]

CALIBRATION_STEPS = ("graph", "checkpointed", "caching_nothing", "recomputed", "calls")
"""A calibration snapshot (seconds): the steps timed side by side (the captured graph, the graph
checkpointed per block, the same regions under a selective policy that keeps nothing) and what that
run's profile predicted for the checkpointed one (its recomputed nodes; its calls and hooks). The
figures come from the snapshot alone, so a node time or call cost that heals later moves no plan."""


STAGEWISE_STEPS = ("checkpointed", "caching_nothing", "forward", "backward", "recomputed", "calls")
"""A stage-wise profile's calibration snapshot (seconds): the two checkpointed steps timed (no plain step:
it does not fit), the plain graph's forward under no_grad, the stages' measured backwards summed, what the profile
predicted for the checkpointed step (recomputed nodes; calls and hooks)."""


SPLIT_STEPS = ("split", "split_recomputed", "split_calls")
"""With a second plan, each calibration region cut in two (`split_plan`): its step and what the profile
predicted for it. About the same recompute in twice the regions: what a region costs the step beyond the
measured call and hook costs (a fresh context per call, the saved inputs' unpacking, a recompute's first
allocations) comes apart from the node-time factor. The plans' region counts are not stored: they follow
from the graph, and a count in the snapshot's total would keep a clearly faster run from healing it."""


def calibration_plan(cost: CostGraph) -> tuple[tuple[int, int], ...]:
    """Regions to time a real recompute with: one per repeated block, else about sqrt(n) even runs."""
    try:
        problem = cost.to_problem()
        regions = block_regions(problem)
        return regions if regions else trim_flat_regions(problem, uniform(problem).regions)
    except Exception:  # noqa: BLE001 - no calibration for a graph these cannot split: planned without it
        return ()


def split_plan(cost: CostGraph, regions: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    """`regions` each cut in two at its middle node (trimmed to end on a node that saves something): about
    as much recompute in about twice the regions; () where that adds no region."""
    halves: list[tuple[int, int]] = []
    for s, e in regions:
        m = (s + e) // 2
        halves += [(s, m), (m + 1, e)] if e > s else [(s, e)]
    try:
        out = trim_flat_regions(cost.to_problem(), halves)
    except Exception:  # noqa: BLE001 - calibrated on the one plan
        return ()
    return out if len(out) > len(regions) else ()


def _fit(paid: list[float], work: list[float], counts: list[float]) -> tuple[float, float]:
    """(node-time factor s, seconds per region k) from one or two calibration plans, each measured paying
    `paid` = s * `work` (predicted node seconds) + k * `counts` (its regions). s is rounded to the time grid
    and held between 1/2 and 4; k >= 0, then refit by least squares at that s; one plan: k = 0."""
    s = paid[0] / work[0] if work[0] > 0 else 1.0
    k = 0.0
    if len(paid) == 2:
        det = work[0] * counts[1] - work[1] * counts[0]
        k = (work[0] * paid[1] - work[1] * paid[0]) / det if det else 0.0
        if k > 0 and work[0] > 0:
            s = (paid[0] - k * counts[0]) / work[0]
    s = min(4.0, max(0.5, quantize(s)))
    if k > 0:
        k = max(0.0, sum(n * (y - s * a) for y, a, n in zip(paid, work, counts)) / sum(n * n for n in counts))
    return s, k


def with_step_times(
    cost: CostGraph, model: torch.nn.Module, graph: torch.nn.Module, args: tuple, kwargs: dict, *, calibrate: bool = True,
    timing_store: bool = True,
) -> CostGraph:
    """The profile with the eager step time, the captured graph's overhead against it, and (`calibrate`)
    node times scaled to what a recompute costs inside a real step, all measured.

    The calibration times one step of the graph checkpointed per block against the plain graph: the
    extra seconds, less the checkpoint calls and hooks, over the summed times of the nodes it
    recomputes, is the factor a recompute costs against the profile's per-node runs (cold caches,
    fresh allocations, a loaded machine). Every node's time is scaled by it (rounded to the time
    grid, between 1/2 and 4), so every solver ranks plans by what the step will pay.

    `timing_store`: with fitted times, the step timings are kept in the device's timing store under the
    graph's signature (profile/timing_store.py): the calibration's three steps side by side, with what the
    profile predicted for them, as one snapshot that heals whole when a run measures it clearly faster;
    the eager and graph steps at the lowest run yet. The figures are derived from what the store holds,
    so a run that the machine's load slowed down plans as the stored runs did.
    """
    if cost.time_source == "flops":
        return cost
    if cost.stages:  # profiled stage by stage: the plain step is not run
        return _stagewise(cost, model, graph, args, kwargs, calibrate=calibrate, timing_store=timing_store)
    device = torch.device(cost.device)
    store = open_store(device, timing_store and cost.time_source == "fitted")
    key = signature([op_key(cost, n) for n in cost.nodes] + [f"calibrate={calibrate}"])
    regions = calibration_plan(cost) if calibrate else ()
    split = split_plan(cost, regions) if regions else ()
    measured = _measured_step(model, graph, args, kwargs, device, regions, split)
    if measured:  # a step that could not be run is tried again next time
        for name in ("step_time_s", "graph_step_s"):
            store.settle("steps", f"{key}|{name}", measured[name], 1.0)
        if "checkpointed" in measured:
            predicted = _predicted(cost, regions)
            snap = {**{k: measured[k] for k in CALIBRATION_STEPS[:3]}, **predicted}
            if "split" in measured:
                snap.update(split=measured["split"], **_split_predicted(cost, split))
            store.settle("graphs", key, snap, HEAL)
        store.save()
    step_s = float(store.get("steps", f"{key}|step_time_s") or 0.0)
    if step_s <= 0:
        return cost
    graph_s = max(0.0, float(store.get("steps", f"{key}|graph_step_s") or 0.0) - step_s)
    cost = replace(cost, step_time_s=step_s, graph_overhead_s=graph_s)
    snapshot = store.get("graphs", key) if calibrate else None
    if not _valid(snapshot, CALIBRATION_STEPS):
        return cost
    scale, op_s, per_region = _calibration(cost, regions, snapshot)
    if op_s is not None:
        cost = replace(cost, op_overhead_s=op_s)
    return _scaled(cost, scale, per_region)


def _valid(snap: object, steps: tuple[str, ...]) -> bool:
    """A stored snapshot of `steps`, with or without the split plan's figures, all numbers (not a file edited
    by hand)."""
    return (isinstance(snap, dict) and set(snap) in (set(steps), set(steps) | set(SPLIT_STEPS))
            and all(isinstance(v, (int, float)) for v in snap.values()))


def _scaled(cost: CostGraph, scale: float, per_region: float) -> CostGraph:
    """`cost` with node times scaled by `scale` and `per_region` seconds more per checkpoint call."""
    if per_region > 0:
        cost = replace(cost, region_overhead_s=quantize(cost.region_overhead_s + per_region))
    if scale == 1.0:
        return cost
    nodes = tuple(replace(n, time=n.time * scale) for n in cost.nodes)
    return replace(cost, nodes=nodes, recompute_scale=scale)


def _stagewise(cost: CostGraph, model: torch.nn.Module, graph: torch.nn.Module, args: tuple, kwargs: dict, *,
               calibrate: bool, timing_store: bool) -> CostGraph:
    """`with_step_times` for a stage-wise profile (profile/stagewise.py), whose plain step does not fit.

    Without calibration its eager step is the node times and the stages' measured backwards (B) summed. But
    the node times, each timed alone, overstate the forward a step runs (the matrix's Llama, one CPU thread:
    3.6 ms summed, a 2.5 ms forward). So where the device has room for the step checkpointed per block (its
    predicted peak; the step a plan is checked against here too), that step is timed, and the plain graph's
    forward under no_grad (F: no activation kept, so it fits wherever a stage does; without autograd's
    recording it is a little short, 1.9 ms there, and B, each stage's backward starting on its own, a little
    long, 2.8 against 2.5 ms). The eager step is F + B, and the calibration is the whole profile's with it in
    the plain graph's place: the node-time factor, a cost per region, the selective policy's cost per op.
    The captured graph's own overhead against the eager model stays 0: no plain step is run."""
    if cost.step_time_s <= 0 or not calibrate:
        return cost
    device = torch.device(cost.device)
    regions = calibration_plan(cost)
    if not regions:
        return cost
    problem = cost.to_problem()
    room = device_room(device)  # what the device can still allocate, the parameters and inputs already in it
    if room is not None and simulate(problem, regions).peak_bytes - cost.param_bytes - cost.input_bytes > room:
        return cost
    store = open_store(device, timing_store and cost.time_source == "fitted")
    key = signature([op_key(cost, n) for n in cost.nodes] + ["stagewise"])
    split = split_plan(cost, regions)
    if split and simulate(problem, split).peak_bytes - cost.param_bytes - cost.input_bytes > _room_or(room):
        split = ()
    checked = _checkpointed(graph, model, regions, split)
    if checked:  # the per-block step, under the policy keeping nothing, the plain forward, then the split plan
        try:  # the graph as every plan runs it (its aten calls bound, fastcode.py), with no region
            plain = rewrite(graph, (), model=model)
        except Exception:  # noqa: BLE001 - timed as captured
            plain = graph
        checked = (*checked[:2], _NoGradForward(plain), *checked[2:])
    times = timed_steps(checked, args, kwargs, device) if checked else ()
    if times and all(t > 0 for t in times):
        measured = {"checkpointed": times[0], "caching_nothing": times[1], "forward": times[2],
                    "backward": cost.step_time_s - cost.total_time, **_predicted(cost, regions)}
        if len(times) > 3:
            measured.update(split=times[3], **_split_predicted(cost, split))
        store.settle("graphs", key, measured, HEAL)
        store.save()
    snap = store.get("graphs", key)
    if not _valid(snap, STAGEWISE_STEPS):
        return cost
    eager = snap["forward"] + max(0.0, snap["backward"])
    scale, op_s, per_region = _calibration(cost, regions, {**snap, "graph": eager})
    if op_s is not None:
        cost = replace(cost, op_overhead_s=op_s)
    return replace(_scaled(cost, scale, per_region), step_time_s=eager)


class _NoGradForward(torch.nn.Module):
    """A graph's forward under no_grad: a timed step of it runs no backward and keeps no activation."""

    def __init__(self, graph: torch.nn.Module) -> None:
        super().__init__()
        self.graph = graph

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with torch.no_grad():
            return self.graph(*args, **kwargs)


def _room_or(room: int | None) -> float:
    """The device's room (bytes), unbounded where it cannot be read."""
    return math.inf if room is None else room


def _checkpointed(graph: torch.nn.Module, model: torch.nn.Module, regions: tuple[tuple[int, int], ...],
                  split: tuple[tuple[int, int], ...]) -> tuple[torch.nn.Module, ...]:
    """The calibration's checkpointed graphs: `regions`, the same under a selective policy keeping nothing, then
    `split` where it is given and can be lowered; () where `regions` cannot be."""
    try:
        checked = (rewrite(graph, regions, model=model), _caching_nothing(rewrite(graph, regions, model=model)))
    except Exception:  # noqa: BLE001 - no calibration for a graph that cannot be checkpointed per block
        return ()
    try:
        return checked + ((rewrite(graph, split, model=model),) if split else ())
    except Exception:  # noqa: BLE001 - calibrated on the one plan
        return checked


def _predicted(cost: CostGraph, regions: tuple[tuple[int, int], ...]) -> dict[str, float]:
    """The calibration plan's recomputed nodes and its calls and hooks, as `cost` predicts them."""
    sim = simulate(cost.to_problem(), regions)
    calls = sim.call_time + sim.hook_time
    return {"recomputed": sim.recompute_time - calls, "calls": calls}


def _split_predicted(cost: CostGraph, split: tuple[tuple[int, int], ...]) -> dict[str, float]:
    """The split plan's predicted figures (SPLIT_STEPS but its step)."""
    p = _predicted(cost, split)
    return {"split_recomputed": p["recomputed"], "split_calls": p["calls"]}


def _calibration(
    cost: CostGraph, regions: tuple[tuple[int, int], ...], snap: dict[str, float]
) -> tuple[float, float | None, float]:
    """(recompute scale, selective policy's cost per op or None, seconds more per region) from a calibration
    snapshot of `regions` (and of the split plan, where it has one)."""
    paid = [snap["checkpointed"] - snap["graph"] - snap["calls"]]
    work, counts = [snap["recomputed"]], [len(regions)]
    if "split" in snap:
        paid.append(snap["split"] - snap["graph"] - snap["split_calls"])
        work.append(snap["split_recomputed"])
        counts.append(len(split_plan(cost, regions)))
    scale, per_region = _fit(paid, work, counts) if work[0] > 0 else (1.0, 0.0)
    return scale, _op_cost(cost, regions, snap), per_region


def _op_cost(cost: CostGraph, regions: tuple[tuple[int, int], ...], snap: dict[str, float]) -> float | None:
    """The selective policy's cost per op (seconds), or None. The same regions under a selective policy that
    keeps nothing: the same recompute, plus the policy's dispatch on every op of the forward and of the
    recompute (what the simulator charges)."""
    ops = sum(cost.nodes[i].dispatch_ops for s, e in regions for i in range(s, e + 1))
    if ops <= 0 or snap["caching_nothing"] <= 0:
        return None
    return max(0.0, snap["caching_nothing"] - snap["checkpointed"]) / (2 * ops)


def _measured_step(
    model: torch.nn.Module, graph: torch.nn.Module, args: tuple, kwargs: dict, device: torch.device,
    regions: tuple[tuple[int, int], ...], split: tuple[tuple[int, int], ...] = (),
) -> dict[str, float]:
    """with_step_times' step timings, measured this run: the eager and graph steps and, with `regions`, the
    calibration's three steps (CALIBRATION_STEPS), and the `split` plan's step where it is given."""
    checked: tuple[torch.nn.Module, ...] = ()
    plain = graph
    try:  # the graph as every plan runs it (its aten calls bound, fastcode.py), with no region
        plain = rewrite(graph, (), model=model)
    except Exception:  # noqa: BLE001 - timed as captured
        pass
    if regions:
        checked = _checkpointed(graph, model, regions, split)
    times = step_times(model, plain, args, kwargs, device, *checked)
    eager_s, graph_s = times[0], times[1]
    if eager_s <= 0 or graph_s <= 0:
        return {}
    out = {"step_time_s": eager_s, "graph_step_s": graph_s}
    if checked:
        out.update(zip(CALIBRATION_STEPS[:3], (graph_s, times[2], times[3])))
    if len(times) > 4:
        out["split"] = times[4]
    return out


def _caching_nothing(checkpointed: torch.nn.Module) -> torch.nn.Module:
    """`checkpointed` with every region run under the kept-node mode keeping nothing: what that mode's
    dispatch alone costs per op on this graph's own ops (a kept node's ops pay it)."""
    for module in checkpointed.modules():
        if isinstance(module, CheckpointRegion):
            module.dispatch_probe = True
    return checkpointed

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

from dataclasses import replace

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

__all__ = ["CALIBRATION_STEPS", "STAGEWISE_STEPS", "with_step_times", "calibration_plan"]

CALIBRATION_STEPS = ("graph", "checkpointed", "caching_nothing", "recomputed", "calls")
"""A calibration snapshot (seconds): the steps timed side by side (the captured graph, the graph
checkpointed per block, the same regions under a selective policy that keeps nothing) and what that
run's profile predicted for the checkpointed one (its recomputed nodes; its calls and hooks). The
figures come from the snapshot alone, so a node time or call cost that heals later moves no plan."""


STAGEWISE_STEPS = ("checkpointed", "caching_nothing", "forward", "backward", "recomputed", "calls")
"""A stage-wise profile's calibration snapshot (seconds): the two checkpointed steps timed (no plain step:
it does not fit), the profile's forward (its node times summed) and its stages' measured backwards, and what
it predicted for the checkpointed step (recomputed nodes; calls and hooks)."""


def calibration_plan(cost: CostGraph) -> tuple[tuple[int, int], ...]:
    """Regions to time a real recompute with: one per repeated block, else about sqrt(n) even runs."""
    try:
        problem = cost.to_problem()
        regions = block_regions(problem)
        return regions if regions else trim_flat_regions(problem, uniform(problem).regions)
    except Exception:  # noqa: BLE001 - no calibration for a graph these cannot split: planned without it
        return ()


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
    measured = _measured_step(model, graph, args, kwargs, device, regions)
    if measured:  # a step that could not be run is tried again next time
        for name in ("step_time_s", "graph_step_s"):
            store.settle("steps", f"{key}|{name}", measured[name], 1.0)
        if "checkpointed" in measured:
            predicted = _predicted(cost, regions)
            store.settle("graphs", key, {**{k: measured[k] for k in CALIBRATION_STEPS[:3]}, **predicted}, HEAL)
        store.save()
    step_s = float(store.get("steps", f"{key}|step_time_s") or 0.0)
    if step_s <= 0:
        return cost
    graph_s = max(0.0, float(store.get("steps", f"{key}|graph_step_s") or 0.0) - step_s)
    cost = replace(cost, step_time_s=step_s, graph_overhead_s=graph_s)
    snapshot = store.get("graphs", key) if calibrate else None
    if not isinstance(snapshot, dict) or set(snapshot) != set(CALIBRATION_STEPS):
        return cost
    if not all(isinstance(v, (int, float)) for v in snapshot.values()):  # a file edited by hand
        return cost
    scale, op_s = _calibration(cost, regions, snapshot)
    if op_s is not None:
        cost = replace(cost, op_overhead_s=op_s)
    if scale == 1.0:
        return cost
    nodes = tuple(replace(n, time=n.time * scale) for n in cost.nodes)
    return replace(cost, nodes=nodes, recompute_scale=scale)


def _stagewise(cost: CostGraph, model: torch.nn.Module, graph: torch.nn.Module, args: tuple, kwargs: dict, *,
               calibrate: bool, timing_store: bool) -> CostGraph:
    """`with_step_times` for a stage-wise profile (profile/stagewise.py), whose plain step does not fit.

    Its eager step is an estimate: the node times (F) and the stages' measured backwards (B) summed. The
    step checkpointed per block is run instead, where the device has room for it (its predicted peak; it is
    the step a plan is checked against here too): it pays the forward, the recompute of its regions (R, as
    predicted), the backward and the calls and hooks (K), so measured C = s * (F + R) + B + K gives the
    factor s that node times are scaled by, and the eager step becomes s * F + B. The same regions under a
    selective policy keeping nothing price that policy per op, as for a whole profile. No plain step is
    timed, so the captured graph's own overhead against the eager model stays 0."""
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
    try:
        checked = (rewrite(graph, regions, model=model), _caching_nothing(rewrite(graph, regions, model=model)))
    except Exception:  # noqa: BLE001 - no calibration for a graph that cannot be checkpointed per block
        checked = ()
    times = timed_steps(checked, args, kwargs, device) if checked else ()
    if times and all(t > 0 for t in times):
        measured = {"checkpointed": times[0], "caching_nothing": times[1], "forward": cost.total_time,
                    "backward": cost.step_time_s - cost.total_time, **_predicted(cost, regions)}
        store.settle("graphs", key, measured, HEAL)
        store.save()
    snap = store.get("graphs", key)
    if not isinstance(snap, dict) or set(snap) != set(STAGEWISE_STEPS):
        return cost
    if not all(isinstance(v, (int, float)) for v in snap.values()):  # a file edited by hand
        return cost
    scale = 1.0
    if snap["forward"] + snap["recomputed"] > 0:
        paid = snap["checkpointed"] - snap["backward"] - snap["calls"]
        scale = min(4.0, max(0.5, quantize(paid / (snap["forward"] + snap["recomputed"]))))
    op_s = _op_cost(cost, regions, snap)
    if op_s is not None:
        cost = replace(cost, op_overhead_s=op_s)
    nodes = tuple(replace(n, time=n.time * scale) for n in cost.nodes)
    return replace(cost, nodes=nodes, recompute_scale=scale,
                   step_time_s=scale * cost.total_time + max(0.0, snap["backward"]))


def _predicted(cost: CostGraph, regions: tuple[tuple[int, int], ...]) -> dict[str, float]:
    """The calibration plan's recomputed nodes and its calls and hooks, as `cost` predicts them."""
    sim = simulate(cost.to_problem(), regions)
    calls = sim.call_time + sim.hook_time
    return {"recomputed": sim.recompute_time - calls, "calls": calls}


def _calibration(
    cost: CostGraph, regions: tuple[tuple[int, int], ...], snap: dict[str, float]
) -> tuple[float, float | None]:
    """(recompute scale, selective policy's cost per op or None) from a calibration snapshot of `regions`."""
    scale = 1.0
    if snap["recomputed"] > 0:
        extra = snap["checkpointed"] - snap["graph"] - snap["calls"]
        scale = min(4.0, max(0.5, quantize(extra / snap["recomputed"])))
    return scale, _op_cost(cost, regions, snap)


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
    regions: tuple[tuple[int, int], ...],
) -> dict[str, float]:
    """with_step_times' step timings, measured this run: the eager and graph steps and, with `regions`, the
    calibration's three steps (CALIBRATION_STEPS)."""
    checked: tuple[torch.nn.Module, ...] = ()
    plain = graph
    try:  # the graph as every plan runs it (its aten calls bound, fastcode.py), with no region
        plain = rewrite(graph, (), model=model)
    except Exception:  # noqa: BLE001 - timed as captured
        pass
    if regions:
        try:
            checked = (rewrite(graph, regions, model=model), _caching_nothing(rewrite(graph, regions, model=model)))
        except Exception:  # noqa: BLE001 - no calibration for a graph that cannot be checkpointed per block
            checked = ()
    times = step_times(model, plain, args, kwargs, device, *checked)
    eager_s, graph_s = times[0], times[1]
    if eager_s <= 0 or graph_s <= 0:
        return {}
    out = {"step_time_s": eager_s, "graph_step_s": graph_s}
    if checked:
        out.update(zip(CALIBRATION_STEPS[:3], (graph_s, times[2], times[3])))
    return out


def _caching_nothing(checkpointed: torch.nn.Module) -> torch.nn.Module:
    """`checkpointed` with every region run under the kept-node mode keeping nothing: what that mode's
    dispatch alone costs per op on this graph's own ops (a kept node's ops pay it)."""
    for module in checkpointed.modules():
        if isinstance(module, CheckpointRegion):
            module.dispatch_probe = True
    return checkpointed

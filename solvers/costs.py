"""Cost-model primitives shared by the solvers: which nodes save, gradient bytes by backward step,
recompute time of a plan, and trimming flat plans to saver-ended regions. All exact and
plan-independent where they can be; `simulate` remains the ground truth.
"""

from __future__ import annotations

from .problem import Problem
from .simulate import call_time, normalize_regions, normalize_saved, region_parents

__all__ = ["saver_flags", "grad_bytes_by_step", "recompute_time", "trim_flat_regions"]


def saver_flags(problem: Problem) -> list[bool]:
    """saves[k]: node k's backward keeps at least one storage."""
    saves = [False] * problem.n
    for st in problem.storages:
        for k in st.saved_by:
            saves[k] = True
    return saves


def grad_bytes_by_step(problem: Problem) -> tuple[list[int], list[int]]:
    """Gradient bytes the simulator holds at each backward step; the plan does not change them.

    Returns (at, before): at[k] is live at the observation of node k's backward
    (after its input gradients appear, with the step's backward temporaries), before[k] is live when a recompute
    triggered at step k runs (before step k adds anything). Parameter gradients
    included. # bytes
    """
    n = problem.n
    last_consumer = [-1] * n
    for i, node in enumerate(problem.nodes):
        for j in set(node.inputs):
            last_consumer[j] = max(last_consumer[j], i)
    d_at, d_before = [0] * (n + 1), [0] * (n + 1)
    for j, node in enumerate(problem.nodes):
        c = last_consumer[j]
        if node.grad_bytes and c > j:
            d_at[j] += node.grad_bytes  # live for j <= k <= c
            d_at[c + 1] -= node.grad_bytes
            d_before[j] += node.grad_bytes  # live for j <= k < c
            d_before[c] -= node.grad_bytes
    at, before = [0] * n, [0] * n
    acc_at = acc_before = 0
    suffix = [0] * (n + 1)
    for k in range(n - 1, -1, -1):
        suffix[k] = suffix[k + 1] + problem.nodes[k].param_grad_bytes
    for k in range(n):
        acc_at += d_at[k]
        acc_before += d_before[k]
        at[k] = acc_at + suffix[k] + problem.nodes[k].backward_temp_bytes
        before[k] = acc_before + suffix[k + 1]
    return at, before


def recompute_time(problem: Problem, regions, saved=()) -> float:
    """The simulator's recompute time of a plan (call costs included), without replaying memory. # seconds"""
    regions = normalize_regions(problem, regions)
    if not regions:
        return 0.0
    saved = normalize_saved(problem, regions, saved)
    is_saved = set(saved)
    nodes, storages = problem.nodes, problem.storages
    saves = saver_flags(problem)
    parents = region_parents(regions)
    inner = [-1] * problem.n
    for r, (s, e) in enumerate(regions):
        for i in range(s, e + 1):
            inner[i] = r
    has_inputs = [any(storages[t].producer < s for i in range(s, e + 1) for t in nodes[i].reads) for s, e in regions]
    child_stops: list[list[int]] = [[] for _ in regions]
    for c, p in enumerate(parents):
        if p >= 0 and has_inputs[c]:
            child_stops[p].append(regions[c][0] - 1)
    prefix = [0.0]
    for i, node in enumerate(nodes):
        hooks = problem.saved_overhead_s * node.saved_tensors
        prefix.append(prefix[-1] + hooks + (0.0 if i in is_saved else node.time))
    total = 0.0
    stops = []
    for r, (s, e) in enumerate(regions):
        own = [k for k in range(s, e + 1) if saves[k] and inner[k] == r] + child_stops[r]
        stop = max(own) if own else s - 1
        stops.append(stop)
        if not any(saves[k] for k in range(s, e + 1)):
            continue
        if stop >= s:
            total += prefix[stop + 1] - prefix[s]
    return total + call_time(problem, regions, saved, stops)


def trim_flat_regions(problem: Problem, regions, saves: list[bool] | None = None) -> tuple[tuple[int, int], ...]:
    """Drop regions without a saving node and cut trailing non-saving nodes off the others.

    For flat (non-nested) plans this never raises the simulated peak nor the
    recompute time: those nodes are never re-run, and outside the region they
    no longer make their inputs region inputs.
    """
    saves = saves if saves is not None else saver_flags(problem)
    out = []
    for s, e in regions:
        while e >= s and not saves[e]:
            e -= 1
        if e >= s:
            out.append((s, e))
    return tuple(out)

"""Cost-model primitives shared by the solvers: which nodes save, gradient bytes by backward step,
recompute time of a plan, and trimming flat plans to saver-ended regions. All exact and
plan-independent where they can be; `simulate` remains the ground truth.
"""

from __future__ import annotations

import numpy as np

from .figures import call_time
from .plans import normalize_regions, normalize_saved, region_parents
from .problem import Problem

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
    a = problem.arrays
    if saved:
        prefix = _forward_prefix(problem, set(saved))
    else:
        if a.recompute_prefix is None:
            a.recompute_prefix = _forward_prefix(problem)
        prefix = a.recompute_prefix
    parents = region_parents(regions)
    inner = np.full(problem.n, -1, dtype=np.int64)
    for r, (s, e) in enumerate(regions):
        inner[s : e + 1] = r
    has_inputs = [bool((a.read_producer[a.read_ptr[s] : a.read_ptr[e + 1]] < s).any()) and a.prev_packer[e] >= s
                  for s, e in regions]  # a region none of whose nodes packs a tensor keeps no inputs (simulate.replay)
    stops = [s - 1 for s, _ in regions]
    owner = inner[a.savers]  # a region's own savers: the nodes whose innermost region it is
    for r, k in zip(owner[owner >= 0].tolist(), a.savers[owner >= 0].tolist()):
        stops[r] = max(stops[r], k)
    for c, p in enumerate(parents):
        if p >= 0 and has_inputs[c]:
            stops[p] = max(stops[p], regions[c][0] - 1)
    total = 0.0
    for (s, e), stop in zip(regions, stops):
        if a.prev_saver[e] >= s and stop >= s:  # some node in the region saves: its recompute runs
            total += prefix[stop + 1] - prefix[s]
    return total + call_time(problem, regions, saved, stops)


def _forward_prefix(problem: Problem, saved: set[int] | frozenset[int] = frozenset()) -> list[float]:
    """prefix[i]: seconds a recompute of nodes 0..i-1 costs (forward time of those not kept, plus the
    regions' hooks on what each saves), summed node by node. # seconds"""
    prefix = [0.0]
    for i, node in enumerate(problem.nodes):
        hooks = problem.saved_overhead_s * node.saved_tensors
        prefix.append(prefix[-1] + hooks + (0.0 if i in saved else node.time))
    return prefix


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

"""Linearising a graph into a chain of stages for the chain solvers.

`_stage_bounds`: about max_stages equal-time stages cut at cheap cuts (ilp's coarsening uses it).
`_dp_stage_bounds`: the same, always including the boundaries of repeated blocks (module-path
changes such as one decoder layer to the next) and cuts that are the least in their neighbourhood.
"""

from __future__ import annotations

from ..heuristics.basic import Segmenter
from ..problem import Node, Problem, Storage

__all__ = ["coarsen", "_stage_bounds", "_dp_stage_bounds", "_module_cuts", "_valley_cuts"]


def _stage_bounds(problem: Problem, max_stages: int) -> list[tuple[int, int]]:
    """Single nodes when they are few, else about max_stages equal-time stages cut at cheap cuts."""
    n = problem.n
    if n <= max_stages:
        return [(i, i) for i in range(n)]
    segments = Segmenter(problem)
    k, bounds = max_stages, []
    for _ in range(8):
        bounds, pos = [], 0
        for s, e in segments(max(1, k)):
            if s > pos:
                bounds.append((pos, s - 1))  # a run of non-recomputable nodes
            bounds.append((s, e))
            pos = e + 1
        if pos < n:
            bounds.append((pos, n - 1))
        if len(bounds) <= max_stages or k <= 1:
            break
        k = max(1, k * max_stages // len(bounds) - 1)
    times = [sum(problem.nodes[i].time for i in range(u, v + 1)) for u, v in bounds]
    while len(bounds) > max_stages:  # runs of non-recomputable nodes: merge the cheapest neighbours
        j = min(range(len(bounds) - 1), key=lambda j: times[j] + times[j + 1])
        bounds[j : j + 2] = [(bounds[j][0], bounds[j + 1][1])]
        times[j : j + 2] = [times[j] + times[j + 1]]
    return bounds


def _valley_cuts(problem: Problem, cut: list[int], radius: int) -> list[int]:
    """Positions i whose cut is the least within radius nodes on both sides, between two recomputable nodes.

    These are the boundaries of repeated blocks (a transformer layer ends where only the hidden state and
    the inputs shared by every layer cross), so a stage chain that cuts there can express one region per
    block. # node indices, ascending
    """
    import numpy as np

    n = problem.n
    if n < 2:
        return []
    rec = np.array([node.recomputable for node in problem.nodes], dtype=bool)
    eligible = rec[:-1] & rec[1:]
    val = np.where(eligible, np.array(cut[:-1], dtype=np.float64), np.inf)  # cut after node i, i < n - 1
    padded = np.concatenate([np.full(radius, np.inf), val, np.full(radius, np.inf)])
    window = np.lib.stride_tricks.sliding_window_view(padded, 2 * radius + 1).min(axis=1)
    return [int(i) for i in np.flatnonzero(eligible & (val <= window))]


def _module_cuts(problem: Problem, limit: int) -> list[int]:
    """Positions i after which the module path changes at the deepest level that gives at most limit cuts.

    With paths like 'model.layers.3.mlp', depth 3 cuts between decoder layers: the boundaries of the
    blocks that per-block checkpointing wraps. Empty when the nodes carry no module paths.
    """
    paths = [tuple(node.module.split(".")) if node.module else () for node in problem.nodes]
    if not any(paths):
        return []
    best: list[int] = []
    for depth in range(1, 1 + max(len(p) for p in paths)):
        cuts = [i for i in range(problem.n - 1) if paths[i][:depth] != paths[i + 1][:depth]]
        if len(cuts) > limit:
            break
        best = cuts
    return best


def _dp_stage_bounds(problem: Problem, max_stages: int) -> list[tuple[int, int]]:
    """`_stage_bounds` plus block boundaries: module-path changes (`_module_cuts`) and valley cuts.

    Stages are then merged, cheapest first, across the other boundaries until at most max_stages remain;
    module cuts take up to a quarter of the stages, valleys the rest of one half (least cut bytes first).
    """
    bounds = _stage_bounds(problem, max_stages)
    n = problem.n
    if n <= max_stages:
        return bounds
    cut = problem.cut_bytes()
    modules = _module_cuts(problem, max_stages // 4)
    valleys = [i for i in _valley_cuts(problem, cut, max(2, n // max_stages)) if i not in set(modules)]
    room = max(0, max_stages // 2 - len(modules))
    if len(valleys) > room:
        valleys = sorted(sorted(valleys, key=lambda i: (cut[i], i))[:room])
    valleys = sorted(set(valleys) | set(modules))
    ends = sorted({e for _s, e in bounds} | set(valleys))
    bounds, start = [], 0
    for e in ends:
        bounds.append((start, e))
        start = e + 1
    keep = set(valleys)
    times = [sum(problem.nodes[i].time for i in range(u, v + 1)) or (v - u + 1) * 1e-12 for u, v in bounds]
    recomputable = [all(problem.nodes[i].recomputable for i in range(u, v + 1)) for u, v in bounds]
    while len(bounds) > max_stages:
        js = [j for j in range(len(bounds) - 1) if bounds[j][1] not in keep]
        if not js:
            break
        # Cheapest pair first; a recomputable stage joins a non-recomputable one only when nothing else is left.
        j = min(js, key=lambda j: (recomputable[j] != recomputable[j + 1], times[j] + times[j + 1]))
        bounds[j : j + 2] = [(bounds[j][0], bounds[j + 1][1])]
        times[j : j + 2] = [times[j] + times[j + 1]]
        recomputable[j : j + 2] = [recomputable[j] and recomputable[j + 1]]
    return bounds


def coarsen(problem: Problem, max_nodes: int) -> tuple[Problem, list[tuple[int, int]]]:
    """Merge runs of nodes into at most about max_nodes groups; returns the coarse problem and the groups."""
    groups = _stage_bounds(problem, max_nodes)
    if len(groups) == problem.n:
        return problem, groups
    group_of = [0] * problem.n
    for g, (u, v) in enumerate(groups):
        for i in range(u, v + 1):
            group_of[i] = g
    nodes = problem.nodes
    readers_of: list[set[int]] = [set() for _ in problem.storages]
    for i, node in enumerate(nodes):
        for t in node.reads:
            if group_of[problem.storages[t].producer] != group_of[i]:
                readers_of[t].add(group_of[i])
    # Storages that look the same at group level are merged (bytes added): the model cannot tell them apart.
    merged: dict[tuple, int] = {}
    for t, st in enumerate(problem.storages):
        key = (
            group_of[st.producer],
            group_of[st.last_use],
            tuple(sorted({group_of[k] for k in st.saved_by})),
            st.is_output,
            tuple(sorted(readers_of[t])),
        )
        merged[key] = merged.get(key, 0) + st.nbytes
    storages, reads = [], [set() for _ in groups]
    for (p, last, saved, is_output, readers), nbytes in merged.items():
        for g in readers:
            reads[g].add(len(storages))
        storages.append(Storage(producer=p, nbytes=nbytes, last_use=last, saved_by=saved, is_output=is_output))
    coarse = []
    for g, (u, v) in enumerate(groups):
        members = range(u, v + 1)
        inputs = sorted({group_of[j] for i in members for j in nodes[i].inputs if group_of[j] != g})
        out_grads = sum(nodes[i].grad_bytes for i in members)
        coarse.append(
            Node(
                name=f"group{g}",
                time=sum(problem.region_time(i) for i in members),
                temp_bytes=max(nodes[i].temp_bytes for i in members),
                grad_bytes=out_grads,
                backward_temp_bytes=max(nodes[i].backward_temp_bytes for i in members),
                param_grad_bytes=sum(nodes[i].param_grad_bytes for i in members),
                inputs=tuple(inputs),
                reads=tuple(sorted(reads[g])),
                recomputable=all(nodes[i].recomputable for i in members),
            )
        )
    return (
        Problem(
            nodes=tuple(coarse),
            storages=tuple(storages),
            param_bytes=problem.param_bytes,
            input_bytes=problem.input_bytes,
            optimizer_bytes=problem.optimizer_bytes,
            name=problem.name,
            region_overhead_s=problem.region_overhead_s,
        ),
        groups,
    )

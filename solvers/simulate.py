"""Replay the forward and backward of a plan over a Problem: predicted peak and recompute time.

The model is that of non-reentrant `torch.utils.checkpoint` with early stop:

* A node's saved storages are kept only when the node runs in the context
  that owns it: the plain forward for nodes outside every region, the
  recompute of region R for nodes whose innermost region is R.
* A region keeps its inputs (storages made before it and read inside it)
  from where its checkpoint call runs until its backward is done; a nested
  region's inputs are kept only in its parent's recompute.
* When backward reaches the highest node of R that saved anything, R re-runs
  its forward up to the last node that saves something in R's context, and
  its saved storages stay until the backward of their last saving node.
* A region that draws random numbers (`rng_state_bytes`) holds the generator state from its
  checkpoint call to its backward, and a second one while its recompute runs.
* Activation gradients live from the backward of their first consumer to
  the backward of their producer; parameter gradients stay once made.
* Selective regions (`saved` nodes inside a region without nested regions;
  `create_selective_checkpoint_contexts` with MUST_SAVE for those nodes):
  a saved node's outputs are cached in the forward and stay until the
  region's recompute has used them and their last saving node's backward
  is done; the recompute takes them from the cache instead of re-running
  the node, and re-runs every other node up to the region's stop.
* Each checkpoint call costs `problem.region_overhead_s` per step, every
  op of a kept node (the only ops that run under a selective policy; one
  more for the policy's mode) costs `problem.op_overhead_s` in the forward
  and again in the recompute, and every tensor a recomputed node saves costs
  `problem.saved_overhead_s` (the region's pack and unpack hooks): all are
  added to the recompute time.

This module is the one source of the figures that solvers optimise and
reports print.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .problem import Problem, ProblemError

__all__ = ["SimResult", "simulate", "normalize_regions", "normalize_saved", "region_parents"]

CATEGORIES = (
    "parameters",
    "inputs",
    "optimizer",
    "param_grads",
    "activations",
    "recomputed",
    "act_grads",
    "temporaries",
)


@dataclass(frozen=True)
class SimResult:
    peak_bytes: int
    """Predicted peak memory of the step, fixed memory included."""
    recompute_time: float
    """Predicted extra seconds per step: forward work re-run during backward, plus the checkpoint
    calls' fixed cost and the selective-policy dispatch (`call_time`)."""
    peak_phase: str
    """'forward', 'recompute' or 'backward': where the peak happens."""
    peak_node: int
    """Node index being run at the peak (-1 when the graph is empty)."""
    breakdown: dict[str, int]
    """Bytes per category at the peak (see CATEGORIES); they sum to peak_bytes."""
    timeline: list[tuple[str, int, int]] = field(default_factory=list)
    """(phase, node, bytes) after every event, when asked for."""
    call_time: float = 0.0
    """The part of recompute_time that is checkpoint-call and policy-dispatch cost. # seconds"""
    hook_time: float = 0.0
    """The part of recompute_time that is the regions' saved-tensor hooks. # seconds"""


def normalize_regions(problem: Problem, regions) -> tuple[tuple[int, int], ...]:
    """Sort regions, check bounds, recomputability and proper nesting."""
    out = sorted({(int(s), int(e)) for s, e in regions}, key=lambda r: (r[0], -r[1]))
    stack: list[tuple[int, int]] = []
    for s, e in out:
        if not 0 <= s <= e < problem.n:
            raise ProblemError(f"region ({s}, {e}) is outside the {problem.n} nodes")
        for i in range(s, e + 1):
            if not problem.nodes[i].recomputable:
                raise ProblemError(f"region ({s}, {e}) contains node {problem.nodes[i].name!r}, which must not be recomputed")
        while stack and stack[-1][1] < s:
            stack.pop()
        if stack and e > stack[-1][1]:
            raise ProblemError(f"regions {stack[-1]} and ({s}, {e}) overlap without nesting")
        stack.append((s, e))
    return tuple(out)


def normalize_saved(problem: Problem, regions: tuple[tuple[int, int], ...], saved) -> tuple[int, ...]:
    """Sorted saved nodes; each must be saveable and inside a region that neither nests nor is nested."""
    out = tuple(sorted({int(i) for i in saved}))
    if not out:
        return out
    parents = region_parents(regions)
    flat = [not (parents[r] >= 0 or any(p == r for p in parents)) for r in range(len(regions))]
    for i in out:
        where = [r for r, (s, e) in enumerate(regions) if s <= i <= e]
        if not where:
            raise ProblemError(f"saved: node {i} is not inside a region")
        if not flat[where[-1]]:
            raise ProblemError(f"saved: node {i} is in a nested region; selective regions do not nest")
        if not problem.nodes[i].saveable:
            raise ProblemError(f"saved: node {problem.nodes[i].name!r} may not be kept by a selective region")
    return out


def call_time(problem: Problem, regions: tuple[tuple[int, int], ...], saved: tuple[int, ...], stops: list[int]) -> float:
    """Checkpoint-call and selective-dispatch seconds of a plan (stops: last recomputed node per region).

    Only a kept node runs under the selective policy: its aten ops, plus one for entering and leaving
    the policy's mode, in the forward and, when the recompute reaches it, in the recompute."""
    total = problem.region_overhead_s * len(regions)
    if saved and problem.op_overhead_s:
        for (s, e), stop in zip(regions, stops):
            for i in saved:
                if s <= i <= e:
                    total += problem.op_overhead_s * (problem.nodes[i].dispatch_ops + 1) * (2 if i <= stop else 1)
    return total


def region_parents(regions: tuple[tuple[int, int], ...]) -> list[int]:
    """parents[r]: index of the innermost region containing region r, or -1."""
    parents, stack = [], []
    for r, (s, _e) in enumerate(regions):
        while stack and regions[stack[-1]][1] < s:
            stack.pop()
        parents.append(stack[-1] if stack else -1)
        stack.append(r)
    return parents


def simulate(problem: Problem, regions=(), *, saved=(), timeline: bool = False) -> SimResult:
    """Predict the peak memory and the recompute time of one training step."""
    regions = normalize_regions(problem, regions)
    saved = normalize_saved(problem, regions, saved)
    is_saved = [False] * problem.n
    for i in saved:
        is_saved[i] = True
    n, storages, nodes = problem.n, problem.storages, problem.nodes
    parents = region_parents(regions)
    inner = [-1] * n  # innermost region of each node; regions sorted outer-first
    for r, (s, e) in enumerate(regions):
        for i in range(s, e + 1):
            inner[i] = r
    produced: list[list[int]] = [[] for _ in range(n)]
    for t, st in enumerate(storages):
        produced[st.producer].append(t)
    saves = [False] * n
    for st in storages:
        for k in st.saved_by:
            saves[k] = True
    # Storages each region keeps as its inputs; per storage, the regions that keep it.
    input_of: list[list[int]] = [[] for _ in storages]
    for r, (s, e) in enumerate(regions):
        seen = set()
        for i in range(s, e + 1):
            for t in nodes[i].reads:
                if storages[t].producer < s and t not in seen:
                    seen.add(t)
                    input_of[t].append(r)
    children: list[list[int]] = [[] for _ in regions]
    for r, p in enumerate(parents):
        if p >= 0:
            children[p].append(r)

    def release_step(t: int, ctx: int) -> int | None:
        """Backward step after which storage t, made in context ctx, is freed; None if not kept."""
        steps = [k for k in storages[t].saved_by if inner[k] == ctx]
        steps += [regions[r][0] for r in input_of[t] if parents[r] == ctx]
        return min(steps) if steps else None

    fixed = {
        "parameters": problem.param_bytes,
        "inputs": problem.input_bytes,
        "optimizer": problem.optimizer_bytes,
    }
    live = dict.fromkeys(CATEGORIES, 0)
    live.update(fixed)
    best = {"bytes": -1, "phase": "forward", "node": -1, "breakdown": dict(live)}
    events: list[tuple[str, int, int]] = []

    def observe(phase: str, node: int, extra: dict[str, int] | None = None) -> None:
        snap = dict(live)
        if extra:
            for key, v in extra.items():
                snap[key] += v
        total = sum(snap.values())
        if total > best["bytes"]:
            best.update(bytes=total, phase=phase, node=node, breakdown=snap)
        if timeline:
            events.append((phase, node, total))

    release_at: list[list[tuple[int, str]]] = [[] for _ in range(n)]
    # A region that draws random numbers saves the generator state when its forward starts (in
    # its parent's context) and keeps it until its backward is done (bytes, keyed by start, ctx).
    # Its recompute forks the generator (`torch.random.fork_rng`): one more state, held while it runs.
    rng_at: dict[tuple[int, int], int] = {}
    rng_of = [max(nodes[i].rng_state_bytes for i in range(s, e + 1)) for s, e in regions]
    for r, (s, _e) in enumerate(regions):
        if rng_of[r]:
            rng_at[(s, parents[r])] = rng_at.get((s, parents[r]), 0) + rng_of[r]

    def forward_pass(lo: int, hi: int, ctx: int, phase: str, category: str) -> None:
        """Run nodes lo..hi in context ctx; kept storages are queued for their backward release."""
        free_at: list[list[int]] = [[] for _ in range(hi - lo + 1)]
        for j in range(lo, hi + 1):
            state = rng_at.get((j, ctx), 0)
            if state:
                live[category] += state
                release_at[j].append((state, category))
            for t in produced[j]:
                st = storages[t]
                if is_saved[j] and ctx >= 0:
                    continue  # taken from the selective cache, held since the forward
                live[category] += st.nbytes
                keep = release_step(t, ctx)
                if is_saved[j]:
                    keep = cached_release[t]
                if ctx == -1 and st.is_output:
                    continue  # alive for the whole step
                if keep is not None:
                    release_at[keep].append((st.nbytes, category))
                else:
                    free_at[min(st.last_use, hi) - lo].append(st.nbytes)
            observe(phase, j, {"temporaries": nodes[j].temp_bytes})
            if free_at[j - lo]:
                live[category] -= sum(free_at[j - lo])
                observe(phase, j)

    # Which regions recompute at which backward step, and how far.
    trigger: dict[int, list[int]] = {}
    has_inputs = {r for regs in input_of for r in regs}
    stops: list[int] = []
    for r, (s, e) in enumerate(regions):
        savers = [k for k in range(s, e + 1) if saves[k]]
        own = [k for k in range(s, e + 1) if saves[k] and inner[k] == r]
        own += [regions[c][0] - 1 for c in children[r] if c in has_inputs]
        stop = max(own) if own else s - 1
        stops.append(stop)
        if savers and stop >= s:
            trigger.setdefault(max(savers), []).append(r)

    def trigger_of(r: int) -> list[int]:
        return [k for k, rs in trigger.items() if r in rs] or [regions[r][0]]

    # A saved node's outputs: cached from the forward until the region's recompute has taken them and
    # their saving nodes' backward is done (or, never taken, until the region's backward ends).
    cached_release: dict[int, int] = {}
    for t, st in enumerate(storages):
        p = st.producer
        if not is_saved[p]:
            continue
        r = inner[p]
        normal = release_step(t, -1)
        steps = [normal] if normal is not None else []
        if stops[r] >= p:
            steps.append(max(trigger_of(r)))
            inside = release_step(t, r)
            if inside is not None:
                steps.append(inside)
        else:
            steps.append(regions[r][0])
        cached_release[t] = min(steps)  # backward runs from n - 1 down: the smallest step is the latest

    if n:
        forward_pass(0, n - 1, -1, "forward", "activations")

    recompute_time = hook_time = 0.0
    hook = problem.saved_overhead_s
    grad_live = [False] * n
    for k in range(n - 1, -1, -1):
        for r in sorted(trigger.get(k, ()), key=lambda r: regions[r][0] - regions[r][1]):
            s = regions[r][0]
            hooks = hook * sum(nodes[i].saved_tensors for i in range(s, stops[r] + 1))
            hook_time += hooks
            recompute_time += hooks + sum(nodes[i].time for i in range(s, stops[r] + 1) if not is_saved[i])
            live["recomputed"] += rng_of[r]
            forward_pass(s, stops[r], r, "recompute", "recomputed")
            live["recomputed"] -= rng_of[r]
        node = nodes[k]
        extra = 0
        for j in set(node.inputs):
            if nodes[j].grad_bytes and not grad_live[j]:
                grad_live[j] = True
                extra += nodes[j].grad_bytes
        live["act_grads"] += extra
        live["param_grads"] += node.param_grad_bytes
        observe("backward", k, {"temporaries": node.backward_temp_bytes} if node.backward_temp_bytes else None)
        if grad_live[k]:
            live["act_grads"] -= node.grad_bytes
            grad_live[k] = False
        for nbytes, category in release_at[k]:
            live[category] -= nbytes
        if release_at[k]:
            observe("backward", k)

    calls = call_time(problem, regions, saved, stops)
    return SimResult(
        peak_bytes=max(best["bytes"], sum(fixed.values())),
        recompute_time=recompute_time + calls,
        call_time=calls,
        hook_time=hook_time,
        peak_phase=best["phase"],
        peak_node=best["node"],
        breakdown=best["breakdown"],
        timeline=events,
    )

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
* Activation gradients live from the backward of their first consumer to
  the backward of their producer; parameter gradients stay once made.

This module is the one source of the figures that solvers optimise and
reports print.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .problem import Problem, ProblemError

__all__ = ["SimResult", "simulate", "normalize_regions", "region_parents"]

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
    """Seconds of forward work re-run during backward."""
    peak_phase: str
    """'forward', 'recompute' or 'backward': where the peak happens."""
    peak_node: int
    """Node index being run at the peak (-1 when the graph is empty)."""
    breakdown: dict[str, int]
    """Bytes per category at the peak (see CATEGORIES); they sum to peak_bytes."""
    timeline: list[tuple[str, int, int]] = field(default_factory=list)
    """(phase, node, bytes) after every event, when asked for."""


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


def region_parents(regions: tuple[tuple[int, int], ...]) -> list[int]:
    """parents[r]: index of the innermost region containing region r, or -1."""
    parents, stack = [], []
    for r, (s, _e) in enumerate(regions):
        while stack and regions[stack[-1]][1] < s:
            stack.pop()
        parents.append(stack[-1] if stack else -1)
        stack.append(r)
    return parents


def simulate(problem: Problem, regions=(), *, timeline: bool = False) -> SimResult:
    """Predict the peak memory and the recompute time of one training step."""
    regions = normalize_regions(problem, regions)
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
    rng_at: dict[tuple[int, int], int] = {}
    for r, (s, e) in enumerate(regions):
        state = max(nodes[i].rng_state_bytes for i in range(s, e + 1))
        if state:
            rng_at[(s, parents[r])] = rng_at.get((s, parents[r]), 0) + state

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
                live[category] += st.nbytes
                keep = release_step(t, ctx)
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

    if n:
        forward_pass(0, n - 1, -1, "forward", "activations")

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

    recompute_time = 0.0
    grad_live = [False] * n
    for k in range(n - 1, -1, -1):
        for r in sorted(trigger.get(k, ()), key=lambda r: regions[r][0] - regions[r][1]):
            s = regions[r][0]
            recompute_time += sum(nodes[i].time for i in range(s, stops[r] + 1))
            forward_pass(s, stops[r], r, "recompute", "recomputed")
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

    return SimResult(
        peak_bytes=max(best["bytes"], sum(fixed.values())),
        recompute_time=recompute_time,
        peak_phase=best["phase"],
        peak_node=best["node"],
        breakdown=best["breakdown"],
        timeline=events,
    )

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
  checkpoint call in the forward (nested or not) to its backward, and a second one while its
  recompute runs; a recompute that runs the start of a region nested in it calls that checkpoint
  again, which holds one more state until the recompute ends.
* Activation gradients live from the backward of their first consumer to
  the backward of their producer; parameter gradients stay once made.
* Selective regions (`saved` nodes inside a region without nested regions;
  `create_selective_checkpoint_contexts` with MUST_SAVE for those nodes):
  a saved node's outputs are cached in the forward and stay until the
  region's recompute has used them and their last saving node's backward
  is done; the recompute takes them from the cache instead of re-running
  the node, and re-runs every other node up to the region's stop.
* Offloaded storages (`offloaded`, see `solvers.copies`): a kept storage copied to pinned host
  memory leaves the device after its last forward reader once its copy is done, comes back at its
  prefetch and is freed at its usual release step; the copy time no compute hides is added to the
  recompute time (`offload_time`).
* Autocast's cached casts of parameters (`problem.casts`) are fixed memory, unless
  `problem.casts_cleared`: then the first recompute empties the cache (see `solvers.casts`).
* Each checkpoint call costs `problem.region_overhead_s` per step, every
  op of a kept node (the only ops that run under a selective policy; one
  more for the policy's mode) costs `problem.op_overhead_s` in the forward
  and again in the recompute, and every tensor a recomputed node saves costs
  `problem.saved_overhead_s` (the region's pack and unpack hooks): all are
  added to the recompute time.

This module is the one source of the figures that solvers optimise and
reports print. `replay` walks the events one by one: it is the reference, and
it records the timeline when one is asked for. `simulate` gets the same
figures, to the byte and to the last bit of the seconds, from a sweep over
live intervals (`figures.py`, with what both return), tens of times faster on
graphs of thousands of nodes.
"""

from __future__ import annotations

from .casts import held_until
from .casts import remade as casts_remade
from .copies import normalize_offloaded, timing
from .figures import CATEGORIES, LAYOUTS_KEPT, SimResult, call_time, layout_of
from .plans import normalize_regions, normalize_saved, region_parents
from .problem import Problem

__all__ = ["SimResult", "simulate", "replay", "layout_of", "LAYOUTS_KEPT", "CATEGORIES", "call_time"]


def simulate(problem: Problem, regions=(), *, saved=(), offloaded=(), timeline: bool = False) -> SimResult:
    """Predict the peak memory and the recompute time of one training step.

    The figures are `replay`'s; with `timeline`, the replay runs and records the bytes after every event.
    `offloaded`: storages the plan copies to pinned host memory (`copies.offloadable`)."""
    regions = normalize_regions(problem, regions)
    saved = normalize_saved(problem, regions, saved)
    if timeline or not problem.n or not problem.arrays.nonnegative:
        return replay(problem, regions, saved=saved, offloaded=offloaded, timeline=timeline)
    if not offloaded:
        return layout_of(problem, regions).figures(problem, saved)
    return layout_of(problem, regions).figures(problem, saved, _offload_timing(problem, regions, saved, offloaded))


def _offload_timing(problem: Problem, regions, saved, offloaded):
    """The checked offloads' copy schedule (`copies.timing`), None when there are none."""

    offloaded, uses = normalize_offloaded(problem, regions, saved, offloaded)
    return timing(problem, regions, saved, uses) if offloaded else None


def replay(problem: Problem, regions=(), *, saved=(), offloaded=(), timeline: bool = False) -> SimResult:
    """`simulate`, event by event: the reference the interval sweep is checked against."""
    regions = normalize_regions(problem, regions)
    saved = normalize_saved(problem, regions, saved)
    off = _offload_timing(problem, regions, saved, offloaded) if offloaded else None
    fetch_at: dict[int, list[int]] = {}
    if off is not None:
        for t, q in off.fetch.items():
            fetch_at.setdefault(q, []).append(t)
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
    # Storages each region keeps as its inputs; per storage, the regions that keep it. A region none of
    # whose nodes packs a tensor (an activation, a parameter or a buffer) keeps nothing: its checkpoint's
    # inputs are held by what it packs for backward, and with nothing packed they go after the forward.
    input_of: list[list[int]] = [[] for _ in storages]
    packer = problem.arrays.prev_packer
    for r, (s, e) in enumerate(regions):
        if packer[e] < s:
            continue
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

    casts = problem.casts if problem.casts_cleared else ()
    fixed = {
        "parameters": problem.param_bytes - sum(cast.nbytes for cast in casts),
        "inputs": problem.input_bytes,
        "optimizer": problem.optimizer_bytes,
    }
    live = dict.fromkeys(CATEGORIES, 0)
    live.update(fixed)
    live["parameters"] = problem.param_bytes  # the casts are made in the forward, held by the cache
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
    # A region that draws random numbers saves the generator state when its checkpoint call runs in the
    # forward, nested or not, and keeps it until its backward is done (bytes, keyed by start).
    # Its recompute forks the generator (`torch.random.fork_rng`): one more state, held while it runs.
    # A recompute calls the checkpoints of the regions inside it again: each saves one more state, held by
    # that call's graph until the recompute ends (`transient`, keyed by (start, context)).
    rng_at: dict[int, int] = {}
    transient: dict[tuple[int, int], int] = {}
    rng_of = [max(nodes[i].rng_state_bytes for i in range(s, e + 1)) for s, e in regions]
    for r, (s, _e) in enumerate(regions):
        if rng_of[r]:
            rng_at[s] = rng_at.get(s, 0) + rng_of[r]
            q = parents[r]
            while q >= 0:
                transient[(s, q)] = transient.get((s, q), 0) + rng_of[r]
                q = parents[q]

    def forward_pass(lo: int, hi: int, ctx: int, phase: str, category: str, casts_made=None) -> int:
        """Run nodes lo..hi in context ctx; kept storages are queued for their backward release.
        `casts_made`: node -> (bytes, release step or None) of the casts it makes again. Returns the
        bytes freed when the pass ends: those casts held only by the cache, and the generator states
        of the nested checkpoint calls it made again."""
        free_at: list[list[int]] = [[] for _ in range(hi - lo + 1)]
        cached = 0
        for j in range(lo, hi + 1):
            state = rng_at.get(j, 0) if ctx == -1 else 0
            if state:
                live[category] += state
                release_at[j].append((state, category))
            state = transient.get((j, ctx), 0)
            live[category] += state
            cached += state
            for nbytes, keep in (casts_made or {}).get(j, ()):
                live[category] += nbytes
                if keep is None:
                    cached += nbytes
                else:
                    release_at[keep].append((nbytes, category))
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
                if ctx == -1 and off is not None and t in off.free_after:
                    free_at[off.free_after[t] - lo].append(st.nbytes)  # back at its prefetch (below)
                elif keep is not None:
                    release_at[keep].append((st.nbytes, category))
                else:
                    free_at[min(st.last_use, hi) - lo].append(st.nbytes)
            observe(phase, j, {"temporaries": nodes[j].temp_bytes})
            if free_at[j - lo]:
                live[category] -= sum(free_at[j - lo])
                observe(phase, j)
        return cached

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
    cache_emptied = not casts
    for k in range(n - 1, -1, -1):
        for t in fetch_at.get(k, ()):  # prefetched at the start of the step, before its recomputes
            live["activations"] += storages[t].nbytes
            release_at[off.release[t]].append((storages[t].nbytes, "activations"))
        for r in sorted(trigger.get(k, ()), key=lambda r: regions[r][0] - regions[r][1]):
            s = regions[r][0]
            hooks = hook * sum(nodes[i].saved_tensors for i in range(s, stops[r] + 1))
            hook_time += hooks
            recompute_time += hooks + sum(nodes[i].time for i in range(s, stops[r] + 1) if not is_saved[i])
            live["recomputed"] += rng_of[r]
            made = casts_remade(casts, inner, r, s, stops[r]) if cache_emptied and casts else None
            cached = forward_pass(s, stops[r], r, "recompute", "recomputed", made)
            live["recomputed"] -= rng_of[r] + cached
            if not cache_emptied:  # this recompute found the forward's casts cached, then emptied the cache
                cache_emptied = True
                for cast in casts:
                    until = held_until(cast, inner, r, s, stops[r], k)
                    if until is None:
                        live["parameters"] -= cast.nbytes
                    else:
                        release_at[until].append((cast.nbytes, "parameters"))
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
    copies = off.exposed_s if off is not None else 0.0
    return SimResult(
        peak_bytes=max(best["bytes"], sum(fixed.values())),
        recompute_time=recompute_time + calls + copies,
        call_time=calls,
        hook_time=hook_time,
        offload_time=copies,
        host_bytes=sum(storages[t].nbytes for t in off.fetch) if off is not None else 0,
        peak_phase=best["phase"],
        peak_node=best["node"],
        breakdown=best["breakdown"],
        timeline=events,
    )

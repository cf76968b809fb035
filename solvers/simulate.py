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
    return _Replay(problem, regions, saved, off, timeline).run()


class _Replay:
    """One replay's state: the plan's structure (which region owns each node, what each region keeps),
    the live bytes per category, and the releases queued for each backward step."""

    def __init__(self, problem: Problem, regions, saved, off, timeline: bool) -> None:
        self.problem, self.regions, self.saved, self.off, self.timeline = problem, regions, saved, off, timeline
        n, storages, nodes = problem.n, problem.storages, problem.nodes
        self.fetch_at: dict[int, list[int]] = {}
        if off is not None:
            for t, q in off.fetch.items():
                self.fetch_at.setdefault(q, []).append(t)
        self.is_saved = [False] * n
        for i in saved:
            self.is_saved[i] = True
        self.parents = region_parents(regions)
        self.inner = [-1] * n  # innermost region of each node; regions sorted outer-first
        for r, (s, e) in enumerate(regions):
            for i in range(s, e + 1):
                self.inner[i] = r
        self.produced: list[list[int]] = [[] for _ in range(n)]
        for t, st in enumerate(storages):
            self.produced[st.producer].append(t)
        self.saves = [False] * n
        for st in storages:
            for k in st.saved_by:
                self.saves[k] = True
        self._inputs()
        self.casts = problem.casts if problem.casts_cleared else ()
        self.fixed = {
            "parameters": problem.param_bytes - sum(cast.nbytes for cast in self.casts),
            "inputs": problem.input_bytes,
            "optimizer": problem.optimizer_bytes,
        }
        self.live = dict.fromkeys(CATEGORIES, 0)
        self.live.update(self.fixed)
        self.live["parameters"] = problem.param_bytes  # the casts are made in the forward, held by the cache
        self.best = {"bytes": -1, "phase": "forward", "node": -1, "breakdown": dict(self.live)}
        self.events: list[tuple[str, int, int]] = []
        self.release_at: list[list[tuple[int, str]]] = [[] for _ in range(n)]
        self.rng_of = [max(nodes[i].rng_state_bytes for i in range(s, e + 1)) for s, e in regions]
        self._rng_states()
        self._triggers()
        self._cached_releases()

    def _inputs(self) -> None:
        """Storages each region keeps as its inputs; per storage, the regions that keep it. A region none of
        whose nodes packs a tensor (an activation, a parameter or a buffer) keeps nothing: its checkpoint's
        inputs are held by what it packs for backward, and with nothing packed they go after the forward."""
        storages, nodes, regions = self.problem.storages, self.problem.nodes, self.regions
        self.input_of: list[list[int]] = [[] for _ in storages]
        packer = self.problem.arrays.prev_packer
        for r, (s, e) in enumerate(regions):
            if packer[e] < s:
                continue
            seen = set()
            for i in range(s, e + 1):
                for t in nodes[i].reads:
                    if storages[t].producer < s and t not in seen:
                        seen.add(t)
                        self.input_of[t].append(r)
        self.children: list[list[int]] = [[] for _ in regions]
        for r, p in enumerate(self.parents):
            if p >= 0:
                self.children[p].append(r)

    def _rng_states(self) -> None:
        """A region that draws random numbers saves the generator state when its checkpoint call runs in the
        forward, nested or not, and keeps it until its backward is done (bytes, keyed by start). Its
        recompute forks the generator (`torch.random.fork_rng`): one more state, held while it runs. A
        recompute calls the checkpoints of the regions inside it again: each saves one more state, held by
        that call's graph until the recompute ends (`transient`, keyed by (start, context))."""
        self.rng_at: dict[int, int] = {}
        self.transient: dict[tuple[int, int], int] = {}
        for r, (s, _e) in enumerate(self.regions):
            if self.rng_of[r]:
                self.rng_at[s] = self.rng_at.get(s, 0) + self.rng_of[r]
                q = self.parents[r]
                while q >= 0:
                    self.transient[(s, q)] = self.transient.get((s, q), 0) + self.rng_of[r]
                    q = self.parents[q]

    def _triggers(self) -> None:
        """Which regions recompute at which backward step (`trigger`), and how far (`stops`)."""
        regions, saves, inner = self.regions, self.saves, self.inner
        self.trigger: dict[int, list[int]] = {}
        has_inputs = {r for regs in self.input_of for r in regs}
        self.stops: list[int] = []
        for r, (s, e) in enumerate(regions):
            savers = [k for k in range(s, e + 1) if saves[k]]
            own = [k for k in range(s, e + 1) if saves[k] and inner[k] == r]
            own += [regions[c][0] - 1 for c in self.children[r] if c in has_inputs]
            stop = max(own) if own else s - 1
            self.stops.append(stop)
            if savers and stop >= s:
                self.trigger.setdefault(max(savers), []).append(r)

    def _trigger_of(self, r: int) -> list[int]:
        return [k for k, rs in self.trigger.items() if r in rs] or [self.regions[r][0]]

    def _cached_releases(self) -> None:
        """A saved node's outputs: cached from the forward until the region's recompute has taken them and
        their saving nodes' backward is done (or, never taken, until the region's backward ends)."""
        self.cached_release: dict[int, int] = {}
        for t, st in enumerate(self.problem.storages):
            p = st.producer
            if not self.is_saved[p]:
                continue
            r = self.inner[p]
            normal = self._release_step(t, -1)
            steps = [normal] if normal is not None else []
            if self.stops[r] >= p:
                steps.append(max(self._trigger_of(r)))
                inside = self._release_step(t, r)
                if inside is not None:
                    steps.append(inside)
            else:
                steps.append(self.regions[r][0])
            self.cached_release[t] = min(steps)  # backward runs from n - 1 down: the smallest step is the latest

    def _release_step(self, t: int, ctx: int) -> int | None:
        """Backward step after which storage t, made in context ctx, is freed; None if not kept."""
        steps = [k for k in self.problem.storages[t].saved_by if self.inner[k] == ctx]
        steps += [self.regions[r][0] for r in self.input_of[t] if self.parents[r] == ctx]
        return min(steps) if steps else None

    def _observe(self, phase: str, node: int, extra: dict[str, int] | None = None) -> None:
        snap = dict(self.live)
        if extra:
            for key, v in extra.items():
                snap[key] += v
        total = sum(snap.values())
        if total > self.best["bytes"]:
            self.best.update(bytes=total, phase=phase, node=node, breakdown=snap)
        if self.timeline:
            self.events.append((phase, node, total))

    def _forward_pass(self, lo: int, hi: int, ctx: int, phase: str, category: str, casts_made=None) -> int:
        """Run nodes lo..hi in context ctx; kept storages are queued for their backward release.
        `casts_made`: node -> (bytes, release step or None) of the casts it makes again. Returns the
        bytes freed when the pass ends: those casts held only by the cache, and the generator states
        of the nested checkpoint calls it made again."""
        live, release_at, off, storages = self.live, self.release_at, self.off, self.problem.storages
        free_at: list[list[int]] = [[] for _ in range(hi - lo + 1)]
        cached = 0
        for j in range(lo, hi + 1):
            state = self.rng_at.get(j, 0) if ctx == -1 else 0
            if state:
                live[category] += state
                release_at[j].append((state, category))
            state = self.transient.get((j, ctx), 0)
            live[category] += state
            cached += state
            for nbytes, keep in (casts_made or {}).get(j, ()):
                live[category] += nbytes
                if keep is None:
                    cached += nbytes
                else:
                    release_at[keep].append((nbytes, category))
            for t in self.produced[j]:
                st = storages[t]
                if self.is_saved[j] and ctx >= 0:
                    continue  # taken from the selective cache, held since the forward
                live[category] += st.nbytes
                keep = self._release_step(t, ctx)
                if self.is_saved[j]:
                    keep = self.cached_release[t]
                if ctx == -1 and st.is_output:
                    continue  # alive for the whole step
                if ctx == -1 and off is not None and t in off.free_after:
                    free_at[off.free_after[t] - lo].append(st.nbytes)  # back at its prefetch (below)
                elif keep is not None:
                    release_at[keep].append((st.nbytes, category))
                else:
                    free_at[min(st.last_use, hi) - lo].append(st.nbytes)
            self._observe(phase, j, {"temporaries": self.problem.nodes[j].temp_bytes})
            if free_at[j - lo]:
                live[category] -= sum(free_at[j - lo])
                self._observe(phase, j)
        return cached

    def _recompute(self, k: int) -> None:
        """The recomputes backward step k triggers, innermost first; the first empties autocast's cache."""
        regions, nodes, casts, live = self.regions, self.problem.nodes, self.casts, self.live
        for r in sorted(self.trigger.get(k, ()), key=lambda r: regions[r][0] - regions[r][1]):
            s, stop = regions[r][0], self.stops[r]
            hooks = self.problem.saved_overhead_s * sum(nodes[i].saved_tensors for i in range(s, stop + 1))
            self.hook_time += hooks
            self.recompute_time += hooks + sum(nodes[i].time for i in range(s, stop + 1) if not self.is_saved[i])
            live["recomputed"] += self.rng_of[r]
            made = casts_remade(casts, self.inner, r, s, stop) if self.cache_emptied and casts else None
            cached = self._forward_pass(s, stop, r, "recompute", "recomputed", made)
            live["recomputed"] -= self.rng_of[r] + cached
            if not self.cache_emptied:  # this recompute found the forward's casts cached, then emptied the cache
                self.cache_emptied = True
                for cast in casts:
                    until = held_until(cast, self.inner, r, s, stop, k)
                    if until is None:
                        live["parameters"] -= cast.nbytes
                    else:
                        self.release_at[until].append((cast.nbytes, "parameters"))

    def _backward(self) -> None:
        """Backward steps n - 1 .. 0: fetches, recomputes, gradients made and freed, releases."""
        n, nodes, storages, live = self.problem.n, self.problem.nodes, self.problem.storages, self.live
        grad_live = [False] * n
        for k in range(n - 1, -1, -1):
            for t in self.fetch_at.get(k, ()):  # prefetched at the start of the step, before its recomputes
                live["activations"] += storages[t].nbytes
                self.release_at[self.off.release[t]].append((storages[t].nbytes, "activations"))
            self._recompute(k)
            node = nodes[k]
            extra = 0
            for j in set(node.inputs):
                if nodes[j].grad_bytes and not grad_live[j]:
                    grad_live[j] = True
                    extra += nodes[j].grad_bytes
            live["act_grads"] += extra
            live["param_grads"] += node.param_grad_bytes
            self._observe("backward", k, {"temporaries": node.backward_temp_bytes} if node.backward_temp_bytes else None)
            if grad_live[k]:
                live["act_grads"] -= node.grad_bytes
                grad_live[k] = False
            for nbytes, category in self.release_at[k]:
                live[category] -= nbytes
            if self.release_at[k]:
                self._observe("backward", k)

    def run(self) -> SimResult:
        problem, off, best = self.problem, self.off, self.best
        if problem.n:
            self._forward_pass(0, problem.n - 1, -1, "forward", "activations")
        self.recompute_time = self.hook_time = 0.0
        self.cache_emptied = not self.casts
        self._backward()
        calls = call_time(problem, self.regions, self.saved, self.stops)
        copies = off.exposed_s if off is not None else 0.0
        return SimResult(
            peak_bytes=max(best["bytes"], sum(self.fixed.values())),
            recompute_time=self.recompute_time + calls + copies,
            call_time=calls,
            hook_time=self.hook_time,
            offload_time=copies,
            host_bytes=sum(problem.storages[t].nbytes for t in off.fetch) if off is not None else 0,
            peak_phase=best["phase"],
            peak_node=best["node"],
            breakdown=best["breakdown"],
            timeline=self.events,
        )

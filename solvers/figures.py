"""The simulator's figures: what it returns (`SimResult`, its breakdown's `CATEGORIES`, and `call_time`, the
checkpoint-call and selective-dispatch seconds of a plan), and the interval sweep that `simulate` computes
them with: `replay`'s figures (`simulate.replay`), to the byte and to the last bit of the seconds, as prefix
sums over live intervals, tens of times faster on graphs of thousands of nodes.

Every byte the replay counts is live over one contiguous run of its observations, and an observation right
after a free never exceeds the one before it when no size is negative, so the peak is the largest prefix sum
over the observations that carry a node's temporaries (a node's forward, a node of a recompute, a backward
step). A Problem keeps the layouts of its last few region plans (`layout_of`), so searches over kept ops
re-sum only the kept nodes' own bytes.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import numpy as np

from .casts import intervals as cast_intervals
from .plans import region_parents
from .problem import Problem

__all__ = ["CATEGORIES", "SimResult", "call_time", "LAYOUTS_KEPT", "layout_of"]

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
    offload_time: float = 0.0
    """The part of recompute_time that is offload copies no compute hides (`copies.timing`). # seconds"""
    host_bytes: int = 0
    """Pinned host bytes the offloaded storages hold at the forward's end (all of them at once)."""


def call_time(problem: Problem, regions: tuple[tuple[int, int], ...], saved: tuple[int, ...], stops: list[int]) -> float:
    """Checkpoint-call and selective-dispatch seconds of a plan (stops: last recomputed node per region).

    Only a kept node runs under the selective policy: its aten ops, plus one for entering and leaving
    the policy's mode, in the forward and, when the recompute reaches it, in the recompute."""
    total = problem.region_overhead_s * len(regions)
    if saved and problem.op_overhead_s:
        for (s, e), stop in zip(regions, stops):
            for i in saved[bisect.bisect_left(saved, s) : bisect.bisect_right(saved, e)]:  # saved is sorted
                total += problem.op_overhead_s * (problem.nodes[i].dispatch_ops + 1) * (2 if i <= stop else 1)
    return total


def _ancestors(parents: np.ndarray, r: int) -> list[int]:
    """The regions enclosing region r, innermost first."""
    out = []
    r = int(parents[r])
    while r >= 0:
        out.append(r)
        r = int(parents[r])
    return out


def _ranges(starts, counts):
    """Concatenated aranges: starts[i] .. starts[i] + counts[i] - 1 for every i. # int64"""
    ends = np.cumsum(counts)
    return np.arange(int(ends[-1]) if len(ends) else 0, dtype=np.int64) + np.repeat(starts - (ends - counts), counts)


class _Least:
    """Least value per (storage, context) pair; context -1 is the forward, r >= 0 region r's recompute."""

    def __init__(self, t, ctx, val, contexts: int) -> None:
        self.width = contexts + 1
        key = t * self.width + ctx + 1
        order = np.lexsort((val, key))
        key, val = key[order], val[order]
        first = np.ones(len(key), dtype=bool)
        first[1:] = key[1:] != key[:-1]
        self.keys, self.vals = key[first], val[first]

    def __call__(self, t, ctx):
        """The least value of each (t, ctx) pair, -1 where there is none."""
        key = t * self.width + ctx + 1
        if not len(self.keys):
            return np.full(len(key), -1, dtype=np.int64)
        pos = np.minimum(np.searchsorted(self.keys, key), len(self.keys) - 1)
        return np.where(self.keys[pos] == key, self.vals[pos], -1)


LAYOUTS_KEPT = 4  # region plans whose layout a Problem keeps: searches over kept ops reuse one plan's


def layout_of(problem: Problem, regions: tuple[tuple[int, int], ...]) -> _Layout:
    """The layout of a normalised region plan, from the Problem's few most recent ones when it is there."""
    kept = problem.arrays.layouts
    found = kept.pop(regions, None) or _Layout(problem, regions)
    kept[regions] = found  # most recent last
    for old in list(kept)[:-LAYOUTS_KEPT]:
        kept.pop(old, None)
    return found


class _Layout:
    """`replay`'s figures as intervals of live bytes over its observations (see the module docstring), for
    one region plan and any kept nodes.

    Slots: the forward's nodes 0..n-1, then per backward step k = n-1..0 the nodes of the recomputes it
    triggers (outermost first) and the step itself. Categories: 0 activations, 1 recomputed, 2 act_grads,
    3 param_grads, 4 the forward's casts of parameters (where the cache empties, `solvers.casts`);
    temporaries are per slot. Kept nodes change only their own storages' intervals (they stay from the
    forward, and their region's recompute does not make them again), so the bytes live with none kept are
    summed once per plan."""

    def __init__(self, problem: Problem, regions: tuple[tuple[int, int], ...]) -> None:
        a = problem.arrays  # kept by neither: the arrays keep the layout
        self.regions = regions
        n, R, i64 = a.n, len(regions), np.int64
        par = np.array(region_parents(regions), dtype=i64)
        r_start = self.r_start = np.array([s for s, _ in regions], dtype=i64)
        r_end = np.array([e for _, e in regions], dtype=i64)
        inner = self.inner = np.full(n, -1, dtype=i64)  # innermost region of each node; regions come outer first
        for r, (s, e) in enumerate(regions):
            inner[s : e + 1] = r

        # Region inputs (storages made before a region and read inside it), and the backward step that
        # releases a storage made in a context: its first saver there, or the start of a child region it feeds.
        counts = a.read_ptr[r_end + 1] - a.read_ptr[r_start]
        idx = _ranges(a.read_ptr[r_start], counts)
        rid = np.repeat(np.arange(R, dtype=i64), counts)
        # a region whose nodes pack no tensor keeps no inputs (simulate.replay says why)
        outside = (a.read_producer[idx] < r_start[rid]) & (a.prev_packer[r_end] >= r_start)[rid]
        width = max(1, a.m)
        key = np.unique(rid[outside] * width + a.read_t[idx][outside])
        in_r, in_t = key // width, key % width
        has_inputs = np.zeros(R, dtype=bool)
        has_inputs[in_r] = True
        release = self.release = _Least(
            np.concatenate([a.saved_t, in_t]), np.concatenate([inner[a.saved_k], par[in_r]]),
            np.concatenate([a.saved_k, r_start[in_r]]), R,
        )

        # Each region's stop (its last node that saves in its context, or ends before a child with inputs)
        # and the step that triggers its recompute (its last saving node).
        stop = r_start - 1
        own = inner[a.savers]
        np.maximum.at(stop, own[own >= 0], a.savers[own >= 0])
        feeding = np.flatnonzero((par >= 0) & has_inputs)
        np.maximum.at(stop, par[feeding], r_start[feeding] - 1)
        last = a.prev_saver[r_end]
        triggered = (last >= r_start) & (stop >= r_start)
        trigger = self.trigger = np.where(triggered, last, r_start)
        passes = np.flatnonzero(triggered)
        passes = passes[np.lexsort((passes, r_start[passes] - r_end[passes], -trigger[passes]))]
        p_s, p_k, p_stop = r_start[passes], trigger[passes], stop[passes]
        self.p_s = p_s
        p_len = p_stop - p_s + 1
        per_step = np.zeros(n, dtype=i64)
        np.add.at(per_step, p_k, p_len)
        bslot = self.bslot = 2 * n - 1 - np.arange(n, dtype=i64) + np.cumsum(per_step[::-1])[::-1]  # step k's slot
        self.group_start = bslot - per_step  # slot of step k's first recompute node (its own when none)
        before = np.cumsum(p_len) - p_len
        first = np.searchsorted(-p_k, -p_k)  # the first pass of the same step
        p_base = self.p_base = bslot[p_k] - per_step[p_k] + before - before[first]  # slot of a pass's first node
        T = self.T = 2 * n + int(p_len.sum())
        self.stop, self.stops = stop, stop.tolist()
        self.spans = list(zip(p_s.tolist(), p_stop.tolist()))  # nodes each recompute runs, in the replay's order

        parts: list[tuple] = []  # (start slot, end slot (exclusive), bytes, category)
        keep = release(np.arange(a.m, dtype=i64), np.full(a.m, -1, dtype=i64))
        end = self.forward_end = np.where(keep >= 0, bslot[np.maximum(keep, 0)] + 1, a.last_use + 1)
        end[a.is_output] = T  # the graph's outputs stay for the whole step
        self.forward_keep = keep
        parts.append((a.producer, end, a.nbytes, 0))
        t = a.by_producer[_ranges(a.producer_ptr[p_s], a.producer_ptr[p_stop + 1] - a.producer_ptr[p_s])]
        q = np.repeat(np.arange(len(passes), dtype=i64), a.producer_ptr[p_stop + 1] - a.producer_ptr[p_s])
        p = a.producer[t]
        keep = release(t, passes[q])
        # A release at a step the backward has passed already (a child with no saver beyond the trigger)
        # never comes: the replay keeps those bytes to the end.
        end = np.where(keep < 0, p_base[q] + np.minimum(a.last_use[t], p_stop[q]) - p_s[q] + 1,
                       np.where(keep <= p_k[q], bslot[np.maximum(keep, 0)] + 1, T))
        start = p_base[q] + p - p_s[q]
        parts.append((start, end, a.nbytes[t], 1))
        # The recompute that makes a storage in its node's innermost region: what keeping the node spares.
        own = passes[q] == inner[p]
        self.rerun_start, self.rerun_end = np.full(a.m, -1, dtype=i64), np.zeros(a.m, dtype=i64)
        self.rerun_start[t[own]], self.rerun_end[t[own]] = start[own], end[own]
        if a.rng.any():
            rng = np.array([a.rng[s : e + 1].max() for s, e in regions], dtype=i64)
            drawn = np.flatnonzero(rng > 0)  # each holds its forward's state until its backward
            parts.append((r_start[drawn], bslot[r_start[drawn]] + 1, rng[drawn], 0))
            pos = np.full(R, -1, dtype=i64)
            pos[passes] = np.arange(len(passes))
            # A recompute that reaches the start of a region inside it (any depth) calls its checkpoint
            # again: one more state, until that recompute ends.
            pairs = [(d, pos[q]) for d in drawn.tolist() for q in _ancestors(par, d) if pos[q] >= 0]
            d, q = (np.array(v, dtype=i64) for v in zip(*pairs)) if pairs else (np.zeros(0, dtype=i64),) * 2
            reached = r_start[d] <= p_stop[q]
            d, q = d[reached], q[reached]
            parts.append((p_base[q] + r_start[d] - p_s[q], p_base[q] + p_len[q], rng[d], 1))
            forked = np.flatnonzero(rng[passes] > 0)
            parts.append((p_base[forked], p_base[forked] + p_len[forked], rng[passes][forked], 1))
        self.cleared_casts = 0  # cast bytes taken out of the fixed memory: where they live is in the parts
        if problem.casts_cleared and len(a.cast_bytes) and len(passes):
            self.cleared_casts = int(a.cast_bytes.sum())
            parts.extend(cast_intervals(a, inner, bslot, passes, p_s, p_stop, p_base, p_len))
        self.fixed = problem.fixed_bytes - self.cleared_casts
        """Bytes resident through the whole step under this plan: the problem's, less casts the cache lets go."""
        parts.append((bslot[a.grad_consumer], bslot[a.grad_nodes] + 1, a.grad_bytes, 2))
        parts.append((bslot[a.param_grad_nodes], np.full(len(a.param_grad_nodes), T, dtype=i64), a.param_grad_bytes, 3))

        self.starts, self.ends, self.sizes = (np.concatenate([part[f] for part in parts]) for f in range(3))
        self.cats = np.concatenate([np.full(len(part[0]), part[3], dtype=np.int8) for part in parts])
        self.delta = np.zeros(T + 1, dtype=i64)
        np.add.at(self.delta, self.starts, self.sizes)
        np.add.at(self.delta, self.ends, -self.sizes)
        temps = self.temps = np.zeros(T, dtype=i64)
        temps[:n] = a.temp
        temps[bslot] = a.backward_temp
        temps[_ranges(p_base, p_len)] = a.temp[_ranges(p_s, p_len)]
        self.live = np.cumsum(self.delta[:T]) + temps  # bytes at each slot with no node kept

    def kept_terms(self, problem: Problem, nodes: np.ndarray) -> _KeptTerms:
        """What keeping each of `nodes` (kept ops of flat regions, int64) changes in this plan's live bytes.

        A kept node's outputs stay from the forward until its region's recompute has taken them and their
        savers there are done, or (not taken) until the region's backward; the recompute does not make them
        again. Each storage's interval [p, plain_end) becomes [p, cached_end), and the rerun's interval
        [spared_start, spared_end) of its region's recompute goes."""
        a = problem.arrays
        lo = a.producer_ptr[nodes]
        counts = a.producer_ptr[nodes + 1] - lo
        t = a.by_producer[_ranges(lo, counts)]
        owner = np.repeat(np.arange(len(nodes), dtype=np.int64), counts)
        p, nbytes = a.producer[t], a.nbytes[t]
        r = self.inner[p]
        big = np.iinfo(np.int64).max
        reached = self.stop[r] >= p
        inside = self.release(t, r)
        normal = self.forward_keep[t]
        keep = np.minimum(
            np.minimum(np.where(normal >= 0, normal, big), np.where(reached & (inside >= 0), inside, big)),
            np.where(reached, self.trigger[r], self.r_start[r]),
        )
        cached_end = np.where(a.is_output[t], self.T, self.bslot[keep] + 1)
        rerun = self.rerun_start[t] >= 0
        return _KeptTerms(
            owner=owner, start=p, nbytes=nbytes, plain_end=self.forward_end[t], cached_end=cached_end,
            spared_owner=owner[rerun], spared_start=self.rerun_start[t][rerun], spared_end=self.rerun_end[t][rerun],
            spared=nbytes[rerun],
        )

    def delta_with(self, kept: _KeptTerms | None) -> np.ndarray:
        """Changes of the live bytes at each slot (their prefix sums are the live bytes, temporaries apart)
        with the kept nodes of `kept` (None: none kept). # bytes int64"""
        if kept is None:
            return self.delta
        delta = self.delta.copy()
        np.add.at(delta, kept.plain_end, kept.nbytes)  # [p, plain_end) becomes [p, cached_end)
        np.add.at(delta, kept.cached_end, -kept.nbytes)
        np.add.at(delta, kept.spared_start, -kept.spared)
        np.add.at(delta, kept.spared_end, kept.spared)
        return delta

    def seconds(self, problem: Problem, saved: tuple[int, ...]) -> tuple[float, float, float]:
        """(recompute seconds, of which hooks, checkpoint-call and policy seconds) with `saved` kept,
        summed in the replay's order so that the floats agree to the last bit."""
        times = problem.arrays.times
        if saved:
            times = list(times)
            for i in saved:
                times[i] = 0  # x + 0 is x: the sum is the replay's, which skips kept nodes
        hook, hooks_before = problem.saved_overhead_s, problem.arrays.hook_prefix
        seconds = hook_time = 0.0
        for s, e in self.spans:
            hooks = hook * (hooks_before[e + 1] - hooks_before[s])
            hook_time += hooks
            seconds += hooks + sum(times[s : e + 1])
        return seconds, hook_time, call_time(problem, self.regions, saved, self.stops)

    def figures(self, problem: Problem, saved: tuple[int, ...], off=None) -> SimResult:
        """The simulator's figures for this region plan of `problem` with `saved` (normalised) kept and the
        offloads of `off` (`offload.OffloadTiming`, None: none)."""
        a = problem.arrays
        by_cat = np.zeros(5, dtype=np.int64)
        kept = self.kept_terms(problem, np.array(saved, dtype=np.int64)) if saved else None
        delta = self.delta_with(kept)
        live = self.live if kept is None else np.cumsum(delta[: self.T]) + self.temps
        if off is not None:
            # An offloaded storage is off the device from after its forward free to its prefetch.
            o_t = np.array(sorted(off.fetch), dtype=np.int64)
            o_gone = np.array([off.free_after[t] for t in o_t.tolist()], dtype=np.int64) + 1
            o_back = self.group_start[np.array([off.fetch[t] for t in o_t.tolist()], dtype=np.int64)]
            o_bytes = a.nbytes[o_t]
            delta = delta.copy()
            np.add.at(delta, o_gone, -o_bytes)
            np.add.at(delta, o_back, o_bytes)
            live = np.cumsum(delta[: self.T]) + self.temps
        at = int(np.argmax(live))  # the first of the highest: the replay keeps a peak until one exceeds it
        if kept is not None:
            held = (kept.start <= at) & (at < kept.cached_end)
            plain = (kept.start <= at) & (at < kept.plain_end)
            by_cat[0] = int(kept.nbytes[held].sum() - kept.nbytes[plain].sum())
            by_cat[1] = -int(kept.spared[(kept.spared_start <= at) & (at < kept.spared_end)].sum())
        if off is not None:
            by_cat[0] -= int(o_bytes[(o_gone <= at) & (at < o_back)].sum())
        covering = (self.starts <= at) & (self.ends > at)
        by_cat += [int(self.sizes[covering & (self.cats == c)].sum()) for c in range(5)]
        breakdown = {
            "parameters": problem.param_bytes - self.cleared_casts + int(by_cat[4]),
            "inputs": problem.input_bytes, "optimizer": problem.optimizer_bytes,
            "param_grads": int(by_cat[3]), "activations": int(by_cat[0]), "recomputed": int(by_cat[1]),
            "act_grads": int(by_cat[2]), "temporaries": int(self.temps[at]),
        }
        n = a.n
        if at < n:
            phase, node = "forward", at
        else:
            k = int(np.searchsorted(-self.bslot, -at))  # bslot falls as k rises
            if k < n and self.bslot[k] == at:
                phase, node = "backward", k
            else:
                j = int(np.searchsorted(self.p_base, at, side="right")) - 1  # p_base rises in pass order
                phase, node = "recompute", int(self.p_s[j] + at - self.p_base[j])

        seconds, hook_time, calls = self.seconds(problem, saved)
        copies = off.exposed_s if off is not None else 0.0
        return SimResult(
            peak_bytes=max(int(live[at]) + self.fixed, self.fixed),
            recompute_time=seconds + calls + copies,
            call_time=calls,
            hook_time=hook_time,
            offload_time=copies,
            host_bytes=int(o_bytes.sum()) if off is not None else 0,
            peak_phase=phase,
            peak_node=node,
            breakdown=breakdown,
        )


@dataclass(frozen=True)
class _KeptTerms:
    """Per storage of some kept nodes, how keeping its producer moves its live intervals (`_Layout.kept_terms`).
    Positions are slots of the layout; `owner` and `spared_owner` index the kept nodes as given. # bytes int64"""

    owner: np.ndarray
    start: np.ndarray
    nbytes: np.ndarray
    plain_end: np.ndarray
    cached_end: np.ndarray
    spared_owner: np.ndarray
    spared_start: np.ndarray
    spared_end: np.ndarray
    spared: np.ndarray

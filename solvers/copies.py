"""The copy streams of offloading: which storages a plan may offload, and when their copies run.

Offloading is the third state of a kept activation, beside keeping it on the device and recomputing it.

A plan may offload a storage it keeps from the forward to the backward: a copy stream moves it to
pinned host memory during the forward, overlapped with compute, and another brings it back before its
backward needs it. The model (`simulate` accounts for it, the solvers optimise it):

* Compute: the forward of node j takes `node.time`; its backward step `BACKWARD_FACTOR` times that (the
  ratio `Problem.base_step_s` assumes); a recompute pass takes the forward time of the nodes it re-runs.
* Device to host: one serial copy stream. Storage t's copy is issued when its producer has run, in
  producer order, and takes `d2h_seconds`: `d2h_fixed_s + nbytes / d2h_bytes_per_s`, a fixed cost per
  storage (the copy's launch and round trip, and the hooks' own host work: on a launch-bound step a copy
  of a few KB costs that and nothing else) plus its bytes at the link's rate. The device copy stays until both its last
  forward reader has run and its copy is done (`free_after`: the first node at or after `last_use`
  whose forward ends no earlier than the copy). The backward starts when every copy is done: the
  stream's overhang past the forward's end is exposed time.
* Host to device: one serial copy stream; a copy takes `h2d_seconds` (`h2d_fixed_s + nbytes /
  h2d_bytes_per_s`). Storage t must be back before the backward reaches its first
  use `first_use` (the latest backward step that reads it: a saver outside every region, or the step
  whose recompute reads it). Its prefetch is issued at the start of backward step `fetch`: the latest
  start that has every copy done by its use on the one serial stream, in baseline backward compute
  (`fetch_steps`: the copies are laid out back to back, due last placed first, each as late as its
  use and the copy after it allow). A copy alone on the stream is issued at `fetch_step`, the nearest
  step whose compute up to the use covers it; copies whose windows overlap are issued earlier, so that
  the ones queued behind others are not late by the queue. It holds device bytes from its issue until
  its usual release step. The compute waits at the use for a prefetch that is late; the waits are
  exposed time.
* Host memory: at the forward's end every offloaded storage is on the host at once, so the plan's
  pinned bytes are the sum of theirs (`host_bytes`), which `host_budget_bytes` bounds.

`offloadable` says which storages a plan may offload; `timing` computes the copy schedule of a plan
(`simulate` prices it); `solvers.offload.choose_offloads` picks the offloads for a recompute plan.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass

from .plans import normalize_regions, normalize_saved, region_parents
from .problem import Problem, ProblemError

__all__ = [
    "BACKWARD_FACTOR",
    "OffloadTiming",
    "backward_uses",
    "offloadable",
    "normalize_offloaded",
    "fetch_step",
    "fetch_steps",
    "timing",
    "host_bytes",
    "backward_prefix",
    "d2h_seconds",
    "h2d_seconds",
]

BACKWARD_FACTOR = 2.0
"""Backward compute of a node in units of its forward time: the windows prefetches hide in."""


def _plan_facts(problem: Problem, regions: tuple[tuple[int, int], ...], saved: tuple[int, ...]):
    """(inner, parents, stops, triggers, inputs, runs): as `simulate.replay` derives them from a normalised plan.

    inner[i]: innermost region of node i (-1: none); stops[r]: last node r's recompute runs; triggers[r]: the
    backward step that runs it (its start when it never runs); inputs[r]: storages made before r and read in
    it; runs[r]: its recompute runs."""

    n, nodes, storages = problem.n, problem.nodes, problem.storages
    parents = region_parents(regions)
    inner = [-1] * n
    for r, (s, e) in enumerate(regions):
        for i in range(s, e + 1):
            inner[i] = r
    saves = [False] * n
    for k in problem.arrays.savers.tolist():
        saves[k] = True
    inputs: list[set[int]] = []
    packer = problem.arrays.prev_packer
    for s, e in regions:  # a region none of whose nodes packs a tensor keeps no inputs (simulate.replay)
        inputs.append({t for i in range(s, e + 1) for t in nodes[i].reads if storages[t].producer < s}
                      if packer[e] >= s else set())
    stops, triggers, runs = [], [], []
    for r, (s, e) in enumerate(regions):
        savers = [k for k in range(s, e + 1) if saves[k]]
        own = [k for k in savers if inner[k] == r]
        own += [regions[c][0] - 1 for c, p in enumerate(parents) if p == r and inputs[c]]
        stop = max(own) if own else s - 1
        stops.append(stop)
        runs.append(bool(savers) and stop >= s)
        triggers.append(max(savers) if runs[-1] else s)
    return inner, parents, stops, triggers, inputs, runs


def backward_uses(problem: Problem, regions, saved=()) -> dict[int, tuple[int, int]]:
    """{storage: (release, first_use)} for the storages the plan keeps on the device from the forward to the
    backward: release is the backward step after which it is freed (as `simulate` frees it), first_use the
    latest step that reads it. Regions and saved nodes normalised (`plans.normalize_regions`/`_saved`)."""
    inner, parents, stops, triggers, inputs, _ = _plan_facts(problem, regions, saved)
    fed: dict[int, list[int]] = {}
    for r, ts in enumerate(inputs):
        if parents[r] < 0:  # a nested region's inputs are kept by its parent's recompute, not by the forward
            for t in ts:
                fed.setdefault(t, []).append(r)
    kept = set(saved)
    out: dict[int, tuple[int, int]] = {}
    for t, st in enumerate(problem.storages):
        if st.is_output:
            continue  # alive for the whole step
        release = [k for k in st.saved_by if inner[k] < 0]
        use = list(release)
        for r in fed.get(t, ()):
            release.append(regions[r][0])
            use.append(triggers[r])  # its recompute reads it; a region never recomputed holds it to its start
        if st.producer in kept:  # a selective region's kept node: cached until its recompute took it
            r = inner[st.producer]
            if stops[r] >= st.producer:
                release += [triggers[r], *(k for k in st.saved_by if inner[k] == r)]
                use.append(triggers[r])
            else:
                release.append(regions[r][0])
                use.append(regions[r][0])
        if release:
            out[t] = (min(release), max(use))
    return out


def offloadable(problem: Problem, regions=(), saved=()) -> tuple[int, ...]:
    """The storages a plan may offload, ascending: those it keeps on the device from the forward to the
    backward (saved by a node outside every recomputed region, the input of an outermost region, or the
    output of a selective region's kept node), graph outputs and storages that are not `copyable` excepted."""
    regions = normalize_regions(problem, regions)
    saved = normalize_saved(problem, regions, saved)
    return tuple(sorted(t for t in backward_uses(problem, regions, saved) if problem.storages[t].copyable))


def normalize_offloaded(problem: Problem, regions, saved, offloaded) -> tuple[tuple[int, ...], dict[int, tuple[int, int]]]:
    """Sorted offloaded storages and their (release, first_use); ProblemError naming `offloaded` when one is
    not offloadable under the plan or the problem cannot offload."""
    out = tuple(sorted({int(t) for t in offloaded}))
    if not out:
        return out, {}
    if not (problem.d2h_bytes_per_s > 0 and problem.h2d_bytes_per_s > 0):
        raise ProblemError("offloaded: the problem has no copy bandwidth (d2h_bytes_per_s, h2d_bytes_per_s)")
    uses = backward_uses(problem, regions, saved)
    for t in out:
        if t not in uses:
            if not 0 <= t < len(problem.storages):
                raise ProblemError(f"offloaded: {t} is not a storage index")
            raise ProblemError(f"offloaded: storage {t} is not kept from the forward to the backward under the plan")
        if not problem.storages[t].copyable:
            raise ProblemError(f"offloaded: storage {t} is made inside its op (not copyable): no copy can be started")
    return out, {t: uses[t] for t in out}


def d2h_seconds(problem: Problem, nbytes: int) -> float:
    """Seconds one storage's copy to the host holds the stream: the fixed cost of a copy plus its bytes at
    the link's rate. # seconds"""
    return problem.d2h_fixed_s + nbytes / problem.d2h_bytes_per_s


def h2d_seconds(problem: Problem, nbytes: int) -> float:
    """Seconds one storage's fetch back to the device holds the stream (fixed cost plus bytes). # seconds"""
    return problem.h2d_fixed_s + nbytes / problem.h2d_bytes_per_s


def host_bytes(problem: Problem, offloaded) -> int:
    """Pinned host bytes a plan holds at the forward's end, when all its offloaded storages are there."""
    return sum(problem.storages[t].nbytes for t in offloaded)


def backward_prefix(problem: Problem) -> list[float]:
    """prefix[k]: baseline backward compute of nodes 0..k (seconds), the windows prefetches hide in."""
    return list(itertools.accumulate(BACKWARD_FACTOR * node.time for node in problem.nodes))


def fetch_step(prefix: list[float], first_use: int, seconds: float) -> int:
    """Backward step at whose start a prefetch of `seconds` for `first_use` is issued: the nearest step
    above the use whose baseline backward compute, up to the use, covers the copy (the first step of the
    backward when none does; the use itself for a copy that takes no time)."""
    if seconds <= 0:
        return first_use
    q = bisect.bisect_left(prefix, prefix[first_use] + seconds, lo=first_use + 1)
    return min(q, len(prefix) - 1)


def fetch_steps(prefix: list[float], uses: dict[int, int], seconds: dict[int, float]) -> dict[int, int]:
    """{storage: backward step at whose start its prefetch is issued}, for copies sharing one serial stream
    (uses: storage -> first_use; seconds: storage -> copy time).

    Each storage's copy must end by the start of its use, and the stream moves one copy at a time: laid out
    back to back from the copy due last (the least first_use) to the one due first, each ends at its use or
    where the copy after it starts, whichever is earlier, and is issued at the start of the step that
    contains its start (the latest step whose compute up to the start covers it). A copy that meets no other
    is issued at `fetch_step`; where windows overlap, `fetch_step` would issue each as if the stream were
    free, and all but the first would wait behind the others and arrive late though the backward had time
    to hide them all. Distances are baseline backward compute before the end of the backward (prefix), as
    in `fetch_step`; recomputes only add time before each use."""
    out: dict[int, int] = {}
    last = len(prefix) - 1
    start = float("-inf")  # prefix distance at which the copy placed before starts (the stream's cursor)
    for t in sorted(uses, key=lambda t: (uses[t], -t)):  # due last first; ties: the lower index runs first
        use = uses[t]
        start = max(prefix[use], start) + max(seconds[t], 0.0)  # a copy of no time still waits its turn
        out[t] = use if start <= prefix[use] else min(bisect.bisect_left(prefix, start, lo=use + 1), last)
    return out


@dataclass(frozen=True)
class OffloadTiming:
    """The copy schedule of a plan's offloads (see the module docstring)."""

    free_after: dict[int, int]
    """Forward node after which each offloaded storage leaves the device."""
    fetch: dict[int, int]
    """Backward step at whose start each offloaded storage comes back (before that step's recomputes)."""
    release: dict[int, int]
    """Backward step after which each offloaded storage is freed for good."""
    d2h_s: float
    """Seconds the backward waits for the device-to-host copies to finish."""
    h2d_s: float
    """Seconds the backward waits for late prefetches."""

    @property
    def exposed_s(self) -> float:
        """Copy seconds not hidden behind compute. # seconds"""
        return self.d2h_s + self.h2d_s


def timing(problem: Problem, regions, saved, uses: dict[int, tuple[int, int]]) -> OffloadTiming:
    """The copy schedule of offloading `uses` (offloaded storage: (release, first_use)) under a normalised
    plan; the one computation `simulate` and `replay` both use, so their seconds agree to the bit."""
    n, nodes, storages = problem.n, problem.nodes, problem.storages
    forward = list(itertools.accumulate(node.time for node in nodes))
    free_after: dict[int, int] = {}
    stream = 0.0
    for t in sorted(uses, key=lambda t: (storages[t].producer, t)):
        st = storages[t]
        stream = max(forward[st.producer], stream) + d2h_seconds(problem, st.nbytes)
        free_after[t] = min(bisect.bisect_left(forward, stream, lo=st.last_use), n - 1)
    d2h = max(0.0, stream - forward[-1]) if uses else 0.0

    prefix = backward_prefix(problem)
    copy = {t: h2d_seconds(problem, storages[t].nbytes) for t in uses}
    fetch = fetch_steps(prefix, {t: use for t, (_, use) in uses.items()}, copy)
    issued: dict[int, list[int]] = {}
    needed: dict[int, list[int]] = {}
    for t in sorted(uses, key=lambda t: (-fetch[t], -uses[t][1], t)):  # the stream's order
        issued.setdefault(fetch[t], []).append(t)
        needed.setdefault(uses[t][1], []).append(t)
    # Recompute passes run on the compute stream before their step: more window for later prefetches.
    _, _, stops, triggers, _, runs = _plan_facts(problem, regions, saved)
    kept = set(saved)
    rerun = [0.0] * n
    for r, (s, _e) in enumerate(regions):
        if runs[r]:
            rerun[triggers[r]] += sum(nodes[i].time for i in range(s, stops[r] + 1) if i not in kept)
    clock = stream = wait = 0.0
    done: dict[int, float] = {}
    for k in range(n - 1, -1, -1):
        for t in issued.get(k, ()):
            stream = max(clock, stream) + copy[t]
            done[t] = stream
        for t in needed.get(k, ()):
            if done[t] > clock:
                wait += done[t] - clock
                clock = done[t]
        clock += rerun[k] + BACKWARD_FACTOR * nodes[k].time
    release = {t: rel for t, (rel, _) in uses.items()}
    return OffloadTiming(free_after=free_after, fetch=fetch, release=release, d2h_s=d2h, h2d_s=wait)

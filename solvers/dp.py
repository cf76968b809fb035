"""`dp`: dynamic programming over nested checkpoint schedules on a chain of stages.

The graph is linearised into stages (single nodes when the graph is small,
else runs of nodes cut at cheap cuts). On that chain the solver is exact over
the *rotor family* of plans: laminar (nested) region families whose regions
are unions of whole stages, where the last stage of every region and of the
whole graph runs in its enclosing context (it is not inside a child region).
This is the schedule space of Beaumont et al.'s heterogeneous-chain DP
(forward with or without saving, input memory per stage), including the
multi-level schedules that reach O(log n) memory.

The recursion's memory model is that of `simulate` on chain problems whose
every node saves something (each node reads only its predecessor's output);
on other graphs it is an approximation, so every plan it returns is checked
with `simulate` and, when it does not fit, the internal budget is tightened.

Memory is discretised into slots: sizes are counted in units of the greatest
common divisor of all sizes when that gives few enough slots (then the model
is exact), else in units of range / slots with sizes rounded up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import reduce
from typing import Any

from .basic import equal_cost_segments
from .problem import Problem
from .registry import SolverResult, register
from .simulate import normalize_regions, region_parents, simulate

__all__ = [
    "DPConfig",
    "DPPlanner",
    "dp",
    "saver_flags",
    "grad_bytes_by_step",
    "recompute_time",
    "trim_flat_regions",
    "MissingDependencyError",
]


class MissingDependencyError(RuntimeError):
    """An optional dependency the solver needs is not installed."""


# ---------------------------------------------------------------------------
# Cost-model primitives shared by the solvers (all plan-independent or exact).


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
    (after its input gradients appear), before[k] is live when a recompute
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
        at[k] = acc_at + suffix[k]
        before[k] = acc_before + suffix[k + 1]
    return at, before


def recompute_time(problem: Problem, regions) -> float:
    """The simulator's recompute time of a plan, without replaying memory. # seconds"""
    regions = normalize_regions(problem, regions)
    if not regions:
        return 0.0
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
    for node in nodes:
        prefix.append(prefix[-1] + node.time)
    total = 0.0
    for r, (s, e) in enumerate(regions):
        if not any(saves[k] for k in range(s, e + 1)):
            continue
        own = [k for k in range(s, e + 1) if saves[k] and inner[k] == r] + child_stops[r]
        stop = max(own) if own else s - 1
        if stop >= s:
            total += prefix[stop + 1] - prefix[s]
    return total


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


# ---------------------------------------------------------------------------
# The stage chain.


@dataclass(frozen=True, kw_only=True)
class DPConfig:
    """Settings of the `dp` solver."""

    max_stages: int = 100
    """Chains longer than this are merged into this many stages (cut at cheap cuts)."""
    slots: int = 128
    """Memory slots of the table when sizes have no common unit that needs fewer."""
    selection: str = "auto"
    """'exact': least-recompute plan of the table whose simulated peak fits (simulates
    candidates in recompute order); 'tighten': the table's plan for the budget, its
    internal budget tightened by the simulated excess until it fits; 'auto': exact
    for graphs up to 300 nodes."""
    max_retries: int = 12
    """Bound on tightening rounds."""


@dataclass(frozen=True)
class _Chain:
    bounds: tuple[tuple[int, int], ...]  # stage g = nodes bounds[g][0]..bounds[g][1]
    time: tuple[float, ...]  # seconds
    recomputable: tuple[bool, ...]
    x: tuple[int, ...]  # bytes crossing the cut after the stage (outputs of the last stage)
    y: tuple[int, ...]  # bytes the stage keeps for its own backward
    tmp: tuple[int, ...]  # transient bytes during the stage's forward
    self_save: tuple[bool, ...]  # the crossing bytes are kept for the stage's own backward
    next_save: tuple[bool, ...]  # ... or for the next stage's backward
    grad_at: tuple[int, ...]  # bytes of gradients at the stage's backward
    grad_before: tuple[int, ...]  # ... and before it
    fixed: int  # bytes resident all step
    out: int  # output bytes, resident from the end of the forward
    fw_out: int  # output bytes produced before the last stage (forward only)


def _stage_bounds(problem: Problem, max_stages: int) -> list[tuple[int, int]]:
    """Single nodes when they are few, else about max_stages equal-time stages cut at cheap cuts."""
    n = problem.n
    if n <= max_stages:
        return [(i, i) for i in range(n)]
    cut = problem.cut_bytes()
    k, bounds = max_stages, []
    for _ in range(8):
        bounds, pos = [], 0
        for s, e in equal_cost_segments(problem, max(1, k), cut):
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


def _build_chain(problem: Problem, bounds: list[tuple[int, int]]) -> _Chain:
    nodes, storages = problem.nodes, problem.storages
    L = len(bounds)
    stage_of = [0] * problem.n
    for g, (u, v) in enumerate(bounds):
        for i in range(u, v + 1):
            stage_of[i] = g
    at, before = grad_bytes_by_step(problem)
    x, y = [0] * L, [0] * L
    self_save, next_save = [False] * L, [False] * L
    cut = problem.cut_bytes()
    out = fw_out = 0
    transient_by_node: list[list[tuple[int, int]]] = [[] for _ in nodes]
    for st in storages:
        g = stage_of[st.producer]
        u, v = bounds[g]
        if st.is_output:
            out += st.nbytes
            if g == L - 1:
                x[g] += st.nbytes
            else:
                fw_out += st.nbytes
            continue
        savers = [stage_of[k] for k in st.saved_by]
        if st.last_use > v or any(s > g for s in savers):
            if any(s == g or s > g + 1 for s in savers) or stage_of[st.last_use] > g + 1:
                self_save[g] = True
            if any(s == g + 1 for s in savers):
                next_save[g] = True
        elif savers:
            y[g] += st.nbytes
        else:
            transient_by_node[st.producer].append((st.last_use, st.nbytes))
    for g, (_u, v) in enumerate(bounds):
        if g < L - 1:
            x[g] = cut[v] - sum(st.nbytes for st in storages if st.is_output and st.producer <= v)
    tmp = []
    for u, v in bounds:
        live, peak, frees = 0, 0, {}
        for j in range(u, v + 1):
            for last, nb in transient_by_node[j]:
                live += nb
                frees[last] = frees.get(last, 0) + nb
            peak = max(peak, live + nodes[j].temp_bytes)
            live -= frees.pop(j, 0)
        tmp.append(peak)
    return _Chain(
        bounds=tuple(bounds),
        time=tuple(sum(nodes[i].time for i in range(u, v + 1)) for u, v in bounds),
        recomputable=tuple(all(nodes[i].recomputable for i in range(u, v + 1)) for u, v in bounds),
        x=tuple(x),
        y=tuple(y),
        tmp=tuple(tmp),
        self_save=tuple(self_save),
        next_save=tuple(next_save),
        grad_at=tuple(max(at[u : v + 1]) for u, v in bounds),
        grad_before=tuple(max(before[u : v + 1]) for u, v in bounds),
        fixed=problem.fixed_bytes,
        out=out,
        fw_out=fw_out,
    )


# ---------------------------------------------------------------------------
# The table.

_OWN = -1


class DPPlanner:
    """The DP table for one problem, reusable across budgets (see `sweep`)."""

    def __init__(self, problem: Problem, config: DPConfig | None = None) -> None:
        try:
            import numpy as np
        except ImportError:  # pragma: no cover - numpy ships with torch
            raise MissingDependencyError("the 'dp' solver needs numpy: pip install numpy") from None
        self._np = np
        self.problem = problem
        self.config = config or DPConfig()
        self.chain = _build_chain(problem, _stage_bounds(problem, self.config.max_stages))
        self._sim_cache: dict[tuple, Any] = {}
        self._time_cache: dict[tuple, float] = {}
        self._units()
        if len(self.chain.bounds):
            self._fill()

    # Units: exact when every size is a multiple of a unit giving few slots.
    def _units(self) -> None:
        c = self.chain
        sizes = [*c.x, *c.y, *c.tmp, *c.grad_at, *c.grad_before, c.out, c.fw_out]
        top = max(1, self._no_ckpt_need())  # bytes: more headroom than this changes nothing
        g = reduce(math.gcd, [s for s in sizes if s], 0) or 1
        if top // g <= max(self.config.slots, 4_000_000 // max(1, len(c.x) ** 2)):
            self.unit, self.exact_units = g, True
        else:
            self.unit, self.exact_units = -(-top // self.config.slots), False
        self.S = -(-top // self.unit) + 1  # slots: headroom 0..S-1 units
        u = self._u
        self._x = [u(v) for v in c.x]
        self._y = [u(v) for v in c.y]
        self._tmp = [u(v) for v in c.tmp]
        self._kept_y = [
            self._y[g] + (self._x[g] if c.self_save[g] and g != len(c.x) - 1 else 0) for g in range(len(c.x))
        ]
        self._bw_extra = [u(c.out) + u(v) for v in c.grad_at]
        self._pass_extra = [u(c.out) + u(v) for v in c.grad_before]
        if c.x:
            self._pass_extra[-1] = u(c.fw_out)  # only the top context ends at the last stage: its pass is the forward

    def _no_ckpt_need(self) -> int:
        c = self.chain
        total = sum(c.x) + sum(c.y) + max(c.tmp, default=0) + max(c.grad_at, default=0) + c.out + c.fw_out
        return total + max(c.x, default=0)

    def _u(self, nbytes: int) -> int:
        """Bytes to units: exact, else rounded to nearest (plans are checked with simulate)."""
        if self.exact_units:
            return nbytes // self.unit
        return (nbytes + self.unit // 2) // self.unit

    def _fill(self) -> None:
        """Tables by increasing suffix length, all suffixes of one length at once.

        SK[i, r, m] / SN[i, r, m]: least recompute time of the suffix i..r of a
        context that ends at stage r, with m units of headroom, a_{i-1} already
        counted in it (K) or not yet (N). AK / AN: the choice (_OWN, or the last
        stage of the child region that starts at i).
        """
        np, c, S = self._np, self.chain, self.S
        L = len(c.bounds)
        x = np.array(self._x, dtype=np.int64)
        x_prev = np.concatenate([[0], x[:-1]])
        y, tmp = np.array(self._y, dtype=np.int64), np.array(self._tmp, dtype=np.int64)
        kept_y = np.array(self._kept_y, dtype=np.int64)
        bw_extra, pass_extra = np.array(self._bw_extra), np.array(self._pass_extra)
        self_save = np.array(c.self_save, dtype=bool)
        next_prev = np.concatenate([[False], np.array(c.next_save[:-1], dtype=bool)])  # a_{i-1} saved by stage i
        prefix = np.concatenate([[0.0], np.cumsum(c.time)])
        rec_end = [-1] * L  # last stage of the recomputable run from i (-1: i is not recomputable)
        for i in range(L - 1, -1, -1):
            if c.recomputable[i]:
                rec_end[i] = rec_end[i + 1] if i + 1 < L and c.recomputable[i + 1] else i
        rec_end = np.array(rec_end)
        PT = np.zeros((L, L), dtype=np.int64)  # peak while stages i..d run inside a parent's pass
        for i in range(L):
            peak = 0
            for d in range(i, L):
                peak = max(peak, (self._x[d - 1] if d > i else 0) + self._x[d] + self._y[d] + self._tmp[d])
                PT[i, d] = peak
        INF = np.float32(np.inf)
        m = np.arange(S)
        SK, SN = np.full((L, L, S), INF, dtype=np.float32), np.full((L, L, S), INF, dtype=np.float32)
        CT = np.full((L, L, S), INF, dtype=np.float32)  # T(i..d) + SK[i, d]: a child region's whole cost
        AK, AN = np.full((L, L, S), -2, dtype=np.int16), np.full((L, L, S), -2, dtype=np.int16)

        def gather(arr, idx, fill):
            """out[p, m] = arr[p, idx[p, m]], fill where idx < 0."""
            out = np.take_along_axis(arr, np.clip(idx, 0, S - 1), axis=1)
            return np.where(idx >= 0, out, fill)

        for ell in range(L):
            rows = np.arange(0, L - ell)
            R = rows + ell
            first = rows == 0
            # Own stage i: it runs in this context and keeps what it saves.
            for f, tab, atab in ((0, SK, AK), (1, SN, AN)):
                a_in = x_prev[rows] * f
                kept_a = np.where(next_prev[rows], a_in, 0)
                m1 = m[None, :] - kept_a[:, None]
                ok = m1 >= (pass_extra[R] + (a_in - kept_a) + x[rows] + y[rows] + tmp[rows])[:, None]
                m2 = m1 - kept_y[rows][:, None]
                ok &= m2 >= bw_extra[rows][:, None]
                if ell == 0:
                    val = np.where(ok, np.float32(0), INF)
                else:
                    nxt = np.where(self_save[rows][:, None], SK[rows + 1, R], SN[rows + 1, R])
                    val = np.where(ok, gather(nxt, m2, INF), INF)
                if f == 1:
                    val[first] = INF
                tab[rows, R] = val
                atab[rows, R] = np.where(np.isfinite(val), _OWN, -2)
            if ell:
                # A child region i..d (d < r), then the rest of the context from d + 1.
                k = np.arange(ell)
                D = rows[:, None] + k[None, :]
                need = pass_extra[R][:, None] + PT[rows[:, None], D]
                need[D > rec_end[rows][:, None]] = S  # not recomputable: never
                if (need < S).any():
                    vals = CT[rows[:, None], D]
                    vals += SN[D + 1, R[:, None]]
                    np.putmask(vals, m[None, None, :] < need[:, :, None], INF)
                    bd = np.argmin(vals, axis=1)
                    best = np.take_along_axis(vals, bd[:, None, :], axis=1)[:, 0, :]
                    bd = np.where(np.isfinite(best), rows[:, None] + bd, -2).astype(np.int16)
                    for f, tab, atab in ((0, SK, AK), (1, SN, AN)):
                        idx = m[None, :] - (x_prev[rows] * f)[:, None]
                        cand, arg = gather(best, idx, INF), gather(bd, idx, -2)
                        if f == 1:
                            cand[first] = INF
                        cur = tab[rows, R]
                        better = cand < cur
                        tab[rows, R] = np.where(better, cand, cur)
                        atab[rows, R] = np.where(better, arg, atab[rows, R])
            CT[rows, R] = SK[rows, R] + (prefix[R + 1] - prefix[rows]).astype(np.float32)[:, None]
        self._tables = (SK, SN, AK, AN)

    # Plans.
    def _regions(self, headroom: int) -> tuple[tuple[int, int], ...] | None:
        SK, SN, AK, AN = self._tables
        x = self._x
        L = len(self.chain.bounds)
        if not L:
            return ()
        h = min(max(headroom, -1), self.S - 1)
        if h < 0 or not math.isfinite(SK[0, L - 1, h]):
            return None
        regions: list[tuple[int, int]] = []
        stack = [(0, L - 1, 0, h)]
        c = self.chain
        while stack:
            i, r, f, mm = stack.pop()
            if i > r:
                continue
            arg = int((AK if f == 0 else AN)[i, r, mm])
            if arg == _OWN:
                kept_a = x[i - 1] if (f == 1 and c.next_save[i - 1]) else 0
                stack.append((i + 1, r, 0 if c.self_save[i] else 1, mm - kept_a - self._kept_y[i]))
            else:
                d = arg
                m1 = mm - (x[i - 1] if f == 1 else 0)
                regions.append((c.bounds[i][0], c.bounds[d][1]))
                stack.append((i, d, 0, m1))
                stack.append((d + 1, r, 1, m1))
        return tuple(sorted(set(regions), key=lambda se: (se[0], -se[1])))

    def headroom(self, budget_bytes: int) -> int:
        """Table index of a budget: whole units of headroom above the fixed bytes."""
        return (budget_bytes - self.chain.fixed) // self.unit

    def candidates(self) -> list[tuple[tuple[int, int], ...]]:
        """The distinct plans of the table, one per breakpoint of the recompute-time curve."""
        SK = self._tables[0] if len(self.chain.bounds) else None
        if SK is None:
            return [()]
        L = len(self.chain.bounds)
        vals = SK[0, L - 1]
        out, seen = [], set()
        for h in range(self.S):
            if not math.isfinite(vals[h]) or (h and vals[h] == vals[h - 1]):
                continue  # the plan at the lowest headroom of each level needs the least memory
            regions = self._regions(h)
            if regions is not None and regions not in seen:
                seen.add(regions)
                out.append(regions)
        return out

    def simulate(self, regions):
        if regions not in self._sim_cache:
            self._sim_cache[regions] = simulate(self.problem, regions)
        return self._sim_cache[regions]

    def time_of(self, regions) -> float:
        if regions not in self._time_cache:
            self._time_cache[regions] = recompute_time(self.problem, regions)
        return self._time_cache[regions]

    def plan(self, budget_bytes: int | None) -> SolverResult:
        """The plan for one budget, verified with `simulate`."""
        cfg, n = self.config, self.problem.n
        stats: dict[str, Any] = {
            "stages": len(self.chain.bounds),
            "slots": self.S,
            "slot_bytes": self.unit,
            "exact_memory_units": self.exact_units,
        }
        if n == 0:
            return SolverResult(regions=(), stats=stats)
        if budget_bytes is None:
            return SolverResult(regions=(), stats=stats)
        selection = cfg.selection
        if selection == "auto":
            selection = "exact" if n <= 300 else "tighten"
        stats["selection"] = selection
        if selection == "exact":
            cands = sorted(self.candidates(), key=lambda r: (self.time_of(r), len(r)))
            best_peak = None
            for regions in cands:
                peak = self.simulate(regions).peak_bytes
                best_peak = peak if best_peak is None else min(best_peak, peak)
                if peak <= budget_bytes:
                    return SolverResult(regions=regions, stats={**stats, "min_peak_bytes": peak})
            low = min(cands, key=lambda r: self.simulate(r).peak_bytes)
            return SolverResult(regions=low, stats={**stats, "min_peak_bytes": best_peak})
        h = self.headroom(budget_bytes)
        tried: list[tuple[int, tuple]] = []
        for attempt in range(cfg.max_retries + 1):
            regions = self._regions(h)
            if regions is None:
                break
            peak = self.simulate(regions).peak_bytes
            tried.append((peak, regions))
            if peak <= budget_bytes:
                return SolverResult(regions=regions, stats={**stats, "retries": attempt, "min_peak_bytes": peak})
            h -= max(1, -(-(peak - budget_bytes) // self.unit))
        floor = self._regions(self._lowest_headroom())
        if floor is not None:
            tried.append((self.simulate(floor).peak_bytes, floor))
        if not tried:
            return SolverResult(regions=(), stats={**stats, "min_peak_bytes": simulate(self.problem, ()).peak_bytes})
        peak, regions = min(tried)
        return SolverResult(regions=regions, stats={**stats, "retries": len(tried), "min_peak_bytes": peak})

    def _lowest_headroom(self) -> int:
        vals = self._tables[0][0, len(self.chain.bounds) - 1]
        finite = [h for h in range(self.S) if math.isfinite(vals[h])]
        return finite[0] if finite else -1


@register("dp")
def dp(
    problem: Problem,
    budget_bytes: int | None = None,
    *,
    max_stages: int = 100,
    slots: int = 128,
    selection: str = "auto",
    max_retries: int = 12,
) -> SolverResult:
    """Optimal nested checkpointing on the stage chain (see the module docstring)."""
    if selection not in ("auto", "exact", "tighten"):
        raise ValueError(f"selection: {selection!r} is not one of 'auto', 'exact', 'tighten'")
    config = DPConfig(max_stages=max_stages, slots=slots, selection=selection, max_retries=max_retries)
    return DPPlanner(problem, config).plan(budget_bytes)

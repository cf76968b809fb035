"""`dp`: dynamic programming over nested checkpoint schedules on a chain of stages.

The graph is linearised into stages (single nodes when the graph is small,
else runs of nodes cut at cheap cuts, always including the boundaries of
repeated blocks: module-path changes such as one decoder layer to the next,
and cuts that are the least in their neighbourhood). On that chain the solver is exact over
the *rotor family* of plans: laminar (nested) region families whose regions
are unions of whole stages, where the last stage of every region and of the
whole graph runs in its enclosing context (it is not inside a child region).
This is the schedule space of Beaumont et al.'s heterogeneous-chain DP
(forward with or without saving, input memory per stage), including the
multi-level schedules that reach O(log n) memory.

The recursion's memory model is that of `simulate` on chain problems whose
every node saves something (each node reads only its predecessor's output);
on other graphs it is an approximation (a storage that several stages far
apart save, such as an attention mask, is counted once at every stage after
the one that makes it), so every plan it returns is checked
with `simulate`: when it does not fit, the internal budget is tightened; when
it leaves room (the chain counts a storage read by many stages, such as an
attention mask, at every cut it crosses), larger internal budgets are probed.

Memory is discretised into slots over headrooms up to 1.5 x the simulated
no-checkpoint activation memory: sizes are counted in units of the greatest
common divisor of all sizes when that gives few enough slots (then the model
is exact), else in units of range / slots with sizes rounded to nearest.

One concept, so one module over 500 lines: the rotor-family DP; the chain, the slot discretisation and the
budget search that checks each plan with `simulate` share one table (`DPSearch`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import reduce
from typing import Any

from ..costs import grad_bytes_by_step, recompute_time
from ..problem import Problem
from ..registry import SolverResult, register
from ..simulate import simulate
from .stages import _dp_stage_bounds

__all__ = [
    "DPConfig",
    "DPSearch",
    "dp",
    "solve_with",
    "MissingDependencyError",
]


class MissingDependencyError(RuntimeError):
    """An optional dependency the solver needs is not installed."""


# ---------------------------------------------------------------------------
# The stage chain.


@dataclass(frozen=True, kw_only=True)
class DPConfig:
    """Settings of the `dp` solver."""

    max_stages: int = 100
    """Chains longer than this are merged into this many stages (cut at cheap cuts)."""
    slots: int = 128
    """Least number of memory slots of the table when sizes have no common unit that needs fewer;
    up to 512 are used while the fill stays cheap (2.5e6 / stages^2: 250 at 100 stages)."""
    selection: str = "auto"
    """'exact': least-recompute plan of the table whose simulated peak fits (simulates
    candidates in recompute order); 'tighten': the table's plan for the budget, its
    internal budget tightened by the simulated excess until it fits, then raised while
    the simulated peak still fits and the recompute time falls; 'auto': exact for graphs
    up to 300 nodes."""
    max_retries: int = 12
    """Bound on tightening rounds, and on the probes above a plan that fits."""


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
    shared: tuple[int, ...]  # bytes made at or before the stage and saved by several stages far on, live here


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
    shared_from, uncut = [0] * (L + 1), [0] * (L + 1)
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
            later = {s for s in savers if s > g + 1}
            if len(later) >= 2 and max(later) - g >= max(2, L // 8):
                # Saved by several stages far on (an attention mask, rotary tables saved by every layer):
                # live from here to the backward of its first saver whatever the plan, so counted once at
                # every later stage rather than in the input of every region that reads it.
                shared_from[g] += st.nbytes
                uncut[g] += st.nbytes  # not in the cuts after stages g .. last_use's stage - 1
                uncut[max(g, stage_of[st.last_use])] -= st.nbytes
                continue
            if any(s == g or s > g + 1 for s in savers) or stage_of[st.last_use] > g + 1:
                self_save[g] = True
            if any(s == g + 1 for s in savers):
                next_save[g] = True
        elif savers:
            y[g] += st.nbytes
        else:
            transient_by_node[st.producer].append((st.last_use, st.nbytes))
    outputs_by = [0] * (problem.n + 1)  # output bytes each node makes
    for st in storages:
        if st.is_output:
            outputs_by[st.producer] += st.nbytes
    shared, acc, acc_shared, acc_out = [0] * L, 0, 0, 0
    for g, (u, v) in enumerate(bounds):
        acc += uncut[g]
        acc_shared += shared_from[g]
        acc_out += sum(outputs_by[u : v + 1])
        shared[g] = acc_shared
        if g < L - 1:
            x[g] = cut[v] - acc_out - acc
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
        time=tuple(sum(problem.region_time(i) for i in range(u, v + 1)) for u, v in bounds),
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
        shared=tuple(shared),
    )


# ---------------------------------------------------------------------------
# The table.

_OWN = -1
_CHILD = -3


class DPSearch:
    """The DP table for one problem, reusable across budgets (see `sweep`)."""

    def __init__(self, problem: Problem, config: DPConfig | None = None) -> None:
        try:
            import numpy as np
        except ImportError:  # pragma: no cover - numpy ships with torch
            raise MissingDependencyError("the 'dp' solver needs numpy: pip install numpy") from None
        self._np = np
        self.problem = problem
        self.config = config or DPConfig()
        self.chain = _build_chain(problem, _dp_stage_bounds(problem, self.config.max_stages))
        self._sim_cache: dict[tuple, Any] = {}
        self._time_cache: dict[tuple, float] = {}
        self._baseline = self.simulate(())
        self._units()
        if len(self.chain.bounds):
            self._fill()

    # Units: exact when every size is a multiple of a unit giving few slots.
    def _units(self) -> None:
        c = self.chain
        sizes = [*c.x, *c.y, *c.tmp, *c.grad_at, *c.grad_before, *c.shared, c.out, c.fw_out]
        # bytes: more headroom than this changes nothing. The chain's own estimate counts a storage at every
        # cut it crosses (an attention mask read by every layer: once per stage), so it can be several times
        # the real need, and slots that coarse round a layer's hidden state to nothing. Budgets at or above
        # the simulated no-checkpoint peak never reach the table; half of it again is left for plans that the
        # chain overestimates.
        top = max(1, min(self._no_ckpt_need(), 3 * (self._baseline.peak_bytes - c.fixed) // 2))
        stages2 = max(1, len(c.x) ** 2)  # the fill is O(stages^3 x slots)
        g = reduce(math.gcd, [s for s in sizes if s], 0) or 1
        if top // g <= max(self.config.slots, 4_000_000 // stages2):
            self.unit, self.exact_units = g, True
        else:  # rounded sizes: at most 512 slots, as `exact` selection simulates a candidate per slot
            self.unit, self.exact_units = -(-top // max(self.config.slots, min(2_500_000 // stages2, 512))), False
        self.S = -(-top // self.unit) + 1  # slots: headroom 0..S-1 units
        u = self._u
        self._x = [u(v) for v in c.x]
        self._y = [u(v) for v in c.y]
        self._tmp = [u(v) + u(s) for v, s in zip(c.tmp, c.shared)]  # shared bytes: live in every pass
        self._kept_y = [
            self._y[g] + (self._x[g] if c.self_save[g] and g != len(c.x) - 1 else 0) for g in range(len(c.x))
        ]
        self._bw_extra = [u(c.out) + u(v) + u(s) for v, s in zip(c.grad_at, c.shared)]
        self._pass_extra = [u(c.out) + u(v) for v in c.grad_before]
        if c.x:
            self._pass_extra[-1] = u(c.fw_out)  # only the top context ends at the last stage: its pass is the forward

    def _no_ckpt_need(self) -> int:
        c = self.chain
        total = sum(c.x) + sum(c.y) + max(c.tmp, default=0) + max(c.grad_at, default=0) + c.out + c.fw_out
        total += max(c.shared, default=0)
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
        from numpy.lib.stride_tricks import as_strided

        L = len(c.bounds)
        x = np.array(self._x, dtype=np.int64)
        x_prev = np.concatenate([[0], x[:-1]])
        y, tmp = np.array(self._y, dtype=np.int64), np.array(self._tmp, dtype=np.int64)
        kept_y = np.array(self._kept_y, dtype=np.int64)
        bw_extra, pass_extra = np.array(self._bw_extra), np.array(self._pass_extra)
        self_save = np.array(c.self_save, dtype=bool)
        next_prev = np.concatenate([[False], np.array(c.next_save[:-1], dtype=bool)])  # a_{i-1} saved by stage i
        prefix = np.concatenate([[0.0], np.cumsum(c.time)])
        self._prefix = prefix
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
        # The choice: _OWN, _CHILD (its last stage is found again by `_child_end` when a plan is read out)
        # or -2 (nothing fits). Keeping only the least value of the child choices in the fill, not where
        # it is, halves the fill's time: an argmin across the middle axis is ten times slower than a min.
        AK, AN = np.full((L, L, S), -2, dtype=np.int8), np.full((L, L, S), -2, dtype=np.int8)

        def diag(arr, i0, ell):
            """View of arr[i0 + p, p + ell] for p < L - ell: the entries of one suffix length, shape [P, S]."""
            t0, t1, t2 = arr.strides
            return as_strided(arr[i0:, ell:], shape=(L - ell, S), strides=(t0 + t1, t2))

        def gather(arr, idx, fill):
            """out[p, m] = arr[p, idx[p, m]], fill where idx < 0 (arr is C-contiguous, shape [P, S])."""
            flat = np.arange(arr.shape[0])[:, None] * S + np.clip(idx, 0, S - 1)
            return np.where(idx >= 0, arr.reshape(-1)[flat], fill)

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
                    nxt = np.where(self_save[rows][:, None], diag(SK, 1, ell), diag(SN, 1, ell))
                    val = np.where(ok, gather(nxt, m2, INF), INF)
                if f == 1:
                    val[first] = INF
                diag(tab, 0, ell)[...] = val
                diag(atab, 0, ell)[...] = np.where(np.isfinite(val), _OWN, -2)
            if ell:
                # A child region i..d (d < r), then the rest of the context from d + 1.
                k = np.arange(ell)
                D = rows[:, None] + k[None, :]
                need = pass_extra[R][:, None] + PT[rows[:, None], D]
                need[D > rec_end[rows][:, None]] = S  # not recomputable: never
                if (need < S).any():
                    # vals[i, k] = CT[i, i + k] + SN[i + k + 1, i + ell]: strided views, no gathers.
                    s0, s1, s2 = CT.strides
                    ct = as_strided(CT, shape=(L - ell, ell, S), strides=(s0 + s1, s1, s2))
                    sn = as_strided(SN[1:, ell:], shape=(L - ell, ell, S), strides=(s0 + s1, s0, s2))
                    fits = m[None, None, :] >= need[:, :, None]  # the child's forward fits in the pass
                    best = np.min(ct + sn, axis=1, where=fits, initial=INF)
                    for f, tab, atab in ((0, SK, AK), (1, SN, AN)):
                        idx = m[None, :] - (x_prev[rows] * f)[:, None]
                        cand = gather(best, idx, INF)
                        if f == 1:
                            cand[first] = INF
                        cur, arg = diag(tab, 0, ell), diag(atab, 0, ell)
                        better = cand < cur
                        cur[better] = cand[better]
                        arg[better] = _CHILD
            # A child region's whole cost: its recompute, its inner schedule, its checkpoint call.
            call = np.float32(self.problem.region_overhead_s)
            diag(CT, 0, ell)[...] = diag(SK, 0, ell) + (prefix[R + 1] - prefix[rows] + call).astype(np.float32)[:, None]
        self._need = (PT, rec_end, pass_extra)
        self._child_cache: dict[tuple[int, int], Any] = {}
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
                m1 = mm - (x[i - 1] if f == 1 else 0)
                d = self._child_end(i, r, m1)
                regions.append((c.bounds[i][0], c.bounds[d][1]))
                stack.append((i, d, 0, m1))
                stack.append((d + 1, r, 1, m1))
        return tuple(sorted(set(regions), key=lambda se: (se[0], -se[1])))

    def _child_end(self, i: int, r: int, m1: int) -> int:
        """Last stage of the best child region starting at i in a context ending at r, with m1 units free.

        The same minimum as the fill's (ties to the shortest region), for every headroom of (i, r) at once.
        """
        key = (i, r)
        if key not in self._child_cache:
            np = self._np
            SK, SN = self._tables[0], self._tables[1]
            PT, rec_end, pass_extra = self._need
            prefix = self._prefix
            D = np.arange(i, r)
            vals = SK[i, D] + (prefix[D + 1] - prefix[i]).astype(np.float32)[:, None]
            vals += SN[D + 1, r]
            need = pass_extra[r] + PT[i, D]
            need[D > rec_end[i]] = self.S
            np.putmask(vals, np.arange(self.S)[None, :] < need[:, None], np.float32(np.inf))
            self._child_cache[key] = i + vals.argmin(axis=0)
        return int(self._child_cache[key][m1])

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

    def solve(self, budget_bytes: int | None) -> SolverResult:
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
        if self._baseline.peak_bytes <= budget_bytes:  # no checkpointing fits: nothing is faster
            return SolverResult(regions=(), stats={**stats, "min_peak_bytes": self._baseline.peak_bytes})
        selection = cfg.selection
        if selection == "auto":
            selection = "exact" if n <= 300 else "tighten"
        stats["selection"] = selection
        if selection == "exact":
            cands = sorted({(), *self.candidates()}, key=lambda r: (self.time_of(r), len(r), r))
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
                regions, peak, probes = self._loosen(h, regions, peak, budget_bytes)
                stats = {**stats, "retries": attempt, "loosened": probes, "min_peak_bytes": peak}
                return SolverResult(regions=regions, stats=stats)
            h -= max(1, -(-(peak - budget_bytes) // self.unit))
        for floor in self._floor_plans():
            tried.append((self.simulate(floor).peak_bytes, floor))
        tried.append((self._baseline.peak_bytes, ()))
        peak, regions = min(tried, key=lambda t: (t[0], len(t[1]), t[1]))
        return SolverResult(regions=regions, stats={**stats, "retries": len(tried), "min_peak_bytes": peak})

    def _loosen(self, h: int, regions, peak: int, budget_bytes: int) -> tuple[tuple, int, int]:
        """Probe headrooms above h while the simulated peak leaves room: the chain overestimates some DAGs.

        Doubling steps from the simulated slack, then bisection; a plan is taken only when it fits and
        recomputes less. Returns (regions, peak, probes). On chains the model is exact, so the plan at h
        stays (a larger headroom's plan fits only when it is the same plan or as fast).
        """
        best = (self.time_of(regions), peak, regions)
        fit, fail, probes = h, self.S, 0
        step = max(1, (budget_bytes - peak) // self.unit)
        while probes < self.config.max_retries and fail - fit > 1:
            nxt = min(fit + step, self.S - 1) if fail == self.S else (fit + fail) // 2
            if nxt <= fit:
                break
            probes += 1
            cand = self._regions(nxt)
            if cand is None:
                break
            cand_peak = self.simulate(cand).peak_bytes
            if cand_peak <= budget_bytes:
                fit, step = nxt, step * 2
                best = min(best, (self.time_of(cand), cand_peak, cand))
            else:
                fail = nxt
        return best[2], best[1], probes

    def _floor_plans(self, count: int = 8) -> list[tuple[tuple[int, int], ...]]:
        """The table's distinct plans at its lowest headrooms: the least memory the table can reach.

        On graphs where the chain is an approximation the lowest-headroom plan need not simulate lowest,
        so a few are tried.
        """
        if not len(self.chain.bounds):
            return []
        vals = self._tables[0][0, len(self.chain.bounds) - 1]
        out: list[tuple[tuple[int, int], ...]] = []
        for h in range(self.S):
            if len(out) >= count:
                break
            if math.isfinite(vals[h]) and not (h and vals[h] == vals[h - 1]):
                regions = self._regions(h)
                if regions is not None and regions not in out:
                    out.append(regions)
        return out


SELECTIVE_CANDIDATES = 6  # table plans dp also tries with saved ops


@register("dp")
def dp(
    problem: Problem,
    budget_bytes: int | None = None,
    *,
    max_stages: int = 100,
    slots: int = 128,
    selection: str = "auto",
    max_retries: int = 12,
    selective: bool = True,
) -> SolverResult:
    """Optimal nested checkpointing on the stage chain (see the module docstring).

    With `selective`, the table's plans within the budget (least recompute first) and one region per
    block are also tried with saved ops inside their regions (`selective.with_saved`).
    """
    if selection not in ("auto", "exact", "tighten"):
        raise ValueError(f"selection: {selection!r} is not one of 'auto', 'exact', 'tighten'")
    config = DPConfig(max_stages=max_stages, slots=slots, selection=selection, max_retries=max_retries)
    return solve_with(DPSearch(problem, config), budget_bytes, selective=selective)


def solve_with(search: DPSearch, budget_bytes: int | None, *, selective: bool = True) -> SolverResult:
    """`dp`'s answer from a table already built (the table does not depend on the budget)."""
    problem = search.problem
    result = search.solve(budget_bytes)
    if not selective or budget_bytes is None or not any(node.saveable for node in problem.nodes):
        return result
    from ..heuristics.selective import block_regions, with_saved

    if search.simulate(result.regions).peak_bytes > budget_bytes:
        return result  # nothing fits: no plan to add kept ops to (`with_saved` would return it as well)
    fitting = []  # the fastest table plans that fit: simulated in order of recompute time until there are enough
    for regions in sorted(search.candidates(), key=lambda r: (search.time_of(r), len(r), r)):
        if len(fitting) == SELECTIVE_CANDIDATES:
            break
        if search.simulate(regions).peak_bytes <= budget_bytes:
            fitting.append(regions)
    return with_saved(problem, budget_bytes, result, [*fitting, block_regions(problem)])

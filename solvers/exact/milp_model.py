"""The MILP of `ilp` (its docstring gives the model): the variables and constraints built in one fixed order
(the backends' answers depend on it), the objective, and one solve with one backend read back as a plan."""

from __future__ import annotations

import os
import tempfile
import warnings
from dataclasses import dataclass
from typing import Any

from ..costs import grad_bytes_by_step, saver_flags
from ..problem import Problem
from ..simulate import simulate
from .milp_backend import (
    _HIGHS_ERRORS,
    _backend,
    _BackendFailure,
    _best_bound,
    _highs_model_status,
    native_stdout_dropped,
)
from .offload_terms import NO_OFFLOAD, OffloadTerms

__all__ = ["_solve_milp"]


@dataclass
class _Scaled:
    """The problem's figures in the MILP's units: bytes in units of the budget (or of the no-checkpoint
    peak), time in units of the whole forward, so that coefficients near 1 keep the tolerances meaningful."""

    unit: float
    nb: list[float]
    fixed: float
    out_bytes: float
    at: list[float]
    before: list[float]
    tunit: float
    prefix: list[float]
    cands: list[tuple[int, int]]
    readers: list[list[int]]
    first_saver: list[int | None]
    made_at: list[list[int]]


def _scaled(problem: Problem, budget: int | None) -> _Scaled:
    n, nodes, storages = problem.n, problem.nodes, problem.storages
    saves = saver_flags(problem)
    at, before = grad_bytes_by_step(problem)
    unit = float(budget if budget else max(1, simulate(problem, ()).peak_bytes))
    nb = [st.nbytes / unit for st in storages]
    times = [problem.region_time(i) for i in range(n)]
    tunit = sum(times) or 1.0
    prefix = [0.0]
    for t in times:
        prefix.append(prefix[-1] + t / tunit)
    readers: list[list[int]] = [[] for _ in storages]
    for i, node in enumerate(nodes):
        for t in node.reads:
            readers[t].append(i)
    made_at: list[list[int]] = [[] for _ in range(n)]
    for t, st in enumerate(storages):
        made_at[st.producer].append(t)
    return _Scaled(
        unit=unit, nb=nb, fixed=problem.fixed_bytes / unit,
        out_bytes=sum(nb[t] for t, st in enumerate(storages) if st.is_output),
        at=[v / unit for v in at], before=[v / unit for v in before], tunit=tunit, prefix=prefix,
        cands=[(s, e) for e in range(n) if saves[e] for s in range(e, -1, -1)
               if all(nodes[i].recomputable for i in range(s, e + 1))],
        readers=readers, first_saver=[min(st.saved_by) if st.saved_by else None for st in storages], made_at=made_at,
    )


class _Model:
    """The pulp problem being built, its variables, and the memory cap (1 budget unit, or the peak variable
    that the objective minimises when there is no budget)."""

    def __init__(self, pulp: Any, budget: int | None) -> None:
        self.pulp, self.budget = pulp, budget
        self.prob = pulp.LpProblem("ckpt", pulp.LpMinimize)
        self._make = getattr(self.prob, "add_variable", None)
        self.infeasible = False
        self.peak_var = self.new_var("peak") if budget is None else None
        self.cap = self.peak_var if budget is None else 1.0  # budget units

    def new_var(self, name: str, low=0, up=None, cat="Continuous"):
        if self._make is not None:
            return self._make(name, low, up, cat=cat)
        return self.pulp.LpVariable(name, lowBound=low, upBound=up, cat=cat)

    def at_most(self, expr) -> None:
        """expr <= cap, where expr may have no variable left."""
        expr = self.pulp.lpSum([expr])
        if self.budget is not None and not expr.keys():
            self.infeasible = self.infeasible or expr.constant > self.cap + 1e-12
        else:
            self.prob.addConstraint(expr <= self.cap)


def _path(m: _Model, n: int, f: _Scaled):
    """One binary per candidate region and one path 0 -> n of keep arcs and region arcs."""
    lpSum = m.pulp.lpSum
    x = {c: m.new_var(f"x_{c[0]}_{c[1]}", 0, 1, "Binary") for c in f.cands}
    keep = [m.new_var(f"keep_{i}", 0, 1) for i in range(n)]
    starting: list[list[tuple[int, int]]] = [[] for _ in range(n)]
    ending: list[list[tuple[int, int]]] = [[] for _ in range(n)]
    for c in f.cands:
        starting[c[0]].append(c)
        ending[c[1]].append(c)
    for q in range(n):
        inflow = 1 if q == 0 else keep[q - 1] + lpSum(x[c] for c in ending[q - 1])
        m.prob += keep[q] + lpSum(x[c] for c in starting[q]) == inflow
    return x, keep, starting, ending


def _cover(m: _Model, n: int, x: dict, starting: list[list[tuple[int, int]]]) -> dict[tuple[int, int], Any]:
    """cover[s][k]: the region that starts at s reaches node k."""
    cover: dict[tuple[int, int], Any] = {}
    for s in range(n):
        if not starting[s]:
            continue
        hi = max(e for _, e in starting[s])
        nxt = 0
        for k in range(hi, s - 1, -1):
            var = m.new_var(f"c_{s}_{k}", 0, 1)
            m.prob += var == nxt + (x[(s, k)] if (s, k) in x else 0)
            cover[(s, k)] = nxt = var
    return cover


def _releases(m: _Model, problem: Problem, f: _Scaled, keep: list, cover: dict):
    """Forward storages: y[t][k] >= [t is kept and released at a step <= k]; `span[t]`: its last step."""
    y_at: dict[int, list] = {}
    span: dict[int, int] = {}
    for t, st in enumerate(problem.storages):
        if st.is_output or not st.nbytes or not (st.saved_by or f.readers[t]):
            continue
        p = st.producer
        K = max([p, *st.saved_by, *f.readers[t]])
        span[t] = K
        ys, prev = [], None
        savers = set(st.saved_by)
        for k in range(p, K + 1):
            var = m.new_var(f"y_{t}_{k}", 0, 1)
            if prev is not None:
                m.prob += var >= prev
            # Keeping node k and starting a region at k are exclusive arcs of the path: their sum is a valid
            # (and, in the relaxation, much tighter) lower bound than either alone.
            release = [keep[k]] if k in savers else []
            if k > p:
                later = [i for i in f.readers[t] if i >= k]
                if later and (k, min(later)) in cover:
                    release.append(cover[(k, min(later))])
            if release:
                m.prob += var >= m.pulp.lpSum(release)
            ys.append(var)
            prev = var
        y_at[t] = ys
    return y_at, span


def _backward_live(m: _Model, problem: Problem, f: _Scaled, y_at: dict, span: dict) -> list:
    """w[k]: bytes of forward storages live at backward step k (outputs apart)."""
    n, storages = problem.n, problem.storages
    W = []
    for k in range(n):
        terms = []
        for t in f.made_at[k]:
            if t in y_at:
                terms.append(f.nb[t] * y_at[t][0])
        W.append(terms)
    w_vars, acc = [], None
    for k in range(n):
        delta = list(W[k])
        for t, K in span.items():
            p = storages[t].producer
            if p < k <= K:
                delta.append(f.nb[t] * (y_at[t][k - p] - y_at[t][k - p - 1]))
        var = m.new_var(f"w_{k}")
        m.prob += var == (acc if acc is not None else 0) + m.pulp.lpSum(delta)
        w_vars.append(var)
        acc = var
    return w_vars


def _forward_limits(m: _Model, problem: Problem, f: _Scaled, y_at: dict, span: dict, off) -> None:
    """Forward: kept storages freed before j stay; the rest of the live set is plan-independent."""
    n, storages, nodes = problem.n, problem.storages, problem.nodes
    live_fw = [0] * (n + 1)
    for t, st in enumerate(storages):
        end = n - 1 if st.is_output else st.last_use
        live_fw[st.producer] += f.nb[t]
        live_fw[end + 1] -= f.nb[t]
    run, freed = 0, [[] for _ in range(n)]
    for t, K in span.items():
        freed[storages[t].last_use].append(f.nb[t] * y_at[t][K - storages[t].producer])
    acc_fw = None
    for j in range(n):
        run += live_fw[j]
        if j:
            var = m.new_var(f"f_{j}")
            m.prob += var == (acc_fw if acc_fw is not None else 0) + m.pulp.lpSum(freed[j - 1])
            acc_fw = var
        m.at_most((acc_fw if acc_fw is not None else 0) + f.fixed + run + nodes[j].temp_bytes / f.unit - off.forward(j))


def _backward_limits(m: _Model, problem: Problem, f: _Scaled, w_vars: list, cover: dict, off) -> None:
    """Backward step k: the bytes the recompute of a region starting at s keeps there (made at >= s, first
    saver <= k), on top of the forward storages, gradients and outputs."""
    n, storages = problem.n, problem.storages
    keep_rc: list[list[tuple[int, int]]] = [[] for _ in range(n)]
    by_p = [0] * n
    kept_by_k: list[list[int]] = [[] for _ in range(n)]
    for t, first in enumerate(f.first_saver):
        if first is not None:
            kept_by_k[first].append(t)
    for k in range(n):
        for t in kept_by_k[k]:
            by_p[storages[t].producer] += f.nb[t]
        acc_s = 0
        for s in range(k, -1, -1):
            acc_s += by_p[s]
            if (s, k) in cover and acc_s:
                keep_rc[k].append((s, acc_s))
    for k in range(n):
        rc = m.pulp.lpSum(v * cover[(s, k)] for s, v in keep_rc[k])
        m.at_most(w_vars[k] + rc + f.fixed + f.at[k] + f.out_bytes - off.backward(k))


def _recompute_limits(m: _Model, problem: Problem, f: _Scaled, ending: list, x: dict, w_vars: list, off) -> None:
    """The recompute pass of each candidate, at its trigger e (its peak precomputed per candidate)."""
    storages, nodes = problem.storages, problem.nodes
    for e in range(problem.n):
        if not ending[e]:
            continue
        terms = []
        for s, _ in ending[e]:
            live, peak, frees = 0, 0, {}
            for j in range(s, e + 1):
                for t in f.made_at[j]:
                    st = storages[t]
                    live += f.nb[t]
                    first = f.first_saver[t]
                    if first is None or first > e:
                        end = min(st.last_use, e)
                        frees[end] = frees.get(end, 0) + f.nb[t]
                peak = max(peak, live + nodes[j].temp_bytes / f.unit)
                live -= frees.pop(j, 0)
            terms.append(peak * x[(s, e)])
        m.at_most(w_vars[e] + m.pulp.lpSum(terms) + f.fixed + f.before[e] + f.out_bytes - off.backward(e))


def _warm_start(x: dict, keep: list, start) -> bool:
    """The start's values as the solver's first incumbent, where every region of it is a candidate."""
    warm = start is not None and all(c in x for c in start)
    if warm:
        for c, v in x.items():
            v.setInitialValue(1 if c in start else 0)
        covered = {i for s_, e_ in start for i in range(s_, e_ + 1)}
        for i, v in enumerate(keep):
            v.setInitialValue(0 if i in covered else 1)
    return warm


def _run(m: _Model, f: _Scaled, backend: str, time_limit: float | None, gap: float, warm: bool, presolve: bool,
         search_nodes: int | None) -> dict[str, Any] | None:
    """Solve with one backend; its stats, or None when it found no plan (infeasible, or out of time).
    A backend's own failure is a _BackendFailure (the caller retries the other backend)."""
    pulp, prob, budget = m.pulp, m.prob, m.budget
    with tempfile.TemporaryDirectory() as tmp:
        log_path = os.path.join(tmp, "cbc.log")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # pulp 3.x announces its 4.0 API
            name, solver = _backend(backend, time_limit, gap, log_path, warm, presolve, node_limit=search_nodes)
            try:
                with native_stdout_dropped():  # HiGHS's banner
                    prob.solve(solver)
            except Exception as e:  # noqa: BLE001 - any failure of the third-party backend is retried
                raise _BackendFailure(f"{type(e).__name__}: {str(e).strip()[:200]}") from e
        stats: dict[str, Any] = {
            "backend": name,
            "variables": prob.numVariables(),  # counted by the solve already: variables() walks every constraint
            "constraints": prob.numConstraints(),
            "status": pulp.LpStatus[prob.status],
        }
        if prob.status in (pulp.LpStatusUndefined, pulp.LpStatusUnbounded):
            raise _BackendFailure(f"status {stats['status']!r}")  # the model is bounded and has a plan or none
        highs_status = _highs_model_status(name, prob)
        if highs_status in _HIGHS_ERRORS:
            raise _BackendFailure(f"HiGHS model status {highs_status}")  # pulp reports these as "Not Solved"
        if prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
            stats["no_plan"] = True  # infeasible, or the time limit passed before any plan was found
            return stats
        objective = pulp.value(prob.objective)
        if objective is None or objective != objective:
            raise _BackendFailure(f"status {stats['status']!r} with no objective value")
        bound = _best_bound(name, prob, log_path, objective)
        scale = 1.0 if budget is None else f.tunit  # objective back in bytes-units / seconds
        stats["objective"] = objective * (f.unit if budget is None else scale)
        if bound is not None:
            stats["bound"] = min(bound, objective) * (f.unit if budget is None else scale)
            stats["gap"] = 0.0 if objective <= 1e-12 else max(0.0, (objective - bound) / abs(objective))
        elif prob.sol_status == pulp.LpSolutionOptimal:
            stats["gap"] = 0.0
        stats["optimal"] = stats.get("gap", 1.0) <= max(gap, 1e-6)
    return stats


def _solve_milp(
    problem: Problem,
    budget: int | None,
    backend: str,
    time_limit: float | None,
    gap: float,
    start=None,
    presolve: bool = True,
    offload: bool = False,
    search_nodes: int | None = None,
):
    """Build and solve the MILP; budget None minimises the peak instead. Returns (regions | None, stats).

    `start`: a flat, saver-ended plan that fits, given to the solver as its first incumbent. `offload`: kept
    storages may also be offloaded (`offload_terms.OffloadTerms`); the choice is `stats["offloaded"]`.
    `search_nodes`: branch-and-bound nodes the search may take (None: no limit).
    """
    import pulp

    n = problem.n
    f = _scaled(problem, budget)
    m = _Model(pulp, budget)
    x, keep, starting, ending = _path(m, n, f)
    cover = _cover(m, n, x, starting)
    y_at, span = _releases(m, problem, f, keep, cover)
    off = OffloadTerms(problem, m.prob, m.new_var, x, keep, y_at, span, f.readers, f.unit, f.tunit) if offload else NO_OFFLOAD
    w_vars = _backward_live(m, problem, f, y_at, span)
    _forward_limits(m, problem, f, y_at, span, off)
    _backward_limits(m, problem, f, w_vars, cover, off)
    _recompute_limits(m, problem, f, ending, x, w_vars, off)
    # Objective: each region's recompute time plus the fixed cost of its checkpoint call.
    call = problem.region_overhead_s / f.tunit
    time_obj = pulp.lpSum((f.prefix[e + 1] - f.prefix[s] + call) * v for (s, e), v in x.items()) + off.cost
    m.prob += m.peak_var if budget is None else time_obj
    if m.infeasible:
        return None, {"status": "Infeasible"}
    warm = _warm_start(x, keep, start)
    stats = _run(m, f, backend, time_limit, gap, warm, presolve, search_nodes)
    if stats.pop("no_plan", False):
        return None, stats
    regions = tuple(sorted(c for c, v in x.items() if (v.value() or 0) > 0.5))
    if offload:
        stats["offloaded"] = off.chosen()
    if any(b[0] <= a[1] for a, b in zip(regions, regions[1:])):
        raise _BackendFailure(f"status {stats['status']!r} but overlapping regions, not a plan")
    return regions, stats

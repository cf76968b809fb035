"""The report's data, stored in `plan.stats` (see report.py): the predicted memory timeline of the step
(computed at plan time) and every solver's memory/overhead curve (computed when a report asks for it:
`ckpt-planner report --model`, or `plan --curve-points N`), in the plan summary's own figures
(the timeline's peak is the plan's predicted peak, the curve's overhead its predicted step over eager,
and the plan's point lies on its solver's curve)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["timeline_data", "curve_data", "curves_for", "plan_data", "step_baseline", "step_overhead"]

_MAX_POINTS = 1500


def _downsample(values: list[int], labels: list[str], limit: int = _MAX_POINTS) -> tuple[list[int], list[str]]:
    """At most `limit` points; each kept point is the maximum of its bucket, so the peak is always kept."""
    n = len(values)
    if n <= limit:
        return list(values), list(labels)
    out_v, out_l = [], []
    for b in range(limit):
        lo, hi = b * n // limit, (b + 1) * n // limit
        k = max(range(lo, max(hi, lo + 1)), key=values.__getitem__)
        out_v.append(values[k])
        out_l.append(labels[k])
    return out_v, out_l


def timeline_data(problem: Any, regions: Sequence[tuple[int, int]], saved: Sequence[int] = (),
                  offloaded: Sequence[int] = ()) -> dict[str, Any]:
    """Predicted live bytes after every simulator event of one step (forward, recompute, backward);
    `saved`: the ops selective regions keep, `offloaded`: the storages copied to host memory, as the plan's
    own figures count them. With offloads, `host` is the copy streams' work: after each event, the bytes of
    offloaded activations off the device (copied out in the forward, not yet fetched back)."""
    from ..solvers.copies import normalize_offloaded, timing
    from ..solvers.plans import normalize_regions, normalize_saved
    from ..solvers.simulate import simulate

    sim = simulate(problem, regions, saved=tuple(saved), offloaded=tuple(offloaded), timeline=True)
    values = [int(b) for _, _, b in sim.timeline]
    phases = [p for p, _, _ in sim.timeline]
    out: dict[str, Any] = {"peak_bytes": sim.peak_bytes, "events": len(sim.timeline)}
    if offloaded:
        spans = normalize_regions(problem, regions)
        kept = normalize_saved(problem, spans, saved)
        chosen, uses = normalize_offloaded(problem, spans, kept, offloaded)
        copies = timing(problem, spans, kept, uses)
        host, step = [], problem.n  # the backward step under way (recompute events run inside one)
        for phase, node, _ in sim.timeline:
            if phase == "backward":
                step = node
            forward = phase == "forward"
            host.append(sum(problem.storages[t].nbytes for t in chosen
                            if (node > copies.free_after[t] if forward else step > copies.fetch[t])))
        host, _ = _downsample(host, phases)  # the same buckets' maxima as the live bytes'
        out["host"] = host
    out["bytes"], out["phase"] = _downsample(values, phases)
    return out


def curve_data(
    problem: Any,
    solver_names: Sequence[str],
    *,
    points: int = 8,
    forward_s: float = 0.0,
    tick: Callable[[], None] | None = None,
) -> dict[str, list[dict[str, Any]]]:
    """Per solver, (peak bytes, recompute seconds) at `points` budgets from the fixed memory to the baseline peak.

    One `sweep` per solver (what does not depend on the budget built once); infeasible budgets are left out.
    `tick` is called once per solver (progress bars).
    """
    from ..solvers.simulate import simulate
    from ..solvers.sweep import sweep

    base = simulate(problem, ()).peak_bytes
    fixed = problem.fixed_bytes
    eager = step_baseline(problem)
    budgets = [int(fixed + (base - fixed) * (k + 1) / points) for k in range(points)] if points > 0 else []
    curves: dict[str, list[dict[str, Any]]] = {}
    for name in solver_names:
        found = sweep(problem, budgets, solver=name)
        curves[name] = [
            {
                "budget_bytes": b,
                "peak_bytes": s.peak_bytes,
                "recompute_s": s.recompute_time,
                "overhead": step_overhead(problem, s.recompute_time, bool(s.regions)) if eager > 0 else (
                    s.recompute_time / forward_s if forward_s > 0 else 0.0),
                "regions": len(s.regions),
            }
            for b, s in zip(budgets, found)
            if s is not None
        ]
        if tick is not None:
            tick()
    return curves


def step_baseline(problem: Any) -> float:
    """The eager step without checkpointing (seconds), as the plan's summary takes it."""
    return problem.base_step_s - problem.graph_overhead_s


def step_overhead(problem: Any, recompute_s: float, has_regions: bool) -> float:
    """The predicted step over the eager one, minus one: the summary's one overhead (a plan with no regions
    runs the model itself)."""
    eager = step_baseline(problem)
    extra = recompute_s + (problem.graph_overhead_s if has_regions else 0.0)
    return extra / eager if eager > 0 else 0.0


def plan_data(
    plan: Any, problem: Any, curve_solvers: Sequence[str], points: int, *, tick: Callable[[], None] | None = None
) -> dict[str, Any]:
    """What the report needs beyond the plan's own figures: `timeline`, and `curves` where `curve_solvers`
    and `points` ask for them, for plan.stats. Every figure is the plan's own: the timeline's peak is its
    predicted peak, the star its predicted step overhead, and that point is on its solver's curve."""
    out: dict[str, Any] = {
        "timeline": {"plan": timeline_data(problem, plan.spans(), plan.saved_indices(), plan.offloaded_storages()),
                     "baseline": timeline_data(problem, ())},
    }
    if curve_solvers and points > 0:
        out["curves"] = curves_for(plan, problem, curve_solvers, points, tick=tick)
    return out


def curves_for(
    plan: Any, problem: Any, curve_solvers: Sequence[str], points: int, *, tick: Callable[[], None] | None = None
) -> dict[str, Any]:
    """`stats["curves"]`: every solver's memory/overhead curve on `problem`, with the plan's own point (its
    predicted peak and overhead) marked and put on its solver's curve. Tens of solves on a model of a few
    hundred nodes: computed when a report asks for it, not on the way to the plan."""
    forward = problem.total_time
    mark = {
        "solver": plan.solver,
        "peak_bytes": plan.predicted_peak_bytes,
        "recompute_s": plan.predicted_recompute_s,
        "overhead": plan.predicted_overhead if plan.eager_step_s > 0 else (
            plan.predicted_recompute_s / forward if forward > 0 else 0.0),
    }
    curves = curve_data(problem, curve_solvers, points=points, forward_s=forward, tick=tick)
    if plan.solver in curves:
        point = {**({"budget_bytes": plan.budget_bytes} if plan.budget_bytes is not None else {}),
                 **{k: mark[k] for k in ("peak_bytes", "recompute_s", "overhead")}, "regions": len(plan.regions),
                 "this_plan": True}
        curves[plan.solver] = sorted([*curves[plan.solver], point], key=lambda p: p["peak_bytes"])
    return {
        "solvers": curves,
        "baseline": {"peak_bytes": plan.baseline_peak_bytes, "recompute_s": 0.0, "overhead": 0.0},
        "plan": mark,
        "forward_s": forward,
        "overhead": "step" if plan.eager_step_s > 0 else "forward",
    }

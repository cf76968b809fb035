"""From a chosen solution to the Plan record: figures re-simulated, regions named by module path, and
the notes and stats that say how it was chosen (no module yet: lowering builds it)."""

from __future__ import annotations

from typing import Any

from ..capture.trace import flatten_for_graph
from ..lower.offload import targets_of
from ..plan import Plan, Region
from ..plan_check import graph_fingerprint
from ..profile.graph import CostGraph
from ..settings import PlanRequest
from ..solvers.problem import Problem, Solution
from ..solvers.simulate import simulate
from .profiled import Profiled

__all__ = ["plan_from_solution", "plan_record", "own_notes"]


def plan_record(p: Profiled, solution: Solution, notes: list[str], request: PlanRequest,
                extra_notes: list[str] = ()) -> Plan:
    """The Plan of `solution` with every note and stat of how it was chosen."""
    keep = request.solve.own_checkpointing == "keep" and bool(p.own_regions)
    if not p.exact:
        notes = notes + [f"chunked region ({c.chunks} chunks): {c.why}" for c in p.chunks]
    plan = plan_from_solution(
        p.cost, p.problem, solution, p.capture,
        notes=notes + p.capture_notes + p.dist_notes + p.offload_notes + own_notes(p, request.solve.own_checkpointing)
        + list(extra_notes),
        solver_options=dict(request.solve.options), baseline_regions=p.own_regions,
    )
    if p.own_regions or p.capture.builtin_checkpointing:
        plan.stats["own_checkpointing"] = "kept" if keep else "replaced"
        plan.stats["no_checkpoint_peak_bytes"] = p.no_checkpoint_peak_bytes
    plan.model_name = type(p.model).__name__
    plan.problem = p.problem
    dist = p.setup.distributed
    if dist.sharding:
        plan.stats["sharding"] = {"world_size": dist.world_size, "sharding": dist.sharding}
    if p.cost.stages:  # its figures are re-checked the same way (Plan.check_figures)
        plan.stats["profile"] = "stages"
    if not p.exact:
        plan.stats["exact"] = False
        plan.stats["chunks"] = [c.to_dict() for c in p.chunks]
    return plan


def own_notes(p: Profiled, mode: str) -> list[str]:
    """What the plan does with the model's own checkpointing, in words (none for a model without it)."""
    cap = p.capture
    if not (p.own_regions or cap.builtin_checkpointing or p.own_unplaced):
        return []
    paths = list(dict.fromkeys(c.module or "a function" for c in cap.own_checkpoints)) or list(cap.builtin_checkpointing)
    shown = ", ".join(paths[:4]) + (" ..." if len(paths) > 4 else "")
    how = (
        "this plan keeps it and adds regions where the budget needs them"
        if mode == "keep" and p.own_regions
        else "this plan replaces it (plan.module does not use it; the model keeps it)"
    )
    notes = [
        f"the model checkpoints itself ({len(p.own_regions)} regions: {shown}); {how}; the baseline and "
        "the memory saved are those of the model as given"
    ]
    if p.own_unplaced:
        notes.append(
            f"{len(p.own_unplaced)} of the model's own checkpoint calls could not be located in the graph "
            f"({', '.join(dict.fromkeys(p.own_unplaced))}): the baseline counts them as not checkpointed"
        )
    return notes


def _region_times(problem: Problem, regions, kept: set[int]) -> list[float]:
    """Each region's recompute seconds as the plan's total counts them: the simulator's, on the problem's
    node times (refit included), without the kept ops, with its checkpoint call. Regions that do not nest
    recompute independently, so theirs add up to the plan's total; a region holding others counts theirs too."""
    return [simulate(problem, [(s, e)], saved=[i for i in kept if s <= i <= e]).recompute_time for s, e in regions]


def plan_from_solution(
    cost: CostGraph,
    problem: Problem,
    solution: Solution,
    cap,
    *,
    notes: list[str] | tuple[str, ...] = (),
    solver_options: dict[str, Any] | None = None,
    baseline_regions=(),
) -> Plan:
    """Wrap a solver's Solution as a Plan (no module yet); the baseline runs `baseline_regions`
    (the model's own checkpointing: the model as given)."""
    base = simulate(problem, tuple(baseline_regions))
    # offloads the graph can lower (node outputs); one made inside an op stays on the device, and the
    # figures say so
    offload = targets_of(problem, solution.offloaded, solution.regions, solution.saved)
    extra = {"offloaded": tuple(o.storage for o in offload)} if offload else {}
    sim = simulate(problem, solution.regions, saved=solution.saved, **extra)
    saved = cost.saved_bytes
    kept = set(solution.saved)
    depth_of: list[int] = []
    stack: list[tuple[int, int]] = []
    for s, e in solution.regions:
        while stack and stack[-1][1] < s:
            stack.pop()
        depth_of.append(len(stack))
        stack.append((s, e))
    own_times = _region_times(problem, solution.regions, kept)
    regions = []
    for (s, e), depth, own_time in zip(solution.regions, depth_of, own_times):
        mods: list[str] = []
        for n in cost.nodes[s : e + 1]:
            top = n.module
            if top and top not in mods:
                mods.append(top)
        regions.append(
            Region(
                start=s,
                end=e,
                first_node=cost.nodes[s].name,
                last_node=cost.nodes[e].name,
                modules=tuple(_collapse(mods)),
                depth=depth,
                recompute_s=own_time,
                saved_bytes=sum(saved[s : e + 1]),
                saved_ops=tuple(cost.nodes[i].name for i in range(s, e + 1) if i in kept),
                saved_positions=tuple(i for i in range(s, e + 1) if i in kept),
            )
        )
    gm = cap.graph_module
    return Plan(
        solver=solution.solver,
        budget_bytes=solution.budget_bytes,
        baseline_peak_bytes=base.peak_bytes,
        predicted_peak_bytes=sim.peak_bytes,
        predicted_recompute_s=sim.recompute_time,
        baseline_step_s=cost.total_time,
        regions=tuple(regions),
        fingerprint=graph_fingerprint(gm, flatten_for_graph(gm, cap.args, cap.kwargs)),
        capture_method=cap.method,
        solve_time_s=solution.solve_time,
        solver_options=dict(solver_options or {}),
        breakdown=dict(sim.breakdown),
        baseline_breakdown=dict(base.breakdown),
        notes=tuple(notes) + (("captured with torch.export",) if cap.fallback_reason else ()),
        stats={k: v for k, v in solution.stats.items() if k != "breakdown"} | ({"offload": {
            "d2h_bytes_per_s": problem.d2h_bytes_per_s, "h2d_bytes_per_s": problem.h2d_bytes_per_s,
            "host_budget_bytes": problem.host_budget_bytes, "exposed_copy_s": sim.offload_time,
            "d2h_fixed_s": problem.d2h_fixed_s, "h2d_fixed_s": problem.h2d_fixed_s}} if offload else {}),
        offloaded=offload,
        time_source=cost.time_source,
        num_nodes=len(cost.nodes),
        eager_step_s=problem.base_step_s - problem.graph_overhead_s,
        predicted_step_s=problem.base_step_s + sim.recompute_time,
        call_overhead_s=sim.call_time,
        graph_overhead_s=problem.graph_overhead_s,
    )


def _collapse(paths: list[str], limit: int = 8) -> list[str]:
    """Module paths with children of a listed parent dropped; at most `limit` shown."""
    out: list[str] = []
    for p in paths:
        if not any(p == q or p.startswith(q + ".") for q in out):
            out = [q for q in out if not q.startswith(p + ".")] + [p]
    return out[:limit] + ([f"... {len(out) - limit} more"] if len(out) > limit else [])

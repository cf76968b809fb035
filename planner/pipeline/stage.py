"""One pipeline stage planned for the microbatches its schedule holds in flight.

A stage of a `torch.distributed.pipelining` schedule holds, at its peak, `k` microbatches forwarded
and not yet backwarded (`schedule.in_flight`): `k - 1` of them as what their forward left saved, the
`k`-th running its full step. Its memory over one step, in bytes:

    fixed:     parameters + their gradients (kept across microbatches) + optimizer state
    buffers:   the stage's inputs for every microbatch (the first stage's batch, the others' receive
               buffers, which `PipelineStage` allocates once per microbatch) and, but on the last stage,
               a gradient receive buffer per microbatch the size of the stage's output; the gradient
               of the stage's input sent back for the previous microbatch, which the schedule's send
               holds through the next backward (none on the first stage); the caller's targets on
               the last stage (`target_bytes`)
    held:      (k - 1) x what one microbatch's forward leaves saved under the plan (its output included)
    running:   one microbatch's step peak under the plan, gradients already made (the steady state);
               on the last stage with the loss step on top (below)
    outputs:   on the last stage, the outputs and losses of the microbatches already done, which the
               schedule keeps to return them at the end of the step, when it concatenates the outputs
               (twice their bytes)

The last stage's loss runs between its forward and its backward, outside the stage's graph: its own
peak (`loss_peak_bytes`, the output's gradient included) sits on the forward's end, the output's
gradient on the first backward step (the profile's own loss, a sum, hands back an expanded scalar),
and what the loss leaves alive (`loss_kept_bytes`: the loss, which the schedule keeps) on every
backward step after.

The held and running figures depend on the plan, so the stage is planned by a search over the budget
its single-microbatch step is given: the largest inner budget whose plan keeps the whole stage within
the per-GPU budget, found by bisection on bytes, each probe solved and judged by the simulator.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ..errors import InputError
from ..solvers.problem import Problem
from ..solvers.registry import SOLVERS, InfeasibleBudgetError, SolverResult, solve
from ..solvers.simulate import simulate
from .schedule import in_flight

__all__ = ["StageFigures", "StageSpec", "stage_figures", "per_layer_regions", "layer_subsets", "search_inner_budget",
           "chosen_solver"]


@dataclass(frozen=True)
class StageSpec:
    """Where a stage sits in its pipeline: what the schedule and the send/receive buffers ask of it."""

    stage: int
    n_stages: int
    schedule: type
    n_microbatches: int
    input_bytes: int
    """One microbatch's stage inputs (bytes)."""
    output_bytes: int
    """One microbatch's stage output (bytes)."""
    target_bytes: int = 0
    """The targets the last stage's loss reads, whole batch (bytes)."""
    loss_peak_bytes: int = 0
    """The last stage's loss step on one microbatch's output: the most bytes its forward and backward
    hold at once beyond the output and the target (measured, `measure_loss`), the output's gradient
    included."""
    loss_kept_bytes: int = 0
    """What the last stage's loss step leaves alive once its backward is done, the output's gradient
    excluded: the loss, which the schedule keeps until the step ends (bytes, one microbatch)."""

    @property
    def is_last(self) -> bool:
        return self.stage == self.n_stages - 1

    @property
    def in_flight(self) -> int:
        return in_flight(self.schedule, self.n_stages, self.n_microbatches, self.stage)


@dataclass(frozen=True)
class StageFigures:
    """A stage's predicted memory under one plan, by part (bytes), and its recompute (seconds)."""

    peak_bytes: int
    in_flight: int
    held_bytes: int
    """What one microbatch's forward leaves saved (its output included)."""
    running_peak_bytes: int
    """One microbatch's step peak with the gradients already made, fixed memory included."""
    buffer_bytes: int
    recompute_s: float
    parts: dict[str, int] = field(default_factory=dict)


def steady_problem(problem: Problem) -> Problem:
    """The step of a microbatch after the first: every parameter gradient already made (fixed memory)."""
    grads = sum(n.param_grad_bytes for n in problem.nodes)
    nodes = tuple(dataclasses.replace(n, param_grad_bytes=0) for n in problem.nodes)
    return dataclasses.replace(problem, nodes=nodes, param_bytes=problem.param_bytes + grads)


def stage_figures(problem: Problem, spec: StageSpec, regions=(), saved=()) -> StageFigures:
    """The stage's peak over a pipeline step when every microbatch runs the plan (regions, saved)."""
    steady = steady_problem(problem)
    sim = simulate(steady, regions, saved=saved, timeline=True)
    forward = [b for phase, _, b in sim.timeline if phase == "forward"]
    held = (forward[-1] if forward else steady.fixed_bytes) - steady.fixed_bytes
    k = spec.in_flight
    # problem.input_bytes is the running microbatch's input: one of the n_microbatches buffers
    inputs = spec.n_microbatches * spec.input_bytes - problem.input_bytes
    grad_recv = 0 if spec.is_last else spec.n_microbatches * spec.output_bytes
    # The gradient of the stage's input, sent back after each backward: the schedule's send ops hold the
    # previous microbatch's through the next forward and backward (measured at the backward's peak).
    grad_send = 0 if spec.stage == 0 else spec.input_bytes
    done = spec.n_microbatches - 1  # the last stage's microbatches already through, at the last backward
    outputs_kept = done * (spec.output_bytes + spec.loss_kept_bytes) if spec.is_last else 0
    targets = spec.target_bytes if spec.is_last else 0
    buffers = inputs + grad_recv + grad_send + targets
    running = sim.peak_bytes
    if spec.is_last:
        running = _with_loss(sim.timeline, problem.n, spec)
    peak = running + (k - 1) * held + buffers + outputs_kept
    if spec.is_last:  # the step's end: the kept outputs and their concatenation, which the schedule returns
        peak = max(peak, steady.fixed_bytes + buffers + 2 * spec.n_microbatches * spec.output_bytes
                   + spec.n_microbatches * spec.loss_kept_bytes)
    parts = {"running": running, "held": (k - 1) * held, "buffers": buffers, "outputs_kept": outputs_kept}
    return StageFigures(peak, k, held, running, buffers, sim.recompute_time, parts)


def _with_loss(timeline: list[tuple[str, int, int]], n: int, spec: StageSpec) -> int:
    """One microbatch's step peak on the last stage with the schedule's loss step in it (bytes): the loss's
    peak on the forward's end, the output's gradient on the first backward step (node n - 1, whose
    backward consumes it), the kept loss on the backward steps after."""
    forward = [b for phase, _, b in timeline if phase == "forward"]
    most = max(forward, default=0)
    if forward:
        most = max(most, forward[-1] + spec.loss_peak_bytes)
    for phase, node, b in timeline:
        if phase != "forward":
            most = max(most, b + spec.loss_kept_bytes + (spec.output_bytes if node == n - 1 else 0))
    return most


def per_layer_regions(problem: Problem, prefix: str) -> tuple[tuple[int, int], ...]:
    """One region per child of module `prefix` (e.g. 'blocks': blocks.0, blocks.1, ...): per-layer
    checkpointing, the policy torchtitan and Megatron apply to every stage."""
    spans: dict[str, list[int]] = {}
    for i, node in enumerate(problem.nodes):
        parts = node.module.split(".")
        head = prefix.split(".")
        if len(parts) > len(head) and parts[: len(head)] == head:
            span = spans.setdefault(".".join(parts[: len(head) + 1]), [i, i])
            span[1] = i
    return tuple(sorted((a, b) for a, b in spans.values()))


def layer_subsets(layers: tuple[tuple[int, int], ...], exhaustive_up_to: int = 4) -> list[tuple[tuple[int, int], ...]]:
    """Per-layer checkpointing on some of the layers only (Megatron's partial checkpointing): what a stage
    holding several microbatches needs, where checkpointing every layer recomputes more than its budget
    asks and a solver's plans, cut for one microbatch's peak, leave too much saved per microbatch. Every
    non-empty subset up to `exhaustive_up_to` layers (each is filled by `fill_kept`, one simulation per
    node it tries), then the first j and the last j layers."""
    n = len(layers)
    if n <= exhaustive_up_to:
        return [tuple(r for i, r in enumerate(layers) if mask >> i & 1) for mask in range(1, 1 << n)]
    return [layers[:j] for j in range(1, n + 1)] + [layers[-j:] for j in range(1, n)]


def _flat(regions: tuple[tuple[int, int], ...]) -> bool:
    """Regions sorted and disjoint: the plans whose regions may keep nodes (selective regions do not nest)."""
    return all(b < a for (_, b), (a, _) in zip(regions, regions[1:]))


def fill_kept(problem: Problem, spec: StageSpec, budget_bytes: int, regions) -> tuple[tuple[int, ...], StageFigures] | None:
    """The nodes inside `regions` a selective cache keeps (`saved`), added while the whole stage still fits
    `budget_bytes`: the most recompute time per byte kept first, each judged on the stage's peak. What a
    plan keeps is held once per microbatch in flight, so the room a stage has is filled here, not by a
    solver's single-microbatch budget. None when `regions` alone does not fit."""
    figs = stage_figures(problem, spec, regions)
    if figs.peak_bytes > budget_bytes:
        return None
    made = [0] * problem.n  # bytes each node's outputs take
    for st in problem.storages:
        made[st.producer] += st.nbytes
    inside = {i for a, b in regions for i in range(a, b + 1)}
    order = sorted((i for i in inside if problem.nodes[i].saveable and problem.nodes[i].time > 0),
                   key=lambda i: -problem.nodes[i].time / max(made[i], 1))
    kept: list[int] = []
    for i in order:
        trial = stage_figures(problem, spec, regions, tuple(kept + [i]))
        if trial.peak_bytes <= budget_bytes and trial.recompute_s < figs.recompute_s:
            kept.append(i)
            figs = trial
    return tuple(sorted(kept)), figs


CHOSEN = "pipeline_stage"


def chosen_plan(problem: Problem, budget_bytes: int | None = None, *, regions=(), saved=()) -> SolverResult:
    """The plan the stage search chose (regions and kept nodes as given), so that the planner lowers it
    and records it as any other: the search judges plans on the whole stage, which no solver sees."""
    return SolverResult(regions=tuple(tuple(r) for r in regions), saved=tuple(saved), stats={CHOSEN: True})


@contextmanager
def chosen_solver() -> Iterator[None]:
    """`chosen_plan` registered as solver 'pipeline_stage' while a stage is planned, and only then: it is
    no solver a user would pick, nor one the CLI's curves should list."""
    outer = CHOSEN in SOLVERS  # nested (a probe filled inside the candidates' loop): the outer one pops it
    SOLVERS[CHOSEN] = chosen_plan
    try:
        yield
    finally:
        if not outer:
            SOLVERS.pop(CHOSEN, None)


def search_inner_budget(problem: Problem, spec: StageSpec, budget_bytes: int, solver: str = "auto",
                        solver_options: dict[str, Any] | None = None, tolerance: int = 1 << 12,
                        candidates: tuple = ()) -> tuple[int, Any, StageFigures]:
    """The plan with the least recompute that keeps the whole stage within `budget_bytes`, and the
    single-microbatch budget it was solved at.

    Bisection on bytes between the fixed memory and the budget; each probe is solved and the stage's
    peak simulated (`stage_figures`). A solver minimises one microbatch's peak, not what its forward
    leaves saved, which the other in-flight microbatches multiply: `candidates` (regions tuples, such as
    per-layer checkpointing) and the `uniform` solver's plans are judged beside the probes. The stage's
    peak need not be monotone in the inner budget, so every fitting plan is kept and the best returned.
    Each candidate and each probe's plan is also judged with the nodes inside its regions that the stage has
    room to keep (`fill_kept`)."""
    options = dict(solver_options or {})
    lo, hi = problem.fixed_bytes, budget_bytes
    best = None

    filled_regions: set = set()

    def consider(inner: int, sol: Any, fill: bool = True) -> None:
        nonlocal best
        figs = stage_figures(problem, spec, sol.regions, sol.saved)
        if figs.peak_bytes <= budget_bytes and (best is None or (figs.recompute_s, figs.peak_bytes) <
                                                (best[2].recompute_s, best[2].peak_bytes)):
            best = (inner, sol, figs)
        regions = tuple(tuple(r) for r in sol.regions)
        if fill and regions and regions not in filled_regions and _flat(regions):
            # A probe's regions, cut for one microbatch's peak, filled with the nodes the stage has room
            # to keep: on a 2-layer stage holding 3 microbatches, dp's probes filled recompute 0.023 ms
            # where the probes as solved recompute 0.027 ms.
            filled_regions.add(regions)
            filled = fill_kept(problem, spec, budget_bytes, regions)
            if filled is not None and filled[0]:
                with chosen_solver():
                    kept = solve(problem, None, CHOSEN, regions=regions, saved=filled[0])
                consider(simulate(problem, regions, saved=filled[0]).peak_bytes, kept, fill=False)

    with chosen_solver():
        for regions in candidates:
            consider(simulate(problem, regions).peak_bytes, solve(problem, None, CHOSEN, regions=regions))
    for segments in range(1, 2 * problem.n + 1):  # Chen et al.'s segments, as many as the graph has
        try:
            sol = solve(problem, None, "uniform", max_segments=segments)
        except (ValueError, InfeasibleBudgetError):
            break
        consider(sol.peak_bytes, sol)
        if segments > 64:
            break
    while hi - lo > tolerance:
        mid = (lo + hi) // 2
        try:
            sol = solve(problem, mid, solver, **options)
        except InfeasibleBudgetError:  # no plan this small
            lo = mid
            continue
        before = best
        consider(mid, sol)
        if stage_figures(problem, spec, sol.regions, sol.saved).peak_bytes <= budget_bytes or best is not before:
            lo = mid
        else:
            hi = mid
    if best is None:
        raise InputError(f"budget: no plan keeps stage {spec.stage} of {spec.n_stages} ({spec.in_flight} microbatches "
                         f"in flight under {spec.schedule.__name__}) within {budget_bytes} bytes")
    return best

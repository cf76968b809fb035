"""A captured and profiled model: what every step of choosing reads.

`profiled()` turns one profile into the problem the solvers see (optimizer state and sharding counted,
the device's cost refit applied) and places the model's own checkpoint calls in it. The safety net
narrows `problem` when a plan's step differs from the model's; `floors` caches the least-memory plans
that feasibility is judged on (choose/budget.py), so it is cleared with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..capture.frozen import ValueGuard
from ..capture.own_checkpoint import own_spans
from ..capture.trace import Capture
from ..distributed import optimizer_state_bytes, rank_problem
from ..lower.apply import whole_module_spans
from ..lower.chunk import ChunkSpec
from ..profile.copy_bandwidth import CopyBandwidth, copy_bandwidth, free_host_bytes, offload_note
from ..profile.graph import CostGraph
from ..profile.profiler import ProfileConfig
from ..profile.timing_store import TimingStore, open_store
from ..settings import Setup
from ..solvers.problem import Problem
from ..solvers.simulate import simulate
from .race.refit import learned
from .regions import laminar, per_block_regions

__all__ = ["Profiled", "profiled", "EVAL_NOTE", "REFERENCE_TOLERANCE"]

Regions = tuple[tuple[int, int], ...]

EVAL_NOTE = (
    "the model was in eval mode: planned for its training step (train mode: dropout on, BatchNorm on batch "
    "statistics), which plan.module runs in train mode; in eval mode plan.module runs the model as given"
)


REFERENCE_TOLERANCE = 0.05
"""How far the reference step's predicted peak may exceed the budget: the simulator's error on whole
steps (it errs high: per-block steps are predicted up to about 3 % over their measured peak)."""


@dataclass(eq=False)
class Profiled:
    """One model's capture and profile, as the choosing steps read them."""

    model: torch.nn.Module
    capture: Capture
    cost: CostGraph
    problem: Problem
    """What the solvers see: bytes and times per node, fixed memory (parameters, inputs, optimizer state)."""
    setup: Setup
    own_regions: Regions = ()
    """Node spans of the model's own checkpoint calls (the model as given recomputes these)."""
    own_unplaced: list[str] = field(default_factory=list)
    """The model's own checkpoint calls that could not be located in the graph."""
    chunks: list[ChunkSpec] = field(default_factory=list)
    """Token-wise groups run in chunks (exact=False only)."""
    capture_notes: list[str] = field(default_factory=list)
    dist_notes: list[str] = field(default_factory=list)
    bandwidth: CopyBandwidth | None = None
    """The host copy bandwidth the problem prices offload at (profile/copy_bandwidth.py)."""
    offload_notes: list[str] = field(default_factory=list)
    """Why offload was not considered, where it was not (one line)."""
    values: ValueGuard | None = None
    """Python values the graph holds as constants, checked before each training call of plan.module."""
    floors: dict[tuple, Any] = field(default_factory=dict)
    """The least-memory plans by solver and options (budget.floor_of): the floor, every candidate of it
    (key + ("all",)) and the floor polished (key + ("polished",))."""
    _reference: tuple[Regions, tuple[str, ...]] | None = None
    _reference_peak: int | None = None

    @property
    def profile_config(self) -> ProfileConfig:
        return ProfileConfig.or_default(self.setup.profile)

    @property
    def real(self) -> bool:
        """Whether the model runs on real tensors (not fake ones): steps can be checked and timed."""
        return not self.profile_config.meta and not self.setup.meta and not any(
            t.device.type == "meta" for t in list(self.model.parameters()) + list(self.model.buffers())
        )

    @property
    def check(self) -> bool:
        """Whether each plan's step is checked against the model's before it is returned."""
        return self.setup.exactness.check_step and self.real

    @property
    def exact(self) -> bool:
        return self.setup.exactness.exact

    @property
    def names(self) -> list[str]:
        return [n.name for n in self.problem.nodes]

    @property
    def baseline_peak_bytes(self) -> int:
        """Predicted peak of one step of the model as given (its own checkpointing included)."""
        return simulate(self.problem, self.own_regions).peak_bytes

    @property
    def no_checkpoint_peak_bytes(self) -> int:
        """Predicted peak of one step with no checkpointing at all."""
        return simulate(self.problem, ()).peak_bytes

    @property
    def reference_regions(self) -> Regions:
        """The node spans of the reference step's checkpointed blocks (see `reference_paths`); () for the
        model's own step."""
        return self._reference_plan()[0]

    @property
    def reference_paths(self) -> tuple[str, ...]:
        """The step a plan's is checked and raced against. Where profiling ran the plain step: the model's
        own (no path). Where it never did (a stage-wise profile, `cost.stages`), so that nothing after
        profiling needs the plain step's memory: the model's own code with each numbered block under
        torch.utils.checkpoint, as transformers' per-layer checkpointing runs it (torch's checkpoint, not
        this planner's rewrite, so a recompute the planner gets wrong cannot hide in the reference). The
        model's own step where its blocks are not whole modules, or checkpointing them saves nothing."""
        return self._reference_plan()[1]

    def _reference_plan(self) -> tuple[Regions, tuple[str, ...]]:
        # Computed on the problem as profiled, before the safety net forbids any node: the reference is the
        # model's own code under torch's checkpoint, whatever this planner may no longer recompute.
        if self._reference is None:
            self._reference = ((), ())
            self._reference_peak = self.no_checkpoint_peak_bytes
            if self.cost.stages and whole_modules_allowed(self):
                blocks = per_block_regions(self.problem, self.capture.graph_module)
                whole = whole_module_spans(self.problem, self.model, blocks) if blocks else None
                whole = _repeated(self.model, whole or [])
                if whole:
                    spans = tuple(span for span, _ in whole)
                    peak = simulate(self.problem, spans).peak_bytes
                    if peak < self._reference_peak:
                        self._reference, self._reference_peak = (spans, tuple(path for _, path in whole)), peak
        return self._reference

    @property
    def reference_peak_bytes(self) -> int:
        """The reference step's predicted peak (bytes)."""
        self._reference_plan()
        return self._reference_peak

    def reference_fits(self, budget: int) -> bool:
        """Whether the reference step is predicted within `budget` (bytes), to the simulator's tolerance."""
        return self.reference_peak_bytes <= budget * (1 + REFERENCE_TOLERANCE)

    def store(self) -> TimingStore:
        """The device's timing store (plans kept, autotune choices, the cost refit)."""
        return open_store(self.cost.device, self.profile_config.timing_store)

    def narrowed(self, problem: Problem) -> None:
        """The safety net forbade some nodes: every cached floor plan is stale."""
        self._reference_plan()  # fixed on the problem as profiled (see there)
        self.problem = problem
        self.floors.clear()


def profiled(model: torch.nn.Module, capture: Capture, cost: CostGraph, setup: Setup, *,
             chunks: list[ChunkSpec] | None = None, capture_notes: list[str] | None = None) -> Profiled:
    """The problem, the model's own regions and the notes of one profile (the bytes pass's or the timed one)."""
    config = ProfileConfig.or_default(setup.profile)
    # offload is priced at the device's host copy bandwidth (0 on the CPU: the solvers never offload there)
    bandwidth = copy_bandwidth("meta" if setup.meta or config.meta else cost.device, store=config.timing_store,
                               simulated=setup.offload.bandwidth, fixed=setup.offload.fixed_s,
                               timed=not config.flop_times)
    host = setup.offload.host_budget_bytes(free_host_bytes()) if bandwidth.usable else 0
    dist = setup.distributed
    problem, dist_notes = rank_problem(cost, model, optimizer_bytes=optimizer_state_bytes(model, setup.optimizer),
                                       world_size=dist.world_size, sharding=dist.sharding,
                                       d2h_bytes_per_s=bandwidth.d2h_bytes_per_s,
                                       h2d_bytes_per_s=bandwidth.h2d_bytes_per_s, host_budget_bytes=host)
    if bandwidth.usable:  # each copy's fixed cost (launch, round trip, the hooks' host work), seconds each way
        problem = replace(problem, d2h_fixed_s=bandwidth.d2h_fixed_s, h2d_fixed_s=bandwidth.h2d_fixed_s)
    note = offload_note(bandwidth, host)
    if cost.time_source == "fitted":  # the device's refit from earlier autotune rounds (race/refit.py)
        problem, fit = learned(problem, open_store(cost.device, config.timing_store))
        if fit is not None:
            dist_notes = [*dist_notes, (
                f"times refit on this device from {fit.rows} measured plans: node times x{fit.scale:.2f}, "
                f"{fit.per_region_s * 1e6:.0f} us per region")]
    nodes = cost.nodes
    spans, unplaced = own_spans(
        capture.own_checkpoints, [n.name for n in nodes], [n.module for n in nodes], [n.recomputable for n in nodes]
    )
    return Profiled(
        model=model, capture=capture, cost=cost, problem=problem, setup=setup, own_regions=laminar(problem, spans),
        own_unplaced=unplaced, chunks=list(chunks or []), capture_notes=[*(capture_notes or []), *cost.notes],
        dist_notes=list(dist_notes), bandwidth=bandwidth, offload_notes=[note] if note else [],
    )


def _repeated(model: torch.nn.Module, whole: list[tuple[tuple[int, int], str]]) -> list[tuple[tuple[int, int], str]]:
    """The (span, path) of modules that are one of several siblings of their class (`layers.0`..`layers.N`),
    not the numbered parts of one heterogeneous Sequential (a stem's BatchNorm and ReLU, whose own
    checkpoint would hold more than it frees)."""
    def key(path: str) -> tuple[str, str]:
        return path.rpartition(".")[0], type(model.get_submodule(path)).__name__

    counts: dict[tuple[str, str], int] = {}
    for _, path in whole:
        counts[key(path)] = counts.get(key(path), 0) + 1
    return [(span, path) for span, path in whole if counts[key(path)] >= 2]


def whole_modules_allowed(p: Profiled) -> bool:
    """Whether hand-written plans may race as the model's own code (`checkpointed_copy`): not where
    that code differs from the planned step (its own checkpointing, eval mode, chunked groups)."""
    cap = p.capture
    own = p.own_regions or cap.builtin_checkpointing or p.own_unplaced or any(
        getattr(m, "gradient_checkpointing", False) is True for m in p.model.modules())
    return not own and EVAL_NOTE not in p.capture_notes and not p.chunks

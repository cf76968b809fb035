"""Typed settings of `optimize()`: the budget, and each group of knobs with a docstring per field.

`optimize()` keeps its keyword arguments (the README's calls); it builds these once, and every stage
reads the group it needs. What is fixed for a captured and profiled model (how to capture, profile,
check) is a `Setup`; what may change from one budget to the next is a `PlanRequest`.

Torch-free: a setting is checked here, where it is made, not by the stage that reads it.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import InputError
from .solvers.registry import get_solver

__all__ = [
    "Budget", "SolveConfig", "ExactnessConfig", "DistributedConfig", "CompileConfig", "OffloadConfig", "Setup",
    "PlanRequest",
    "ON_LARGER_SHAPE", "OWN_CHECKPOINTING", "LOWERINGS", "SHARDING", "OUTPUTS",
]

ON_LARGER_SHAPE = ("error", "replan")
OWN_CHECKPOINTING = ("replace", "keep")
LOWERINGS = ("best", "regions", "knapsack")
SHARDING = ("ddp", "fsdp")
OUTPUTS = ("all", "loss")


@dataclass(frozen=True, kw_only=True)
class Budget:
    """The peak memory one training step may reach, as the caller gave it (at most one of the three).

    The one conversion to bytes is `in_bytes`: an absolute budget is itself; a fraction of the
    activations is the fixed memory plus that fraction of what the step as given holds above it.
    """

    gb: float | None = None
    """Gigabytes (1e9 bytes): parameters, gradients, activations, temporaries, optimizer state."""
    nbytes: int | None = None
    """The same in bytes."""
    activation_fraction: float | None = None
    """0 < f <= 1: fixed memory plus f x the activation memory of the step as given (torch.compile's
    memory-budget knob, in our units)."""
    safety_margin: float = 0.02
    """Fraction of the budget's activation part reserved for what the simulator does not see (the
    allocator's rounding on a GPU, workspaces that change with sizes): the solvers plan for
    `budget - floor(margin * (budget - fixed))`."""

    def __post_init__(self) -> None:
        if self.gb is not None and self.nbytes is not None:
            raise InputError("budget: give budget_gb or budget_bytes, not both")
        if self.gb is not None and not self.gb > 0:
            raise InputError(f"budget_gb: {self.gb} must be positive")
        if self.nbytes is not None and not self.nbytes > 0:
            raise InputError(f"budget_bytes: {self.nbytes} must be positive")
        if self.activation_fraction is not None:
            if self.gb is not None or self.nbytes is not None:
                raise InputError("activation_budget: give it or a budget in bytes/GB, not both")
            if not 0 < self.activation_fraction <= 1:
                raise InputError(f"activation_budget: {self.activation_fraction} must be in (0, 1]")
        if not 0 <= self.safety_margin < 1:
            raise InputError(f"safety_margin: {self.safety_margin} must be in [0, 1)")

    @classmethod
    def of(cls, budget_gb: float | None = None, budget_bytes: int | None = None,
           activation_budget: float | None = None, safety_margin: float = 0.02) -> Budget:
        """From `optimize()`'s keywords."""
        return cls(gb=budget_gb, nbytes=budget_bytes, activation_fraction=activation_budget,
                   safety_margin=safety_margin)

    @property
    def given(self) -> bool:
        """Whether the caller named a budget (else: the knee of the memory/recompute curve)."""
        return (self.gb, self.nbytes, self.activation_fraction) != (None, None, None)

    @property
    def absolute_bytes(self) -> int | None:
        """The budget in bytes when given in bytes or GB; None for a fraction or no budget."""
        if self.gb is not None:
            return int(self.gb * 1e9)
        return None if self.nbytes is None else int(self.nbytes)

    def in_bytes(self, fixed_bytes: int, as_given_peak_bytes: int) -> int | None:
        """The budget in bytes for a step whose fixed memory and peak as given are these (bytes)."""
        if self.activation_fraction is None:
            return self.absolute_bytes
        return int(fixed_bytes + self.activation_fraction * (as_given_peak_bytes - fixed_bytes))

    def keywords(self) -> dict[str, Any]:
        """As `optimize()`'s budget keywords (PlanRequest.keywords reads them)."""
        return dict(budget_gb=self.gb, budget_bytes=self.nbytes, activation_budget=self.activation_fraction,
                    safety_margin=self.safety_margin)


@dataclass(frozen=True, kw_only=True)
class SolveConfig:
    """Which solver chooses the regions, and what it may change of the model's own checkpointing."""

    solver: str = "auto"
    """A registered solver (`ckpt_planner.solvers.SOLVERS`); an unknown name is an error listing them."""
    options: Mapping[str, Any] = field(default_factory=dict)
    """Keyword options of that solver (`time_limit` for the MILP, ...)."""
    own_checkpointing: str = "replace"
    """For a model that checkpoints itself: 'replace' plans the plain graph freely; 'keep' keeps its
    regions and adds regions where the budget needs them."""

    def __post_init__(self) -> None:
        get_solver(self.solver)  # an unknown name fails here, before any work, listing the valid ones
        if self.own_checkpointing not in OWN_CHECKPOINTING:
            raise InputError(f"own_checkpointing: {self.own_checkpointing!r} is not one of {', '.join(OWN_CHECKPOINTING)}")
        object.__setattr__(self, "options", dict(self.options or {}))


@dataclass(frozen=True, kw_only=True)
class ExactnessConfig:
    """How close the plan's training step must be to the model's, and whether that is checked."""

    exact: bool = True
    """True: outputs and gradients bitwise equal to the model's step. False also admits plans that run
    token-wise work in chunks (sums in another order): allclose in the model's dtype."""
    check_step: bool = True
    """Before a plan is returned, one step of its module is compared with one of the model (outputs,
    gradients, buffers); a plan that differs is solved again without what differed. Formerly
    `exact_check`. Nothing runs on fake tensors, so nothing is checked there."""


@dataclass(frozen=True, kw_only=True)
class DistributedConfig:
    """How the budget counts per rank under data parallelism."""

    world_size: int = 1
    """Ranks the step is split over; the example inputs are one rank's batch."""
    sharding: str | None = None
    """'ddp' (parameters, gradients, optimizer state replicated) or 'fsdp' (divided by world_size)."""

    def __post_init__(self) -> None:
        if not isinstance(self.world_size, int) or isinstance(self.world_size, bool) or self.world_size < 1:
            raise InputError(f"world_size: {self.world_size!r} must be a positive integer")
        if self.sharding is not None and self.sharding not in SHARDING:
            raise InputError(f"sharding: {self.sharding!r} is not one of {', '.join(SHARDING)}")
        if self.world_size > 1 and self.sharding is None:
            raise InputError(f"sharding: give 'ddp' or 'fsdp' with world_size={self.world_size}")


@dataclass(frozen=True, kw_only=True)
class CompileConfig:
    """The plan lowered into torch.compile."""

    enabled: bool = False
    """plan.module runs its training step under torch.compile (inductor, fullgraph); the budget is the
    compiled step's measured allocator peak."""
    lowering: str = "best"
    """'regions' (checkpoint regions), 'knapsack' (our knapsack picks what inductor's partitioner
    recomputes) or 'best' (both; the faster compiled step that fits)."""

    def __post_init__(self) -> None:
        if self.lowering not in LOWERINGS:
            raise InputError(f"lowering: {self.lowering!r} is not one of {', '.join(LOWERINGS)}")
        if self.lowering != "best" and not self.enabled:
            raise InputError(f"lowering: {self.lowering!r} applies to compiled plans only; pass compile=True (--compile) "
                             "or drop lowering")


def _number(v: Any) -> bool:
    """A finite int or float (not a bool)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass(frozen=True, kw_only=True)
class OffloadConfig:
    """Offload: a kept activation copied to pinned host memory in the forward and fetched back for its
    backward, where the device's copy bandwidth makes that cheaper than recomputing it."""

    host_budget_gb: float | None = None
    """Pinned host memory (1e9 bytes) offloaded activations may hold at once. None: half of the host
    memory free when the model is profiled; 0: never offload."""
    bandwidth: tuple[float, float] | None = None
    """(device-to-host, host-to-device) copy bandwidth in bytes/s, for simulation and testing: used instead
    of the bandwidth measured on a CUDA device, and on the CPU, where no copy frees device memory (0 there
    otherwise, so the solvers never offload). None: measured (profile/copy_bandwidth.py). A third entry
    (optimize's `offload_bandwidth=(d2h, h2d, seconds)`) sets `fixed_s` for both directions."""
    fixed_s: tuple[float, float] | None = None
    """(device-to-host, host-to-device) seconds each offloaded storage's copy costs beyond its bytes (the
    copy's launch and round trip, the offload hooks' host work), for simulation and testing; a number sets
    both. None: measured on the device with the bandwidth (profile/copy_bandwidth.py `fixed_seconds`); with
    a simulated bandwidth, measured where the profile measures node times and 0 where it does not."""

    def __post_init__(self) -> None:
        if self.host_budget_gb is not None and not (_number(self.host_budget_gb) and self.host_budget_gb >= 0):
            raise InputError(f"host_budget_gb: {self.host_budget_gb!r} must be a finite number of GB >= 0 (or None)")
        if self.bandwidth is not None:
            if not (isinstance(self.bandwidth, (tuple, list)) and len(self.bandwidth) in (2, 3)
                    and all(_number(b) and b >= 0 for b in self.bandwidth)):
                raise InputError(f"offload_bandwidth: {self.bandwidth!r} must be (device-to-host, host-to-device) "
                                 "bytes/s, two finite numbers >= 0, and optionally a third: seconds per copy")
            if len(self.bandwidth) == 3 and self.fixed_s is None:
                object.__setattr__(self, "fixed_s", self.bandwidth[2])
            object.__setattr__(self, "bandwidth", (float(self.bandwidth[0]), float(self.bandwidth[1])))
        if self.fixed_s is not None:
            fixed = (self.fixed_s, self.fixed_s) if _number(self.fixed_s) else self.fixed_s
            if not (isinstance(fixed, (tuple, list)) and len(fixed) == 2 and all(_number(f) and f >= 0 for f in fixed)):
                raise InputError(f"offload fixed_s: {self.fixed_s!r} must be seconds per copy, a finite number >= 0 "
                                 "or (device-to-host, host-to-device)")
            object.__setattr__(self, "fixed_s", (float(fixed[0]), float(fixed[1])))

    def host_budget_bytes(self, free_host_bytes: int) -> int:
        """The host budget in bytes, given the host memory free now (bytes)."""
        if self.host_budget_gb is not None:
            return int(self.host_budget_gb * 1e9)
        return max(0, int(free_host_bytes) // 2)


@dataclass(frozen=True, kw_only=True)
class Setup:
    """What is fixed once a model is captured and profiled: one `Planner` serves many `PlanRequest`s."""

    device: Any = None
    """Where to profile: None (the model's device), 'cpu', 'cuda', or 'meta' (fake tensors, FLOP times)."""
    optimizer: Any = None
    """Optimizer whose state counts in the budget: None, 'sgd', 'sgd-momentum', 'adam', 'adamw' or an instance."""
    capture_method: str = "auto"
    """'auto' (torch.fx, else torch.export), 'fx' or 'export'."""
    profile: Any = None
    """A `ProfileConfig` (how to measure per-node costs); None: its defaults."""
    partial: bool = True
    """When the whole model cannot be captured, plan its largest capturable submodules and run the rest eagerly."""
    exactness: ExactnessConfig = ExactnessConfig()
    """Exact or chunked plans, and the check of each plan's step."""
    distributed: DistributedConfig = DistributedConfig()
    """Per-rank budgets under DDP or FSDP."""
    compile: CompileConfig = CompileConfig()
    """The plan lowered into torch.compile."""
    offload: OffloadConfig = OffloadConfig()
    """Activations offloaded to host memory: the host budget and (for simulation) the copy bandwidth."""
    outputs: str = "all"
    """What the planned module returns. 'all': everything the model returns. 'loss': the model's output
    of the same type with `loss` alone set and every other field None (a model returning a 0-dim tensor:
    that tensor), as Liger and Cut-Cross-Entropy users train: the graph is captured without the logits
    as an output, so they are freed after the loss (or, with exact=False, never made whole). A model that
    computes no loss (a transformers model given no `labels`) is refused in one line (lower/outputs.py)."""

    def __post_init__(self) -> None:
        if self.outputs not in OUTPUTS:
            raise InputError(f"outputs: {self.outputs!r} is not one of {', '.join(OUTPUTS)}")
        if not self.exactness.exact and (self.compile.enabled or self.distributed.world_size != 1):
            raise InputError("exact: exact=False (chunked token-wise work) is planned eagerly on one rank; "
                             "drop compile=True / world_size or keep exact=True")
        if self.compile.enabled and self.meta:
            raise InputError("compile: compile=True (--compile) plans are compiled and measured on real tensors, "
                             "which the meta device has none of; plan on cpu/cuda or drop compile=True")
        if self.compile.enabled and self.distributed.world_size != 1:
            raise InputError("compile: sharded plans (world_size > 1) are not measured under torch.compile; "
                             "drop compile=True or plan one rank with world_size=1")

    @property
    def meta(self) -> bool:
        """Planning on fake tensors (device='meta')."""
        return self.device is not None and str(self.device).split(":")[0] == "meta"

    @classmethod
    def of(cls, *, device: Any = None, optimizer: Any = None, capture_method: str = "auto", profile_config: Any = None,
           partial: bool = True, exact: bool = True, check_step: bool = True, world_size: int = 1,
           sharding: str | None = None, compile: bool = False, lowering: str = "best", outputs: str = "all",
           host_budget_gb: float | None = None, offload_bandwidth: tuple[float, float] | None = None,
           exact_check: bool | None = None) -> Setup:
        """From the keywords `optimize()` and `Planner()` take (`exact_check`: check_step's former name)."""
        if exact_check is not None:
            warnings.warn("exact_check is now check_step", DeprecationWarning, stacklevel=3)
            check_step = exact_check
        return cls(
            device=device, optimizer=optimizer, capture_method=capture_method, profile=profile_config, partial=partial,
            exactness=ExactnessConfig(exact=exact, check_step=check_step),
            distributed=DistributedConfig(world_size=world_size, sharding=sharding),
            compile=CompileConfig(enabled=compile, lowering=lowering), outputs=outputs,
            offload=OffloadConfig(host_budget_gb=host_budget_gb, bandwidth=offload_bandwidth),
        )


@dataclass(frozen=True, kw_only=True)
class PlanRequest:
    """What one plan is asked for: the budget, the solver, larger shapes, and the measured choice."""

    budget: Budget = Budget()
    """The peak memory of one step (none: the fastest plan down to the knee of the trade-off curve)."""
    solve: SolveConfig = SolveConfig()
    """The solver and what it may change of the model's own checkpointing."""
    on_larger_shape: str = "error"
    """A call larger than the example inputs: 'error' (ShapeError) or 'replan' (planned again at its shape,
    cached per shape). Smaller calls run the plan as it is."""
    autotune: bool | int | None = None
    """Time the best plans that fit on the device and keep the fastest: True, False, or a cap on the model
    steps it runs. None: on where the profile's times are the clock's."""

    def __post_init__(self) -> None:
        if self.on_larger_shape not in ON_LARGER_SHAPE:
            raise InputError(f"on_larger_shape: {self.on_larger_shape!r} is not one of {', '.join(ON_LARGER_SHAPE)}")

    @classmethod
    def of(cls, *, budget_gb: float | None = None, budget_bytes: int | None = None,
           activation_budget: float | None = None, solver: str = "auto", solver_options: Mapping[str, Any] | None = None,
           safety_margin: float = 0.02, on_larger_shape: str = "error", own_checkpointing: str = "replace",
           autotune: bool | int | None = None) -> PlanRequest:
        """From the keywords `optimize()` and `Planner.plan()` take."""
        return cls(
            budget=Budget.of(budget_gb, budget_bytes, activation_budget, safety_margin),
            solve=SolveConfig(solver=solver, options=dict(solver_options or {}), own_checkpointing=own_checkpointing),
            on_larger_shape=on_larger_shape, autotune=autotune,
        )

    def replace(self, **changes: Any) -> PlanRequest:
        return dataclasses.replace(self, **changes)

    def keywords(self) -> dict[str, Any]:
        """As the keywords of `Planner.plan()` (the inverse of `of`)."""
        return dict(**self.budget.keywords(), solver=self.solve.solver, solver_options=dict(self.solve.options),
                    own_checkpointing=self.solve.own_checkpointing, on_larger_shape=self.on_larger_shape,
                    autotune=self.autotune)

"""The Plan: what to recompute, the predicted figures, and the checkpointed module.

A plan file is JSON (schema `ckpt-planner/plan`, version 1) holding the
solver and its settings, the budget, the regions by node name and module
path, the predicted figures and a fingerprint of the graph it was made for.

One concept, so one module over 500 lines: the Plan record, its figures, its file and its rebuild on a model
(the file's schema is plan_schema.py, the checks of a loaded plan plan_check.py).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .distributed import checks_agreed
from .errors import InputError, PlanFileError
from .lower.offload import OffloadTarget
from .plan_check import (
    FIGURE_TOLERANCE,
    as_made_for,
    check_budget,
    check_figures,
    matching_capture,
    module_paths,
    race_granted,
    race_record,
    refuse_knapsack,
    step_checked,
)
from .plan_schema import check_plan, read_plan_file, write_file
from .plan_summary import autotune_rows, fmt_bytes

__all__ = ["Plan", "Region", "SCHEMA", "SCHEMA_VERSION"]

SCHEMA = "ckpt-planner/plan"
SCHEMA_VERSION = 1


@dataclass(frozen=True)
class Region:
    """A recomputed run of nodes, by index in the graph's compute order and by name."""

    start: int
    end: int
    first_node: str
    last_node: str
    modules: tuple[str, ...]
    """Module paths the region covers, outermost first."""
    depth: int = 0
    """0 for a top-level region, 1 for one nested inside it, ..."""
    recompute_s: float = 0.0
    saved_bytes: int = 0
    """Bytes the region's nodes would otherwise keep for backward."""
    saved_ops: tuple[str, ...] = ()
    """Nodes whose outputs the region keeps (a selective region; every other node is recomputed)."""
    saved_positions: tuple[int, ...] = ()
    """The same nodes by index in the graph's compute order."""


@dataclass
class Plan:
    """A checkpointing plan and (when built) the module that executes it.

    Figures come from the simulator: bytes and seconds.
    """

    solver: str
    budget_bytes: int | None
    baseline_peak_bytes: int
    predicted_peak_bytes: int
    predicted_recompute_s: float
    baseline_step_s: float
    """Forward time of the graph (seconds): recompute overhead is relative to it."""
    regions: tuple[Region, ...]
    fingerprint: str
    capture_method: str
    solve_time_s: float = 0.0
    solver_options: dict[str, Any] = field(default_factory=dict)
    breakdown: dict[str, int] = field(default_factory=dict)
    """Bytes per category at the predicted peak (parameters, param_grads, activations, ...)."""
    baseline_breakdown: dict[str, int] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    stats: dict[str, Any] = field(default_factory=dict)
    time_source: str = "measured"
    num_nodes: int = 0
    model_name: str = ""
    module: torch.nn.Module | None = field(default=None, repr=False, compare=False)
    """The checkpointed module (None for a plan loaded from a file until `rebuild`)."""
    problem: Any = field(default=None, repr=False, compare=False)
    """The solvers.Problem the plan was solved on (not saved; None for a loaded plan)."""
    measured_peak_bytes: int | None = None
    baseline_measured_peak_bytes: int | None = None
    predicted_step_s: float = 0.0
    """Predicted step time of the plan (seconds): eager step + the captured graph's overhead + recompute,
    checkpoint-call and policy costs. 0 when the profile has no step time."""
    eager_step_s: float = 0.0
    """Measured (or, without a measurement, estimated) eager step without checkpointing (seconds)."""
    call_overhead_s: float = 0.0
    """The part of predicted_recompute_s that is checkpoint-call and selective-policy cost (seconds)."""
    graph_overhead_s: float = 0.0
    """The captured graph's own extra time per step against the eager model (seconds)."""
    offloaded: tuple[OffloadTarget, ...] = ()
    """Activations copied to host memory in the forward and fetched back for the backward (lower/offload.py),
    each a node output; `stats["offload"]` has the copy bandwidths and the predicted exposed copy time."""

    @property
    def offloaded_bytes(self) -> int:
        return sum(o.nbytes for o in self.offloaded)

    def offload_targets(self) -> tuple[OffloadTarget, ...]:
        """The offloads as the lowering runs them: their fetch steps re-derived on this plan's Problem where it
        has one (a file's own steps are never trusted to hold device bytes no longer than predicted)."""
        if self.problem is None or not self.offloaded:
            return self.offloaded
        from .lower.offload import targets_of

        return targets_of(self.problem, self.offloaded_storages(), self.spans(), self.saved_indices())

    def offloaded_storages(self) -> list[int]:
        """Storage indices (of the Problem) the plan offloads."""
        return [o.storage for o in self.offloaded]

    @property
    def predicted_overhead(self) -> float:
        """Predicted step time over the eager step, minus one: the slowdown a user pays."""
        return self.predicted_step_s / self.eager_step_s - 1.0 if self.eager_step_s > 0 else 0.0

    def saved_indices(self) -> list[int]:
        """Compute-node indices whose outputs selective regions keep."""
        return [i for r in self.regions for i in r.saved_positions]

    @property
    def saved_bytes(self) -> int:
        return self.baseline_peak_bytes - self.predicted_peak_bytes

    @property
    def recompute_overhead(self) -> float:
        """Recompute time as a fraction of the forward time."""
        return self.predicted_recompute_s / self.baseline_step_s if self.baseline_step_s > 0 else 0.0

    def spans(self) -> list[tuple[int, int]]:
        return [(r.start, r.end) for r in self.regions]

    # -- reporting ---------------------------------------------------------
    def summary(self) -> str:
        """A table a person reads in ten seconds."""
        rows = [
            ("model", f"{self.model_name or '-'} ({self.num_nodes} nodes, {self.capture_method})"),
            ("solver", f"{self.solver} (solved in {self.solve_time_s:.2f} s)"),
            ("budget", fmt_bytes(self.budget_bytes) if self.budget_bytes is not None else "none (knee of the curve)"),
            (
                "peak memory, model as given" if self.stats.get("own_checkpointing") else "peak memory, no checkpointing",
                f"{fmt_bytes(self.baseline_peak_bytes)} predicted"
                + (f", {fmt_bytes(self.baseline_measured_peak_bytes)} measured" if self.baseline_measured_peak_bytes else ""),
            ),
            (
                "peak memory, this plan",
                f"{fmt_bytes(self.predicted_peak_bytes)} predicted"
                + (f", {fmt_bytes(self.measured_peak_bytes)} measured" if self.measured_peak_bytes else ""),
            ),
            (
                "memory saved",
                f"{fmt_bytes(self.saved_bytes)} ({100 * self.saved_bytes / max(1, self.baseline_peak_bytes):.1f} %)",
            ),
            (
                "recompute overhead",
                f"{self.predicted_recompute_s * 1e3:.1f} ms = {100 * self.recompute_overhead:.1f} % of the forward"
                + (" (FLOP estimate)" if self.time_source == "flops" else ""),
            ),
            ("recomputed regions", f"{len(self.regions)} ({sum(1 for r in self.regions if r.depth) } nested, "
             f"{sum(1 for r in self.regions if r.saved_ops)} selective, {len(self.saved_indices())} ops kept)"),
        ]
        compiled = self.stats.get("compiled") if isinstance(self.stats.get("compiled"), dict) else None
        if compiled and self.measured_peak_bytes:
            rows[4:] = _compiled_rows(self, compiled)
        if self.stats.get("own_checkpointing"):
            rows.insert(4, ("model's own checkpointing", f"{self.stats['own_checkpointing']} (savings are against the model as given)"))
        if self.eager_step_s > 0 and not (compiled and compiled.get("lowering") == "knapsack"):
            # One overhead, the step's, with its parts (they add up to it); no second percentage beside it.
            rows = [r for r in rows if r[0] != "recompute overhead"]
            rows.append(
                (
                    "predicted step time",
                    f"{self.predicted_step_s * 1e3:.1f} ms against {self.eager_step_s * 1e3:.1f} ms eager: "
                    f"{100 * self.predicted_overhead:+.1f} % = recompute {self.predicted_recompute_s * 1e3:.1f} ms "
                    f"(checkpoint calls {self.call_overhead_s * 1e3:.1f} ms of it) + captured graph "
                    f"{self.graph_overhead_s * 1e3:.1f} ms" + (" (FLOP estimate)" if self.time_source == "flops" else ""),
                )
            )
        if self.offloaded:
            info = self.stats.get("offload") if isinstance(self.stats.get("offload"), dict) else {}
            exposed = info.get("exposed_copy_s")
            rows.append(("offloaded to host", f"{len(self.offloaded)} activations, {fmt_bytes(self.offloaded_bytes)}"
                         + (f"; exposed copy time {exposed * 1e3:.1f} ms predicted" if exposed is not None else "")))
        # autotune's candidates, predicted (the step-time row's own figure) and measured (with its noise band)
        rows += autotune_rows(self.stats, self.eager_step_s, self.graph_overhead_s, self.predicted_overhead)
        width = max(len(k) for k, _ in rows)
        lines = [f"{k.ljust(width)}  {v}" for k, v in rows]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    # -- files ---------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "version": SCHEMA_VERSION,
            "model": self.model_name,
            "fingerprint": self.fingerprint,
            "capture_method": self.capture_method,
            "num_nodes": self.num_nodes,
            "solver": self.solver,
            "solver_options": self.solver_options,
            "solve_time_s": self.solve_time_s,
            "budget_bytes": self.budget_bytes,
            "baseline_peak_bytes": self.baseline_peak_bytes,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "predicted_recompute_s": self.predicted_recompute_s,
            "baseline_step_s": self.baseline_step_s,
            "predicted_step_s": self.predicted_step_s,
            "eager_step_s": self.eager_step_s,
            "predicted_overhead": self.predicted_overhead,
            "call_overhead_s": self.call_overhead_s,
            "graph_overhead_s": self.graph_overhead_s,
            "time_source": self.time_source,
            "breakdown": self.breakdown,
            "baseline_breakdown": self.baseline_breakdown,
            "measured_peak_bytes": self.measured_peak_bytes,
            "baseline_measured_peak_bytes": self.baseline_measured_peak_bytes,
            "notes": list(self.notes),
            "stats": _jsonable(self.stats),
            **({"offloaded": [o.to_dict() for o in self.offloaded]} if self.offloaded else {}),
            "regions": [
                {
                    "start": r.start,
                    "end": r.end,
                    "first_node": r.first_node,
                    "last_node": r.last_node,
                    "modules": list(r.modules),
                    "depth": r.depth,
                    "recompute_s": r.recompute_s,
                    "saved_bytes": r.saved_bytes,
                    "saved_ops": list(r.saved_ops),
                    "saved_positions": list(r.saved_positions),
                }
                for r in self.regions
            ],
        }

    def save(self, path: str | os.PathLike) -> Path:
        """Write the plan as JSON; atomic: an existing regular file is replaced only when the write
        succeeded, and keeps its mode; anything else at `path` (a device node, a folder) is refused."""
        path = Path(path)
        text = json.dumps(self.to_dict(), indent=2)
        directory = path.parent if str(path.parent) else Path(".")
        if not directory.is_dir():
            raise PlanFileError(f"plan path {str(path)!r}: directory {str(directory)!r} does not exist")
        write_file(path, text, "plan path")
        return path

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "plan") -> Plan:
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            raise PlanFileError(f"{source}: not a ckpt-planner plan (schema field missing or wrong)")
        if data.get("version") != SCHEMA_VERSION:
            raise PlanFileError(f"{source}: plan schema version {str(data.get('version'))[:40]!r}, this planner reads {SCHEMA_VERSION}")
        check_plan(data, source)  # every field's type and range, before any is used
        try:
            regions = tuple(
                Region(
                    start=int(r["start"]),
                    end=int(r["end"]),
                    first_node=str(r["first_node"]),
                    last_node=str(r["last_node"]),
                    modules=tuple(r.get("modules", ())),
                    depth=int(r.get("depth", 0)),
                    recompute_s=float(r.get("recompute_s", 0.0)),
                    saved_bytes=int(r.get("saved_bytes", 0)),
                    saved_ops=tuple(str(x) for x in r.get("saved_ops", ())),
                    saved_positions=tuple(int(x) for x in r.get("saved_positions", ())),
                )
                for r in data["regions"]
            )
            plan = cls(
                solver=str(data["solver"]),
                budget_bytes=data["budget_bytes"],
                baseline_peak_bytes=int(data["baseline_peak_bytes"]),
                predicted_peak_bytes=int(data["predicted_peak_bytes"]),
                predicted_recompute_s=float(data["predicted_recompute_s"]),
                baseline_step_s=float(data.get("baseline_step_s", 0.0)),
                regions=regions,
                fingerprint=str(data["fingerprint"]),
                capture_method=str(data["capture_method"]),
                solve_time_s=float(data.get("solve_time_s", 0.0)),
                solver_options=dict(data.get("solver_options", {})),
                breakdown=dict(data.get("breakdown", {})),
                baseline_breakdown=dict(data.get("baseline_breakdown", {})),
                notes=tuple(data.get("notes", ())),
                stats=dict(data.get("stats", {})),
                time_source=str(data.get("time_source", "measured")),
                num_nodes=int(data.get("num_nodes", 0)),
                model_name=str(data.get("model", "")),
                measured_peak_bytes=data.get("measured_peak_bytes"),
                baseline_measured_peak_bytes=data.get("baseline_measured_peak_bytes"),
                predicted_step_s=float(data.get("predicted_step_s", 0.0)),
                eager_step_s=float(data.get("eager_step_s", 0.0)),
                call_overhead_s=float(data.get("call_overhead_s", 0.0)),
                graph_overhead_s=float(data.get("graph_overhead_s", 0.0)),
                offloaded=tuple(OffloadTarget(int(o["storage"]), str(o["node"]), int(o["output"]), int(o["bytes"]),
                                              int(o.get("fetch_step", -1)), int(o.get("use_step", -1)))
                                for o in data.get("offloaded", ())),  # absent in files before offload
            )
        except (KeyError, TypeError, ValueError) as e:
            raise PlanFileError(f"{source}: corrupt plan file, field {e} missing or malformed") from None
        _check_regions(data["regions"], plan.regions, plan.num_nodes, source)
        return plan

    @classmethod
    def load(cls, path: str | os.PathLike) -> Plan:
        """Read a plan file; the module is built later with `rebuild(model, example_inputs)`."""
        source = f"plan file {str(path)!r}"
        return cls.from_dict(read_plan_file(path, source), source=source)

    def rebuild(self, model: torch.nn.Module, example_inputs: Any = None, *, check_step: bool | None = None) -> torch.nn.Module:
        """Build the checkpointed module for `model` (a fresh instance of the planned model).

        Raises PlanMismatchError when the model's graph differs from the one the plan was made for,
        or, for a plan loaded from a file: when a figure it states differs from its re-derivation on this
        model (see `check_figures`), when it is predicted over its own budget, or when one training step
        of the module differs from the model's own (the safety net optimize() runs on every plan it
        returns). `check_step=False` skips that step; None (the default) runs it, under a process group of
        several ranks on rank 0 alone (the model as given, before any wrapper's collectives); every rank
        checks the graph and the figures, and every rank learns every verdict: no rank runs a plan one
        refused (`distributed.checks_agreed`).
        """
        refuse_knapsack(self, "rebuild")
        return self._rebuild(model, example_inputs, check_step=check_step, eager=True)

    def _rebuild(self, model: torch.nn.Module, example_inputs: Any, *, check_step: bool | None = None,
                 eager: bool = False) -> torch.nn.Module:
        """`rebuild` without its knapsack refusal. `eager`: the module runs as built, so a loaded plan is judged
        on its eager prediction; False where the caller compiles it (`compile_saved_plan`), whose budget is
        the compiled step's."""
        from .lower.rewrite import rewrite

        model = as_made_for(self, model, example_inputs)
        if self.problem is None:  # loaded: checked on every rank, the step on one, before anything is built
            def check(leader: bool) -> tuple[Any, torch.nn.Module]:
                cap = matching_capture(self, model, example_inputs)
                self.problem = check_figures(self, model, cap, eager=eager)
                module = rewrite(cap.graph_module, self.spans(), model=model, saved=self.saved_indices(),
                                 offload=self.offload_targets())
                step_checked(self, model, module, cap, leader if check_step is None else check_step)
                return cap, module

            try:
                cap, module = checks_agreed(check)
            except BaseException:
                self.problem = None  # refused: the next rebuild checks again
                raise
        else:  # not profiled in this capture: which nodes draw random numbers, from one run
            from .capture.rng import observe_random
            from .capture.trace import flatten_for_graph

            cap = matching_capture(self, model, example_inputs)
            observe_random(cap.graph_module, flatten_for_graph(cap.graph_module, cap.args, cap.kwargs))
            module = rewrite(cap.graph_module, self.spans(), model=model, saved=self.saved_indices(),
                             offload=self.offload_targets())
        self.module = module
        from .capture.shapes import ShapeGuard, input_shapes

        guard = ShapeGuard(input_shapes(cap.args, cap.kwargs), "error", None, dynamic_dims=cap.dynamic_dims)
        object.__setattr__(self.module, "shape_guard", guard)  # larger shapes: ShapeError, as for a fresh plan
        return self.module

    def check_figures(self, model: torch.nn.Module, cap: Any, *, rel_tol: float = FIGURE_TOLERANCE) -> Any:
        """Re-derive every figure this plan states on `model` (captured as `cap`); returns the Problem
        (`plan_check.check_figures`: PlanMismatchError naming a field that differs, or a plan over its budget)."""
        return check_figures(self, model, cap, rel_tol=rel_tol)

    def check_budget(self, fixed_bytes: int = 0, *, device_type: str | None = None) -> None:
        """PlanMismatchError when this plan is predicted over its own `budget_bytes` (`plan_check.check_budget`)."""
        check_budget(self, fixed_bytes, device_type=device_type)

    # -- in place ------------------------------------------------------------
    def apply(self, model: torch.nn.Module, example_inputs: Any = None, *, allow_over_budget: bool = False,
              check_step: bool | None = None) -> Any:
        """Checkpoint whole submodules of `model` in place; returns a lower.apply.Application.

        Same module object, same `state_dict` keys, hooks and optimizer untouched.
        Where regions do not follow module boundaries, the nearest module-level
        plan within the budget is used and the Application says how it differs.
        When no module-level plan fits the budget, raises InfeasibleBudgetError and
        changes nothing, unless allow_over_budget=True.
        A plan loaded from a file is refused (PlanMismatchError) when it is predicted over its own
        budget. With `example_inputs` it is checked against `model` first as in `rebuild`: graph
        fingerprint, every figure re-derived, and one training step of the module-level plan against
        the model's own (`check_step` as in `rebuild`), all before anything is changed; without them
        its recorded module paths are applied as they are.
        """
        from .lower.apply import apply_plan, checkpointed_copy

        refuse_knapsack(self, "apply")
        if self.stats.get("outputs") == "loss":
            raise InputError("plan.apply: this plan was made with outputs='loss' (the model returning its loss "
                             "alone), which checkpointing the model in place cannot give; use "
                             "plan.rebuild(model, example_inputs), whose module returns the loss alone")
        loaded = self.problem is None
        if self.problem is None and example_inputs is None:
            checks_agreed(lambda leader: self.check_budget())
        elif self.problem is None:
            def check(leader: bool) -> None:
                cap = matching_capture(self, model, example_inputs)
                self.problem = check_figures(self, model, cap)
                if self.measured_peak_bytes is not None or self.baseline_measured_peak_bytes is not None:
                    from .lower.rewrite import rewrite
                    from .verification import check_measured

                    exact = rewrite(cap.graph_module, self.spans(), model=model, saved=self.saved_indices(),
                                    offload=self.offload_targets())
                    # the figures are those of the plan's own regions (plan.module), measured again
                    check_measured(self, model, exact, cap.args, cap.kwargs)
                trusted = race_granted(self, model)
                paths = module_paths(self, model, allow_over_budget, trusted)  # what apply_plan will checkpoint
                if (leader if check_step is None else check_step) and paths:
                    from .verification import check_loaded_step

                    # the module-level variant, on a copy: the model is untouched
                    check_loaded_step(self, model, checkpointed_copy(model, paths), cap.args, cap.kwargs)

            try:
                checks_agreed(check)
            except BaseException:
                self.problem = None  # refused: the next apply checks again
                raise
        # a loaded plan's race record lets a module-level variant past its budget only where measured here
        trusted = not loaded or (example_inputs is not None and race_granted(self, model))
        with race_record(self, trusted):
            return apply_plan(self, model, allow_over_budget=allow_over_budget)

    def remove(self, model: torch.nn.Module) -> tuple[str, ...]:
        """Undo `apply`: restore every checkpointed submodule's forward; returns their paths."""
        from .lower.apply import remove_checkpointing

        return remove_checkpointing(model)


def _check_regions(raw: list[Any], regions: tuple[Region, ...], num_nodes: int, source: str) -> None:
    """Refuse regions a hand edit broke (one line naming the field): not integers, negative, inverted,
    outside the graph's nodes, or overlapping without nesting. None is dropped or repaired."""
    for i, (r, region) in enumerate(zip(raw, regions)):
        for key in ("start", "end"):
            value = r[key]
            if isinstance(value, bool) or not isinstance(value, int):
                raise PlanFileError(f"{source}: regions[{i}].{key}: {value!r} is not an integer node index")
            if value < 0:
                raise PlanFileError(f"{source}: regions[{i}].{key}: {value} is negative")
            if num_nodes > 0 and value >= num_nodes:
                raise PlanFileError(
                    f"{source}: regions[{i}].{key}: {value} is outside the graph's {num_nodes} nodes (num_nodes)"
                )
        if region.end < region.start:
            raise PlanFileError(f"{source}: regions[{i}].end: {region.end} is before its start {region.start} (inverted)")
        if len(region.saved_ops) != len(region.saved_positions):
            raise PlanFileError(
                f"{source}: regions[{i}].saved_positions: {len(region.saved_positions)} positions for "
                f"{len(region.saved_ops)} saved_ops (one position per kept op)"
            )
        outside = [k for k in region.saved_positions if not region.start <= k <= region.end]
        if outside:  # a kept op outside its region is no part of any selective policy
            raise PlanFileError(
                f"{source}: regions[{i}].saved_positions: node {outside[0]} is outside the region "
                f"({region.start}..{region.end}); a region keeps only its own nodes"
            )
    order = sorted(range(len(regions)), key=lambda i: (regions[i].start, -regions[i].end))
    stack: list[int] = []
    for i in order:
        r = regions[i]
        while stack and regions[stack[-1]].end < r.start:
            stack.pop()
        if stack and r.end > regions[stack[-1]].end:
            j = stack[-1]
            raise PlanFileError(
                f"{source}: regions[{i}] ({r.start}..{r.end}) and regions[{j}] ({regions[j].start}..{regions[j].end}) "
                "overlap without nesting"
            )
        stack.append(i)


def _jsonable(obj: Any) -> Any:
    try:
        json.dumps(obj)
        return obj
    except TypeError:
        if isinstance(obj, dict):
            return {str(k): _jsonable(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [_jsonable(v) for v in obj]
        return str(obj)


def _compiled_rows(plan: Any, compiled: dict[str, Any]) -> list[tuple[str, str]]:
    """The summary's rows from 'peak memory, this plan' on, for a plan measured compiled: the measured
    peak leads; a knapsack plan has no regions and no eager prediction of its own."""
    lowering = compiled.get("lowering", "regions")
    measured = plan.measured_peak_bytes or 0
    saved = plan.baseline_peak_bytes - measured
    rows = [
        ("peak memory, this plan", f"{fmt_bytes(measured)} measured, compiled ({lowering} lowering)"
         + ("" if lowering == "knapsack" else f"; {fmt_bytes(plan.predicted_peak_bytes)} predicted for the eager plan")),
        ("memory saved", f"{fmt_bytes(saved)} ({100 * saved / max(1, plan.baseline_peak_bytes):.1f} %) below the eager "
                         "step without checkpointing (the compiled step without a plan is not measured)"),
    ]
    k = compiled.get("knapsack")
    if lowering == "knapsack" and isinstance(k, dict):
        rows += [
            ("recompute overhead", f"{k.get('estimated_recompute_s', 0) * 1e3:.1f} ms estimated (FLOP/bytes roofline "
                                   "of the ops the partitioner may recompute)"),
            ("recomputed ops", f"no regions: the partitioner may recompute {k.get('candidates', 0) - k.get('kept_saved', 0)} "
                               f"of {k.get('candidates', 0)} ops (our knapsack keeps {fmt_bytes(k.get('saved_bytes', 0))} saved)"),
        ]
    else:
        rows += [
            ("recompute overhead", f"{plan.predicted_recompute_s * 1e3:.1f} ms = {100 * plan.recompute_overhead:.1f} % of "
                                   "the forward, eager (fused under compile)"),
            ("recomputed regions", f"{len(plan.regions)} ({sum(1 for r in plan.regions if r.depth)} nested)"),
        ]
    return rows

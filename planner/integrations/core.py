"""FirstBatchPlanner: the framework-free part of the training callbacks.

It takes over the forward of the model (or of one of its submodules), on that instance only. On the
first training call it plans (`optimize()`) at the longest shape the loader will produce: that call's
inputs grown to `max_length` (given, or found on the collator or tokenizer: `lengths.py`), since a plan
that fits the longest batch fits the shorter ones. Then it runs the plan that was chosen:

- `apply="graph"` (default): the model's forward runs `plan.module`, the plan's own checkpointed
  module, which shares every parameter and buffer with the model (`lower/inplace.py`); the model
  object, its optimizer, `state_dict` keys and `save_pretrained` are untouched. Calls above the
  planned shape are planned again at their shape (`on_larger_shape="replan"` unless told otherwise).
- `apply="modules"`, or where the graph cannot run in place (parameters sharded per submodule, a
  capture that pinned every size while lengths vary): whole submodules are checkpointed in place. The
  plan itself when its regions are whole modules; else the whole-module plans `module_candidates`
  simulates (nearest, per block, greedy) and the one within budget with the least recompute, named in
  one log line with its peak and recompute beside the chosen plan's.

It measures the peak of forward + backward of step `measure_step` and of every later step whose
inputs are larger than any measured before (so the longest batch is measured), and logs each beside
the prediction, naming both shapes. Log lines go through tqdm's bar while one is shown. The prediction is
for the loop's own step (`loop`, loop.py); where the planned shape measures more than 3 % off it, the
shape is planned once more between two steps with the difference taken as fixed bytes (closed_loop.py).

Measuring: on CUDA `torch.cuda.max_memory_allocated` from the forward's start; on CPU the live tensor
storages (planner/profile/memory.py), with the parameters, gradients, buffers, optimizer state and
inputs that exist at the forward's start counted in, as the plan counts them.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import time
import types
from dataclasses import dataclass
from typing import Any

import torch

from ..capture.shapes import InputShapes, input_shapes
from ..choose.regions import ModuleCandidate, best_module_plan, module_candidates
from ..errors import InputError
from ..lower.apply import checkpoint_modules, remove_checkpointing
from ..lower.inplace import executed_regions, restore_forward, run_in_place
from ..lower.rewrite import CheckpointedModule
from ..profile.memory import LiveMemory
from ..solvers.registry import InfeasibleBudgetError
from .calibrate import state_tensors as _state_tensors
from .closed_loop import first_plan, note_measured, replan_measured
from .lengths import find_max_length, grown_to, sequence_length
from .logs import _log
from .loop import HELD, LoopStep, loop_prediction

__all__ = ["FirstBatchPlanner", "Applied", "Measurement"]

APPLY_MODES = ("graph", "modules")


def _submodule(root: torch.nn.Module, path: str | None) -> torch.nn.Module:
    if not path:
        return root
    try:
        return root.get_submodule(path)
    except AttributeError:
        raise InputError(f"module: {path!r} is not a submodule of {type(root).__name__}") from None


def optimizer_name(optimizer: Any) -> Any:
    """What `optimize(optimizer=...)` should count for a framework's optimizer (unwraps accelerate's)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    return inner if isinstance(inner, torch.optim.Optimizer) else None


def _as_kwargs(module: torch.nn.Module, args: tuple, kwargs: dict, sig: inspect.Signature | None = None
               ) -> dict[str, Any]:
    """The call's arguments by name (None dropped; tensors only from **kwargs, such as a loss's item count).
    `sig`: the module's own forward's signature, when its forward is replaced for now."""
    sig = sig if sig is not None else inspect.signature(module.forward)
    bound = sig.bind_partial(*args, **kwargs)
    inputs: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        kind = sig.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            inputs.update({k: v for k, v in value.items() if isinstance(v, torch.Tensor)})
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            if value:
                raise InputError(f"inputs: {type(module).__name__}.forward takes *{name}; plan it with optimize()")
        elif value is not None:
            inputs[name] = value
    return inputs


def _by_name(inner: torch.nn.Module, names: list[str]) -> torch.nn.Module:
    """`inner` behind a forward that takes the call's inputs as named parameters.

    torch.export cannot keep the sizes of inputs that a forward takes through `**kwargs` (a Trainer's
    `num_items_in_batch`) symbolic, so their capture pins every size; by name it keeps them dynamic.
    The wrapper holds `inner` itself, so the plan's module shares its parameters and submodules."""

    def forward(self: torch.nn.Module, **kwargs: Any) -> Any:
        return self.inner(**kwargs)

    forward.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        + [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY) for n in names]
    )
    wrapper = type(type(inner).__name__, (torch.nn.Module,), {"forward": forward})()
    wrapper.inner = inner
    return wrapper


def _needs_names(module: torch.nn.Module, inputs: dict[str, Any]) -> bool:
    params = inspect.signature(module.forward).parameters
    return any(name not in params or params[name].kind is inspect.Parameter.VAR_KEYWORD for name in inputs)


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.2f} MB"


def _sharded(module: torch.nn.Module) -> bool:
    """Parameters gathered per submodule by hooks (FSDP): the captured graph would bypass them."""
    return any(type(m).__name__.startswith(("FSDP", "FullyShardedDataParallel")) for m in module.modules())


@dataclass(frozen=True)
class Applied:
    """What runs in training, as the callback applied it."""

    kind: str
    """'graph': the model's forward runs plan.module; 'modules': whole submodules are checkpointed in
    place; 'none': the plan recomputes nothing and the model runs as it is."""
    predicted_peak_bytes: int
    predicted_recompute_s: float
    modules: tuple[str, ...] = ()
    """Checkpointed submodule paths ('modules')."""
    regions: tuple[tuple[str, str, frozenset[str]], ...] = ()
    """(first node, last node, kept positions) of each region the running module executes ('graph')."""
    candidate: ModuleCandidate | None = None
    """The whole-module plan applied ('modules'); `candidate.name` is 'as planned' when it is the plan itself."""
    candidates: tuple[ModuleCandidate, ...] = ()
    """Every whole-module plan compared ('modules')."""
    note: str = ""
    """The one line that says what was applied and, for a whole-module plan, why and at what cost."""


@dataclass(frozen=True)
class Measurement:
    step: int
    shapes: InputShapes
    peak_bytes: int


class FirstBatchPlanner:
    """Plan on the first training call at the longest shape, run the chosen plan in place, measure."""

    def __init__(
        self, *, module: str | None = None, measure_step: int = 1, allow_over_budget: bool = True,
        max_length: int | str | None = "auto", apply: str = "graph", **optimize_kwargs: Any,
    ) -> None:
        if measure_step < 1:
            raise InputError(f"measure_step: {measure_step} must be >= 1 (step 0 runs the planning)")
        if apply not in APPLY_MODES:
            raise InputError(f"apply: {apply!r} is not one of {', '.join(APPLY_MODES)}")
        if not (max_length is None or max_length == "auto" or (isinstance(max_length, int) and max_length > 0)):
            raise InputError(f"max_length: {max_length!r} must be a positive int, 'auto' or None")
        if not any(optimize_kwargs.get(k) is not None for k in ("budget_gb", "budget_bytes", "activation_budget")):
            optimize_kwargs.setdefault("activation_budget", 0.5)
        optimize_kwargs.setdefault("on_larger_shape", "replan")
        self.module_path = module
        self.measure_step = measure_step
        self.allow_over_budget = allow_over_budget
        """For a whole-module plan over the budget: True applies it and logs a warning with its peak; False
        raises InfeasibleBudgetError on the first batch instead."""
        self.max_length = max_length
        """The sequence length to plan at: an int, 'auto' (the collator's or tokenizer's, else the first
        batch's) or None (the first batch's)."""
        self.apply = apply
        self.optimize_kwargs = optimize_kwargs
        self.plan: Any = None
        """The Plan made on the first batch (None before it)."""
        self.application: Applied | None = None
        """What runs in training (None before the first batch)."""
        self.planned_shapes: InputShapes | None = None
        """The input shapes the plan was made for."""
        self.measurements: list[Measurement] = []
        """Each measured step: its number, input shapes and peak (bytes)."""
        self.planning_s: float | None = None
        self._target: torch.nn.Module | None = None
        self._root: torch.nn.Module | None = None
        self._signature: inspect.Signature | None = None
        """What was planned: the target, or the target behind named inputs (`_by_name`)."""
        self._hook = None
        self._optimizer: Any = None
        self._length: int | None = None
        self._length_source = ""
        self._meter: LiveMemory | None = None
        self._device: torch.device | None = None
        self._measuring: tuple[int, InputShapes] | None = None
        self._larger_seen: set[InputShapes] = set()
        self._inside = False
        self._waiting: tuple[Any, ...] | None = None
        """(previous instance forward,) while the first-call wrapper is installed."""
        self._steps = 0
        self.loop: LoopStep = HELD
        """How the training loop runs the step against the captured one (the callbacks set theirs: loop.py)."""
        self.correction = 0
        """Bytes the measured step of the planned shape was over its prediction (negative: under), taken as
        fixed bytes by the closed loop (closed_loop.py); 0 until it corrects."""
        self.replans: list[str] = []
        """The closed loop's log line for each planning it redid after a measurement."""
        self._planning_inputs: dict[str, Any] | None = None
        self._pending: tuple[int, int, int] | None = None
        self._corrected = False
        self._remeasure = False
        self._planner: Any = None
        """The Planner that captured and profiled the planned shape, kept for planning it again (closed_loop.py)."""
        self.run_steps: int | None = None
        """Training steps (forward and backward) the run will take, where the loop says (the callbacks set it):
        the race is held to a share of them (`race_for_run`)."""

    @property
    def predicted_peak_bytes(self) -> int | None:
        """Simulated peak of what runs (the plan, or the whole-module plan applied), in bytes."""
        return None if self.application is None else self.application.predicted_peak_bytes

    @property
    def measured_peak_bytes(self) -> int | None:
        """The peak of the largest step measured (the longest batch), in bytes (None until measured)."""
        if not self.measurements:
            return None
        return max(self.measurements, key=lambda m: (sum(_numel(s) for _, s in m.shapes.shapes), m.step)).peak_bytes

    # -- attaching ------------------------------------------------------------------------
    def attach(self, root: torch.nn.Module, optimizer: Any = None, *, collators: tuple = (),
               tokenizers: tuple = ()) -> None:
        """Take over the forward of `root` (or of its `module` submodule): plan on its first training call.

        `collators` and `tokenizers` are where `max_length='auto'` looks for the longest length."""
        if optimizer is not None:
            self._optimizer = optimizer
            if "optimizer" not in self.optimize_kwargs:
                self.optimize_kwargs["optimizer"] = optimizer_name(optimizer)
        if self._target is not None:
            return
        target = _submodule(root, self.module_path)
        self._target = target
        if isinstance(self.max_length, int):
            self._length, self._length_source = self.max_length, "max_length="
        elif self.max_length == "auto":
            self._length, self._length_source = find_max_length(root, collators=collators, tokenizers=tokenizers)
        self._signature = inspect.signature(target.forward)
        self._hook = target.register_forward_pre_hook(self._before_forward, with_kwargs=True)
        if self.plan is not None:
            self._apply(target)
            return
        previous = target.__dict__.get("forward")
        own = previous if previous is not None else type(target).forward.__get__(target, type(target))

        def first_call(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            if not (module.training and torch.is_grad_enabled()):
                return own(*args, **kwargs)
            self._unwait(module)  # the model as it was while it is captured and profiled
            self._plan(module, args, kwargs)
            self._apply(module)
            return module.forward(*args, **kwargs)

        self._waiting = (previous,)
        target.forward = types.MethodType(first_call, target)

    def _unwait(self, module: torch.nn.Module) -> None:
        if self._waiting is None:
            return
        previous, self._waiting = self._waiting[0], None
        if previous is not None:
            module.forward = previous
        else:
            module.__dict__.pop("forward", None)

    # -- planning -------------------------------------------------------------------------
    def _plan(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        inputs = _as_kwargs(module, args, kwargs)
        first = input_shapes((), inputs)
        seq = sequence_length(inputs)
        if self._length is not None and seq is not None and self._length > seq:
            planning = grown_to(inputs, self._length)
            why = f"the longest length {self._length} ({self._length_source}); the first batch is {first}"
        else:
            planning = inputs
            why = ("the first batch" if self._length is None else
                   f"the first batch, at or above the longest length {self._length} ({self._length_source})")
            if self._length is None and self.max_length == "auto" and seq is not None:
                why += f"; {self._length_source}: a longer batch is planned again when it comes"
        self.planned_shapes = input_shapes((), planning)
        _log(logging.INFO, "planning %s at %s (%s)", type(module).__name__, self.planned_shapes, why)
        t0 = time.perf_counter()
        self._root = _by_name(module, list(planning)) if _needs_names(module, planning) else module
        self._planning_inputs = planning
        budget = {k: v for k, v in self.optimize_kwargs.items() if k in ("budget_gb", "budget_bytes", "activation_budget")}
        self.plan, line = first_plan(self, budget)
        self.planning_s = time.perf_counter() - t0
        if line:
            _log(logging.INFO, "%s", line)

    def _apply(self, module: torch.nn.Module) -> None:
        plan = self.plan
        reason = None
        if self.apply == "modules":
            reason = "apply='modules'"
        elif _sharded(module):
            reason = "parameters are gathered per submodule (FSDP)"
        elif isinstance(plan.module, CheckpointedModule):
            guard = plan.module.__dict__.get("shape_guard")
            if guard is not None and not guard.dynamic_dims and self._length is not None:
                reason = "the capture pinned every size and batch lengths vary (each would be planned again)"
        if plan.module is self._root or (not plan.regions and reason is None):
            self.application = Applied("none", plan.predicted_peak_bytes, plan.predicted_recompute_s,
                                       note="the plan recomputes nothing: the model runs as it is")
        elif reason is None:
            run_in_place(module, plan.module, call=self._run_planned)
            regions = executed_regions(plan.module) if isinstance(plan.module, CheckpointedModule) else ()
            self.application = Applied(
                "graph", plan.predicted_peak_bytes, plan.predicted_recompute_s, regions=tuple(regions),
                note=f"{type(module).__name__}.forward runs the plan's own module: {len(plan.regions)} regions, "
                     f"{sum(len(r.saved_positions) for r in plan.regions)} kept ops",
            )
        else:
            self.application = self._whole_modules(module, reason)
        predicted, delta = loop_prediction(plan, self.application, self.loop)
        if delta or self.correction:  # the loop's step, as modelled and as measured (closed_loop.py)
            self.application = dataclasses.replace(
                self.application, predicted_peak_bytes=predicted + self.correction,
                note=self.application.note + (f"; predicted for the loop's step ({self.loop.describe()})" if delta else "")
                + (f"; corrected by {self.correction / 1e6:+.2f} MB measured at this shape" if self.correction else ""))
        over = plan.budget_bytes is not None and self.application.predicted_peak_bytes > plan.budget_bytes
        _log(
            logging.WARNING if over else logging.INFO,
            "%s; predicted peak %s at %s (budget %s, without checkpointing %s), recompute %.1f ms%s",
            self.application.note, _mb(self.application.predicted_peak_bytes), self.planned_shapes,
            "none" if plan.budget_bytes is None else _mb(plan.budget_bytes), _mb(plan.baseline_peak_bytes),
            self.application.predicted_recompute_s * 1e3,
            "" if self.planning_s is None else f"; planned in {self.planning_s:.1f} s",
        )
        for line in plan.notes:  # what the race measured against the budget, which the user should see here
            if line.startswith("autotune:") and "within the budget" in line:
                _log(logging.WARNING, "%s (the captured step, which holds the outputs: %s)", line, self.loop.describe())

    def _whole_modules(self, module: torch.nn.Module, reason: str) -> Applied:
        plan = self.plan
        candidates = module_candidates(plan, self._root)
        best = best_module_plan(candidates, plan.budget_bytes)
        if not best.fits(plan.budget_bytes) and not self.allow_over_budget:
            raise InfeasibleBudgetError(
                plan.budget_bytes, min(c.peak_bytes for c in candidates), f"{plan.solver} applied per module",
                plan.problem.fixed_bytes,
                detail=f"; {reason}, and no whole-module plan fits: pass allow_over_budget=True or raise the budget",
            )
        checkpoint_modules(self._root, list(best.paths))  # the target's own submodule objects
        paths = tuple(_own_path(p, self._root is not module) for p in best.paths)
        shown = ", ".join(p or type(module).__name__ for p in paths[:3]) + (" ..." if len(paths) > 3 else "")
        if best.name == "as planned":
            note = f"the plan's regions are whole modules: checkpointed {len(best.paths)} in place ({shown})"
        else:
            compared = "; ".join(f"{c.name} {_mb(c.peak_bytes)}, {c.recompute_s * 1e3:.1f} ms" for c in candidates)
            note = (
                f"{reason}: applied the whole-module plan '{best.name}' instead of the chosen plan "
                f"({_mb(plan.predicted_peak_bytes)}, recompute {plan.predicted_recompute_s * 1e3:.1f} ms): "
                f"{len(paths)} modules ({shown}); compared by simulation: {compared}"
            )
        return Applied("modules", best.peak_bytes, best.recompute_s, modules=paths, candidate=best,
                       candidates=tuple(candidates), note=note)

    def _run_planned(self, planned: torch.nn.Module, own: Any, args: tuple, kwargs: dict) -> Any:
        if self._inside:  # planning again at a larger shape captures the model: its own code
            return own(*args, **kwargs)
        inputs = _as_kwargs(self._target, args, kwargs, self._signature)  # as planned: by name, None dropped
        shapes = input_shapes((), inputs)
        if shapes not in self._larger_seen and shapes.larger_than(self.planned_shapes):
            self._larger_seen.add(shapes)
            if self.optimize_kwargs.get("on_larger_shape") == "replan":
                _log(logging.WARNING, "step %d at %s is larger than planned (%s): planning again at its shape",
                     self._steps, shapes, self.planned_shapes)
        self._inside = True
        try:
            return planned(**inputs)
        finally:
            self._inside = False

    # -- measuring ------------------------------------------------------------------------
    def _before_forward(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if (self.plan is None or self._inside or self._measuring is not None
                or not (module.training and torch.is_grad_enabled())):
            return
        shapes = input_shapes((), _as_kwargs(module, args, kwargs, self._signature))
        larger = bool(self.measurements) and bool(shapes.larger_than(_largest(self.measurements)))
        again = self._remeasure and shapes == self.planned_shapes  # planned once more after a measurement
        if self._steps != self.measure_step and not (self._steps > self.measure_step and larger) and not again:
            return
        self._remeasure = self._remeasure and not again
        self._measuring = (self._steps, shapes)
        state = list(module.parameters()) + list(module.buffers())
        self._device = next((t.device for t in state), torch.device("cpu"))
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
            torch.cuda.reset_peak_memory_stats(self._device)
            return
        meter = LiveMemory()
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        meter.track(state, grads, _state_tensors(self._optimizer), args, kwargs)
        self._meter = meter.__enter__()

    def step_begin(self, model: torch.nn.Module, optimizer: Any = None) -> None:
        """Call at the start of each training step (before its forward)."""
        if optimizer is not None:
            self._optimizer = optimizer
        if self._pending is not None and self._target is not None:
            replan_measured(self)  # between two steps: the last one measured the planned shape off

    def step_end(self) -> None:
        """Call after the step's backward, before the optimizer step."""
        if self._measuring is not None:
            step, shapes = self._measuring
            self._measuring = None
            peak = None
            if self._device is not None and self._device.type == "cuda":
                torch.cuda.synchronize(self._device)
                peak = int(torch.cuda.max_memory_allocated(self._device))
            elif self._meter is not None:
                self._meter.__exit__(None, None, None)
                peak, self._meter = self._meter.peak, None
            if peak is not None:
                self.measurements.append(Measurement(step, shapes, peak))
                self._log_measured(step, shapes, peak)
                note_measured(self, step, shapes, peak)
        self._steps += 1

    def _log_measured(self, step: int, shapes: InputShapes, peak: int) -> None:
        predicted, budget = self.predicted_peak_bytes, self.plan.budget_bytes
        if shapes == self.planned_shapes:
            against = f"predicted {_mb(predicted)} ({100 * (predicted - peak) / max(1, peak):+.1f} %)"
        elif shapes in self._larger_seen:
            against = f"planned again at this shape (the plan at {self.planned_shapes} predicted {_mb(predicted)})"
        else:
            against = f"predicted {_mb(predicted)} at the planned {self.planned_shapes}, a bound for this shape"
        fits = "" if budget is None else (
            f", within the budget of {_mb(budget)}" if peak <= budget else f", OVER the budget of {_mb(budget)}")
        _log(logging.INFO if budget is None or peak <= budget else logging.WARNING,
             "step %d at %s: measured peak %s; %s%s", step, shapes, _mb(peak), against, fits)

    def close(self) -> None:
        """End of training: the model's own forward back, checkpointed submodules restored, hooks dropped."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._meter is not None:
            self._meter.__exit__(None, None, None)
            self._meter = None
        self._measuring = None
        self._planner = self._planning_inputs = None
        target, self._target = self._target, None
        if target is None:
            return
        self._unwait(target)
        restore_forward(target)
        if self.application is not None and self.application.kind == "modules":
            remove_checkpointing(target)


def _own_path(path: str, wrapped: bool) -> str:
    """A path in the planned root as a path in the target ('' for the target itself)."""
    if not wrapped:
        return path
    return "" if path == "inner" else path.removeprefix("inner.")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _largest(measurements: list[Measurement]) -> InputShapes:
    return max(measurements, key=lambda m: sum(_numel(s) for _, s in m.shapes.shapes)).shapes

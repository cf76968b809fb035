"""FirstBatchPlanner: the framework-free part of the training callbacks.

It hooks the forward of the model (or one of its submodules). On the first call it
plans with that call's own inputs (`optimize()`), applies the plan in place
(`Plan.apply`: the chosen submodules' forward runs under non-reentrant checkpoint,
same module object, same parameters, optimizer untouched) and lets the call go on
with the checkpointed model. It then measures the peak of forward + backward of
one later step (`measure_step`; the first step also runs the planning, so it is
not the one measured) and logs the predicted and the measured peak to the
"ckpt_planner" logger.

Measuring: on CUDA `torch.cuda.max_memory_allocated` from the step's start; on CPU
the live tensor storages (planner/profile/memory.py), with the parameters, gradients,
buffers and optimizer state that exist at the step's start counted in. The
prediction is the simulated peak of the module-level plan that was applied
(`Application.predicted_peak_bytes`), parameters, gradients and optimizer state included.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch

from ..errors import InputError
from ..profile.memory import LiveMemory
from ..progress import logger

__all__ = ["FirstBatchPlanner"]


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


def _state_tensors(optimizer: Any) -> list[torch.Tensor]:
    inner = getattr(optimizer, "optimizer", optimizer)
    if not isinstance(inner, torch.optim.Optimizer):
        return []
    return [v for s in inner.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


def _as_kwargs(module: torch.nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The call's arguments by name (None dropped; tensors only from **kwargs, such as a loss's item count)."""
    sig = inspect.signature(module.forward)
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


class FirstBatchPlanner:
    """Plan on the first forward call, apply in place, measure one later step."""

    def __init__(
        self, *, module: str | None = None, measure_step: int = 1, allow_over_budget: bool = True, **optimize_kwargs: Any
    ) -> None:
        if measure_step < 1:
            raise InputError(f"measure_step: {measure_step} must be >= 1 (step 0 runs the planning)")
        if not any(optimize_kwargs.get(k) is not None for k in ("budget_gb", "budget_bytes", "activation_budget")):
            optimize_kwargs.setdefault("activation_budget", 0.5)
        self.module_path = module
        self.measure_step = measure_step
        self.allow_over_budget = allow_over_budget
        """A trainer runs the model object itself, so the plan is applied per module (Plan.apply): when no
        whole-module plan fits the budget, True applies the nearest one and logs a warning with its peak;
        False raises InfeasibleBudgetError on the first batch instead."""
        self.optimize_kwargs = optimize_kwargs
        self.plan: Any = None
        """The Plan made on the first batch (None before it)."""
        self.application: Any = None
        """What Plan.apply did (lower.apply.Application)."""
        self.measured_peak_bytes: int | None = None
        """Peak of forward + backward of step `measure_step`, in bytes (None until measured)."""
        self._handle = None
        self._meter: LiveMemory | None = None
        self._device: torch.device | None = None
        self._steps = 0

    @property
    def predicted_peak_bytes(self) -> int | None:
        """Simulated peak of the plan as applied (module-level), in bytes."""
        if self.application is None:
            return None
        applied = self.application.predicted_peak_bytes
        return applied if applied is not None else self.plan.predicted_peak_bytes

    # -- planning ---------------------------------------------------------------
    def attach(self, root: torch.nn.Module, optimizer: Any = None) -> None:
        """Hook the forward of `root` (or of its `module` submodule) to plan on its first call."""
        if self._handle is not None or self.plan is not None:
            return
        if optimizer is not None and "optimizer" not in self.optimize_kwargs:
            self.optimize_kwargs["optimizer"] = optimizer_name(optimizer)
        target = _submodule(root, self.module_path)
        self._handle = target.register_forward_pre_hook(self._on_first_call, with_kwargs=True)

    def _on_first_call(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        self._handle.remove()
        self._handle = None
        from ..api import optimize

        inputs = _as_kwargs(module, args, kwargs)
        shapes = {k: tuple(v.shape) for k, v in inputs.items() if isinstance(v, torch.Tensor)}
        logger.info("callback: planning %s on the first batch %s", type(module).__name__, shapes)
        self.plan = optimize(module, inputs, **self.optimize_kwargs)
        self.application = self.plan.apply(module, allow_over_budget=self.allow_over_budget)
        budget, applied = self.plan.budget_bytes, self.application.predicted_peak_bytes
        for note in self.application.notes:
            over = budget is not None and applied is not None and applied > budget
            logger.log(logging.WARNING if over else logging.INFO, "callback: %s", note)
        logger.info(
            "callback: checkpointing %d modules, predicted peak %.2f MB (budget %s, without checkpointing %.2f MB)",
            len(self.application.modules), self.predicted_peak_bytes / 1e6,
            "none" if self.plan.budget_bytes is None else f"{self.plan.budget_bytes / 1e6:.2f} MB",
            self.plan.baseline_peak_bytes / 1e6,
        )

    # -- measuring --------------------------------------------------------------
    def step_begin(self, model: torch.nn.Module, optimizer: Any = None) -> None:
        """Call at the start of each training step (before its forward)."""
        if self._steps != self.measure_step or self.plan is None:
            return
        state = list(model.parameters()) + list(model.buffers())
        self._device = next((t.device for t in state), torch.device("cpu"))
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
            torch.cuda.reset_peak_memory_stats(self._device)
            return
        meter = LiveMemory()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        meter.track(state, grads, _state_tensors(optimizer))
        self._meter = meter.__enter__()

    def step_end(self) -> None:
        """Call after the step's backward, before the optimizer step."""
        if self._steps == self.measure_step and self.plan is not None:
            if self._device is not None and self._device.type == "cuda":
                torch.cuda.synchronize(self._device)
                self.measured_peak_bytes = int(torch.cuda.max_memory_allocated(self._device))
            elif self._meter is not None:
                self._meter.__exit__(None, None, None)
                self.measured_peak_bytes = self._meter.peak
                self._meter = None
            if self.measured_peak_bytes is not None:
                predicted = self.predicted_peak_bytes
                logger.info(
                    "callback: step %d peak, predicted %.2f MB, measured %.2f MB (%+.1f %%)%s",
                    self._steps, predicted / 1e6, self.measured_peak_bytes / 1e6,
                    100 * (predicted - self.measured_peak_bytes) / max(1, self.measured_peak_bytes),
                    "" if self.plan.budget_bytes is None or self.measured_peak_bytes <= self.plan.budget_bytes
                    else f", OVER the budget of {self.plan.budget_bytes / 1e6:.2f} MB",
                )
        self._steps += 1

    def close(self) -> None:
        """Drop the hook and any meter still open (training ended early)."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        if self._meter is not None:
            self._meter.__exit__(None, None, None)
            self._meter = None

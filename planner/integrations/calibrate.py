"""A plan calibrated on the step the user runs: measured once, its fixed bytes corrected, planned once more.

The planner predicts the step it captured. The user's step may hold more (an extra copy of the logits, a
workspace the capture never saw) or less (outputs dropped before the backward); the difference is bytes
that stay for the step whatever is recomputed, so it is corrected as fixed bytes: a plan for a budget B
whose real step measured C bytes over its prediction is planned again for B - C (C < 0: more room).

- `calibrate(plan, model, inputs, step)`: for `optimize()` users; `step(module)` runs one real step of
  theirs (forward and backward, no optimizer step) with `module` as the model.
- the callbacks (core.py) do the same between two training steps, from the peak they measure of the
  planned shape.

Either way the calibration never changes a loss: the random generators and the gradients the model held
are put back after each measured step and each planning, and a plan recomputes bitwise.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..errors import InputError
from ..profile.memory import LiveMemory
from ..progress import logger
from ..solvers.registry import InfeasibleBudgetError

__all__ = ["calibrate", "THRESHOLD", "corrected_budget", "preserved", "measure_peak", "replan_within",
           "state_tensors"]

THRESHOLD = 0.03
"""Measured and predicted peaks of the planned shape parting by more than this fraction (either way)
start one more planning: over it risks running out of memory, under it leaves budget unused."""

BUDGET_KEYS = ("budget_gb", "budget_bytes", "activation_budget")


def state_tensors(optimizer: Any) -> list[torch.Tensor]:
    """The tensors an optimizer (or a framework's wrapper of one) holds as state, for the step's meter."""
    inner = getattr(optimizer, "optimizer", optimizer)
    if not isinstance(inner, torch.optim.Optimizer):
        return []
    return [v for s in inner.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.2f} MB"


@contextlib.contextmanager
def preserved(model: torch.nn.Module) -> Iterator[None]:
    """The random generators and the parameters' gradients as they were, after whatever runs inside."""
    params = list(model.parameters())
    grads = [p.grad for p in params]
    devices = sorted({p.device.index or 0 for p in params if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices):
        try:
            for p in params:
                p.grad = None
            yield
        finally:
            for p, g in zip(params, grads):
                p.grad = g


def measure_peak(model: torch.nn.Module, run: Callable[[], Any], resident: Any = ()) -> int:
    """Peak bytes of `run()`: on CUDA the allocator's, on the CPU the live tensor storages, with the model's
    parameters, buffers, gradients and `resident` (inputs, optimizer state) counted in, as a plan counts them."""
    state = list(model.parameters()) + list(model.buffers())
    device = next((t.device for t in state), torch.device("cpu"))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        run()
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device))
    meter = LiveMemory()
    meter.track(state, [p.grad for p in model.parameters() if p.grad is not None], resident)
    with meter:
        run()
    return int(meter.peak)


def corrected_budget(budget: int, correction: int) -> int:
    """The budget a captured step's plan is asked for so that the real step, `correction` bytes heavier
    (negative: lighter) whatever is recomputed, stays within `budget`."""
    return int(budget - correction)


def replan_within(
    plan: Any, budget: int, correction: int, make_plan: Callable[[int], Any],
    predict: Callable[[Any], int],
) -> tuple[Any, int, int, str]:
    """Plan again so that the real step (`predict(plan) + correction`) fits `budget`.

    `make_plan(b)` plans the captured step for a budget of b bytes; `predict(plan)` is the captured step's
    peak as the loop runs it, before the measured correction. A first plan for the budget moved by what
    the real step differs by; where its prediction still parts from the budget (the difference is not quite
    constant across plans), one more moved by what is left over. Returns (plan, its corrected prediction,
    the captured step's budget asked first, why): the old plan stands when no new one fits, or a new one
    cannot be made (below the feasible floor)."""
    old = predict(plan) + correction
    target = first = corrected_budget(budget, old - int(plan.predicted_peak_bytes))
    best, best_peak, why = (plan, old, "") if old <= budget else (None, None, "")
    for _ in range(2):
        try:
            new = make_plan(target)
        except InfeasibleBudgetError as e:
            why = f"no plan fits {_mb(target)} for the captured step (its floor is {_mb(e.smallest_bytes)})"
            break
        peak = predict(new) + correction
        if peak <= budget and (best is None or best is plan or peak > best_peak):
            best, best_peak = new, peak  # the new plan: planned on what was measured
        if peak <= budget:
            break
        target -= peak - budget
    if best is None:  # nothing fits: the old plan, said so by the caller's line
        best, best_peak = plan, old
        why = why or "no plan was predicted within the budget after the correction"
    return best, int(best_peak), first, why


def calibrate(
    plan: Any, model: torch.nn.Module, example_inputs: Any, step: Callable[[torch.nn.Module], Any], *,
    threshold: float = THRESHOLD, **optimize_kwargs: Any,
) -> Any:
    """A plan calibrated on one real step of the caller's.

    `step(module)` runs one training step as the caller's loop runs it, forward and backward (no optimizer
    step), with `module` standing for the model, at the planned shape (`example_inputs`, as given to
    `optimize()`). It runs once with `plan.module`; where its measured peak parts from
    `plan.predicted_peak_bytes` by more than `threshold` (3 %) either way, the difference is taken as fixed
    bytes and the model is planned once more for the budget less it (`optimize(model, example_inputs,
    budget_bytes=..., **optimize_kwargs)`: pass the keywords of the first call other than its budget), and
    the new plan's step is measured too. The plan returned carries one note, and
    `stats["calibration"]` (bytes: measured, predicted, correction, budget; the new plan's measured peak).
    The random generators and the model's gradients are put back after each step, so training is unchanged.
    """
    from ..api import optimize

    if plan.budget_bytes is None:
        raise InputError("calibrate: the plan has no budget to fit (plan it with budget_gb= or budget_bytes=)")
    if plan.module is None:
        raise InputError("calibrate: the plan has no module (build it with plan.rebuild(model) first)")
    if any(optimize_kwargs.get(k) is not None for k in BUDGET_KEYS):
        raise InputError("calibrate: the budget is the plan's own; pass the other optimize() keywords only")

    def measured(p: Any) -> int:
        with preserved(model):
            return measure_peak(model, lambda: step(p.module), example_inputs)

    budget, predicted = int(plan.budget_bytes), int(plan.predicted_peak_bytes)
    peak = measured(plan)
    error = (peak - predicted) / max(1, predicted)
    record: dict[str, Any] = {"measured_bytes": peak, "predicted_bytes": predicted, "budget_bytes": budget,
                              "correction_bytes": peak - predicted, "replanned": False}
    if abs(error) <= threshold:
        line = (f"calibrated on the caller's step: measured {_mb(peak)}, predicted {_mb(predicted)} "
                f"({100 * error:+.1f} %, within {100 * threshold:.0f} %): the plan stands")
        _note(plan, line, record)
        return plan

    def make_plan(b: int) -> Any:
        with preserved(model):
            return optimize(model, example_inputs, budget_bytes=b, **optimize_kwargs)

    correction = peak - predicted
    new, new_predicted, target, why = replan_within(plan, budget, correction, make_plan,
                                                    lambda p: int(p.predicted_peak_bytes))
    record.update(replanned=new is not plan, corrected_prediction_bytes=new_predicted)
    if new is plan:
        line = (f"calibrated on the caller's step: measured {_mb(peak)}, predicted {_mb(predicted)} "
                f"({100 * error:+.1f} %); kept the plan: {why}")
    else:
        after = measured(new)
        record["measured_after_bytes"] = after
        line = (f"calibrated on the caller's step: measured {_mb(peak)}, predicted {_mb(predicted)} "
                f"({100 * error:+.1f} %): the step is {_mb(abs(correction))} "
                f"{'heavier' if correction > 0 else 'lighter'} than the captured one whatever is recomputed, "
                f"so planned again for {_mb(target)} (budget {_mb(budget)}): "
                f"{len(plan.regions)} -> {len(new.regions)} regions, predicted {_mb(new_predicted)}, "
                f"measured {_mb(after)}")
        record["asked_budget_bytes"] = new.budget_bytes
    _note(new, line, record)
    return new


def _note(plan: Any, line: str, record: dict[str, Any]) -> None:
    plan.notes = (*plan.notes, line)
    plan.stats["calibration"] = record
    logger.log(logging.INFO if "kept the plan" not in line else logging.WARNING, "%s", line)

"""The step the user's loop runs, as far as its memory goes, against the step the planner captured.

`optimize()` plans, and `verify` measures, the step `out = model(**inputs); loss_of(out).backward()` with
`out` alive through the backward: every output of the graph is held to the step's end. A training loop
may hold less or more than that, and how long it keeps the outputs is its own choice:

- `transformers.Trainer`: `compute_loss` returns the loss alone, so the model's other outputs (the
  logits: batch x length x vocabulary, fp32) are dropped before `accelerator.backward(loss)`. On a
  4-layer, 256-wide LoRA Llama (vocabulary 8,000) at 4 x 256 tokens that is 32.8 MB of a 191.0 MB step.
- Lightning: `training_step` returns the loss (the model's output goes with its frame), the same.
- Gradient accumulation: from the second micro-batch on, the parameters' gradients are alive from the
  forward's start, where the captured step makes them in its backward.
- AMP with the backward outside `torch.autocast` (both frameworks): leaving the autocast context empties
  autocast's cache of parameter casts, so from there a cast lives only while a saved tensor holds it,
  as on a backward thread of its own (`Problem.casts_cleared`).

`loop_problem` is the plan's Problem with those changes; the same plan simulated on it is the prediction
for the loop's step. What stays unmodelled is measured: the callbacks correct the fixed bytes by the
measured peak of the planned shape (core.py), `calibrate()` does the same for `optimize()` users.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..solvers.problem import Problem
from ..solvers.simulate import simulate

__all__ = ["LoopStep", "loop_problem", "loop_prediction", "HELD"]

LOSS_BYTES = 64
"""An output storage this small is the loss (a scalar): the loop keeps it for its backward."""


@dataclass(frozen=True)
class LoopStep:
    """What the loop holds during its step that the captured step does not, or the other way round."""

    outputs_dropped: bool = False
    """Only the loss is kept through the backward; the model's other outputs go after the loss is made."""
    accumulating: bool = False
    """Gradient accumulation: the parameters' gradients are alive through the whole step."""
    backward_outside_autocast: bool = False
    """The forward runs under autocast and the backward after leaving it: the casts' cache is emptied."""

    def describe(self) -> str:
        parts = []
        if self.outputs_dropped:
            parts.append("outputs other than the loss dropped before the backward")
        if self.accumulating:
            parts.append("gradients alive through the step (accumulation)")
        if self.backward_outside_autocast:
            parts.append("the backward outside autocast, where the forward runs under it")
        return "; ".join(parts) or "outputs held through the backward (optimize()'s step)"


HELD = LoopStep()
"""optimize()'s and verify's step: the output held through the backward."""


def loop_problem(problem: Problem, loop: LoopStep) -> Problem:
    """The captured step's Problem as the loop runs it."""
    changes: dict[str, Any] = {}
    if loop.outputs_dropped:
        changes["storages"] = tuple(
            dataclasses.replace(st, is_output=False) if st.is_output and st.nbytes > LOSS_BYTES else st
            for st in problem.storages
        )
    if loop.accumulating:
        grads = sum(n.param_grad_bytes for n in problem.nodes)
        changes["nodes"] = tuple(dataclasses.replace(n, param_grad_bytes=0) for n in problem.nodes)
        changes["param_bytes"] = problem.param_bytes + grads  # resident from the forward's start
    if loop.backward_outside_autocast and problem.casts and not problem.casts_cleared:
        changes["casts_cleared"] = True
    return dataclasses.replace(problem, **changes) if changes else problem


def _spans_of(plan: Any, application: Any) -> tuple[list[tuple[int, int]], list[int], list[int]]:
    """(regions, kept nodes, offloaded storages) of what runs."""
    candidate = getattr(application, "candidate", None)
    if application is not None and application.kind == "modules" and candidate is not None:
        return list(candidate.spans), [], []
    if application is not None and application.kind == "none":
        return [], [], []
    return plan.spans(), plan.saved_indices(), plan.offloaded_storages()


def loop_prediction(plan: Any, application: Any, loop: LoopStep) -> tuple[int, int]:
    """(the loop's predicted peak in bytes, what the loop's step differs by from the captured one).

    The difference is the same plan simulated on the captured Problem and on `loop_problem`; it is taken
    off the applied plan's own prediction, so that a figure made some other way (a plan in parts) moves by
    it too. Without a Problem (a plan loaded from a file) the difference is 0."""
    predicted = int(application.predicted_peak_bytes if application is not None else plan.predicted_peak_bytes)
    problem = getattr(plan, "problem", None)
    if problem is None or loop == HELD:
        return predicted, 0
    spans, saved, offloaded = _spans_of(plan, application)
    try:
        held = simulate(problem, tuple(spans), saved=tuple(saved), offloaded=tuple(offloaded)).peak_bytes
        ran = simulate(loop_problem(problem, loop), tuple(spans), saved=tuple(saved),
                       offloaded=tuple(offloaded)).peak_bytes
    except (ValueError, IndexError):  # a Problem the plan's regions do not index (a joined partial capture)
        return predicted, 0
    delta = int(ran - held)
    return predicted + delta, delta

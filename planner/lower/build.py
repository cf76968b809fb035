"""The module a plan runs: the captured graph rewritten with the plan's regions, or the model's own code
with whole modules checkpointed (when autotune measured that faster), or the model itself when there is
nothing to recompute; each with the guard that checks the shapes of its training calls."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..capture.shapes import ShapeGuard, guard_model, input_shapes
from ..capture.trace import Capture
from ..progress import stage
from .apply import checkpointed_copy
from .outputs import returns_loss_only
from .rewrite import rewrite

__all__ = ["lower_plan"]

Replan = Callable[[tuple, dict[str, Any]], torch.nn.Module]


def lower_plan(plan: Any, model: torch.nn.Module, cap: Capture, *, chunked: bool, whole_modules: list[str] | None,
               on_larger_shape: str, replan: Replan, values: Any = None) -> None:
    """Give `plan` (a Plan) its `module`, and the notes and step figures that go with the choice made."""
    if cap.on_meta:  # its graph is the meta device's: Plan.rebuild captures the real model that way
        plan.stats["captured_on"] = "meta"
    if returns_loss_only(model):  # outputs="loss": Plan.rebuild returns the loss alone too
        plan.stats["outputs"] = "loss"
    if not plan.regions and not plan.offloaded and not chunked and on_larger_shape == "error":
        # Nothing to recompute: the model itself, not its captured graph (which costs time of its own).
        plan.module, plan.graph_overhead_s, plan.predicted_step_s = model, 0.0, plan.eager_step_s
        plan.notes = (*plan.notes, "no checkpoint regions: plan.module is the model itself, unchanged")
        return
    if whole_modules:  # autotune measured the model's own code, with these modules checkpointed, fastest
        plan.module = checkpointed_copy(model, whole_modules)
        # the model's own code: no captured graph to pay for
        plan.predicted_step_s, plan.graph_overhead_s = plan.predicted_step_s - plan.graph_overhead_s, 0.0
        shown = ", ".join(whole_modules[:3]) + (" ..." if len(whole_modules) > 3 else "")
        plan.notes = (*plan.notes, f"plan.module is the model's own code with {len(whole_modules)} whole modules "
                      f"checkpointed ({shown}), as Plan.apply does, on a shallow copy: autotune measured it faster "
                      "than the captured graph")
        guard_model(plan.module, input_shapes(cap.args, cap.kwargs), on_larger_shape, replan)
        return
    with stage("rewrite", f"{len(plan.regions)} checkpoint regions, {len(plan.offloaded)} offloaded activations"):
        plan.module = rewrite(cap.graph_module, plan.spans(), model=model, saved=plan.saved_indices(),
                              offload=plan.offload_targets())
    planned = input_shapes(cap.args, cap.kwargs)
    guard = ShapeGuard(planned, on_larger_shape, replan, dynamic_dims=cap.dynamic_dims)
    guard.values = values
    object.__setattr__(plan.module, "shape_guard", guard)
    larger = "re-planned per shape" if on_larger_shape == "replan" else "raise ShapeError"
    if not cap.dynamic_dims:
        note = f"planned for inputs {planned}; the capture pinned every dimension, so any other shape is re-planned"
    else:
        note = f"planned for inputs {planned}: smaller shapes run this plan, larger ones {larger}"
    plan.notes = (*plan.notes, *getattr(plan.module, "rewrite_notes", ()), note)

"""TrainerPlanCallback: plan checkpointing for a `transformers.Trainer` run on its first batch.

    trainer = Trainer(model, args, train_dataset=ds, callbacks=[TrainerPlanCallback(activation_budget=0.5)])

The model object stays the Trainer's: the plan is applied in place (`Plan.apply`), so
the optimizer, `state_dict` keys and saving are untouched. See planner/integrations/core.py.
"""

from __future__ import annotations

from typing import Any

try:
    from transformers import TrainerCallback
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("TrainerPlanCallback needs transformers: pip install transformers") from e

from .core import FirstBatchPlanner

__all__ = ["TrainerPlanCallback"]


class TrainerPlanCallback(TrainerCallback):
    """Plan on the first batch, apply in place, log the predicted and the measured peak.

    Keyword arguments are those of `optimize()` (budget_gb, budget_bytes, activation_budget,
    solver, ...; default activation_budget=0.5), plus `module` (a submodule path to plan
    instead of the whole model) and `measure_step` (the step whose peak is measured, default 1).
    The Trainer's optimizer is counted unless `optimizer=` is given. After training:
    `.plan`, `.application`, `.predicted_peak_bytes`, `.measured_peak_bytes` (bytes).
    """

    def __init__(self, **kwargs: Any) -> None:
        self.planner = FirstBatchPlanner(**kwargs)

    def __getattr__(self, name: str) -> Any:
        if name in ("plan", "application", "predicted_peak_bytes", "measured_peak_bytes"):
            return getattr(self.__dict__["planner"], name)
        raise AttributeError(name)

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.planner.attach(model, optimizer)

    def on_step_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.planner.step_begin(model, optimizer)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.planner.step_end()

    def on_train_end(self, args, state, control, **kwargs):
        self.planner.close()

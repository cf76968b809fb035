"""TrainerPlanCallback: plan checkpointing for a `transformers.Trainer` run and run that plan.

    trainer = Trainer(model, args, train_dataset=ds, data_collator=collator,
                      callbacks=[TrainerPlanCallback(activation_budget=0.5, max_length=512)])

The model object stays the Trainer's: its forward runs the plan's own module, which shares its
parameters, so the optimizer, `state_dict` keys and saving are untouched. See planner/integrations/core.py.
"""

from __future__ import annotations

from typing import Any

try:
    from transformers import TrainerCallback
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("TrainerPlanCallback needs transformers: pip install transformers") from e

from .core import FirstBatchPlanner
from .lengths import collators_of
from .loop import LoopStep

__all__ = ["TrainerPlanCallback"]

_READ = ("plan", "application", "predicted_peak_bytes", "measured_peak_bytes", "measurements", "planned_shapes",
         "planning_s", "replans", "correction")


class TrainerPlanCallback(TrainerCallback):
    """Plan on the first batch at the longest length, run the chosen plan in place, log predicted and measured peaks.

    Keyword arguments are those of `optimize()` (budget_gb, budget_bytes, activation_budget,
    solver, ...; default activation_budget=0.5, on_larger_shape='replan'), plus `module` (a submodule
    path to plan instead of the whole model), `max_length` (the length to plan at; default 'auto': the
    collator's `max_length`, else the tokenizer's `model_max_length`, else the first batch's),
    `apply` ('graph', default: the plan's own module; 'modules': whole submodules only) and
    `measure_step` (the first step measured, default 1; every later step with larger inputs is measured
    too). The Trainer's optimizer is counted unless `optimizer=` is given. After training: `.plan`,
    `.application`, `.predicted_peak_bytes`, `.measured_peak_bytes` (bytes, the longest batch
    measured), `.measurements`. At the end of training the model's own forward is put back.

    The plan is made for the Trainer's step, not the one `optimize()` captures: `compute_loss` returns the
    loss alone, so the logits go before the backward; with gradient accumulation the gradients live
    through each step; under bf16/fp16 the backward runs outside autocast (planner/integrations/loop.py).
    `loop=LoopStep(...)` says otherwise (a `compute_loss` that keeps the outputs). Where the longest batch
    measures more than 3 % off its prediction, the plan is made once more between two steps with the
    difference taken as fixed bytes (`.replans`: the log line of each).
    """

    def __init__(self, *, loop: LoopStep | None = None, **kwargs: Any) -> None:
        self.planner = FirstBatchPlanner(**kwargs)
        self.loop = loop

    def __getattr__(self, name: str) -> Any:
        if name in _READ:
            return getattr(self.__dict__["planner"], name)
        raise AttributeError(name)

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        processing = kwargs.get("processing_class")
        self.planner.loop = self.loop or LoopStep(
            outputs_dropped=True, accumulating=args.gradient_accumulation_steps > 1, backward_outside_autocast=True)
        if state.max_steps and state.max_steps > 0:  # a forward and backward per batch, several per optimizer step
            self.planner.run_steps = state.max_steps * max(1, args.gradient_accumulation_steps)
        self.planner.attach(
            model, optimizer, collators=collators_of(kwargs.get("train_dataloader")),
            tokenizers=(processing, getattr(processing, "tokenizer", None)),
        )

    def on_step_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.planner.step_begin(model, optimizer)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.planner.step_end()

    def on_train_end(self, args, state, control, **kwargs):
        self.planner.close()

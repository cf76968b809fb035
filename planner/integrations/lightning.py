"""LightningPlanCallback: plan checkpointing for a `lightning.Trainer` run and run that plan.

    trainer = lightning.Trainer(callbacks=[LightningPlanCallback(activation_budget=0.5)])

It takes over the LightningModule's forward (or that of the submodule named by `module`, for a
`training_step` that calls `self.model(x)`), plans on its first training call at the longest length,
and runs the chosen plan in place. See planner/integrations/core.py.
"""

from __future__ import annotations

from typing import Any

try:
    from lightning.pytorch.callbacks import Callback
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError('LightningPlanCallback needs lightning: pip install "ckpt-planner[lightning]"') from e

from .core import FirstBatchPlanner
from .lengths import collators_of
from .loop import LoopStep

__all__ = ["LightningPlanCallback"]

_READ = ("plan", "application", "predicted_peak_bytes", "measured_peak_bytes", "measurements", "planned_shapes",
         "planning_s", "replans", "correction")


class LightningPlanCallback(Callback):
    """Plan on the first batch at the longest length, run the chosen plan in place, log predicted and measured peaks.

    Keyword arguments are those of `optimize()` (default activation_budget=0.5, on_larger_shape='replan'),
    plus `module` (submodule path of the LightningModule whose forward the training step calls; default
    the LightningModule itself), `max_length` (default 'auto': the collator's or its tokenizer's, or a
    `tokenizer` on the datamodule or the LightningModule, else the first batch's), `apply` ('graph' or
    'modules') and `measure_step` (default 1). The first optimizer of the run is counted unless
    `optimizer=` is given. After training: `.plan`, `.application`, `.predicted_peak_bytes`,
    `.measured_peak_bytes` (bytes, the longest batch measured), `.measurements`.

    Lightning runs `training_step` before `zero_grad`, so the last step's gradients would stay
    alive through the forward, a peak the plan does not count (one more copy of the parameters).
    With `free_grads=True` (default) they are dropped at the batch's start instead, as
    `zero_grad(set_to_none=True)` would drop them a moment later; skipped while gradients accumulate.

    The plan is made for Lightning's step: `training_step` returns the loss, so the model's other outputs
    go before the backward; with `accumulate_grad_batches` the gradients live through each step; under a
    mixed precision plugin the backward runs outside autocast (planner/integrations/loop.py).
    `loop=LoopStep(...)` says otherwise (a `training_step` that returns its outputs). Where the longest batch
    measures more than 3 % off its prediction, the plan is made once more between two steps with the
    difference taken as fixed bytes (`.replans`: the log line of each).
    """

    def __init__(self, *, free_grads: bool = True, loop: LoopStep | None = None, **kwargs: Any) -> None:
        self.free_grads = free_grads
        self.loop = loop
        self.planner = FirstBatchPlanner(**kwargs)

    def __getattr__(self, name: str) -> Any:
        if name in _READ:
            return getattr(self.__dict__["planner"], name)
        raise AttributeError(name)

    def on_train_start(self, trainer, pl_module) -> None:
        datamodule = getattr(trainer, "datamodule", None)
        self.planner.loop = self.loop or LoopStep(
            outputs_dropped=True, accumulating=trainer.accumulate_grad_batches > 1, backward_outside_autocast=True)
        steps = getattr(trainer, "estimated_stepping_batches", None)  # optimizer steps; inf for an endless run
        if isinstance(steps, (int, float)) and 0 < steps < float("inf"):
            self.planner.run_steps = int(steps) * max(1, trainer.accumulate_grad_batches)
        self.planner.attach(
            pl_module, trainer.optimizers[0] if trainer.optimizers else None,
            collators=collators_of(getattr(trainer, "train_dataloader", None)),
            tokenizers=(getattr(datamodule, "tokenizer", None), getattr(pl_module, "tokenizer", None)),
        )

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.free_grads and pl_module.automatic_optimization and trainer.accumulate_grad_batches == 1:
            for p in pl_module.parameters():
                p.grad = None
        self.planner.step_begin(pl_module, trainer.optimizers[0] if trainer.optimizers else None)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.planner.step_end()

    def on_train_end(self, trainer, pl_module) -> None:
        self.planner.close()

"""Trainer and Lightning callbacks: plan on the first batch, run the plan in place, the same losses as without."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

STEPS = 4


# -- transformers.Trainer ------------------------------------------------------------


def _hf_run(tmp_path, callbacks):
    transformers = pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    class Recording(Trainer):
        losses: list[torch.Tensor] = []

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            self.losses.append(loss.detach().clone())
            return loss

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=3, n_embd=64, n_head=2, vocab_size=128, n_positions=64, use_cache=False))
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 128, (4 * STEPS, 32), generator=g)]
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=4, use_cpu=True, report_to=[],
        save_strategy="no", logging_strategy="no", disable_tqdm=True, seed=0, dataloader_num_workers=0,
    )
    trainer = Recording(model=model, args=args, train_dataset=data, callbacks=callbacks)
    trainer.losses = []
    transformers.logging.set_verbosity_error()
    trainer.train()
    return trainer.losses, model


@pytest.mark.slow  # a real Trainer run: ~13 s on 2 busy cores
def test_trainer_callback_same_losses_and_logs_peaks(tmp_path, caplog) -> None:
    from ckpt_planner.integrations import TrainerPlanCallback

    base_losses, base_model = _hf_run(tmp_path, [])
    callback = TrainerPlanCallback(activation_budget=0.6, solver="dp")
    with caplog.at_level(logging.INFO, logger="ckpt_planner"):
        losses, model = _hf_run(tmp_path, [callback])
    assert len(losses) == len(base_losses) == STEPS
    for a, b in zip(losses, base_losses):
        assert torch.equal(a, b)  # bitwise, dropout included
    for (name, p), q in zip(model.named_parameters(), base_model.parameters()):
        assert torch.equal(p, q), name
    # it planned, and the Trainer's own model object ran the plan's module; its own forward is back after training
    assert callback.plan is not None and callback.application.kind == "graph"
    assert "forward" not in model.__dict__
    assert callback.plan.predicted_peak_bytes < callback.plan.baseline_peak_bytes
    assert callback.measured_peak_bytes is not None and callback.predicted_peak_bytes is not None
    assert abs(callback.predicted_peak_bytes / callback.measured_peak_bytes - 1) < 0.1
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "planning GPT2LMHeadModel at input_ids [4, 32]" in text and "(the first batch" in text
    assert "predicted" in text and "measured" in text
    # the Trainer's max_steps is the run's length: too short a run to race (the note says so)
    assert callback.planner.run_steps == STEPS
    assert any(n.startswith("autotune: off") and f"{STEPS} training steps" in n for n in callback.plan.notes)


# -- lightning ----------------------------------------------------------------------


def _lightning_run(callbacks):
    L = pytest.importorskip("lightning")

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            blocks = [nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Dropout(0.1), nn.Linear(128, 32), nn.LayerNorm(32))
                      for _ in range(4)]
            self.net = nn.Sequential(*blocks, nn.Linear(32, 5))
            self.losses: list[torch.Tensor] = []

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.cross_entropy(self(x), y)
            self.losses.append(loss.detach().clone())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    torch.manual_seed(0)
    net = Net()
    g = torch.Generator().manual_seed(1)
    ds = torch.utils.data.TensorDataset(torch.randn(64 * STEPS, 32, generator=g), torch.randint(0, 5, (64 * STEPS,), generator=g))
    trainer = L.Trainer(
        max_steps=STEPS, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
    )
    trainer.fit(net, torch.utils.data.DataLoader(ds, batch_size=64))
    return net.losses, net


def test_lightning_callback_same_losses_and_logs_peaks(caplog) -> None:
    from ckpt_planner.integrations import LightningPlanCallback

    logging.getLogger("lightning").setLevel(logging.ERROR)
    base_losses, base_net = _lightning_run([])
    callback = LightningPlanCallback(activation_budget=0.5, solver="dp")
    with caplog.at_level(logging.INFO, logger="ckpt_planner"):
        losses, net = _lightning_run([callback])
    assert len(losses) == len(base_losses) == STEPS
    for a, b in zip(losses, base_losses):
        assert torch.equal(a, b)
    for (name, p), q in zip(net.named_parameters(), base_net.parameters()):
        assert torch.equal(p, q), name
    assert callback.plan is not None and callback.application.kind in ("graph", "modules")
    assert callback.plan.predicted_peak_bytes < callback.plan.baseline_peak_bytes
    assert callback.measured_peak_bytes is not None
    assert abs(callback.predicted_peak_bytes / callback.measured_peak_bytes - 1) < 0.1
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "planning Net at x [64, 32]" in text and "measured" in text
    assert callback.planner.run_steps == STEPS  # Lightning's estimated stepping batches: the run's length
    assert any(n.startswith("autotune: off") and f"{STEPS} training steps" in n for n in callback.plan.notes)


def test_missing_framework_names_the_install(monkeypatch) -> None:
    import importlib.util

    import ckpt_planner.integrations as integrations

    monkeypatch.delitem(integrations.__dict__, "LightningPlanCallback", raising=False)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "lightning" else real(name, *a))
    with pytest.raises(ImportError, match="pip install"):
        integrations.LightningPlanCallback  # noqa: B018

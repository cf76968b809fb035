"""The callbacks run the plan they chose, planned at the longest length, on a variable-length fine-tune.

A small Qwen2 (2 layers x 64, vocabulary 512) trains 10 steps on sequences of 20-120 tokens padded per
batch. The callback plans at max_length=120 (the first batch is shorter), the model's forward runs the
plan's own module (its regions read back from the graph that runs equal the plan's), the losses and
the weights are bitwise those of a run without it, and the longest batch's measured peak is within
the budget. Plan costs come from FLOPs (`flop_times=True`) so the plan does not depend on the clock.
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys

import pytest
import torch
from ckpt_planner.profile.profiler import ProfileConfig

from tests.support.batches import PadPerBatch

STEPS, BATCH, LONGEST = 10, 4, 120
# each step's longest sequence: the first batch is short, the longest comes later and again after
BATCH_MAX = [64, 40, 90, 120, 50, 120, 30, 100, 77, 20]
PLAN = {"activation_budget": 0.5, "solver": "dp", "autotune": False, "check_step": False,
        "profile_config": ProfileConfig(flop_times=True, count_flops=True)}


def _examples() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for top in BATCH_MAX:
        lengths = [top] + torch.randint(20, top + 1, (BATCH - 1,), generator=g).tolist()
        out += [{"input_ids": torch.randint(1, 512, (n,), generator=g)} for n in lengths]
    return out




def _qwen():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=512, max_position_embeddings=256, use_cache=False)
    return Qwen2ForCausalLM(config)


def _hf_run(tmp_path, callbacks, *, collator=None, tqdm_bar=False):
    transformers = pytest.importorskip("transformers")
    from ckpt_planner.lower.apply import checkpointed_modules
    from ckpt_planner.lower.inplace import running_module
    from transformers import Trainer, TrainingArguments

    class Recording(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            self.losses.append(loss.detach().clone())
            self.running.append(running_module(model))
            self.checkpointed.append(checkpointed_modules(model))
            return loss

        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    model = _qwen()
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=BATCH, use_cpu=True, report_to=[],
        save_strategy="no", logging_strategy="no", disable_tqdm=not tqdm_bar, seed=0, dataloader_num_workers=0,
    )
    trainer = Recording(model=model, args=args, train_dataset=_examples(), data_collator=collator or PadPerBatch(),
                        callbacks=callbacks)
    trainer.losses, trainer.running, trainer.checkpointed = [], [], []
    transformers.logging.set_verbosity_error()
    trainer.train()
    return trainer, model


@pytest.fixture(scope="module")
def hf_runs(tmp_path_factory):
    pytest.importorskip("transformers")
    from ckpt_planner.integrations import TrainerPlanCallback

    tmp = tmp_path_factory.mktemp("hf")
    base, base_model = _hf_run(tmp, [])
    callback = TrainerPlanCallback(max_length=LONGEST, **PLAN)
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    logger = logging.getLogger("ckpt_planner")
    keep, level = Keep(), logger.level
    err = io.StringIO()
    logger.addHandler(keep)
    logger.setLevel(logging.INFO)
    try:
        with contextlib.redirect_stderr(err):
            console = logging.StreamHandler(sys.stderr)  # a console handler, as basicConfig makes
            logger.addHandler(console)
            try:
                run, model = _hf_run(tmp, [callback], tqdm_bar=True)
            finally:
                logger.removeHandler(console)
    finally:
        logger.removeHandler(keep)
        logger.setLevel(level)
    return {"base": base, "base_model": base_model, "run": run, "model": model, "callback": callback,
            "log": [r.getMessage() for r in records], "stderr": err.getvalue()}


def test_trainer_losses_bitwise_with_the_plan_running(hf_runs) -> None:
    base, run = hf_runs["base"], hf_runs["run"]
    assert len(run.losses) == len(base.losses) == STEPS
    for step, (a, b) in enumerate(zip(run.losses, base.losses)):
        assert torch.equal(a, b), step
    for (name, p), q in zip(hf_runs["model"].named_parameters(), hf_runs["base_model"].parameters()):
        assert torch.equal(p, q), name


def test_trainer_runs_the_plan_it_chose(hf_runs) -> None:
    from ckpt_planner.lower.inplace import executed_regions, running_module

    callback, run, model = hf_runs["callback"], hf_runs["run"], hf_runs["model"]
    plan = callback.plan
    assert plan.regions and callback.application.kind == "graph"
    # every training step ran the plan's own module, in place of the model's forward: from the step after
    # the closed loop planned again (the longest batch, step 3, measured off its prediction), the new plan's
    since = 4 if callback.replans else 0
    assert all(m is plan.module for m in run.running[since:])
    assert all(m is not None for m in run.running)
    # the regions and kept ops of the graph that ran are the plan's
    chosen = sorted((r.first_node, r.last_node, frozenset(r.saved_ops)) for r in plan.regions)
    assert executed_regions(plan.module) == chosen
    assert list(callback.application.regions) == chosen
    # predicted for the Trainer's step: the plan's own figure less the logits compute_loss drops before the
    # backward, plus what the closed loop measured
    from ckpt_planner.integrations.loop import loop_prediction

    assert callback.planner.loop.outputs_dropped
    delta = loop_prediction(plan, callback.application, callback.planner.loop)[1]
    assert callback.predicted_peak_bytes == plan.predicted_peak_bytes + delta + callback.correction and delta < 0
    assert not any("whole modules instead" in line for line in hf_runs["log"])
    # the same model object, parameters shared, its own forward back after training
    assert {id(p) for p in plan.module.parameters()} <= {id(p) for p in model.parameters()}
    assert running_module(model) is None and "forward" not in model.__dict__


def test_trainer_plans_at_the_longest_length_and_measures_it(hf_runs) -> None:
    callback = hf_runs["callback"]
    planned = dict(callback.planned_shapes.shapes)
    assert planned["input_ids"] == (BATCH, LONGEST) and planned["labels"] == (BATCH, LONGEST)
    # measured: step 1 (the first after planning), then each batch longer than any measured before
    # and the longest again (step 5) after the closed loop planned once more on step 3's measurement
    measured = [(m.step, dict(m.shapes.shapes)["input_ids"][1]) for m in callback.measurements]
    assert measured == [(1, 40), (2, 90), (3, 120)] + ([(5, 120)] if callback.replans else [])
    assert len(callback.replans) <= 1
    longest = max(callback.measurements, key=lambda m: dict(m.shapes.shapes)["input_ids"][1])
    assert callback.measured_peak_bytes == longest.peak_bytes
    assert longest.peak_bytes <= callback.plan.budget_bytes
    # the same shape as planned: the Trainer's step as predicted, once the closed loop corrected what it measured
    assert abs(longest.peak_bytes - callback.predicted_peak_bytes) <= 0.02 * longest.peak_bytes
    assert all(m.peak_bytes <= callback.plan.budget_bytes for m in callback.measurements)
    # shorter batches ran the same plan: nothing was planned again
    assert not callback.plan.module.shape_guard.replanned


def test_trainer_log_lines_name_their_shapes(hf_runs) -> None:
    log = hf_runs["log"]
    planning = next(line for line in log if "planning Qwen2ForCausalLM" in line)
    assert "input_ids [4, 120]" in planning and "the first batch is input_ids [4, 64]" in planning
    assert "max_length=" in planning
    step1 = next(line for line in log if line.startswith("callback: step 1 at"))
    assert "input_ids [4, 40]" in step1 and "at the planned input_ids [4, 120]" in step1
    step3 = next(line for line in log if line.startswith("callback: step 3 at"))
    assert "input_ids [4, 120]" in step3 and "within the budget" in step3 and "%)" in step3


def test_log_lines_do_not_interleave_with_the_bar(hf_runs) -> None:
    text = hf_runs["stderr"]
    assert "it/s]" in text or "s/it]" in text  # the Trainer's bar was drawn here
    lines = [seg for line in text.split("\n") for seg in [line.split("\r")[-1]] if "callback:" in line]
    assert lines, "no callback line reached the console"
    for seg in lines:
        assert seg.startswith("callback:"), seg  # nothing of the bar before it on its line


def test_collator_max_length_is_found() -> None:
    from ckpt_planner.integrations.lengths import collators_of, find_max_length, grown_to

    loader = torch.utils.data.DataLoader(_examples(), batch_size=BATCH, collate_fn=PadPerBatch(max_length=100))
    length, source = find_max_length(_qwen(), collators=collators_of(loader))
    assert length == 100 and "collator" in source

    class Tok:
        model_max_length = 1_000_000_000_000_000_019_884_624_838_656  # transformers' "unset"

    assert find_max_length(None, tokenizers=(Tok(),))[0] is None
    Tok.model_max_length = 4096
    length, source = find_max_length(_qwen(), tokenizers=(Tok(),))
    assert length == 256 and "max_position_embeddings" in source
    batch = PadPerBatch()(_examples()[:BATCH])
    grown = grown_to(batch, LONGEST)
    assert {k: tuple(v.shape) for k, v in grown.items()} == {k: (BATCH, LONGEST) for k in batch}
    assert torch.equal(grown["input_ids"][:, : batch["input_ids"].shape[1]], batch["input_ids"])
    assert set(grown["labels"][:, -1].tolist()) <= set(batch["labels"][:, -1].tolist())


def test_whole_module_candidates_are_simulated_and_the_best_fitting_kept(hf_runs) -> None:
    from ckpt_planner.choose.regions import best_module_plan, module_candidates

    callback = hf_runs["callback"]
    plan = callback.plan
    candidates = module_candidates(plan, callback.planner._root)
    assert [c.name for c in candidates] == ["nearest", "per block", "greedy"]  # the plan's regions are not modules
    best = best_module_plan(candidates, plan.budget_bytes)
    fitting = [c for c in candidates if c.fits(plan.budget_bytes)]
    assert best in fitting if fitting else best.peak_bytes == min(c.peak_bytes for c in candidates)
    assert not fitting or best.recompute_s == min(c.recompute_s for c in fitting)
    per_block = candidates[1]
    assert per_block.paths == ("inner.model.layers.0", "inner.model.layers.1")


@pytest.mark.slow  # a second planned Trainer run: ~60 s on 2 busy cores
def test_trainer_whole_modules_named_and_bitwise(tmp_path, caplog) -> None:
    from ckpt_planner.integrations import TrainerPlanCallback

    base, _ = _hf_run(tmp_path, [])
    callback = TrainerPlanCallback(max_length=LONGEST, apply="modules", **PLAN)
    with caplog.at_level(logging.INFO, logger="ckpt_planner"):
        run, model = _hf_run(tmp_path, [callback])
    for step, (a, b) in enumerate(zip(run.losses, base.losses)):
        assert torch.equal(a, b), step
    applied = callback.application
    assert applied.kind == "modules" and applied.candidate.name in ("nearest", "per block", "greedy")
    # what ran in training is the whole-module plan named, not another one
    since = 4 if callback.replans else 1  # the closed loop's plan from the step after it planned again
    assert all(set(paths) == set(applied.modules) for paths in run.checkpointed[since:])
    from ckpt_planner.integrations.loop import loop_prediction

    delta = loop_prediction(callback.plan, applied, callback.planner.loop)[1]
    assert applied.predicted_peak_bytes == applied.candidate.peak_bytes + delta + callback.correction
    lines = [r.getMessage() for r in caplog.records if "instead of the chosen plan" in r.getMessage()]
    # one line per plan applied (the closed loop's second plan has its own)
    assert len(lines) == 1 + len(callback.replans)
    assert f"'{applied.candidate.name}'" in lines[-1] and "compared by simulation" in lines[-1]
    assert callback.measured_peak_bytes <= callback.plan.budget_bytes
    assert not any(hasattr(m, "_ckpt_planner_state") for m in model.modules())  # restored after training


# -- lightning ----------------------------------------------------------------------


def _lightning_run(callbacks):
    L = pytest.importorskip("lightning")
    pytest.importorskip("transformers")

    class FineTune(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = _qwen()
            self.losses: list[torch.Tensor] = []

        def training_step(self, batch, batch_idx):
            loss = self.model(**batch).loss
            self.losses.append(loss.detach().clone())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    net = FineTune()
    loader = torch.utils.data.DataLoader(_examples(), batch_size=BATCH, collate_fn=PadPerBatch(max_length=LONGEST))
    trainer = L.Trainer(
        max_steps=STEPS, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
    )
    trainer.fit(net, loader)
    return net


# a planned Lightning fine-tune on top of the module's two Trainer runs. In the default run the Trainer
# tests above check a callback running its plan, and test_callbacks.py the Lightning callback.
@pytest.mark.slow
def test_lightning_runs_the_plan_it_chose_at_the_collators_length() -> None:
    pytest.importorskip("lightning")
    from ckpt_planner.integrations import LightningPlanCallback
    from ckpt_planner.lower.inplace import executed_regions

    logging.getLogger("lightning").setLevel(logging.ERROR)
    base = _lightning_run([])
    callback = LightningPlanCallback(module="model", **PLAN)  # max_length from the collator
    net = _lightning_run([callback])
    assert len(net.losses) == len(base.losses) == STEPS
    for step, (a, b) in enumerate(zip(net.losses, base.losses)):
        assert torch.equal(a, b), step
    for (name, p), q in zip(net.named_parameters(), base.parameters()):
        assert torch.equal(p, q), name
    plan = callback.plan
    assert dict(callback.planned_shapes.shapes)["input_ids"] == (BATCH, LONGEST)
    assert callback.application.kind == "graph"
    assert executed_regions(plan.module) == sorted(
        (r.first_node, r.last_node, frozenset(r.saved_ops)) for r in plan.regions)
    longest = max(callback.measurements, key=lambda m: dict(m.shapes.shapes)["input_ids"][1])
    assert dict(longest.shapes.shapes)["input_ids"][1] == LONGEST
    assert longest.peak_bytes <= plan.budget_bytes

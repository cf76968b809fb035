"""The training callbacks on a real variable-length fine-tune: plan applied, losses, peak, planning's share of the run.

A small Qwen2 (4 layers x 256, 4 heads, 2 kv heads, intermediate 688, vocabulary 8,000) fine-tunes
for 300 steps at batch 8 on synthetic token ids (a seeded generator; nothing downloaded) of 40-300
tokens, padded per batch (pad id 0, labels -100 on padding, an attention mask). One row of the middle
batch is exactly 300 tokens, so the longest batch, the one the plan is made for, comes in every run.
For `transformers.Trainer` and for `lightning.Trainer`, the fine-tune runs once without the callback
(the reference: its losses, its wall time) and once with it (`TrainerPlanCallback` /
`LightningPlanCallback(module="model")`, `budget_gb=0.45`, `max_length=300`, the default profile:
measured times, autotune on), with the same seed and data order. Each run is a fresh interpreter with
its own empty timing store, so the planned run pays what a user's first fine-tune pays.

Reported per framework: each run's wall time (the `train()` / `fit()` call), the planning seconds the
callback records (`.planning_s`, the `optimize()` call on the first batch) and its stages (the
"<stage>: done in <s> s" lines optimize() logs), planning as a % of the planned run's wall time (the
issue's target: at most 10 % of a 300-step fine-tune), the first step's extra time seen from outside
(planned run's step 0 minus the reference's), steps/s after planning against the reference's, the plan
applied (solver, autotune's choice, whether the graph that runs is the plan chosen or a named
whole-module plan), losses bitwise against the reference (every step) and the final weights, the
peak the callback measured on the longest batch against the budget, and the load average at start.

    python -m benchmarks.finetune --quick     # 30 steps (a smoke run, minutes)
    python -m benchmarks.finetune             # 300 steps; writes benchmarks/results/finetune.json and .md

`--lora` (needs peft: `pip install "ckpt-planner[peft]"`): a 4-layer, 256-wide Llama (vocabulary 8,000)
under LoRA r=8 on q_proj and v_proj, batch 4, 64-512 tokens padded per batch, the longest batch twice.
The budget is halfway between the measured peaks of the loop's step at the longest batch without
checkpointing and with per-layer `gradient_checkpointing_enable()`. Per framework three runs side by
side (none, per layer, the callback): the longest batch's measured peak against the callback's
prediction and the budget, losses and weights bitwise against none, the median step against per-layer
checkpointing's, planning's share of the run and, extrapolated, of a 300-step run. It writes its own
section of finetune.json / .md and keeps the rest.

    python -m benchmarks.finetune --lora --steps 9
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BATCH, SHORTEST, LONGEST, VOCAB = 8, 40, 300, 8000
BUDGET_GB = 0.45
TARGET_SHARE = 0.10
FRAMEWORKS = ("trainer", "lightning")


# -- data --------------------------------------------------------------------------------


def examples(steps: int) -> list[dict[str, Any]]:
    """steps x BATCH rows of token ids, lengths uniform in [SHORTEST, LONGEST]; one row of the middle
    batch is LONGEST long. Ids from 1 (0 is the pad id)."""
    import torch

    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(SHORTEST, LONGEST + 1, (steps * BATCH,), generator=g).tolist()
    lengths[(steps // 2) * BATCH] = LONGEST
    return [{"input_ids": torch.randint(1, VOCAB, (n,), generator=g)} for n in lengths]




def qwen2():
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(num_hidden_layers=4, hidden_size=256, intermediate_size=688, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=512, use_cache=False)
    return Qwen2ForCausalLM(config)


# -- one run (a fresh interpreter) -----------------------------------------------------------


def _weights_digest(model) -> str:
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def _trainer_run(steps: int, callback, out_dir: str, stop_after: int | None = None) -> dict[str, Any]:
    """`steps` steps (the learning-rate schedule's length), or the first `stop_after` of them."""
    import torch
    import transformers
    from ckpt_planner.lower.inplace import running_module
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class Recording(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            self.losses.append(loss.detach().clone())
            self.running.append(running_module(model))
            return loss

        def _get_train_sampler(self, *args, **kwargs):  # the same order in every run, whatever planning draws
            return torch.utils.data.SequentialSampler(self.train_dataset)

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())
            if stop_after is not None and state.global_step >= stop_after:
                control.should_training_stop = True

    ends: list[float] = []
    model = qwen2()
    args = TrainingArguments(
        output_dir=out_dir, max_steps=steps, per_device_train_batch_size=BATCH, use_cpu=True, report_to=[],
        save_strategy="no", logging_strategy="no", disable_tqdm=True, seed=0, dataloader_num_workers=0,
    )
    from tests.support.batches import PadPerBatch

    callbacks = ([callback] if callback is not None else []) + [Clock()]
    trainer = Recording(model=model, args=args, train_dataset=examples(steps),
                        data_collator=PadPerBatch(max_length=LONGEST), callbacks=callbacks)
    trainer.losses, trainer.running = [], []
    transformers.logging.set_verbosity_error()
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "start": t0, "ends": ends, "losses": [x.item() for x in trainer.losses],
            "running": trainer.running, "weights": _weights_digest(model)}


def _lightning_run(steps: int, callback) -> dict[str, Any]:
    import logging

    import lightning as L
    import torch
    from ckpt_planner.lower.inplace import running_module

    from tests.support.batches import PadPerBatch

    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    ends: list[float] = []

    class FineTune(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = qwen2()
            self.losses: list[torch.Tensor] = []
            self.running: list[Any] = []

        def training_step(self, batch, batch_idx):
            loss = self.model(**batch).loss
            self.losses.append(loss.detach().clone())
            self.running.append(running_module(self.model))
            return loss

        def on_train_batch_end(self, outputs, batch, batch_idx):
            ends.append(time.perf_counter())

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=5e-5)

    net = FineTune()
    loader = torch.utils.data.DataLoader(examples(steps), batch_size=BATCH, shuffle=False,
                                         collate_fn=PadPerBatch(max_length=LONGEST))
    trainer = L.Trainer(
        max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[callback] if callback is not None else [],
    )
    t0 = time.perf_counter()
    trainer.fit(net, loader)
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "start": t0, "ends": ends, "losses": [x.item() for x in net.losses],
            "running": net.running, "weights": _weights_digest(net.model)}


def regions_match(read_back: list[list[Any]], planned: list[list[Any]]) -> bool:
    """The regions the running graph holds ([first, last, kept]) are the plan's ([first, last, start, end,
    kept]), one for one: the same kept ops, and the same end nodes where the running graph names them by
    their op. The running graph may number kept ops from the region's start where the plan numbers them in
    the whole graph, and names a region's first or last node `keep_begin` / `keep_end_<n>` when that node
    is a kept op."""
    left = [(f, last, tuple(k)) for f, last, k in read_back]
    if len(left) != len(planned):
        return False
    for first, last, start, _end, kept in planned:
        forms = {tuple(kept), tuple(k - start for k in kept)}
        hit = next((x for x in left if x[2] in forms and (x[0] == first or x[0].startswith("keep_begin"))
                    and (x[1] == last or x[1].startswith("keep_end"))), None)
        if hit is None:
            return False
        left.remove(hit)
    return True


def _applied(callback, running: list[Any]) -> dict[str, Any]:
    """What the callback applied, and whether the graph that ran is the plan it chose."""
    from ckpt_planner.lower.apply import checkpointed_modules
    from ckpt_planner.lower.inplace import executed_regions
    from ckpt_planner.lower.rewrite import CheckpointedModule

    plan, app = callback.plan, callback.application
    autotune = plan.stats.get("autotune") or {}
    chosen = sorted((r.first_node, r.last_node, frozenset(r.saved_positions)) for r in plan.regions)
    out: dict[str, Any] = {
        "kind": app.kind, "solver": plan.solver, "chosen": plan.stats.get("chosen") or autotune.get("chosen"),
        "autotune_steps": autotune.get("steps"), "autotune_seconds": autotune.get("seconds"),
        "autotune_candidates": [c.get("label") for c in autotune.get("candidates", ()) if isinstance(c, dict)],
        "regions": len(plan.regions), "kept_ops": sum(len(r.saved_positions) for r in plan.regions),
        "note": app.note,
        "predicted_peak_bytes": app.predicted_peak_bytes, "predicted_recompute_s": app.predicted_recompute_s,
        "plan_predicted_peak_bytes": plan.predicted_peak_bytes, "baseline_peak_bytes": plan.baseline_peak_bytes,
        "budget_bytes": plan.budget_bytes,
    }
    whole = list(plan.stats.get("whole_modules") or ())
    if app.kind == "graph" and whole:  # the race's winner runs as the model's own code, those modules checkpointed
        ran_modules = list(checkpointed_modules(plan.module))
        out["every_step_ran_the_plan"] = bool(running) and all(m is plan.module for m in running)
        out["steps_checked"] = len(running)
        out["whole_module_plan"] = autotune.get("chosen")
        out["modules_planned"], out["modules_run"] = whole, ran_modules
        out["plan_is_chosen"] = out["every_step_ran_the_plan"] and sorted(ran_modules) == sorted(whole)
    elif app.kind == "graph":
        ran = executed_regions(plan.module)
        out["every_step_ran_the_plan"] = bool(running) and all(m is plan.module for m in running)
        out["steps_checked"] = len(running)
        # as the tests read it: (first node, last node, kept positions) of the graph that runs == the plan's
        out["regions_run_are_the_plan"] = ran == chosen
        out["regions_read_back"] = [[f, last, sorted(k)] for f, last, k in ran]
        out["regions_planned"] = [[r.first_node, r.last_node, r.start, r.end, sorted(r.saved_positions)]
                                  for r in sorted(plan.regions, key=lambda r: r.first_node)]
        out["regions_run_match_by_first_node_and_kept"] = regions_match(out["regions_read_back"],
                                                                         out["regions_planned"])
        out["plan_is_chosen"] = out["every_step_ran_the_plan"] and out["regions_run_match_by_first_node_and_kept"]
    elif app.kind == "modules":
        out["whole_module_plan"] = app.candidate.name if app.candidate is not None else None
        out["modules"] = list(app.modules)
        out["plan_is_chosen"] = app.candidate is not None and app.candidate.name == "as planned"
    else:
        out["plan_is_chosen"] = True
    guard = plan.module.__dict__.get("shape_guard") if isinstance(plan.module, CheckpointedModule) else None
    out["planned_again_at"] = [str(s) for s in getattr(guard, "replanned", {})] if guard is not None else []
    return out


def _child(conn, framework: str, planned: bool, steps: int, threads: int, store: str) -> None:
    os.environ["CKPT_PLANNER_TIMINGS"] = store
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    import logging
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    torch.set_num_threads(threads)
    from benchmarks.scale import _StageTimes

    stages, log = _StageTimes(), logging.getLogger("ckpt_planner")
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("callback:"):
                lines.append(record.getMessage())

    log.addHandler(stages)
    log.addHandler(Keep())
    log.setLevel(logging.INFO)
    callback = None
    if planned:
        kwargs = {"budget_gb": BUDGET_GB, "max_length": LONGEST}
        if framework == "trainer":
            from ckpt_planner.integrations import TrainerPlanCallback

            callback = TrainerPlanCallback(**kwargs)
        else:
            from ckpt_planner.integrations import LightningPlanCallback

            callback = LightningPlanCallback(module="model", **kwargs)
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as out_dir:
        r = _trainer_run(steps, callback, out_dir) if framework == "trainer" else _lightning_run(steps, callback)
    ends, start = r["ends"], r["start"]
    step_s = [b - a for a, b in zip([start, *ends[:-1]], ends)]
    result: dict[str, Any] = {
        "framework": framework, "planned": planned, "steps": len(r["losses"]), "threads": threads,
        "load_start": load, "wall_s": r["wall_s"], "losses": r["losses"], "weights": r["weights"],
        "first_step_s": step_s[0] if step_s else None,
        "after_first_s": ends[-1] - ends[0] if len(ends) > 1 else None,
        "steps_per_s_after_first": (len(ends) - 1) / (ends[-1] - ends[0]) if len(ends) > 1 else None,
        "median_step_s_after_first": statistics.median(step_s[1:]) if len(step_s) > 1 else None,
        "stages_s": stages.seconds, "callback_log": lines,
    }
    if callback is not None:
        longest = max(callback.measurements, key=lambda m: (dict(m.shapes.shapes)["input_ids"][1], m.step))
        result.update({
            "planning_s": callback.planning_s,
            "planned_shapes": str(callback.planned_shapes),
            "applied": _applied(callback, r["running"]),
            "measurements": [{"step": m.step, "shapes": str(m.shapes), "peak_bytes": m.peak_bytes}
                             for m in callback.measurements],
            "longest_measured": {"step": longest.step, "length": dict(longest.shapes.shapes)["input_ids"][1],
                                 "peak_bytes": longest.peak_bytes},
            "measured_peak_bytes": callback.measured_peak_bytes,
        })
    conn.send(result)


def run_once(framework: str, planned: bool, steps: int, threads: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    with tempfile.TemporaryDirectory() as store:  # an empty timing store: a user's first fine-tune
        proc = ctx.Process(target=_child, args=(child, framework, planned, steps, threads, store))
        proc.start()
        child.close()
        try:
            result = parent.recv()
        except EOFError:
            proc.join()
            raise RuntimeError(f"{framework} run (planned={planned}) died with exit code {proc.exitcode}") from None
        proc.join()
    return result


# -- comparing and reporting -------------------------------------------------------------


def compare(ref: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    a, b = ref["losses"], run["losses"]
    differ = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    planning = run.get("planning_s")
    budget = run["applied"]["budget_bytes"]
    peak = run["longest_measured"]["peak_bytes"]
    return {
        "losses_compared": min(len(a), len(b)), "same_count": len(a) == len(b),
        "losses_bitwise": len(a) == len(b) and not differ, "first_differing_step": differ[0] if differ else None,
        "weights_bitwise": ref["weights"] == run["weights"],
        "planning_share": planning / run["wall_s"] if planning is not None else None,
        "planning_within_target": planning is not None and planning / run["wall_s"] <= TARGET_SHARE,
        "first_step_extra_s": run["first_step_s"] - ref["first_step_s"],
        "wall_extra_s": run["wall_s"] - ref["wall_s"],
        "speed_after_planning": (run["steps_per_s_after_first"] / ref["steps_per_s_after_first"]
                                 if run["steps_per_s_after_first"] and ref["steps_per_s_after_first"] else None),
        "peak_within_budget": peak <= budget,
        "peak_vs_budget": peak / budget,
    }


def _mb(n: float | None) -> str:
    return "-" if n is None else f"{n / 1e6:.1f} MB"


def markdown(results: dict[str, Any]) -> str:
    env = results["environment"]
    lines = [
        "# The callbacks on a variable-length fine-tune",
        "",
        f"`python -m benchmarks.finetune{' --quick' if results['quick'] else ''}"
        f"{'' if results['steps'] == (30 if results['quick'] else 300) else ' --steps ' + str(results['steps'])}`: Qwen2 4 x 256 (vocabulary "
        f"{VOCAB}), batch {BATCH}, {results['steps']} steps on {SHORTEST}-{LONGEST} tokens padded per batch, "
        f"`budget_gb={BUDGET_GB}`, `max_length={LONGEST}`, default profile (measured times, autotune); each run a "
        f"fresh interpreter with an empty timing store; {env['cpus']} CPUs, {env['threads']} torch threads, "
        f"torch {env['torch']}, transformers {env['transformers']}, lightning {env['lightning']}. "
        f"Planning: the callback's `.planning_s` (the optimize() call on the first batch). Wall times stretch "
        f"under load (see the load at start).",
        "",
        "| framework | wall s (ref / planned) | planning s | planning % of run | step 0 extra s | steps/s after planning "
        "(ref / planned) | plan applied | plan is chosen | losses bitwise | weights bitwise | longest batch peak "
        "/ budget | load at start (ref / planned) |",
        "|" + "---|" * 12,
    ]
    for fw, r in results["frameworks"].items():
        ref, run, c = r["reference"], r["planned"], r["compare"]
        app = run["applied"]
        what = f"{app['kind']}: {app['solver']}"
        if app.get("chosen") and app["chosen"] != app["solver"]:
            what += f" (autotune: {app['chosen']})"
        if app["kind"] == "modules" or app.get("modules_planned"):
            what += f"; whole-module plan '{app.get('whole_module_plan')}'"
        what += f", {app['regions']} regions"
        lm = run["longest_measured"]
        lines.append("| " + " | ".join([
            fw, f"{ref['wall_s']:.0f} / {run['wall_s']:.0f}", f"{run['planning_s']:.1f}",
            f"{100 * c['planning_share']:.1f} % ({'within' if c['planning_within_target'] else 'over'} 10 %)",
            f"{c['first_step_extra_s']:.1f}",
            f"{ref['steps_per_s_after_first']:.3f} / {run['steps_per_s_after_first']:.3f} "
            f"({100 * (c['speed_after_planning'] - 1):+.1f} %)",
            what, ("yes" if app["plan_is_chosen"] else "no")
            + ("" if app.get("regions_run_are_the_plan", True) else " (see below)"),
            f"{'yes' if c['losses_bitwise'] else 'no'} ({c['losses_compared']})",
            "yes" if c["weights_bitwise"] else "no",
            f"{_mb(lm['peak_bytes'])} at {BATCH} x {lm['length']} (step {lm['step']}) / {_mb(app['budget_bytes'])} "
            f"({'within' if c['peak_within_budget'] else 'OVER'})",
            f"{ref['load_start']:.1f} / {run['load_start']:.1f}",
        ]) + " |")
    stages = sorted({s for r in results["frameworks"].values() for s in r["planned"]["stages_s"]},
                    key=lambda s: -max(r["planned"]["stages_s"].get(s, 0.0) for r in results["frameworks"].values()))
    lines += ["", "Planning stages (s, from optimize()'s log):", "",
              "| framework | planning s | " + " | ".join(stages) + " |", "|" + "---|" * (len(stages) + 2)]
    for fw, r in results["frameworks"].items():
        run = r["planned"]
        lines.append(f"| {fw} | {run['planning_s']:.1f} | "
                     + " | ".join(f"{run['stages_s'].get(s, 0.0):.1f}" for s in stages) + " |")
    if any(not r["planned"]["applied"].get("regions_run_are_the_plan", True) for r in results["frameworks"].values()):
        lines += ["", "Plan is chosen: every step ran the plan's own module, and its regions read back from the "
                      "running graph (`executed_regions`) are the plan's one for one, matched by their kept ops "
                      "counted from each region's start and their end nodes (`keep_begin` / `keep_end_<n>` where an "
                      "end node is a kept op); read back as-is they differ from `plan.regions` in those two ways "
                      "(the JSON keeps both)."]
    if results.get("note"):
        lines += ["", results["note"]]
    return "\n".join(lines) + "\n"


# -- the LoRA case (peft): the Trainer and Lightning beside no checkpointing and per-layer checkpointing ----

LORA_BATCH, LORA_SHORTEST, LORA_LONGEST = 4, 64, 512
LORA_MODES = ("none", "per-layer", "planned")


def lora_model():
    """A 4-layer, 256-wide Llama (vocabulary 8,000) under LoRA r=8 on q_proj and v_proj."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise SystemExit('the LoRA case needs peft: pip install "ckpt-planner[peft]"') from None
    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=4, hidden_size=256, intermediate_size=688, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=1024, use_cache=False)
    return get_peft_model(LlamaForCausalLM(config), LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))


def lora_examples(steps: int) -> list[dict[str, Any]]:
    import torch

    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(LORA_SHORTEST, LORA_LONGEST + 1, (steps * LORA_BATCH,), generator=g).tolist()
    for k in (steps // 3, 2 * steps // 3):  # the longest batch comes twice: measured, and again after a re-plan
        lengths[k * LORA_BATCH] = LORA_LONGEST
    return [{"input_ids": torch.randint(1, VOCAB, (n,), generator=g)} for n in lengths]


def _per_layer(model) -> None:
    model.base_model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _lora_bounds(conn, threads: int) -> None:
    """Measured peaks of the loop's step (the logits dropped before the backward) at the longest batch."""
    import torch
    from ckpt_planner.integrations.calibrate import measure_peak

    from tests.support.batches import PadPerBatch

    torch.set_num_threads(threads)
    batch = PadPerBatch()(lora_examples(3)[LORA_BATCH:2 * LORA_BATCH])
    out = {}
    for mode in ("none", "per-layer"):
        model = lora_model().train()
        if mode == "per-layer":
            _per_layer(model)
        out[mode] = measure_peak(model, lambda m=model: m(**batch).loss.backward(), batch)
    conn.send(out)


def _lora_child(conn, framework: str, mode: str, steps: int, data_steps: int, threads: int, budget: int,
                store: str) -> None:
    """One run of `steps` steps over the first batches of the `data_steps`-step data set (the same batches in
    every run, however many steps it takes)."""
    os.environ["CKPT_PLANNER_TIMINGS"] = store
    import logging
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    torch.set_num_threads(threads)
    global qwen2, examples, BATCH, LONGEST
    qwen2, BATCH, LONGEST = lora_model, LORA_BATCH, LORA_LONGEST  # this process only
    examples = lambda n: lora_examples(data_steps)[: n * LORA_BATCH]  # noqa: E731
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("callback:"):
                lines.append(record.getMessage())

    log = logging.getLogger("ckpt_planner")
    log.addHandler(Keep())
    log.setLevel(logging.INFO)
    callback = None
    if mode == "planned":
        from ckpt_planner import integrations

        kwargs = {"budget_bytes": budget, "max_length": LORA_LONGEST}
        callback = (integrations.TrainerPlanCallback(**kwargs) if framework == "trainer"
                    else integrations.LightningPlanCallback(module="model", **kwargs))
    elif mode == "per-layer":
        build = lora_model
        qwen2 = lambda: (m := build(), _per_layer(m))[0]  # noqa: E731
    with tempfile.TemporaryDirectory() as out_dir:
        # the Trainer's learning rate decays over max_steps: a shorter reference stops early on the same schedule
        r = (_trainer_run(data_steps, callback, out_dir, stop_after=steps) if framework == "trainer"
             else _lightning_run(steps, callback))
    ends, start = r["ends"], r["start"]
    step_s = [b - a for a, b in zip([start, *ends[:-1]], ends)]
    result = {"framework": framework, "mode": mode, "wall_s": r["wall_s"], "losses": r["losses"],
              "weights": r["weights"], "step_s": step_s, "median_step_s": statistics.median(step_s[1:]),
              "callback_log": lines}
    if callback is not None:
        result.update(planning_s=callback.planning_s, predicted_bytes=callback.predicted_peak_bytes,
                      measured_bytes=callback.measured_peak_bytes, replans=callback.replans,
                      notes=list(callback.plan.notes), regions=len(callback.plan.regions),
                      measurements=[[m.step, str(m.shapes), m.peak_bytes] for m in callback.measurements])
    conn.send(result)


def _spawn(target, *args) -> Any:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=target, args=(child, *args))
    proc.start()
    child.close()
    try:
        return parent.recv()
    finally:
        proc.join()


def lora_main(steps: int, threads: int, frameworks: list[str], out: Path, note: str,
              ref_steps: int | None = None) -> dict[str, Any]:
    """The planned run takes `steps` steps; the two references (no checkpointing, per layer) the first
    `ref_steps` of the same batches, where given: losses and step times are compared over those."""
    ref_steps = min(ref_steps or steps, steps)
    bounds = _spawn(_lora_bounds, threads)
    budget = (bounds["none"] + bounds["per-layer"]) // 2
    results: dict[str, Any] = {"steps": steps, "batch": LORA_BATCH, "lengths": [LORA_SHORTEST, LORA_LONGEST],
                               "ref_steps": ref_steps,
                               "threads": threads, "measured_bounds_bytes": bounds, "budget_bytes": budget,
                               "note": note, "frameworks": {}}
    for fw in frameworks:
        runs = {}
        for mode in LORA_MODES:
            with tempfile.TemporaryDirectory() as store:
                n = steps if mode == "planned" else ref_steps
                runs[mode] = _spawn(_lora_child, fw, mode, n, steps, threads, budget, store)
            print(f"{fw} {mode}: {runs[mode]['wall_s']:.0f} s", flush=True)
        ref, gc, run = runs["none"], runs["per-layer"], runs["planned"]
        pred, meas = run["predicted_bytes"], run["measured_bytes"]
        per_step = run["median_step_s"]
        common = slice(1, ref_steps)  # after the first step (planning) on the batches all three ran
        step_vs_per_layer = statistics.median(run["step_s"][common]) / statistics.median(gc["step_s"][common])
        results["frameworks"][fw] = {
            "runs": {m: {k: v for k, v in r.items() if k != "losses"} for m, r in runs.items()},
            "losses_bitwise_vs_none": run["losses"][:ref_steps] == ref["losses"] and len(run["losses"]) == steps,
            "per_layer_losses_bitwise_vs_none": gc["losses"] == ref["losses"],
            "weights_bitwise_vs_none": run["weights"] == ref["weights"] if ref_steps == steps else None,
            "prediction_error": (meas - pred) / pred, "within_2pct": abs(meas - pred) <= 0.02 * pred,
            "within_budget": meas <= budget, "budget_used": meas / budget,
            "step_vs_per_layer": step_vs_per_layer,
            "planning_share_of_run": run["planning_s"] / run["wall_s"],
            "planning_share_300_steps_extrapolated": run["planning_s"] / (run["planning_s"] + 300 * per_step),
        }
    return results


def lora_markdown(r: dict[str, Any]) -> str:
    b = r["measured_bounds_bytes"]
    lines = [
        "## LoRA (peft) under the Trainer and Lightning",
        "",
        f"`python -m benchmarks.finetune --lora --steps {r['steps']}"
        f"{'' if r.get('ref_steps', r['steps']) == r['steps'] else ' --ref-steps ' + str(r['ref_steps'])}`: Llama 4 x 256 (vocabulary {VOCAB}) under "
        f"LoRA r=8 on q_proj, v_proj; batch {r['batch']}, {r['lengths'][0]}-{r['lengths'][1]} tokens padded per "
        f"batch, the longest batch twice; {r['threads']} torch threads. Budget {_mb(r['budget_bytes'])}: halfway "
        f"between the measured peaks of the loop's step at the longest batch without checkpointing "
        f"({_mb(b['none'])}) and with `gradient_checkpointing_enable()` per layer ({_mb(b['per-layer'])}). "
        "Per framework three runs, each a fresh interpreter: no checkpointing, per layer, and the callback "
        "(`budget_bytes`, `max_length=512`, default profile with autotune)"
        + (f"; the two references run the first {r['ref_steps']} of the planned run's {r['steps']} batches, and "
           "losses and step times are compared over those" if r.get("ref_steps", r["steps"]) != r["steps"] else "")
        + ". Step times are medians after the first step (noisy on this CPU: read the ratio as a rough one). "
        + ("The planning share is measured: the callback's planning seconds over the planned run's wall time."
           if r["steps"] >= 300 else "The 300-step planning share is extrapolated from the planning seconds and "
           "the planned run's median step, not measured."),
        "",
        "| framework | predicted (longest) | measured (longest) | error | of budget | losses bitwise | weights "
        "bitwise | step / per-layer step | planning s | planning % of run | % of 300 steps (extrapolated) | "
        "re-plans |",
        "|" + "---|" * 12,
    ]
    for fw, x in r["frameworks"].items():
        run = x["runs"]["planned"]
        lines.append("| " + " | ".join([
            fw, _mb(run["predicted_bytes"]), _mb(run["measured_bytes"]), f"{100 * x['prediction_error']:+.1f} %",
            f"{100 * x['budget_used']:.1f} % ({'within' if x['within_budget'] else 'OVER'})",
            "yes" if x["losses_bitwise_vs_none"] else "no",
            {True: "yes", False: "no", None: "n/a"}[x["weights_bitwise_vs_none"]],
            f"{x['step_vs_per_layer']:.2f}", f"{run['planning_s']:.1f}", f"{100 * x['planning_share_of_run']:.1f} %",
            f"{100 * x['planning_share_300_steps_extrapolated']:.1f} %", str(len(run["replans"])),
        ]) + " |")
    for fw, x in r["frameworks"].items():
        lines += ["", f"{fw}, the plan's notes on the loop:", ""]
        lines += [f"- {n}" for n in x["runs"]["planned"]["notes"] if "loop" in n or "measured" in n]
    if r.get("note"):
        lines += ["", r["note"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.finetune", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="30 steps (a smoke run); the target is for 300")
    ap.add_argument("--steps", type=int, default=None, help="training steps (default 300, 30 with --quick)")
    ap.add_argument("--frameworks", default=",".join(FRAMEWORKS), help="comma-separated: trainer,lightning")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: min(2, the CPUs))")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--note", default="", help="a line on the machine's state, printed under the tables")
    ap.add_argument("--lora", action="store_true", help="the LoRA (peft) case; its section replaces the LoRA "
                    "section of the results and keeps the rest")
    ap.add_argument("--ref-steps", type=int, default=None, help="with --lora: steps of the two reference runs "
                    "(no checkpointing, per layer), the first batches of the planned run's; default: --steps")
    args = ap.parse_args(argv)
    steps = args.steps or (30 if args.quick else 300)
    threads = args.threads or max(1, min(2, os.cpu_count() or 1))
    if args.lora:
        lora = lora_main(steps, threads, args.frameworks.split(","), args.out, args.note, args.ref_steps)
        path = args.out / "finetune.json"
        results = json.loads(path.read_text()) if path.exists() else {}
        kept = results.get("lora", {})
        if all(kept.get(k) == lora[k] for k in ("steps", "ref_steps", "budget_bytes")):  # the frameworks not run
            lora["frameworks"] = {**kept["frameworks"], **lora["frameworks"]}
        results["lora"] = lora
        path.write_text(json.dumps(results, indent=2) + "\n")
        text = (markdown(results) + "\n" if "frameworks" in results else "") + lora_markdown(lora)
        (args.out / "finetune.md").write_text(text)
        print(lora_markdown(lora))
        return 0
    import lightning
    import torch
    import transformers

    t0 = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:6.0f} s] {msg}", flush=True)

    results: dict[str, Any] = {
        "environment": {"machine": platform.machine() + " " + platform.system(), "cpus": mp.cpu_count(),
                        "threads": threads, "torch": torch.__version__, "transformers": transformers.__version__,
                        "lightning": lightning.__version__, "python": platform.python_version()},
        "quick": args.quick, "steps": steps, "budget_gb": BUDGET_GB, "max_length": LONGEST, "batch": BATCH,
        "target_share": TARGET_SHARE, "frameworks": {}, "note": args.note,
    }
    for fw in args.frameworks.split(","):
        log(f"{fw}: reference run ({steps} steps, load {os.getloadavg()[0]:.1f})")
        ref = run_once(fw, False, steps, threads)
        log(f"{fw}: reference done in {ref['wall_s']:.0f} s; planned run (load {os.getloadavg()[0]:.1f})")
        run = run_once(fw, True, steps, threads)
        c = compare(ref, run)
        log(f"{fw}: planned done in {run['wall_s']:.0f} s, planning {run['planning_s']:.1f} s "
            f"({100 * c['planning_share']:.1f} %), losses bitwise: {c['losses_bitwise']}")
        for k in (ref, run):
            k["first_loss"], k["last_loss"] = (k["losses"][0], k["losses"][-1]) if k["losses"] else (None, None)
            del k["losses"]
        results["frameworks"][fw] = {"reference": ref, "planned": run, "compare": c}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "finetune.json"
    if path.exists() and "lora" in json.loads(path.read_text()):
        results["lora"] = json.loads(path.read_text())["lora"]  # the LoRA case's own run (--lora) kept
    path.write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "finetune.md").write_text(markdown(results) + ("\n" + lora_markdown(results["lora"]) if "lora" in results else ""))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Planning within the budget: the allocator's peak over a whole `optimize` call against the budget it is given.

The budget is each model's per-layer checkpointing peak (transformers' `gradient_checkpointing_enable`,
or `torch.utils.checkpoint` around every block of the CNN), measured on the allocator meter
(planner/profile/memory.py). Then `optimize(model, inputs, budget_bytes=that)` runs inside one allocator
meter, and its peak (with the parameters, inputs and gradients it starts with) is set against the budget.
The plan's own step is then measured the same way and compared with the model's (bitwise on the CPU).

Each case runs twice side by side, in the order given: `--paths bounded whole`. `whole` profiles the
plain step (`ProfileConfig(bounded=False)`, the path every budget took before); `bounded` is the default,
which profiles a stage at a time once the plain step would not fit the budget.

With an allocator meter around the call, the planner's own meters cannot run (one profiler at a time on
the CPU): kernel workspaces are then read from live tensors only. The figures are of the memory the call
needs, not of the plan's quality.

    python -m benchmarks.plan_memory                 # the Llama shape, the CNN and the encoder
    python -m benchmarks.plan_memory --cases llama
    python -m benchmarks.plan_memory --depth         # and planning time at 4 and 24 layers on each path
    python -m benchmarks.plan_memory --cases --zoo   # the zoo's plans and prediction errors on each profile

Writes benchmarks/results/plan_memory.json and plan_memory.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

from ._io import out_dir, write_files

os.environ.setdefault("KINETO_LOG_LEVEL", "6")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from ckpt_planner import optimize  # noqa: E402
from ckpt_planner.choose.safety_net import step_differences  # noqa: E402
from ckpt_planner.cli.examples import ResBlock  # noqa: E402
from ckpt_planner.errors import PlannerError  # noqa: E402
from ckpt_planner.profile.loss import default_loss  # noqa: E402
from ckpt_planner.profile.memory import AllocatorMeter, LiveMemory, measure_step_peaks  # noqa: E402
from ckpt_planner.profile.profiler import ProfileConfig  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MB = 1e6
TARGET = 1.05


class CheckpointedBlocks(nn.Module):
    """A CNN with every residual block under torch.utils.checkpoint: its per-layer reference."""

    def __init__(self, stem: nn.Module, blocks: nn.Sequential, head: nn.Module) -> None:
        super().__init__()
        self.stem, self.blocks, self.head = stem, blocks, head
        self.checkpointing = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointing else block(x)
        return self.head(x.mean(dim=(2, 3)))


def llama() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The issue's case: 6 layers x 256, vocabulary 8,000, 1,024 tokens, batch 4."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(num_hidden_layers=6, hidden_size=256, intermediate_size=688, num_attention_heads=4,
                      num_key_value_heads=4, vocab_size=8000, max_position_embeddings=1024, use_cache=False)
    model = LlamaForCausalLM(cfg)
    ids = torch.randint(0, 8000, (4, 1024))
    return model, {"input_ids": ids, "labels": ids}


def encoder() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A BERT encoder: 6 layers x 256, 512 tokens, batch 8, masked-LM loss."""
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(num_hidden_layers=6, hidden_size=256, intermediate_size=1024, num_attention_heads=4,
                     vocab_size=8000, max_position_embeddings=512, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    model = BertForMaskedLM(cfg)
    ids = torch.randint(0, 8000, (8, 512))
    return model, {"input_ids": ids, "labels": ids}


def cnn() -> tuple[nn.Module, tuple[torch.Tensor]]:
    """A ResNet-style CNN: 8 residual blocks of 32 channels at 64 x 64, batch 32."""
    c = 32
    stem = nn.Sequential(nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU())
    model = CheckpointedBlocks(stem, nn.Sequential(*[ResBlock(c) for _ in range(8)]), nn.Linear(c, 10))
    return model, (torch.randn(32, 3, 64, 64),)


CASES = {"llama": llama, "cnn": cnn, "encoder": encoder}
DEPTHS = (4, 24)


def llama_of_depth(layers: int) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The Llama shape at another depth (width 256, 512 tokens, batch 2): planning time against depth."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(num_hidden_layers=layers, hidden_size=256, intermediate_size=688, num_attention_heads=4,
                      num_key_value_heads=4, vocab_size=8000, max_position_embeddings=512, use_cache=False)
    model = LlamaForCausalLM(cfg)
    ids = torch.randint(0, 8000, (2, 512))
    return model, {"input_ids": ids, "labels": ids}


def depth_row(layers: int, path: str) -> dict[str, Any]:
    """Wall seconds of `optimize` at per-layer checkpointing's peak (no meter around the call), with an
    empty timing store: a first plan, as a new user makes it (autotune races, nothing reused)."""
    import logging
    import tempfile

    torch.manual_seed(0)
    model, inputs = llama_of_depth(layers)
    model.train()
    _per_layer(model, True)
    budget = _step_peak(model, inputs)
    _per_layer(model, False)
    stages: dict[str, float] = {}

    class Stages(logging.Handler):  # "<stage>: done in <s> s" lines of the planner's log
        def emit(self, record: logging.LogRecord) -> None:
            text = record.getMessage()
            if ": done in " in text:
                name, rest = text.split(": done in ", 1)
                stages[name] = stages.get(name, 0.0) + float(rest.split()[0])

    log = logging.getLogger("ckpt_planner")
    handler, level = Stages(), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    saved = os.environ.get("CKPT_PLANNER_TIMINGS")
    try:
        with tempfile.TemporaryDirectory() as store:
            os.environ["CKPT_PLANNER_TIMINGS"] = store
            t0 = time.perf_counter()
            optimize(model, inputs, budget_bytes=budget,
                     profile_config=ProfileConfig(bounded=None if path == "bounded" else False))
            wall = time.perf_counter() - t0
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
        if saved is None:
            os.environ.pop("CKPT_PLANNER_TIMINGS", None)
        else:
            os.environ["CKPT_PLANNER_TIMINGS"] = saved
    return {"layers": layers, "path": path, "budget_mb": budget / MB, "wall_s": wall, "stages_s": stages}


def _split(inputs: Any) -> tuple[tuple, dict]:
    return ((), inputs) if isinstance(inputs, dict) else (inputs, {})


def _step_peak(model: nn.Module, inputs: Any) -> int:
    args, kwargs = _split(inputs)
    state = list(model.parameters()) + list(model.buffers())
    peaks, _ = measure_step_peaks(model, args, kwargs, [p for p in model.parameters() if p.requires_grad], state,
                                  default_loss, torch.device("cpu"))
    for p in model.parameters():
        p.grad = None
    return peaks.allocator


def _per_layer(model: nn.Module, on: bool) -> None:
    if isinstance(model, CheckpointedBlocks):
        model.checkpointing = on
    elif on:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.activation_checkpointing_disable()


def run_case(name: str, path: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model, inputs = CASES[name]()
    model.train()
    plain = _step_peak(model, inputs)
    _per_layer(model, True)
    budget = _step_peak(model, inputs)
    _per_layer(model, False)
    config = ProfileConfig(bounded=None if path == "bounded" else False)
    resident = LiveMemory()
    resident.track(list(model.parameters()), list(model.buffers()), inputs)
    row: dict[str, Any] = {"model": name, "path": path, "plain_mb": plain / MB, "budget_mb": budget / MB}
    t0 = time.perf_counter()
    try:
        with AllocatorMeter("cpu") as meter:
            plan = optimize(model, inputs, budget_bytes=budget, profile_config=config)
    except (PlannerError, ValueError) as e:
        row.update(error=str(e).splitlines()[0], wall_s=time.perf_counter() - t0)
        return row
    row["wall_s"] = time.perf_counter() - t0
    call = resident.current + meter.peak
    step = _step_peak(plan.module, inputs)
    args, kwargs = _split(inputs)
    differ = step_differences(model, plan.module, args, kwargs)
    row.update(call_mb=call / MB, call_over_budget=call / budget, plan_step_mb=step / MB,
               plan_within_budget=step <= budget, bitwise=differ == [], predicted_mb=plan.predicted_peak_bytes / MB)
    return row


ZOO_FRACTION = 0.5


def zoo_row(name: str) -> dict[str, Any]:
    """One zoo model planned on each profile (FLOP times, solver dp, half its activations): the plans, their
    predicted and measured peaks. The stage-wise profile should give the same plan, or one predicted no
    slower, with a prediction error no worse."""
    from ckpt_planner.api import Planner

    from tests.models.zoo import build

    row: dict[str, Any] = {"model": name}
    for path in ("whole", "stages"):
        model, inputs = build(name)
        planner = Planner(model, inputs, profile_config=ProfileConfig(flop_times=True, bounded=path == "stages"))
        plan = planner.plan(activation_budget=ZOO_FRACTION, solver="dp", autotune=False)
        measured = _step_peak(plan.module, inputs)
        row[path] = {"regions": [list(r) for r in plan.spans()], "predicted_mb": plan.predicted_peak_bytes / MB,
                     "recompute_ms": plan.predicted_recompute_s * 1e3, "measured_mb": measured / MB,
                     "error": plan.predicted_peak_bytes / measured - 1, "budget_mb": plan.budget_bytes / MB}
    row["same_plan"] = row["whole"]["regions"] == row["stages"]["regions"]
    return row


def write(rows: list[dict[str, Any]], depth: list[dict[str, Any]], zoo: list[dict[str, Any]], meta: dict[str, Any],
          out: Path) -> None:
    out_dir(out)
    data = {"meta": meta, "rows": rows, "depth": depth, "zoo": zoo}
    old = out / "plan_memory.json"
    if old.exists():  # rows not measured this time are kept as the last run wrote them, dated
        kept = json.loads(old.read_text())
        when = kept.get("meta", {}).get("when")
        for key, ident in (("rows", ("model", "path")), ("depth", ("layers", "path")), ("zoo", ("model",))):
            fresh = {tuple(r[i] for i in ident) for r in data[key]}
            older = [{"measured": when, **r} for r in kept.get(key, []) if tuple(r[i] for i in ident) not in fresh]
            data[key] = older + data[key]
    order = list(CASES)
    data["rows"].sort(key=lambda r: (order.index(r["model"]) if r["model"] in order else len(order), r["path"]))
    data["depth"].sort(key=lambda r: (r["path"], r["layers"]))
    rows, depth, zoo = data["rows"], data["depth"], data["zoo"]
    write_files(out, {"plan_memory.json": json.dumps(data, indent=1) + "\n"})
    lines = [
        "# Planning within the budget",
        "",
        f"`python -m benchmarks.plan_memory` on {meta['machine']}, torch {meta['torch']}, {meta['when']}. "
        "Budget: the model's per-layer checkpointing peak on the allocator. Call: the allocator's peak over the "
        f"whole `optimize` call (target at most {TARGET}x the budget). MB = 1e6 bytes.",
        "",
        "| model | path | plain step MB | budget MB | call peak MB | call / budget | plan step MB | within | bitwise | planning s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        r = {**r, "model": r["model"] + (f" (run of {r['measured']})" if r.get("measured") else "")}
        if "error" in r:
            lines.append(f"| {r['model']} | {r['path']} | {r['plain_mb']:.1f} | {r['budget_mb']:.1f} | {r['error']} | | | | | {r['wall_s']:.1f} |")
            continue
        lines.append(
            f"| {r['model']} | {r['path']} | {r['plain_mb']:.1f} | {r['budget_mb']:.1f} | {r['call_mb']:.1f} | "
            f"{r['call_over_budget']:.2f}x | {r['plan_step_mb']:.1f} | {'yes' if r['plan_within_budget'] else 'no'} | "
            f"{'yes' if r['bitwise'] else 'no'} | {r['wall_s']:.1f} |"
        )
    if depth:
        lines += ["", f"Planning time against depth: the Llama shape at width 256, 512 tokens, batch 2, budget at "
                  f"per-layer checkpointing's peak; `optimize` with its defaults (timed profile, safety net, "
                  f"autotune), each run with an empty timing store (a first plan). Target: {DEPTHS[-1]} layers in at most 3x the time of {DEPTHS[0]}.", "",
                  "| path | " + " | ".join(f"{d} layers s" for d in DEPTHS) + " | ratio | ratio without the race |",
                  "|---|" + "---|" * (len(DEPTHS) + 2)]
        for path in dict.fromkeys(r["path"] for r in depth):
            got = [next(r for r in depth if r["path"] == path and r["layers"] == d) for d in DEPTHS]
            walls = [r["wall_s"] for r in got]
            when = {r.get("measured") for r in got} - {None}
            label = path + (f" (run of {', '.join(sorted(when))}; timing store not emptied)" if when else "")
            # The race times whole steps, whose cost grows with the depth: the rest is what the stages' sharing bounds.
            rest = [r["wall_s"] - r.get("stages_s", {}).get("autotune", 0.0) for r in got]
            apart = f"{rest[-1] / rest[0]:.2f}x" if all(r.get("stages_s") for r in got) else "not recorded"
            lines.append(f"| {label} | " + " | ".join(f"{w:.1f}" for w in walls) + f" | {walls[-1] / walls[0]:.2f}x | {apart} |")
        if meta.get("depth_note"):
            lines += ["", meta["depth_note"]]
        lines += ["", "Seconds per stage (the planner's log):", "", "| path | layers | stages |", "|---|---|---|"]
        for r in depth:
            split = ", ".join(f"{k} {v:.1f}" for k, v in r.get("stages_s", {}).items()) or "not recorded in that run"
            lines.append(f"| {r['path']} | {r['layers']} | {split} |")
    if zoo:
        lines += ["", f"The zoo (tests/models/zoo.py) on each profile: FLOP times, solver dp, {ZOO_FRACTION} of its "
                  "activations. Error: predicted over the plan's measured peak, less one.", "",
                  "| model | same plan | whole: predicted MB | error | recompute ms | stages: predicted MB | error | "
                  "recompute ms |", "|---|---|---|---|---|---|---|---|"]
        for r in zoo:
            w, g = r["whole"], r["stages"]
            lines.append(f"| {r['model']} | {'yes' if r['same_plan'] else 'no'} | {w['predicted_mb']:.2f} | "
                         f"{w['error'] * 100:+.1f} % | {w['recompute_ms']:.2f} | {g['predicted_mb']:.2f} | "
                         f"{g['error'] * 100:+.1f} % | {g['recompute_ms']:.2f} |")
    write_files(out, {"plan_memory.md": "\n".join(lines) + "\n"})


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    ap.add_argument("--paths", nargs="+", default=["bounded", "whole"], choices=["bounded", "whole"])
    ap.add_argument("--depth", action="store_true", help=f"also time planning at {DEPTHS} layers on each path")
    ap.add_argument("--zoo", action="store_true", help="also plan the zoo on each profile (plans and prediction errors)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--depth-note", default="", help="a line printed under the depth table (the machine's state)")
    a = ap.parse_args(argv)
    meta = {"machine": f"{platform.machine()} {os.cpu_count()} CPUs (no GPU)", "torch": torch.__version__,
            "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "depth_note": a.depth_note}
    rows = []
    for name in a.cases:
        for path in a.paths:
            rows.append(run_case(name, path))
            print(json.dumps(rows[-1]), flush=True)
    depth = []
    for layers in DEPTHS if a.depth else ():
        for path in a.paths:
            depth.append(depth_row(layers, path))
            print(json.dumps(depth[-1]), flush=True)
    zoo = []
    if a.zoo:
        from tests.models.zoo import ZOO

        for name in ZOO:
            zoo.append(zoo_row(name))
            print(json.dumps(zoo[-1]), flush=True)
    write(rows, depth, zoo, meta, a.out)


if __name__ == "__main__":
    main()

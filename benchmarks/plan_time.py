"""Where planning time goes, stage by stage: the command line on an exported Llama, and optimize() on a LoRA Llama.

* `cli`: `ckpt-planner plan llama.pt2 --activation-budget 0.75` (a 4-layer, 256-wide LlamaForCausalLM,
  vocabulary 8,192, 2 x 128 tokens with labels, exported as the README's `ckpt-planner export` line does),
  with `--no-autotune` and with the race (targets 30 s and 60 s on a quiet machine);
* `lora`: `optimize()` on the same Llama shape (vocabulary 8,000) wrapped by `peft.get_peft_model` with
  `LoraConfig(r=8, target_modules=["q_proj", "v_proj"])`, 4 x 512 tokens, at a budget of 0.36 GB, between
  per-layer checkpointing's peak and no checkpointing's (skipped where peft is not installed).

Each run is a fresh interpreter (imports counted, as a user's command pays them) with an empty timing store.
Stages: imports; loading (the model file and inputs, or building the model); capture, bytes, profile, step
times, solve, check, autotune (the race), rewrite, from the "<stage>: done in <s> s" lines the planner logs;
timeline (the report's memory timeline the plan file carries); write (the plan file). The memory/overhead
curve the plan file once carried is timed too with `--curve` (now computed by `ckpt-planner report --model`).
Wall seconds stretch under load; cpu s is the process's own. The load average at the start is recorded.

    python -m benchmarks.plan_time [--curve]     # writes benchmarks/results/plan_time.json and .md
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ._io import write_files

ROOT = Path(__file__).resolve().parents[1]
TARGETS_S = {"cli, --no-autotune": 30.0, "cli, with the race": 60.0}
LORA_BUDGET_GB = 0.36
_LLAMA = dict(num_hidden_layers=4, hidden_size=256, intermediate_size=688, num_attention_heads=4,
              num_key_value_heads=4, use_cache=False)


def _export(path: str) -> None:
    """The README's export step for a Llama (not timed: it is done once, before planning)."""
    import torch
    from ckpt_planner import export_for_cli
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=8192, **_LLAMA))
    ids = torch.randint(0, 8192, (2, 128))  # [B, T]
    export_for_cli(model, {"input_ids": ids, "labels": ids}, path)


def _handler():
    """Seconds of each stage from the planner's "<stage>: start" / "<stage>: done in <s> s" records (wall as
    logged; this process's CPU seconds between the two)."""
    import logging
    import re

    class Stages(logging.Handler):
        START, DONE = re.compile(r"^([\w ]+?): start\b"), re.compile(r"^([\w ]+?): done in ([0-9.]+) s$")

        def __init__(self) -> None:
            super().__init__(logging.INFO)
            self.seconds: dict[str, float] = {}
            self.cpu_seconds: dict[str, float] = {}
            self._started: dict[str, float] = {}

        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            if (m := self.START.match(message)) is not None:
                self._started[m.group(1)] = time.process_time()
            elif (m := self.DONE.match(message)) is not None:
                self.seconds[m.group(1)] = self.seconds.get(m.group(1), 0.0) + float(m.group(2))
                if m.group(1) in self._started:
                    self.cpu_seconds[m.group(1)] = (self.cpu_seconds.get(m.group(1), 0.0) + time.process_time()
                                                    - self._started.pop(m.group(1)))

    handler, log = Stages(), logging.getLogger("ckpt_planner")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    return handler


def _timed(extra: dict[str, float], name: str, fn):
    def wrapped(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            extra[name] = extra.get(name, 0.0) + time.perf_counter() - t0
    return wrapped


def _cli_child(conn, store: str, pt2: str, out: str, autotune: bool, curve: bool) -> None:
    os.environ["CKPT_PLANNER_TIMINGS"] = store
    load = os.getloadavg()[0]
    t0, c0 = time.perf_counter(), time.process_time()
    import torch  # noqa: F401 - counted in the imports, as the command pays it
    from ckpt_planner.cli import commands, report_data
    from ckpt_planner.cli.cli_args import build_parser

    extra = {"imports": time.perf_counter() - t0}
    handler = _handler()
    commands._model_and_inputs = _timed(extra, "loading", commands._model_and_inputs)
    commands._write_atomic = _timed(extra, "write", commands._write_atomic)
    report_data.plan_data = _timed(extra, "timeline", report_data.plan_data)
    argv = ["plan", pt2, "--activation-budget", "0.75", "--quiet", "-o", out] + ([] if autotune else ["--no-autotune"])
    args = build_parser().parse_args(argv)
    args.stdout = sys.stdout
    code = commands.cmd_plan(args)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    plan = json.loads(Path(out).read_text())
    result = {"wall_s": wall, "cpu_s": cpu, "load_start": load, "exit": code, "stages_s": {**extra, **handler.seconds},
              "stages_cpu_s": handler.cpu_seconds, "solver": plan["solver"],
              "autotune": _race(plan["stats"].get("autotune"))}
    if curve:
        from ckpt_planner.api import Planner
        from ckpt_planner.plan import Plan

        loaded, inputs, _ = commands._model_and_inputs(args)
        problem = Planner(loaded.model, inputs).problem
        t1 = time.perf_counter()
        args.curve_points = 8
        report_data.curves_for(Plan.load(out), problem, commands._curve_solvers(args, problem), 8)
        result["curve_s"] = time.perf_counter() - t1
    conn.send(result)


def _race(rec: Any) -> str:
    if not isinstance(rec, dict):
        return "off"
    if rec.get("skipped"):
        return f"not run: {rec['skipped']}"
    return f"{rec.get('steps', 0)} steps, {rec.get('rounds', 0)} rounds, band {100 * rec.get('band', 0):.1f} %"


def _lora_child(conn, store: str) -> None:
    os.environ["CKPT_PLANNER_TIMINGS"] = store
    load = os.getloadavg()[0]
    t0, c0 = time.perf_counter(), time.process_time()
    import torch
    from ckpt_planner import optimize
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    extra = {"imports": time.perf_counter() - t0}
    t1 = time.perf_counter()
    torch.manual_seed(0)
    model = get_peft_model(LlamaForCausalLM(LlamaConfig(vocab_size=8000, **_LLAMA)),
                           LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    ids = torch.randint(0, 8000, (4, 512))  # [B, T]
    extra["loading"] = time.perf_counter() - t1
    handler = _handler()
    # between per-layer checkpointing's peak (about 297 MB predicted) and no checkpointing's (about 419 MB)
    plan = optimize(model, {"input_ids": ids, "labels": ids}, budget_gb=LORA_BUDGET_GB)
    conn.send({"wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0, "load_start": load, "exit": 0,
               "stages_s": {**extra, **handler.seconds}, "stages_cpu_s": handler.cpu_seconds, "solver": plan.solver,
               "autotune": _race(plan.stats.get("autotune"))})


def _guarded(conn, target, *args) -> None:
    """The child: its result, or the one line of the error that stopped it."""
    try:
        target(conn, *args)
    except BaseException as e:
        conn.send({"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]})
        raise


def _spawn(target, *args) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_guarded, args=(child, target, *args))
    proc.start()
    child.close()  # the child's end: its death is an EOF here, not a wait forever
    try:
        result = parent.recv()
    except EOFError:
        result = {"error": f"the child process died (exit code {proc.exitcode})"}
    proc.join()
    if "error" in result:
        raise SystemExit(f"plan_time: {target.__name__}: {result['error']}")
    return result


def markdown(results: dict[str, Any]) -> str:
    order = ["imports", "loading", "capture", "bytes", "profile", "step times", "solve", "check", "autotune", "rewrite",
             "timeline", "write"]
    seen = {s for r in results["runs"] for s in r["stages_s"]}
    stages = [s for s in order if s in seen] + sorted(seen - set(order))
    head = ["run", "wall s", "cpu s", "target s", "load at start", *stages, "race"]
    lines = [
        "# Planning time, stage by stage",
        "",
        f"`python -m benchmarks.plan_time{' --curve' if results['curve'] else ''}`: each run a fresh interpreter with an "
        f"empty timing store; {results['environment']['cpus']} CPUs, torch {results['environment']['torch']}, "
        f"OMP_NUM_THREADS {results['environment'].get('OMP_NUM_THREADS', 'unset')}. "
        "Stage seconds are wall time (under load they stretch; cpu s is the process's own). The targets hold on a "
        "quiet machine: compare them with cpu s where the load at the start was high.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for r in results["runs"]:
        target = TARGETS_S.get(r["label"])
        cells = [r["label"], f"{r['wall_s']:.1f}", f"{r['cpu_s']:.1f}", f"{target:.0f}" if target else "-",
                 f"{r['load_start']:.1f}", *(f"{r['stages_s'][s]:.1f}" if s in r["stages_s"] else "-" for s in stages), r["autotune"]]
        lines.append("| " + " | ".join(cells) + " |")
    curves = [r for r in results["runs"] if "curve_s" in r]
    if curves:
        lines += ["", f"The memory/overhead curve (8 budgets per solver) that `plan` computed on the way to the plan "
                      f"before: {curves[0]['curve_s']:.1f} s wall on the same model; now `ckpt-planner report --model` "
                      "computes it when a report asks for it."]
    if results.get("skipped"):
        lines += ["", results["skipped"]]
    if results.get("note"):
        lines += ["", results["note"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.plan_time", description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--curve", action="store_true", help="also time the memory/overhead curve (tens of solves)")
    ap.add_argument("--only", choices=["cli", "lora"], help="one case")
    ap.add_argument("--note", default="", help="a line on the machine's state, printed under the table")
    args = ap.parse_args(argv)
    import torch

    runs, skipped = [], ""
    with tempfile.TemporaryDirectory() as work:
        if args.only in (None, "cli"):
            pt2 = os.path.join(work, "llama.pt2")
            _spawn_export = mp.get_context("spawn").Process(target=_export, args=(pt2,))
            _spawn_export.start()
            _spawn_export.join()
            for label, race in (("cli, --no-autotune", False), ("cli, with the race", True)):
                store = tempfile.mkdtemp(dir=work)
                runs.append({"label": label, **_spawn(_cli_child, store, pt2, os.path.join(work, f"{race}.json"), race,
                                                      args.curve and not race)})
        if args.only in (None, "lora"):
            try:
                import peft  # noqa: F401
            except ImportError:
                skipped = "LoRA case skipped: peft is not installed (`pip install peft`)."
            else:
                runs.append({"label": "optimize(), LoRA Llama", **_spawn(_lora_child, tempfile.mkdtemp(dir=work))})
    results = {"environment": {"machine": platform.machine() + " " + platform.system(), "cpus": mp.cpu_count(),
                               "torch": torch.__version__, "python": platform.python_version(),
                               "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "unset")},
               "targets_s": TARGETS_S, "curve": args.curve, "runs": runs, "skipped": skipped, "note": args.note}
    write_files(args.out, {"plan_time.json": json.dumps(results, indent=2) + "\n", "plan_time.md": markdown(results)})
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How long the README's Quickstart takes to plan, stage by stage (target: 15 s on this CPU when quiet).

The Quickstart's GPT-2 (4 layers x 256, vocabulary 8,192, batch 8 x 128 with labels) planned with
`optimize(model, batch, budget_gb=0.2)` as the README writes it: measured times, the safety net and the
autotune race included. Each run is a fresh interpreter (a user's first call pays torch.export's lazy
imports) with its own empty timing store, so the first run is the first plan a user sees; the second run
reuses that store (the same model planned again). The split comes from the "<stage>: done in <s> s"
lines optimize() logs; the load average at the start says how busy the machine was.

    python -m benchmarks.quickstart            # writes benchmarks/results/quickstart.json and .md
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
TARGET_S = 15.0


def _child(conn, store: str) -> None:
    os.environ["CKPT_PLANNER_TIMINGS"] = store
    import logging

    import torch
    from ckpt_planner import optimize
    from transformers import GPT2Config, GPT2LMHeadModel

    from benchmarks.scale import _StageTimes

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=8192, use_cache=False))
    input_ids = torch.randint(0, 8192, (8, 128))  # [B, T]
    handler, log = _StageTimes(), logging.getLogger("ckpt_planner")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    load = os.getloadavg()[0]
    t0, c0 = time.perf_counter(), time.process_time()
    plan = optimize(model, {"input_ids": input_ids, "labels": input_ids}, budget_gb=0.2)
    conn.send({"wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0, "stages_s": handler.seconds,
               "load_start": load, "chosen": plan.stats.get("chosen") or plan.solver,
               "predicted_peak_bytes": plan.predicted_peak_bytes, "budget_bytes": plan.budget_bytes,
               "autotune_steps": (plan.stats.get("autotune") or {}).get("steps")})


def run_once(store: str) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(child, store))
    proc.start()
    result = parent.recv()
    proc.join()
    return result


def markdown(results: dict[str, Any]) -> str:
    stages = sorted({s for r in results["runs"] for s in r["stages_s"]}, key=lambda s: -results["runs"][0]["stages_s"].get(s, 0))
    head = ["run", "wall s", "cpu s", "target s", "met", "load at start", *stages, "chosen", "autotune steps"]
    lines = [
        "# Quickstart planning time",
        "",
        f"`python -m benchmarks.quickstart`: the README's Quickstart `optimize(model, batch, budget_gb=0.2)`, each run a "
        f"fresh interpreter; {results['environment']['cpus']} CPUs, torch {results['environment']['torch']}. "
        "Stage seconds are wall time (under load they stretch; cpu s is the process's own).",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for r in results["runs"]:
        cells = [r["label"], f"{r['wall_s']:.1f}", f"{r['cpu_s']:.1f}", f"{TARGET_S:.0f}",
                 "yes" if r["wall_s"] <= TARGET_S else "no", f"{r['load_start']:.1f}",
                 *(f"{r['stages_s'].get(s, 0.0):.1f}" for s in stages), str(r["chosen"]), str(r["autotune_steps"])]
        lines.append("| " + " | ".join(cells) + " |")
    if results.get("note"):
        lines += ["", results["note"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.quickstart", description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--note", default="", help="a line on the machine's state, printed under the table")
    args = ap.parse_args(argv)
    import torch

    with tempfile.TemporaryDirectory() as store:
        runs = [{"label": "first plan (empty timing store)", **run_once(store)},
                {"label": "planned again (same store)", **run_once(store)}]
    results = {"environment": {"machine": platform.machine() + " " + platform.system(), "cpus": mp.cpu_count(),
                               "torch": torch.__version__, "python": platform.python_version()},
               "target_s": TARGET_S, "runs": runs, "note": args.note}
    write_files(args.out, {"quickstart.json": json.dumps(results, indent=2) + "\n", "quickstart.md": markdown(results)})
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())

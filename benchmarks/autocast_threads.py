"""Autocast's casts of parameters where the backward runs on a thread of its own, rehearsed on the CPU.

On CUDA autograd runs the backward on a device thread, whose first recompute leaves autocast as that
thread's outermost context and empties the cache of parameter casts the process shares; on the CPU the
backward runs on the caller's thread, inside its autocast context, and the cache holds every cast through
the step. The planner predicts each (`solvers.Problem.casts_cleared`). Here every model of
tests/models/zoo.py is planned at 50 % of its activation memory under bf16 autocast and stepped both
ways on the CPU: on the caller's thread, and with the backward seeing autocast as the device thread does
(tests/support `as_on_a_backward_thread`: the caller's autocast nesting taken to zero while the backward
runs). Each measured peak (the allocator's) is set against both predictions.

    python -m benchmarks.autocast_threads [--models gpt2,bert]

Writes benchmarks/results/autocast-threads.{md,json}.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import time
from pathlib import Path

import torch
from ckpt_planner.profile.loss import default_loss
from ckpt_planner.profile.memory import measure_step_peaks
from ckpt_planner.solvers import simulate

from tests.models.zoo import ZOO, build, planned_at_half
from tests.support.steps import as_on_a_backward_thread

from ._io import write_files

ROOT = Path(__file__).resolve().parents[1]
TUNED = ("mlp",)
"""The model the placement of the casts was built and tested on (tests/unit/profile/test_autocast_prediction.py):
none of the zoo's, so every row here is held out."""


def row_of(name: str) -> dict:
    torch.manual_seed(0)
    model, inputs = build(name)
    params = list(model.parameters())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        planner, plan = planned_at_half(model, inputs)
        problem = planner.profiled.problem
        cap = planner.profiled.capture
        spans, saved = plan.spans(), plan.saved_indices()
        row = {"model": name, "regions": len(plan.regions), "budget_bytes": plan.budget_bytes,
               "cast_bytes": sum(c.nbytes for c in problem.casts)}
        for label, cleared in (("held", False), ("cleared", True)):
            row[f"predicted_{label}_bytes"] = simulate(dataclasses.replace(problem, casts_cleared=cleared), spans,
                                                       saved=saved).peak_bytes
        for label, loss in (("caller", default_loss), ("own_thread", as_on_a_backward_thread())):
            peaks, out = measure_step_peaks(plan.module, cap.args, cap.kwargs, params, params + list(model.buffers()),
                                            loss, torch.device("cpu"))
            del out
            for p in params:
                p.grad = None
            row[f"{label}_bytes"] = int(peaks.allocator)
    return row


def markdown(rows: list[dict], meta: dict) -> str:
    def cell(measured: int, predicted: int) -> str:
        return f"{measured / 1e3:,.1f} ({(predicted - measured) / measured * 100:+.1f} %)"

    out = ["# bf16 autocast: the casts of parameters with the backward on a thread of its own (CPU rehearsal)", "",
           f"torch {meta['torch']}, {meta['platform']}, {meta['threads']} threads; `python -m benchmarks.autocast_threads`, "
           f"{meta['seconds']:.0f} s. Each zoo model planned at 50 % of its activation memory (solver auto, no "
           "autotune) under bf16 autocast; peak of one step on the allocator, KB, with the error (predicted - "
           "measured) / measured of the prediction that step should meet: the caller's thread against the casts "
           "held through the step, the backward as on a device thread of its own against the casts let go at the "
           "first recompute. None of these models was used to build the placement (held out).", "",
           "| model | regions | casts KB | predicted, held KB | predicted, let go KB | caller thread KB | own thread KB | own thread vs held |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['model']} | {r['error']} | | | | | | |")
            continue
        out.append(f"| {r['model']} | {r['regions']} | {r['cast_bytes'] / 1e3:,.1f} | {r['predicted_held_bytes'] / 1e3:,.1f} "
                   f"| {r['predicted_cleared_bytes'] / 1e3:,.1f} | {cell(r['caller_bytes'], r['predicted_held_bytes'])} "
                   f"| {cell(r['own_thread_bytes'], r['predicted_cleared_bytes'])} "
                   f"| {(r['predicted_held_bytes'] - r['own_thread_bytes']) / r['own_thread_bytes'] * 100:+.1f} % |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(ZOO), help="comma-separated zoo models")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    rows = []
    for name in args.models.split(","):
        try:
            rows.append(row_of(name))
        except Exception as e:  # a model that cannot be planned under bf16 is a row, not the end of the run
            rows.append({"model": name, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"})
        print(rows[-1], flush=True)
    meta = {"torch": torch.__version__, "platform": platform.platform(), "threads": torch.get_num_threads(),
            "seconds": time.perf_counter() - start}
    write_files(args.out, {"autocast-threads.json": json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n",
                           "autocast-threads.md": markdown(rows, meta)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

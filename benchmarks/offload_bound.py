"""How much offloading can gain over recompute alone on a ~1B Llama, under the planner's own cost model.

The model is the GPU run's offload section (benchmarks/gpu.py, `section_offload`): LlamaForCausalLM with 16
layers of 2048 (16 heads, 16 kv heads, MLP 5632, vocab 32000), batch 4 x 2048 tokens, bf16 weights. It is
built on the meta device, captured and profiled on fake tensors (exact bytes, roofline times at
`--flops` FLOP/s and `--bandwidth` B/s), so nothing runs; the copies are priced at `--copy` B/s each way with
a host budget that never binds.

At fractions of per-layer checkpointing's predicted peak it solves `auto` twice, on the problem without
copy bandwidth (recompute only) and with it, and reports each plan's predicted peak, recompute plus
exposed copy seconds, the offloads, and (base step + recompute-only) / (base step + offload plan).

The bound: an offload plan's regions, run without offloading, peak at most the bytes it offloads above its
own peak (offloaded bytes are off the device at most from their copy to their prefetch), so its recompute is
at least R(B + X), the best recompute-only time at budget B + X for X offloaded bytes, and its exposed copy
time at least X / copy - forward. The least of R(B + X) + max(0, X / copy - forward) over X bounds what any
offload plan can cost at budget B, up to how close `auto` comes to the recompute-only optimum.

    python -m benchmarks.offload_bound              # 16 layers; writes benchmarks/results/offload-bound.{md,json}
    python -m benchmarks.offload_bound --layers 4   # quicker
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from ckpt_planner.capture.trace import capture
from ckpt_planner.profile.profiler import ProfileConfig, profile
from ckpt_planner.solvers import InfeasibleBudgetError, Problem, simulate, solve
from ckpt_planner.solvers.heuristics.selective import block_regions

from ._io import write_files

RESULTS = Path(__file__).resolve().parent / "results"
FRACTIONS = (1.0, 0.9, 0.75, 0.5)
HOST_BYTES = 64 * 10**9  # pinned host memory: far more than the activations, so it never binds


def llama_problem(layers: int, flops: float, bandwidth: float) -> Problem:
    """The GPU run's Llama, captured and profiled on fake tensors (no weights, nothing run)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(num_hidden_layers=layers, hidden_size=2048, num_attention_heads=16, num_key_value_heads=16,
                      intermediate_size=5632, vocab_size=32000, max_position_embeddings=2048, use_cache=False,
                      pad_token_id=0, attn_implementation="sdpa")
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to(torch.bfloat16).train()  # as benchmarks/gpu.py's `llama` on a GPU
    ids = torch.zeros(4, 2048, dtype=torch.long, device="meta")
    cap = capture(model, {"input_ids": ids, "labels": ids.clone()})
    cost = profile(cap, ProfileConfig(meta=True, peak_flops=flops, bandwidth=bandwidth))
    return cost.to_problem(name=f"llama-{layers}x2048")


def solved(problem: Problem, budget: int) -> dict[str, Any]:
    """auto's plan at `budget`: its figures, or the smallest budget it names when none fits."""
    try:
        plan = solve(problem, budget, solver="auto")
    except InfeasibleBudgetError as e:
        return {"infeasible": True, "smallest_bytes": e.smallest_bytes}
    sim = simulate(problem, plan.regions, saved=plan.saved, offloaded=plan.offloaded)
    return {"peak_bytes": sim.peak_bytes, "peak_phase": sim.peak_phase, "peak_node": problem.nodes[sim.peak_node].name,
            "recompute_s": sim.recompute_time, "exposed_copy_s": sim.offload_time, "regions": len(plan.regions),
            "kept_ops": len(plan.saved), "offloaded": len(plan.offloaded),
            "offloaded_bytes": sum(problem.storages[t].nbytes for t in plan.offloaded), "chosen": plan.stats.get("chosen")}


def bound(problem: Problem, budget: int, window_s: float, copy: float, step: int) -> dict[str, Any]:
    """min over X of R(budget + X) + max(0, X / copy - window_s), X on a grid of `step` bytes up to twice the
    bytes the window moves (beyond, each byte costs more to copy than the densest recompute saves)."""
    best = None
    for k in range(int(2 * window_s * copy / step) + 2):
        x = k * step
        r = solved(problem, budget + x)
        if r.get("infeasible"):
            continue
        cost = r["recompute_s"] + max(0.0, x / copy - window_s)
        if best is None or cost < best["time_s"]:
            best = {"time_s": cost, "offloaded_bytes": x, "recompute_s": r["recompute_s"]}
    return best or {"time_s": None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--flops", type=float, default=400e12, help="FLOP/s of the roofline (bf16 matmuls)")
    ap.add_argument("--bandwidth", type=float, default=3e12, help="device memory bytes/s of the roofline")
    ap.add_argument("--copy", type=float, default=55e9, help="host copy bytes/s, each way")
    ap.add_argument("--step-gb", type=float, default=0.25, help="grid of offloaded bytes in the bound (GB)")
    ap.add_argument("--out", type=Path, default=RESULTS / "offload-bound")
    args = ap.parse_args()

    plain = llama_problem(args.layers, args.flops, args.bandwidth)
    copying = dataclasses.replace(plain, d2h_bytes_per_s=args.copy, h2d_bytes_per_s=args.copy, host_budget_bytes=HOST_BYTES)
    layer_peak = simulate(plain, block_regions(plain)).peak_bytes
    base, forward = plain.base_step_s, plain.total_time
    rows = []
    for f in FRACTIONS:
        budget = int(f * layer_peak)
        row: dict[str, Any] = {"fraction": f, "budget_bytes": budget, "recompute": solved(plain, budget),
                               "offload": solved(copying, budget)}
        rec, off = row["recompute"], row["offload"]
        if not off.get("infeasible"):
            row["bound"] = bound(plain, budget, forward, args.copy, int(args.step_gb * 1e9))
            if not rec.get("infeasible"):
                row["ratio"] = (base + rec["recompute_s"]) / (base + off["recompute_s"])
                row["bound"]["ratio"] = (base + rec["recompute_s"]) / (base + row["bound"]["time_s"])
        rows.append(row)
        print(json.dumps(row, default=float), flush=True)
    data = {"model": plain.name, "nodes": plain.n, "flops": args.flops, "bandwidth": args.bandwidth, "copy": args.copy,
            "param_bytes": plain.param_bytes, "per_layer_peak_bytes": layer_peak, "base_step_s": base,
            "forward_s": forward, "window_bytes": forward * args.copy, "rows": rows}
    write_files(args.out.parent, {args.out.with_suffix(".json").name: json.dumps(data, indent=1) + "\n",
                                  args.out.with_suffix(".md").name: render(data) + "\n"})


def render(d: dict[str, Any]) -> str:
    mb = lambda b: f"{b / 1e6:,.1f}"  # noqa: E731
    ms = lambda s: f"{s * 1e3:.2f}"  # noqa: E731
    lines = [
        "# Offload against recompute-only, under the cost model",
        "",
        f"{d['model']} ({d['nodes']} nodes), bf16 weights, batch 4 x 2048; profiled on fake tensors, roofline "
        f"{d['flops'] / 1e12:g} TFLOP/s and {d['bandwidth'] / 1e12:g} TB/s; copies {d['copy'] / 1e9:g} GB/s each way. "
        f"Per-layer checkpointing's predicted peak {mb(d['per_layer_peak_bytes'])} MB; base step {ms(d['base_step_s'])} ms, "
        f"forward {ms(d['forward_s'])} ms, in which the copy stream moves at most {mb(d['window_bytes'])} MB.",
        "",
        "| x per-layer | plan | peak MB | recompute + copy ms | exposed copy ms | offloaded | chosen | ratio | bound ms | bound ratio |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in d["rows"]:
        for label in ("recompute", "offload"):
            p = r[label]
            if p.get("infeasible"):
                lines.append(f"| {r['fraction']:g}x | {label} | infeasible (least {mb(p['smallest_bytes'])}) | | | | | | | |")
                continue
            extra = ["", "", ""]
            if label == "offload" and r.get("bound", {}).get("time_s") is not None:
                extra = [f"{r['ratio']:.4f}" if "ratio" in r else "-", ms(r["bound"]["time_s"]),
                         f"{r['bound']['ratio']:.4f}" if "ratio" in r["bound"] else "-"]
            lines.append(f"| {r['fraction']:g}x | {label} | {mb(p['peak_bytes'])} | {ms(p['recompute_s'])} | "
                         f"{ms(p['exposed_copy_s'])} | {p['offloaded']} ({mb(p['offloaded_bytes'])} MB) | {p['chosen']} | "
                         + " | ".join(extra) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

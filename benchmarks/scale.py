"""Planning models too large for this machine: a Llama-2-7B and a GPT-2-XL shape on the meta device.

Each model is built under `torch.device("meta")` in bf16 (no weights are
allocated), captured with torch.export, profiled on fake tensors (exact bytes,
FLOP-based time) and solved for several budgets: 24 and 40 GB counting
parameters and gradients, 64 and 80 GB counting AdamW state too, and one budget
below the fixed memory, which must fail naming the smallest feasible budget
(that budget is then solved to check it is feasible). Wall time per budget is
capture + profile + solve; the target is under 60 s.

The targets: one whole `optimize(model, inputs, device="meta")` call with the
default solver ("auto") for a Llama-2-7B at 64 GB with AdamW (target 15 s) and
a Llama-2-70B on 8 ranks under FSDP at 80 GB per rank with AdamW (target 60 s),
each in a fresh interpreter, timed with the split its stages log: wall seconds
and the process's CPU seconds per stage, with the load average at the start and
the end (on a shared machine the wall time also holds the waits for a core).

    python -m benchmarks.scale                     # both models, solver uniform, then the targets
    python -m benchmarks.scale --solver greedy --compare uniform dp auto   # as in results/
    python -m benchmarks.scale --targets           # only the targets, merged into scale.json
    python -m benchmarks.scale --render            # rewrite scale.md from scale.json

Writes benchmarks/results/scale.json and scale.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import platform
import re
import resource
import sys
import time
from pathlib import Path
from typing import Any

import ckpt_planner.solvers as solvers
import torch
from ckpt_planner.api import optimize
from ckpt_planner.capture.trace import capture
from ckpt_planner.distributed import optimizer_state_bytes
from ckpt_planner.errors import InfeasibleBudgetError
from ckpt_planner.profile.profiler import ProfileConfig, profile

from ._io import write_files

ROOT = Path(__file__).resolve().parents[1]
GB = 1e9
TARGET_S = 60.0
BUDGETS = ((24, None), (40, None), (64, "adamw"), (80, "adamw"))  # (GB, optimizer)


def llama_7b() -> tuple[torch.nn.Module, dict]:
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(
        num_hidden_layers=32, hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
        num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096, use_cache=False,
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    return model, {"input_ids": torch.zeros(1, 4096, dtype=torch.long, device="meta")}  # [B, T]


def gpt2_xl() -> tuple[torch.nn.Module, dict]:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=48, n_embd=1600, n_head=25, n_positions=1024, vocab_size=50257, use_cache=False)
    with torch.device("meta"):
        model = GPT2LMHeadModel(cfg).to(torch.bfloat16)
    return model, {"input_ids": torch.zeros(1, 1024, dtype=torch.long, device="meta")}  # [B, T]


def llama2_70b() -> tuple[torch.nn.Module, dict]:
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(
        num_hidden_layers=80, hidden_size=8192, intermediate_size=28672, num_attention_heads=64,
        num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096, use_cache=False,
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    return model, {"input_ids": torch.zeros(1, 4096, dtype=torch.long, device="meta")}  # [B, T]


MODELS = {"llama-7b": llama_7b, "gpt2-xl": gpt2_xl}
BUILDERS = {**MODELS, "llama2-70b": llama2_70b}
TARGETS = (  # (model, optimize() keywords, wall-clock target of the whole call in seconds)
    ("llama-7b", {"budget_gb": 64, "optimizer": "adamw"}, 15.0),
    ("llama2-70b", {"budget_gb": 80, "optimizer": "adamw", "world_size": 8, "sharding": "fsdp"}, 60.0),
)


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3  # KB on Linux -> MB


def _solve(problem: solvers.Problem, budget: int, solver: str) -> dict[str, Any]:
    t0 = time.perf_counter()
    try:
        sol = solvers.solve(problem, budget, solver)
    except InfeasibleBudgetError as e:
        return {"status": "infeasible", "solve_s": time.perf_counter() - t0, "smallest_bytes": e.smallest_bytes,
                "error": str(e)}
    return {
        "status": "ok",
        "solve_s": time.perf_counter() - t0,
        "predicted_peak_bytes": sol.peak_bytes,
        "recompute_s": sol.recompute_time,
        "regions": len(sol.regions),
        "breakdown": dict(sol.stats.get("breakdown", {})),
        "peak_phase": sol.stats.get("peak_phase"),
    }


def _child(conn, problem, budget, solver):
    conn.send(_solve(problem, budget, solver))


def _solve_with_timeout(problem: solvers.Problem, budget: int, solver: str, timeout: float) -> dict[str, Any]:
    """Another solver's figures, in a forked child so a slow one can be stopped."""
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(child, problem, budget, solver))
    t0 = time.perf_counter()
    proc.start()
    got = parent.poll(timeout)
    result = parent.recv() if got else {"status": "timeout", "solve_s": time.perf_counter() - t0}
    proc.kill() if not got else None
    proc.join()
    return result


def run_model(name: str, solver: str, compare: list[str], timeout: float, api: bool) -> dict[str, Any]:
    t0 = time.perf_counter()
    model, inputs = MODELS[name]()
    build_s = time.perf_counter() - t0
    rss0 = _rss_mb()
    t0 = time.perf_counter()
    cap = capture(model, inputs)
    capture_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    cost = profile(cap, ProfileConfig(meta=True))
    profile_s = time.perf_counter() - t0
    n_params = sum(p.numel() for p in model.parameters())
    out: dict[str, Any] = {
        "model": name,
        "parameters": n_params,
        "dtype": "bfloat16",
        "inputs": {k: list(v.shape) for k, v in inputs.items()},
        "capture_method": cap.method,
        "graph_nodes": len(cap.graph_module.graph.nodes),
        "compute_nodes": len(cost.nodes),
        "storages": len(cost.storages),
        "build_s": build_s,
        "capture_s": capture_s,
        "profile_s": profile_s,
        "param_bytes": cost.param_bytes,
        "saved_activation_bytes": cost.total_saved_bytes,
        "forward_flops": sum(n.flops for n in cost.nodes),
        "forward_s_estimate": cost.total_time,
        "budgets": [],
    }
    for budget_gb, opt in BUDGETS:
        opt_bytes = optimizer_state_bytes(model, opt)
        problem = cost.to_problem(optimizer_bytes=opt_bytes, name=name)
        base = solvers.simulate(problem, ())
        row: dict[str, Any] = {
            "budget_gb": budget_gb, "optimizer": opt or "none", "solver": solver, "optimizer_bytes": opt_bytes,
            "fixed_bytes": problem.fixed_bytes, "baseline_peak_bytes": base.peak_bytes,
            "baseline_breakdown": dict(base.breakdown),
            **_solve(problem, int(budget_gb * GB), solver),
        }
        if row["status"] == "infeasible":
            row["smallest_check"] = _solve(problem, row["smallest_bytes"], solver)
        row["wall_s"] = capture_s + profile_s + row["solve_s"]
        row["under_target"] = row["wall_s"] < TARGET_S
        row["compare"] = {s: _solve_with_timeout(problem, int(budget_gb * GB), s, timeout) for s in compare}
        out["budgets"].append(row)
    # a budget below the fixed memory (parameters, inputs, optimizer state) must be refused
    problem = cost.to_problem(optimizer_bytes=0, name=name)
    below = problem.fixed_bytes // 2
    row = {"budget_gb": below / GB, "optimizer": "none", "solver": solver, "fixed_bytes": problem.fixed_bytes,
           **_solve(problem, below, solver)}
    if row["status"] == "infeasible":
        row["smallest_check"] = _solve(problem, row["smallest_bytes"], solver)
    out["below_fixed"] = row
    out["rss_growth_mb"] = _rss_mb() - rss0
    if api:  # the public entry point, end to end (capture + profile + solve + rewrite)
        feasible = next((b for b in out["budgets"] if b["status"] == "ok"), None)
        if feasible is not None:
            t0 = time.perf_counter()
            plan = optimize(model, inputs, device="meta", budget_gb=feasible["budget_gb"], solver=solver,
                            optimizer=None if feasible["optimizer"] == "none" else feasible["optimizer"])
            out["optimize_api"] = {"budget_gb": feasible["budget_gb"], "optimizer": feasible["optimizer"],
                                   "wall_s": time.perf_counter() - t0,
                                   "predicted_peak_bytes": plan.predicted_peak_bytes,
                                   "regions": len(plan.regions)}
    out["max_rss_mb"] = _rss_mb()
    return out


class _StageTimes(logging.Handler):
    """Seconds of each pipeline stage, from the "<stage>: start" and "<stage>: done in <s> s" records optimize()
    logs: wall seconds as logged, and this process's CPU seconds between the two records (the machine may be
    shared: the wall time then includes waiting for a core, the CPU time does not)."""

    START = re.compile(r"^(\w+): start\b")
    DONE = re.compile(r"^(\w+): done in ([0-9.]+) s$")

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.seconds: dict[str, float] = {}
        self.cpu_seconds: dict[str, float] = {}
        self._started: dict[str, float] = {}  # stage -> process CPU seconds at its start

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        started = self.START.match(message)
        if started:
            self._started[started.group(1)] = time.process_time()
            return
        found = self.DONE.match(message)
        if found:
            name = found.group(1)
            self.seconds[name] = self.seconds.get(name, 0.0) + float(found.group(2))
            if name in self._started:
                self.cpu_seconds[name] = self.cpu_seconds.get(name, 0.0) + time.process_time() - self._started.pop(name)


def _target_child(conn, name: str, keywords: dict[str, Any]) -> None:
    model, inputs = BUILDERS[name]()
    handler, log = _StageTimes(), logging.getLogger("ckpt_planner")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    load = os.getloadavg()[0]
    t0, c0 = time.perf_counter(), time.process_time()
    plan = optimize(model, inputs, device="meta", **keywords)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    conn.send({"wall_s": wall, "cpu_s": cpu, "stages_s": handler.seconds, "stages_cpu_s": handler.cpu_seconds,
               "load_start": load, "load_end": os.getloadavg()[0], "solver": plan.solver,
               "chosen": plan.stats.get("chosen"), "predicted_peak_bytes": plan.predicted_peak_bytes,
               "predicted_recompute_s": plan.predicted_recompute_s, "budget_bytes": plan.budget_bytes,
               "regions": len(plan.regions), "saved_ops": len(plan.saved_indices())})


def run_target(name: str, keywords: dict[str, Any], target_s: float) -> dict[str, Any]:
    """One whole optimize() call on the meta device, in a fresh interpreter (its first call pays what a
    user's first call pays: torch.export's lazy imports and caches)."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_target_child, args=(child, name, keywords))
    proc.start()
    result = parent.recv()
    proc.join()
    return {"model": name, "keywords": keywords, "target_s": target_s, **result,
            "under_target": result["wall_s"] <= target_s}


def _stage_cell(wall: dict[str, float], cpu: dict[str, float], stage: str) -> str:
    """A stage's "wall / CPU" seconds (wall alone where no CPU time was recorded)."""
    return f"{wall.get(stage, 0):.1f}" + (f" / {cpu[stage]:.1f}" if stage in cpu else "")


def _gb(x: float | None) -> str:
    return "-" if x is None else f"{x / GB:.2f}"


def markdown(results: dict[str, Any]) -> str:
    env = results["environment"]
    lines = [
        "# Planning at scale on the meta device",
        "",
        f"`python -m benchmarks.scale` on {env['machine']} ({env['cpus']} CPUs, 1-minute load average "
        f"{env.get('load_start', float('nan')):.1f} at the start), "
        f"torch {env['torch']}, transformers {env['transformers']}. Models built on the meta device in bf16, "
        "batch 1; bytes exact on fake tensors, time from FLOPs. Wall = capture + profile + solve "
        f"(target < {TARGET_S:.0f} s). GB = 1e9 bytes.",
        "",
        "| model | params | nodes (graph / compute) | capture s | profile s | saved activations GB | forward TFLOP |",
        "|---|---|---|---|---|---|---|",
    ]
    for m in results["models"]:
        lines.append(
            f"| {m['model']} | {m['parameters'] / 1e9:.2f} B | {m['graph_nodes']} / {m['compute_nodes']} | "
            f"{m['capture_s']:.1f} | {m['profile_s']:.1f} | {_gb(m['saved_activation_bytes'])} | "
            f"{m['forward_flops'] / 1e12:.1f} |"
        )
    lines += [
        "",
        "| model | budget GB | optimizer | solver | solve s | wall s | < 60 s | fixed GB | baseline GB | "
        "predicted GB | params / grads / optimizer / activations / recomputed / act grads / temps GB | regions | "
        "recompute s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    keys = ("parameters", "param_grads", "optimizer", "activations", "recomputed", "act_grads", "temporaries")
    for m in results["models"]:
        for b in m["budgets"]:
            if b["status"] == "ok":
                pred, parts = _gb(b["predicted_peak_bytes"]), " / ".join(_gb(b["breakdown"].get(k, 0)) for k in keys)
                regions, recompute = str(b["regions"]), f"{b['recompute_s']:.1f}"
            else:
                pred = f"infeasible; smallest {_gb(b['smallest_bytes'])}"
                chk = b.get("smallest_check", {})
                parts = f"smallest budget solved: {chk.get('status')} at {_gb(chk.get('predicted_peak_bytes'))}"
                regions = str(chk.get("regions", "-"))
                recompute = f"{chk['recompute_s']:.1f}" if "recompute_s" in chk else "-"
            lines.append(
                f"| {m['model']} | {b['budget_gb']} | {b['optimizer']} | {b['solver']} | {b['solve_s']:.2f} | "
                f"{b['wall_s']:.1f} | {'yes' if b['under_target'] else 'no'} | {_gb(b['fixed_bytes'])} | "
                f"{_gb(b['baseline_peak_bytes'])} | {pred} | {parts} | {regions} | {recompute} |"
            )
    lines += ["", "Recompute seconds are FLOP/bandwidth estimates at the CPU defaults of ProfileConfig "
              "(1e11 FLOP/s, 2e10 B/s): compare them between rows, not with a GPU's step time. The breakdown is "
              "at the predicted peak; param grads are those alive at that moment.", ""]
    lines += ["Below the fixed memory (half of parameters + inputs, no optimizer):", ""]
    for m in results["models"]:
        b = m["below_fixed"]
        chk = b.get("smallest_check", {})
        lines.append(
            f"- {m['model']}: budget {b['budget_gb']:.2f} GB -> {b['status']}"
            + (f", smallest {_gb(b['smallest_bytes'])} GB, which solves ({chk.get('status')}, "
               f"predicted {_gb(chk.get('predicted_peak_bytes'))} GB)" if b["status"] == "infeasible" else "")
        )
    compared = sorted({s for m in results["models"] for b in m["budgets"] for s in b["compare"]})
    if compared:
        lines += ["", "Other solvers on the same problems (solve s, predicted GB; forked, stopped after "
                  f"{results['compare_timeout_s']:.0f} s):", "",
                  "| model | budget GB | " + " | ".join(compared) + " |", "|---|---|" + "---|" * len(compared)]
        for m in results["models"]:
            for b in m["budgets"]:
                cells = []
                for s in compared:
                    r = b["compare"].get(s, {})
                    if r.get("status") == "ok":
                        cells.append(f"{r['solve_s']:.2f} s, {_gb(r['predicted_peak_bytes'])}")
                    elif r.get("status") == "infeasible":
                        cells.append(f"{r['solve_s']:.2f} s, infeasible (smallest {_gb(r['smallest_bytes'])})")
                    else:
                        cells.append(f"{r.get('status', '-')} ({r.get('solve_s', 0):.0f} s)")
                lines.append(f"| {m['model']} | {b['budget_gb']} | " + " | ".join(cells) + " |")
    lines += ["", "Memory of this process: " + ", ".join(
        f"{m['model']} RSS growth over capture+profile+solve {m['rss_growth_mb']:.0f} MB (max RSS {m['max_rss_mb']:.0f} MB)"
        for m in results["models"]) + "."]
    apis = [m for m in results["models"] if "optimize_api" in m]
    if apis:
        lines += ["", "`optimize(model, inputs, device='meta', ...)` end to end (capture, profile, solve, rewrite): "
                  + "; ".join(f"{m['model']} at {m['optimize_api']['budget_gb']} GB: {m['optimize_api']['wall_s']:.1f} s, "
                              f"predicted {_gb(m['optimize_api']['predicted_peak_bytes'])} GB" for m in apis) + "."]
    if results.get("targets"):
        lines += ["", "## Targets: one `optimize(..., device=\"meta\")` call, solver auto", "",
                  results.get("targets_note", ""), "",
                  "Each call runs in a fresh interpreter. Stage cells: wall / CPU seconds (this process's CPU time; "
                  "on a machine shared with other work the wall time also holds the waits for a core). Load: the "
                  "1-minute load average at the call's start and end, on "
                  f"{results['environment']['cpus']} CPUs. A target is met on the wall time.", "",
                  "| model | keywords | wall s | CPU s | target s | met | capture | profile | solve | rewrite | other | "
                  "load start / end | chosen | predicted GB | recompute s | regions / kept ops |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for t in results["targets"]:
            st, cpu = t["stages_s"], t.get("stages_cpu_s", {})
            stages = ("capture", "profile", "solve", "rewrite")
            other = t["wall_s"] - sum(st.get(k, 0.0) for k in stages)
            other_cpu = t["cpu_s"] - sum(cpu.get(k, 0.0) for k in stages) if "cpu_s" in t else None
            kw = ", ".join(f"{k}={v}" for k, v in t["keywords"].items())
            load = f"{t['load_start']:.1f}" + (f" / {t['load_end']:.1f}" if "load_end" in t else "")
            total_cpu = f"{t['cpu_s']:.1f}" if "cpu_s" in t else "-"
            other_cell = f"{other:.1f}" + (f" / {other_cpu:.1f}" if other_cpu is not None else "")
            lines.append(
                f"| {t['model']} | {kw} | {t['wall_s']:.1f} | {total_cpu} | {t['target_s']:.0f} | "
                f"{'yes' if t['under_target'] else 'no'} | {' | '.join(_stage_cell(st, cpu, stage) for stage in stages)} | {other_cell} | "
                f"{load} | {t['chosen']} | {_gb(t['predicted_peak_bytes'])} | {t['predicted_recompute_s']:.2f} | "
                f"{t['regions']} / {t['saved_ops']} |"
            )
    lines += ["", "Notes:", ""]
    for m in results["models"]:
        weights = m["parameters"] * 2  # bf16 bytes
        lines.append(
            f"- {m['model']}: the optimizer step is not part of the simulated step. torch's foreach AdamW "
            "(the default on CUDA) allocates one parameter-sized temporary (sqrt of exp_avg_sq) in step(), so "
            f"the step itself peaks near params + grads + 2 states + 1 temporary = {_gb(5 * weights)} GB; "
            f"fused=True or foreach=False keep it near 4 x weights = {_gb(4 * weights)} GB."
        )
    lines.append(
        "- Bytes equal a real CPU step (meta tensors are profiled as fake CPU tensors). GPT-2 trains with "
        "attention dropout, for which CPU scaled_dot_product_attention does not use its fused kernel: it saves "
        "[B, H, T, T] attention matrices (about 334 MB per layer at GPT-2-XL width, T = 1024). CUDA flash "
        "attention supports dropout and saves the output and a logsumexp, so these GPT-2 activation figures "
        "overstate a GPU step; Llama (no attention dropout) takes the fused kernel here."
    )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.scale", description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    ap.add_argument("--solver", default="uniform", help="solver timed in the wall figure (default uniform)")
    ap.add_argument("--compare", nargs="*", default=[], help="other solvers to time on the same problems")
    ap.add_argument("--compare-timeout", type=float, default=60.0, help="seconds before a compared solver is stopped")
    ap.add_argument("--no-api", action="store_true", help="skip the end-to-end optimize() call")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--render", action="store_true", help="only rewrite scale.md from scale.json")
    ap.add_argument("--targets", action="store_true", help="only the targets, merged into an existing scale.json")
    ap.add_argument("--note", default="", help="a line on the machine's state printed above the targets")
    args = ap.parse_args(argv)
    if args.render:
        write_files(args.out, {"scale.md": markdown(json.loads((args.out / "scale.json").read_text()))})
        return 0
    if args.targets:
        results = json.loads((args.out / "scale.json").read_text())
        results["targets"] = [run_target(*case) for case in TARGETS]
        results["targets_note"] = args.note
        write_files(args.out, {"scale.json": json.dumps(results, indent=2) + "\n", "scale.md": markdown(results)})
        print(markdown(results))
        return 0
    import transformers

    results = {
        "environment": {"machine": platform.machine() + " " + platform.system(), "cpus": mp.cpu_count(),
                        "torch": torch.__version__, "transformers": transformers.__version__,
                        "python": platform.python_version(), "load_start": os.getloadavg()[0]},
        "target_s": TARGET_S,
        "compare_timeout_s": args.compare_timeout,
        "models": [],
    }
    for name in args.models:
        results["models"].append(run_model(name, args.solver, args.compare, args.compare_timeout, not args.no_api))
        print(f"{name}: done", file=sys.stderr)
    results["targets"] = [run_target(*case) for case in TARGETS]
    results["targets_note"] = args.note
    write_files(args.out, {"scale.json": json.dumps(results, indent=2) + "\n", "scale.md": markdown(results)})
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())

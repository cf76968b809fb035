"""Our plans compiled against torch.compile's own activation_memory_budget, both compiled, in one process.

For each model:
- compile@f: `torch.compile` (inductor) with `torch._functorch.config.activation_memory_budget=f`
  (a fraction of saved bytes), and without a budget (`compile`, its default 1.0);
- ours@f: `CompiledPlanner` (optimize(..., compile=True)) at a byte budget equal to compile@f's
  measured peak, so "at no more bytes than compile@0.5" reads directly; besides those, budgets
  half-way between consecutive ones, for the monotone check over more points.

Both are measured with the same meter (`measure_compiled_step`: resident parameters, buffers and
inputs + the allocator's peak over one forward + backward after a warm-up step; on CPU the
profiler's allocator events). Time: median of `--repeats` steps, all contenders of a model
round-robin in one process (machine load hits them alike). Gradients of every contender are
compared with those of the compiled step without a budget.

    python benchmarks/compile.py                                # gpt2, llama (cpu sizes), unet (tiny)
    python benchmarks/compile.py --models gpt2 --fractions 0.5 --out /tmp/c
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ckpt_planner import Planner  # noqa: E402
from ckpt_planner.compiled import CompiledPlanner, measure_compiled_step  # noqa: E402
from ckpt_planner.verify import default_loss  # noqa: E402
from tradeoff_models import MODELS  # noqa: E402

SCALES = {"gpt2": "cpu", "llama": "cpu", "unet": "tiny"}  # models and the size each runs at
FRACTIONS = (0.1, 0.3, 0.5, 0.7, 0.9)


def compile_at(model: torch.nn.Module, budget: float | None) -> torch.nn.Module:
    """torch.compile of a copy of `model` whose partitioner runs under activation_memory_budget=budget."""
    import torch._functorch.config as fconfig
    from torch._inductor.compile_fx import compile_fx

    def backend(gm, example_inputs):
        if budget is None:
            return compile_fx(gm, example_inputs)
        with fconfig.patch(activation_memory_budget=budget):
            return compile_fx(gm, example_inputs)

    return torch.compile(copy.deepcopy(model), backend=backend)  # HF forwards log once: a graph break, as users get


def _step(module, params, inputs) -> None:
    for p in params:
        p.grad = None
    default_loss(module(**inputs)).backward()


def _grads(module, params, inputs) -> list[torch.Tensor]:
    torch.manual_seed(0)
    _step(module, params, inputs)
    return [p.grad.detach().clone() for p in params]


def run_model(name: str, fractions, repeats: int, log) -> dict:
    case = MODELS[name](SCALES[name], "cpu")
    model, inputs = case.model, case.inputs
    out: dict = {"model": name, "title": case.title, "shapes": case.shapes,
                 "parameters": sum(p.numel() for p in model.parameters())}
    rows = []  # one per contender: name, family, fraction / budget, module, params
    t0 = time.perf_counter()
    for f in (None, *fractions):
        mod = compile_at(model, f)
        params = list(mod._orig_mod.parameters())
        peak = measure_compiled_step(mod, mod._orig_mod, (), inputs)
        rows.append({"name": "compile" if f is None else f"compile@{f}", "family": "compile", "fraction": f,
                     "measured_peak_bytes": peak, "module": mod, "params": params})
        log(f"[{name}] compile@{f}: {peak / 1e6:.2f} MB ({time.perf_counter() - t0:.0f} s)")
    out["compile_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    planner = Planner(model, inputs)
    cp = CompiledPlanner(planner)
    out["predicted_eager_baseline_bytes"] = planner.baseline_peak_bytes
    labels = {r["measured_peak_bytes"]: r["name"] for r in reversed(rows)}
    peaks = sorted(labels)
    budgets = peaks + [(a + b) // 2 for a, b in zip(peaks, peaks[1:])]
    budgets = sorted(set(budgets))
    plans = cp.sweep(budgets)
    out["ours_plan_s"] = time.perf_counter() - t0
    out["compiles_ours"] = len(cp._tried)
    params = list(model.parameters())
    for b, plan in zip(budgets, plans):
        label = labels.get(b, "between")
        row = {"name": f"ours@{label}", "family": "ours", "budget_bytes": b, "at_peak_of": labels.get(b)}
        if plan is None:
            row["infeasible"] = True
            rows.append(row)
            log(f"[{name}] ours at {b / 1e6:.2f} MB: infeasible")
            continue
        c = plan.stats["compiled"]
        row.update(measured_peak_bytes=plan.measured_peak_bytes, predicted_peak_bytes=plan.predicted_peak_bytes,
                   regions=len(plan.regions), replans=c["replans"], loosened=c["loosened"], tries=c["tries"],
                   kept_looser_plan="kept_looser_plan" in plan.stats, module=plan.module, params=params,
                   within_budget=plan.measured_peak_bytes <= b)
        rows.append(row)
        log(f"[{name}] ours at {b / 1e6:.2f} MB: {plan.measured_peak_bytes / 1e6:.2f} MB measured, "
            f"{len(plan.regions)} regions, {c['replans']} re-plans, {c['loosened']} looser ({time.perf_counter() - t0:.0f} s)")
    live = [r for r in rows if "module" in r]
    ref = _grads(live[0]["module"], live[0]["params"], inputs)
    for r in live[1:]:
        g = _grads(r["module"], r["params"], inputs)
        r["max_abs_grad_diff"] = max(float((a - b).abs().max()) for a, b in zip(g, ref))
    ref2 = _grads(live[0]["module"], live[0]["params"], inputs)  # compile's own run-to-run difference
    live[0]["max_abs_grad_diff"] = max(float((a - b).abs().max()) for a, b in zip(ref2, ref))
    eager = _grads(model, params, inputs)  # how far compiling alone moves the gradients
    out["compile_vs_eager_max_abs_grad_diff"] = max(float((a - b).abs().max()) for a, b in zip(eager, ref))
    out["max_abs_grad"] = max(float(g.abs().max()) for g in ref)
    times: dict[str, list[float]] = {r["name"] + str(r.get("budget_bytes", "")): [] for r in live}
    for _ in range(repeats):
        for r in live:
            t = time.perf_counter()
            _step(r["module"], r["params"], inputs)
            times[r["name"] + str(r.get("budget_bytes", ""))].append(time.perf_counter() - t)
    for r in live:
        r["step_times_s"] = times[r["name"] + str(r.get("budget_bytes", ""))]
        r["step_s"] = statistics.median(r["step_times_s"])
        del r["module"], r["params"]
    out["contenders"] = rows
    out["checks"] = checks(rows)
    return out


def checks(rows: list[dict]) -> dict:
    """Monotone peaks, peaks within budgets, and the done-when comparison at compile@0.5."""
    comp = sorted((r for r in rows if r["family"] == "compile" and r["fraction"] is not None),
                  key=lambda r: r["fraction"])
    ours = sorted((r for r in rows if r["family"] == "ours" and not r.get("infeasible")), key=lambda r: r["budget_bytes"])
    compile_nonmono = [f"{a['fraction']}->{b['fraction']}: {a['measured_peak_bytes']} > {b['measured_peak_bytes']}"
                       for a, b in zip(comp, comp[1:]) if a["measured_peak_bytes"] > b["measured_peak_bytes"]]
    ours_nonmono = [f"{a['budget_bytes']}->{b['budget_bytes']}" for a, b in zip(ours, ours[1:])
                    if a["measured_peak_bytes"] > b["measured_peak_bytes"]]
    out = {"compile_non_monotone": compile_nonmono, "ours_non_monotone": ours_nonmono,
           "ours_over_budget": [r["budget_bytes"] for r in ours if not r["within_budget"]],
           "ours_budgets": len(ours) + sum(1 for r in rows if r.get("infeasible"))}
    half = next((r for r in comp if r["fraction"] == 0.5), None)
    mine = next((r for r in ours if r.get("at_peak_of") == "compile@0.5"), None)
    if half and mine:
        out["at_compile@0.5"] = {"compile_step_s": half["step_s"], "ours_step_s": mine["step_s"],
                                 "ours_vs_compile": mine["step_s"] / half["step_s"] - 1,
                                 "compile_peak": half["measured_peak_bytes"], "ours_peak": mine["measured_peak_bytes"]}
    return out


def report(results: dict) -> str:
    lines = ["# Our compiled plans against torch.compile's activation_memory_budget", "",
             f"Measured {results['date']} by `{results['command']}` (torch {torch.__version__}, "
             f"{torch.get_num_threads()} torch threads on a shared 2-core CPU machine), {results['wall_s'] / 60:.1f} min.",
             "", "- Peak: resident parameters, buffers and inputs + the CPU allocator's peak (profiler memory events) "
             "over one forward + backward, after a warm-up step that compiles. Both families compiled with inductor; "
             "ours with fullgraph=True, compile@f as users call it (transformers' forwards log once: a graph break).",
             f"- Time: median of {results['repeats']} steps, all contenders of a model round-robin in one process "
             "(noisy: other jobs share the 2 cores).",
             "- ours@compile@f: our plan (`CompiledPlanner.sweep`) at a byte budget equal to compile@f's measured "
             "peak; 'between': budgets half-way between those, for the monotone check. Each plan is compiled and "
             "measured; over its budget it is planned again tighter, well under it (5 % of the activation part) "
             "looser (at most 2 tries), kept while it fits and recomputes less.",
             "- Grad diff: max |grad - grad of compile without a budget| after one step from the same state and seed; "
             "the 'compile' row is compile's own run-to-run difference. GPT-2's config trains with dropout 0.1, so "
             "there a difference can be another dropout mask (the compiled graphs draw their random numbers their "
             "own way), not rounding.",
             f"- activation_memory_budget fractions: {', '.join(map(str, results['fractions']))} (fewer than "
             "0.1-0.9 in steps of 0.1, to fit the compile time of 2 shared cores)."]
    for m in results["models"]:
        lines += ["", f"## {m['title']}", "", f"Shapes `{m['shapes']}`, {m['parameters'] / 1e6:.2f} M parameters; "
                  f"compile variants built in {m['compile_s']:.0f} s, our sweep in {m['ours_plan_s']:.0f} s "
                  f"({m['compiles_ours']} compiled plans). Gradients: compiled (no budget) against eager differ by "
                  f"up to {m['compile_vs_eager_max_abs_grad_diff']:.1e} (largest gradient {m['max_abs_grad']:.1e}).", "",
                  "| contender | budget (MB) | measured peak (MB) | within | step ms: median (min-max) | grad diff | regions | re-plans: tighter / looser |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in m["contenders"]:
            if r.get("infeasible"):
                lines.append(f"| {r['name']} | {r['budget_bytes'] / 1e6:.2f} | infeasible | | | | | |")
                continue
            budget = r.get("budget_bytes")
            within = "" if budget is None else ("yes" if r["within_budget"] else "**no**")
            name = r["name"] + (" (looser plan kept)" if r.get("kept_looser_plan") else "")
            lines.append(
                f"| {name} | {'' if budget is None else f'{budget / 1e6:.2f}'} | {r['measured_peak_bytes'] / 1e6:.2f} | "
                f"{within} | {r['step_s'] * 1e3:.0f} ({min(r['step_times_s']) * 1e3:.0f}-{max(r['step_times_s']) * 1e3:.0f}) | {r.get('max_abs_grad_diff', 0):.1e} | {r.get('regions', '')} | "
                f"{_replans(r)} |")
        c = m["checks"]
        lines += ["", f"- compile's peak non-monotone in its budget: {', '.join(c['compile_non_monotone']) or 'no'}",
                  f"- ours non-monotone over {c['ours_budgets']} budgets: {', '.join(c['ours_non_monotone']) or 'no'}; "
                  f"over budget: {c['ours_over_budget'] or 'none'}"]
        if "at_compile@0.5" in c:
            h = c["at_compile@0.5"]
            lines.append(f"- at compile@0.5's peak ({h['compile_peak'] / 1e6:.2f} MB): ours {h['ours_peak'] / 1e6:.2f} MB, "
                         f"step {h['ours_step_s'] * 1e3:.1f} ms against {h['compile_step_s'] * 1e3:.1f} ms "
                         f"({100 * h['ours_vs_compile']:+.1f} %)")
    return "\n".join(lines) + "\n"


def _replans(r: dict) -> str:
    return f"{r['replans']} / {r['loosened']}" if "replans" in r else ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(SCALES))
    ap.add_argument("--fractions", default=",".join(map(str, FRACTIONS)))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--from-json", action="store_true", help="only re-write compile.md from compile.json in --out")
    args = ap.parse_args(argv)
    if args.from_json:
        out = Path(args.out)
        (out / "compile.md").write_text(report(json.loads((out / "compile.json").read_text())))
        return 0
    import torch._dynamo

    torch._dynamo.config.recompile_limit = 64  # one cache entry per compiled variant of the same forward
    fractions = [float(f) for f in args.fractions.split(",") if f]
    t0 = time.perf_counter()
    results = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "repeats": args.repeats,
               "command": "python benchmarks/compile.py " + " ".join(argv if argv is not None else sys.argv[1:]),
               "fractions": fractions, "models": []}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in args.models.split(","):
        results["models"].append(run_model(name, fractions, args.repeats, lambda s: print(s, file=sys.stderr, flush=True)))
        results["wall_s"] = time.perf_counter() - t0
        (out / "compile.json").write_text(json.dumps(results, indent=1))
        (out / "compile.md").write_text(report(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

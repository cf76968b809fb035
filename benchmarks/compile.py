"""Our plans compiled against torch.compile's own activation_memory_budget, both compiled, in one process.

For each model:
- compile@f: `torch.compile` (inductor) with `torch._functorch.config.activation_memory_budget=f`
  (a fraction of saved bytes), and without a budget (`compile`, its default 1.0);
- ours@f: `CompiledPlanner` (optimize(..., compile=True)) at a byte budget equal to compile@f's
  measured peak, so "at no more bytes than compile@0.5" reads directly; besides those, budgets
  half-way between consecutive ones, then half-way points in the widest gaps until `--budgets`
  (default 10), for the monotone check. `--lowerings` (default best) names the lowerings swept:
  best (ours@...), and regions or knapsack alone (regions@..., knapsack@...) to compare frontiers.

Both are measured with the same meter (`measure_compiled_step`: resident parameters, buffers and
inputs + the allocator's peak over one forward + backward after a warm-up step; on CPU the
profiler's allocator events). Time: `--repeats` rounds, each running every contender of a model once,
in an order reversed every round, in one process (machine load hits them alike); median and
interquartile range per contender, and for "ours vs compile@0.5" the median and IQR of the per-round
ratio of the two. Gradients of every contender are compared with those of the compiled step without
a budget.

    python -m benchmarks.compile                                # gpt2, llama (cpu sizes), unet (tiny)
    python -m benchmarks.compile --models llama --update        # re-run one model, merge into the results
    python -m benchmarks.compile --models gpt2 --fractions 0.5 --budgets 2 --lowerings regions,knapsack --out /tmp/c
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch
from ckpt_planner import Planner
from ckpt_planner.compile.compiled import CompiledPlanner, _quartiles, measure_compiled_step
from ckpt_planner.verification import default_loss

from ._io import out_dir, write_files
from .tradeoff_models import MODELS

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


def spread_budgets(peaks: list[int], n: int) -> list[int]:
    """Compile's peaks, the points half-way between them, then half-way points in the widest gaps, until n."""
    peaks = sorted(set(peaks))
    budgets = sorted(set(peaks + [(a + b) // 2 for a, b in zip(peaks, peaks[1:])]))
    while len(budgets) < n and len(budgets) > 1:
        a, b = max(zip(budgets, budgets[1:]), key=lambda g: g[1] - g[0])
        if b - a < 2:
            break
        budgets = sorted(set(budgets + [(a + b) // 2]))
    return budgets


def run_model(name: str, fractions, repeats: int, log, *, n_budgets: int = 10, lowerings=("best",)) -> dict:
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
    out["predicted_eager_baseline_bytes"] = planner.baseline_peak_bytes
    labels = {r["measured_peak_bytes"]: r["name"] for r in reversed(rows)}
    budgets = spread_budgets(list(labels), n_budgets)
    out["compiles_ours"] = 0
    params = list(model.parameters())
    for lowering in lowerings:
        family = "ours" if lowering == "best" else lowering
        cp = CompiledPlanner(planner, lowering=lowering)
        plans = cp.sweep(budgets)
        out["compiles_ours"] += len(cp._tried) + len(cp._knapsack.tries if cp._knapsack else ())
        for b, plan in zip(budgets, plans):
            label = labels.get(b, "between")
            row = {"name": f"{family}@{label}", "family": family, "budget_bytes": b, "at_peak_of": labels.get(b)}
            if plan is None:
                row["infeasible"] = True
                rows.append(row)
                log(f"[{name}] {family} at {b / 1e6:.2f} MB: infeasible")
                continue
            c = plan.stats["compiled"]
            row.update(measured_peak_bytes=plan.measured_peak_bytes, predicted_peak_bytes=plan.predicted_peak_bytes,
                       regions=len(plan.regions), replans=c["replans"], loosened=c["loosened"], tries=c["tries"],
                       lowering=c["lowering"], lowerings=c.get("lowerings"), knapsack=c.get("knapsack"),
                       kept_looser_plan="kept_looser_plan" in plan.stats, module=plan.module, params=params,
                       within_budget=plan.measured_peak_bytes <= b)
            rows.append(row)
            log(f"[{name}] {family} at {b / 1e6:.2f} MB: {plan.measured_peak_bytes / 1e6:.2f} MB measured, "
                f"{c['lowering']} lowering, {len(plan.regions)} regions, {c['replans']} re-plans, {c['loosened']} looser "
                f"({time.perf_counter() - t0:.0f} s)")
    out["ours_plan_s"] = time.perf_counter() - t0
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
    for r in live:
        r["step_times_s"] = []
    for k in range(repeats):  # one round runs every contender once; the order flips every round
        for r in (live if k % 2 == 0 else live[::-1]):
            t = time.perf_counter()
            _step(r["module"], r["params"], inputs)
            r["step_times_s"].append(time.perf_counter() - t)
    for r in live:
        r["step_q1_s"], r["step_s"], r["step_q3_s"] = _quartiles(r["step_times_s"])
        del r["module"], r["params"]
    out["contenders"] = rows
    out["checks"] = checks(rows)
    return out


def checks(rows: list[dict]) -> dict:
    """Monotone peaks, peaks within budgets, and the done-when comparison at compile@0.5, per family of ours."""
    comp = sorted((r for r in rows if r["family"] == "compile" and r["fraction"] is not None),
                  key=lambda r: r["fraction"])
    compile_nonmono = [f"{a['fraction']}->{b['fraction']}: {a['measured_peak_bytes']} > {b['measured_peak_bytes']}"
                       for a, b in zip(comp, comp[1:]) if a["measured_peak_bytes"] > b["measured_peak_bytes"]]
    out: dict = {"compile_non_monotone": compile_nonmono, "families": {}}
    half = next((r for r in comp if r["fraction"] == 0.5), None)
    for family in dict.fromkeys(r["family"] for r in rows if r["family"] != "compile"):
        fam = [r for r in rows if r["family"] == family]
        ours = sorted((r for r in fam if not r.get("infeasible")), key=lambda r: r["budget_bytes"])
        c = {"non_monotone": [f"{a['budget_bytes']}->{b['budget_bytes']}" for a, b in zip(ours, ours[1:])
                              if a["measured_peak_bytes"] > b["measured_peak_bytes"]],
             "over_budget": [r["budget_bytes"] for r in ours if not r["within_budget"]], "budgets": len(fam)}
        mine = next((r for r in ours if r.get("at_peak_of") == "compile@0.5"), None)
        if half and mine:
            ratio = [a / b - 1 for a, b in zip(mine["step_times_s"], half["step_times_s"])]  # same round: paired
            q1, med, q3 = _quartiles(ratio)
            c["at_compile@0.5"] = {"compile_step_s": half["step_s"], "ours_step_s": mine["step_s"],
                                   "ours_vs_compile": med, "ours_vs_compile_iqr": [q1, q3],
                                   "lowering": mine.get("lowering"),
                                   "compile_peak": half["measured_peak_bytes"], "ours_peak": mine["measured_peak_bytes"]}
        out["families"][family] = c
    return out


def report(results: dict) -> str:
    lines = ["# Our compiled plans against torch.compile's activation_memory_budget", "",
             f"Measured {results['date']} by `{results['command']}` (torch {torch.__version__}, "
             f"{torch.get_num_threads()} torch threads on a shared 2-core CPU machine), {results['wall_s'] / 60:.1f} min"
             + (" (models merged from separate runs: each model's own command and date below)" if results.get("merged") else "")
             + ".",
             "", "- Peak: resident parameters, buffers and inputs + the CPU allocator's peak (profiler memory events) "
             "over one forward + backward, after a warm-up step that compiles. Both families compiled with inductor; "
             "ours with fullgraph=True, compile@f as users call it (transformers' forwards log once: a graph break).",
             f"- Time: {results['repeats']} rounds, each running every contender of a model once (order reversed every "
             "round), in one process; median and interquartile range (IQR) per contender (noisy: other jobs share the "
             "2 cores). 'ours vs compile@0.5' is the median (IQR) of the per-round ratio of the two step times.",
             "- ours@compile@f: our plan (`CompiledPlanner.sweep`, lowering best) at a byte budget equal to compile@f's "
             "measured peak; 'between': budgets half-way between those, then half-way points in the widest gaps, "
             f"until {results.get('budgets', 9)} budgets, for the monotone check. Each plan is compiled and measured; "
             "over its budget it is planned again tighter, well under it (5 % of the activation part) looser (at most 2 "
             "tries). Lowering: 'regions' (whole checkpoint regions) or 'knapsack' (our knapsack picks the ops compile's "
             "partitioner may recompute, its byte target searched against the measured peak); 'best' builds both and "
             "keeps the one that fits with the faster step (median over 7 interleaved rounds of the ratio of the two). regions@/knapsack@ rows, where "
             "present, sweep one lowering alone.",
             "- Grad diff: max |grad - grad of compile without a budget| after one step from the same state and seed; "
             "the 'compile' row is compile's own run-to-run difference. GPT-2's config trains with dropout 0.1, so "
             "there a difference can be another dropout mask (the compiled graphs draw their random numbers their "
             "own way), not rounding.",
             f"- activation_memory_budget fractions: {', '.join(map(str, results['fractions']))}."]
    for m in results["models"]:
        lines += ["", f"## {m['title']}", ""]
        if results.get("merged"):
            lines += [f"Measured {m.get('date', '?')} by `{m.get('command', '?')}`.", ""]
        lines += [f"Shapes `{m['shapes']}`, {m['parameters'] / 1e6:.2f} M parameters; "
                  f"compile variants built in {m['compile_s']:.0f} s, our sweep in {m['ours_plan_s']:.0f} s "
                  f"({m['compiles_ours']} compiled plans). Gradients: compiled (no budget) against eager differ by "
                  f"up to {m['compile_vs_eager_max_abs_grad_diff']:.1e} (largest gradient {m['max_abs_grad']:.1e}).", "",
                  "| contender | budget (MB) | measured peak (MB) | within | lowering | step ms: median (IQR) | grad diff | regions | re-plans: tighter / looser |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in m["contenders"]:
            if r.get("infeasible"):
                lines.append(f"| {r['name']} | {r['budget_bytes'] / 1e6:.2f} | infeasible | | | | | | |")
                continue
            budget = r.get("budget_bytes")
            within = "" if budget is None else ("yes" if r["within_budget"] else "**no**")
            name = r["name"] + (" (looser plan kept)" if r.get("kept_looser_plan") else "")
            q1, q3 = r.get("step_q1_s", r["step_s"]), r.get("step_q3_s", r["step_s"])
            lines.append(
                f"| {name} | {'' if budget is None else f'{budget / 1e6:.2f}'} | {r['measured_peak_bytes'] / 1e6:.2f} | "
                f"{within} | {_lowering(r)} | {r['step_s'] * 1e3:.0f} ({q1 * 1e3:.0f}-{q3 * 1e3:.0f}) | "
                f"{r.get('max_abs_grad_diff', 0):.1e} | {r.get('regions', '')} | {_replans(r)} |")
        c = m["checks"]
        lines += ["", f"- compile's peak non-monotone in its budget: {', '.join(c['compile_non_monotone']) or 'no'}"]
        families = c.get("families") or {"ours": {  # results written before lowerings: one family, older keys
            "budgets": c.get("ours_budgets"), "non_monotone": c.get("ours_non_monotone", []),
            "over_budget": c.get("ours_over_budget", [])}}
        for family, f in families.items():
            lines.append(f"- {family} non-monotone over {f['budgets']} budgets: {', '.join(f['non_monotone']) or 'no'}; "
                         f"over budget: {f['over_budget'] or 'none'}")
            if "at_compile@0.5" in f:
                h = f["at_compile@0.5"]
                lines.append(f"- {family} vs compile@0.5: {100 * h['ours_vs_compile']:+.1f} % (IQR "
                             f"{100 * h['ours_vs_compile_iqr'][0]:+.1f} to {100 * h['ours_vs_compile_iqr'][1]:+.1f} %): "
                             f"{h['ours_step_s'] * 1e3:.1f} ms median against {h['compile_step_s'] * 1e3:.1f} ms, "
                             f"{h['lowering']} lowering, at {h['ours_peak'] / 1e6:.2f} MB against compile@0.5's "
                             f"{h['compile_peak'] / 1e6:.2f} MB")
    return "\n".join(lines) + "\n"


def _lowering(r: dict) -> str:
    """The lowering used; for 'best', the other one's median step (ms) or that it did not fit."""
    low = r.get("lowering")
    if not low:
        return ""
    other = {k: v for k, v in (r.get("lowerings") or {}).items() if k != low}
    for k, v in other.items():
        if not v.get("fits"):
            return f"{low} ({k}: over)"
        if "step_s_median" in v:
            return f"{low} ({k}: {v['step_s_median'] * 1e3:.0f} ms)"
    return low


def _replans(r: dict) -> str:
    return f"{r['replans']} / {r['loosened']}" if "replans" in r else ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.compile", description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(SCALES), help=f"comma-separated, of {', '.join(SCALES)}")
    ap.add_argument("--fractions", default=",".join(map(str, FRACTIONS)))
    ap.add_argument("--budgets", type=int, default=10, help="our budgets per model and lowering, at least (default 10)")
    ap.add_argument("--lowerings", default="best", help="comma-separated lowerings to sweep: best, regions, knapsack")
    ap.add_argument("--repeats", type=int, default=9, help="interleaved timing rounds (default 9)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--update", action="store_true", help="merge these models into compile.json in --out (others kept)")
    ap.add_argument("--from-json", action="store_true", help="only re-write compile.md from compile.json in --out")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.from_json:
        write_files(out, {"compile.md": report(json.loads((out / "compile.json").read_text()))})
        return 0
    models = [m for m in args.models.split(",") if m]
    lowerings = [x for x in args.lowerings.split(",") if x]
    bad = [m for m in models if m not in SCALES] + [x for x in lowerings if x not in ("best", "regions", "knapsack")]
    if bad or args.budgets < 2 or args.repeats < 1:
        ap.error(f"unknown model or lowering {bad} (models: {', '.join(SCALES)}; lowerings: best, regions, knapsack), "
                 "or --budgets < 2, or --repeats < 1")
    import torch._dynamo

    torch._dynamo.config.recompile_limit = 64  # one cache entry per compiled variant of the same forward
    fractions = [float(f) for f in args.fractions.split(",") if f]
    t0 = time.perf_counter()
    command = "python -m benchmarks.compile " + " ".join(argv if argv is not None else sys.argv[1:])
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    results = {"date": date, "repeats": args.repeats, "budgets": args.budgets, "command": command,
               "fractions": fractions, "models": []}
    earlier = json.loads((out / "compile.json").read_text()) if args.update and (out / "compile.json").exists() else None
    out_dir(out)
    for name in models:
        m = run_model(name, fractions, args.repeats, lambda s: print(s, file=sys.stderr, flush=True),
                      n_budgets=args.budgets, lowerings=lowerings)
        m.update(name=name, date=date, command=command)
        results["models"].append(m)
        results["wall_s"] = time.perf_counter() - t0
        merged = _merge(earlier, results) if earlier else results
        write_files(out, {"compile.json": json.dumps(merged, indent=1), "compile.md": report(merged)})
    return 0


def _merge(earlier: dict, new: dict) -> dict:
    """Earlier results with the newly run models replaced (by model name) or added, in SCALES order."""
    mine = {m.get("name", m["model"]): m for m in new["models"]}
    kept = [{"date": earlier.get("date"), "command": earlier.get("command"), **m}  # older runs: the run's own
            for m in earlier["models"] if m.get("name", m["model"]) not in mine]
    models = sorted(kept + list(mine.values()), key=lambda m: list(SCALES).index(m.get("name", m["model"]))
                    if m.get("name", m["model"]) in SCALES else len(SCALES))
    return {**new, "models": models, "merged": bool(kept),
            "wall_s": new["wall_s"] + (earlier.get("wall_s", 0) if kept else 0)}


if __name__ == "__main__":
    raise SystemExit(main())

"""Solve time and optimality gap of every solver on synthetic chains and layered DAGs.

    python -m benchmarks.solvers_bench [problem.json ...] [--quick]

Budgets are 30 / 50 / 70 % of the activation memory of the step without
checkpointing (peak minus fixed bytes) plus the fixed bytes. The gap of a
solver is its recompute time over the best recompute time that `dp` or `ilp`
reached on the same case, minus one. Besides the synthetic problems, two captured
graphs (unless --no-captured): a GPT-2-small-shaped model (12 layers, hidden 768,
batch 4, seq 512) and a ResNet-50-shaped CNN (transformers' ResNet-50 config,
batch 8 at 224x224), built on the meta device and profiled on fake tensors
(exact bytes, FLOP-based times). Extra problems (Problem.to_dict JSON) are given
on the command line.
Writes benchmarks/results/solvers.json and benchmarks/results/solvers.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

from ckpt_planner.solvers import InfeasibleBudgetError, Node, Problem, Storage, simulate, solve

from ._io import write_files

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MB = 2**20
FRACTIONS = (0.3, 0.5, 0.7)
SOLVERS = {
    "uniform": {},
    "greedy": {},
    "dp": {},
    "ilp": {"backend": "cbc", "time_limit": 10.0, "gap": 0.01, "max_retries": 1},
}


def synthetic_chain(n: int, seed: int = 0) -> Problem:
    """A chain of n stages: each keeps an internal activation and hands an output to the next."""
    rng = random.Random(seed)
    nodes, storages = [], []
    for i in range(n):
        out = rng.randint(4, 16) * MB
        inner = rng.randint(0, 24) * MB
        storages.append(Storage(producer=i, nbytes=out, last_use=min(i + 1, n - 1), saved_by=(min(i + 1, n - 1),)))
        storages.append(Storage(producer=i, nbytes=inner, last_use=i, saved_by=(i,)))
        nodes.append(
            Node(
                name=f"stage{i}",
                time=(out + inner) / MB * 1e-5 * rng.uniform(0.5, 2.0),  # seconds
                temp_bytes=rng.randint(0, 8) * MB,
                grad_bytes=out,
                param_grad_bytes=rng.randint(0, 2) * MB,
                inputs=(i - 1,) if i else (),
                reads=(2 * (i - 1),) if i else (),
            )
        )
    return Problem(nodes=tuple(nodes), storages=tuple(storages), param_bytes=n * MB, name=f"chain{n}")


def layered_dag(n: int, seed: int = 0, width: int = 4) -> Problem:
    """Layers of `width` nodes reading the previous layer, with skip connections two to five layers back."""
    rng = random.Random(seed)
    nodes, storages, readers = [], [], []
    layer_of: list[int] = []
    for i in range(n):
        layer = i // width
        prev = [j for j in range(max(0, (layer - 1) * width), layer * width)]
        inputs = set(rng.sample(prev, min(len(prev), rng.randint(1, 2)))) if prev else set()
        if layer >= 2 and rng.random() < 0.15:
            back = max(0, layer - rng.randint(2, 5)) * width
            inputs.add(rng.randrange(back, back + width))
        inputs = tuple(sorted(inputs))
        storages.append({"producer": i, "nbytes": rng.randint(1, 16) * MB})
        readers.append([])
        for j in inputs:
            readers[j].append(i)
        nodes.append(
            dict(
                name=f"n{i}",
                time=rng.uniform(0.2, 2.0) * 1e-4,
                temp_bytes=rng.randint(0, 4) * MB,
                grad_bytes=storages[i]["nbytes"],
                param_grad_bytes=rng.choice([0, MB]),
                inputs=inputs,
                reads=inputs,
                recomputable=rng.random() > 0.01,
            )
        )
        layer_of.append(layer)
    final = []
    for i, st in enumerate(storages):
        users = readers[i]
        saved = tuple(sorted({k for k in users if rng.random() < 0.7} | ({i} if rng.random() < 0.3 else set())))
        final.append(
            Storage(
                producer=i,
                nbytes=st["nbytes"],
                last_use=max([i, *users]),
                saved_by=saved,
                is_output=i == n - 1,
            )
        )
    return Problem(
        nodes=tuple(Node(**d) for d in nodes), storages=tuple(final), param_bytes=n * MB // 2, name=f"dag{n}"
    )


def run_case(problem: Problem, solvers: dict) -> list[dict]:
    base = simulate(problem, ()).peak_bytes
    activation = base - problem.fixed_bytes
    rows = []
    for frac in FRACTIONS:
        budget = problem.fixed_bytes + int(frac * activation)
        case = []
        for name, options in solvers.items():
            t0 = time.perf_counter()
            try:
                sol = solve(problem, budget, solver=name, **options)
                row = {
                    "fits": True,
                    "recompute_s": sol.recompute_time,
                    "overhead": sol.recompute_time / max(problem.total_time, 1e-12),
                    "peak_bytes": sol.peak_bytes,
                    "stats": {
                        k: v for k, v in sol.stats.items() if isinstance(v, (int, float, str, bool)) or v is None
                    },
                }
            except InfeasibleBudgetError as err:
                row = {"fits": False, "smallest_bytes": err.smallest_bytes}
            row.update(
                problem=problem.name,
                nodes=problem.n,
                budget_frac=frac,
                budget_bytes=budget,
                solver=name,
                solve_s=time.perf_counter() - t0,
            )
            case.append(row)
            print(f"{problem.name:>10} {frac:.0%} {name:>8} {row['solve_s']:7.2f}s fits={row['fits']}", flush=True)
        best = [r["recompute_s"] for r in case if r["fits"] and r["solver"] in ("dp", "ilp")]
        for r in case:
            if r["fits"] and best:
                r["gap_vs_best"] = (
                    r["recompute_s"] / min(best) - 1 if min(best) > 0 else (0.0 if r["recompute_s"] == 0 else None)
                )
        rows += case
    return rows


def machine_load() -> dict:
    """CPU count and 1-minute load average: solve times on a shared machine scale with the load."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {"cpus": os.cpu_count(), "load_avg_1min": None if load is None else round(load, 2)}


def markdown(rows: list[dict], machine: dict | None = None) -> str:
    lines = [
        "# Solver benchmark",
        "",
        "Budget = fixed + fraction x activation memory of the no-checkpoint step. Gap: recompute time over the",
        "best of dp / ilp on the same case, minus one. `-`: the solver found no plan within the budget.",
        "Solve s: wall-clock of `solvers.solve`, which re-simulates the returned plan (included).",
        "",
        "| problem | nodes | budget | solver | solve s | fits | recompute overhead | gap vs best |",
        "|---|---:|---:|---|---:|---|---:|---:|",
    ]
    for r in rows:
        gap = r.get("gap_vs_best")
        lines.append(
            f"| {r['problem']} | {r['nodes']} | {r['budget_frac']:.0%} | {r['solver']} | {r['solve_s']:.2f} | "
            f"{'yes' if r['fits'] else 'no'} | {r['overhead'] * 100:.1f} % | "
            f"{'-' if gap is None else f'{gap * 100:.2f} %'} |"
            if r["fits"]
            else f"| {r['problem']} | {r['nodes']} | {r['budget_frac']:.0%} | {r['solver']} | {r['solve_s']:.2f} | no | - | - |"
        )
    if machine:
        lines += [
            "",
            f"Machine: {machine['cpus']} CPUs; 1-minute load average {machine['start']['load_avg_1min']} at the start, "
            f"{machine['end']['load_avg_1min']} at the end (other jobs share the CPUs: compare times within a run).",
        ]
    return "\n".join(lines) + "\n"


def captured_problems() -> list[Problem]:
    """GPT-2-small and ResNet-50 shapes, captured and profiled in meta mode (no weights allocated)."""
    import warnings

    import torch
    from ckpt_planner.capture.trace import capture
    from ckpt_planner.profile.profiler import ProfileConfig, profile
    from transformers import GPT2Config, GPT2LMHeadModel, ResNetConfig, ResNetForImageClassification

    cases = []
    with torch.device("meta"):
        gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=12, n_embd=768, n_head=12, use_cache=False))
        ids = torch.zeros(4, 512, dtype=torch.long)
        cases.append(("gpt2-small", gpt2, {"input_ids": ids, "labels": ids}))
        resnet = ResNetForImageClassification(ResNetConfig())  # the ResNet-50 layout: bottlenecks 3-4-6-3
        images = torch.zeros(8, 3, 224, 224)
        cases.append(("resnet50", resnet, {"pixel_values": images, "labels": torch.zeros(8, dtype=torch.long)}))
    out = []
    for name, model, inputs in cases:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out.append(profile(capture(model, inputs), ProfileConfig(meta=True)).to_problem(name=name))
    return out


def uniform_comparison(rows: list[dict]) -> list[str]:
    """Lines: dp's and ilp's recompute time against uniform's at each budget of the captured graphs."""
    lines = []
    by = {(r["problem"], r["budget_frac"], r["solver"]): r for r in rows}
    for name in ("gpt2-small", "resnet50"):
        for frac in FRACTIONS:
            u = by.get((name, frac, "uniform"))
            parts = []
            for solver in ("dp", "ilp"):
                r = by.get((name, frac, solver))
                if r and r["fits"] and u and u["fits"] and u["overhead"] > 0:
                    less = (1 - r["overhead"] / u["overhead"]) * 100
                    parts.append(f"{solver} {abs(less):.0f} % {'less' if less >= 0 else 'more'}")
                elif r and r["fits"]:
                    parts.append(f"{solver} fits where uniform does not" if u and not u["fits"] else f"{solver} -")
                else:
                    parts.append(f"{solver}: no plan")
            if u is not None:
                lines.append(f"- {name} at {frac:.0%}: recompute against uniform's: " + ", ".join(parts))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.solvers_bench", description=__doc__.splitlines()[0])
    parser.add_argument("problems", nargs="*", help="extra Problem JSON files (Problem.to_dict format)")
    parser.add_argument("--quick", action="store_true", help="small sizes only")
    parser.add_argument("--no-captured", action="store_true", help="skip the captured GPT-2 and ResNet graphs")
    args = parser.parse_args(argv)
    chains = (100, 1000) if args.quick else (100, 1000, 10000)
    dags = (100, 500) if args.quick else (100, 500, 1000, 2000)
    problems = [synthetic_chain(n) for n in chains] + [layered_dag(n) for n in dags]
    if not args.no_captured:
        problems += captured_problems()
    for path in args.problems:
        problems.append(Problem.from_dict(json.loads(Path(path).read_text())))
    rows = []
    t0 = time.perf_counter()
    start = machine_load()
    for problem in problems:
        rows += run_case(problem, SOLVERS)
    machine = {"cpus": start["cpus"], "start": start, "end": machine_load()}
    solvers_json = json.dumps(
        {"total_s": time.perf_counter() - t0, "machine": machine, "solver_options": SOLVERS, "rows": rows}, indent=1
    )
    text = markdown(rows, machine)
    versus = uniform_comparison(rows)
    if versus:
        text += "\nOn the captured graphs (target: dp/ilp recompute at least 30 % below uniform's):\n\n" + "\n".join(versus) + "\n"
    write_files(RESULTS, {"solvers.json": solvers_json, "solvers.md": text})
    print(f"wrote {RESULTS / 'solvers.json'} and {RESULTS / 'solvers.md'} in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

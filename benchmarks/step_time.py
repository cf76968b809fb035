"""The step-time model against the measured step, on the conformance matrix's held-out architectures.

For each held-out model at the matrix's `below` path (fp32, activation_budget=0.5, or the smallest budget a
refusal names), the plan is the matrix's own: FLOP-based times, no autotune race, so it is the same plan on
every run. Its overhead (plan's step / plain step - 1) is then predicted twice (three times with --bounded):
  flop     the plan's own figure, on the FLOP-based times it was planned with;
  default  the same regions and kept ops simulated on the profile a user gets by default (`Planner(model,
           inputs)`: node times measured on one torch thread, the eager and captured steps timed, node
           times and a cost per region calibrated on two checkpointed steps, the per-block one and the same
           blocks cut in two, checkpoint call and hook costs measured), as the Plan computes it:
           (base_step_s + recompute_s) / (base_step_s - graph_overhead_s) - 1;
  bounded  the same on the profile optimize() builds at the plan's budget, where the plain step does not fit:
           stage by stage (profile/stagewise.py), the eager step as the plain graph's forward under no_grad
           and the stages' measured backwards, calibrated on the same two checkpointed steps;
and measured: the plain model, the captured graph with no region, and the plan's module, interleaved, the
median of `--repeats` rounds after one warm-up round, in process CPU time (as the matrix measures it) and in
wall time. The graph alone splits the measured overhead into the graph's own share and the checkpointing's;
the default profile's prediction is split the same way, and its checkpointing share per region into
recompute and call/hook cost, so a miss says where it is.

Each model runs in a forked process of its own with one torch thread and a fresh, empty timing store (the
default profile as a first run on the machine sees it; --store keeps the machine's own).

    python -m benchmarks.step_time                        # every held-out model (under 10 minutes when quiet)
    python -m benchmarks.step_time --models tv_vgg,albert --out /tmp/st
    python -m benchmarks.step_time --bounded              # and the stage-wise profile (5-6 minutes, 2 cores)

Writes benchmarks/results/step_time.json and step_time.md.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported: every model forks from this process

import argparse  # noqa: E402
import contextlib  # noqa: E402
import multiprocessing  # noqa: E402
import platform  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from ._io import write_files  # noqa: E402
from .conformance_models import FAMILY, HELD_OUT, MODELS, build  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FRACTION = 0.5  # the matrix's `below` path
REPEATS = 7  # measured rounds per model (after one warm-up round)
TIMEOUT_S = 480  # mobilevit (21 regions, each measured alone) took 219 s at a load of 8 on 2 cores
WITHIN = 1.5  # the bar: predicted / measured within [1/1.5, 1.5]
PREDICTIONS = ("flop", "default", "bounded")  # bounded: only with --bounded
SMALL = 0.05  # a measured overhead below this is noise for a ratio (conformance_report.overhead_stats)


def _flops():
    from ckpt_planner.profile.profiler import ProfileConfig

    return ProfileConfig(warmup=0, repeats=1, flop_times=True)


def matrix_plan(model, inputs):
    """The matrix's `below` plan: (plan, the refusal's line or None, seconds)."""
    from ckpt_planner import optimize
    from ckpt_planner.errors import InfeasibleBudgetError

    t0 = time.perf_counter()
    try:
        plan = optimize(model, inputs, profile_config=_flops(), autotune=False, activation_budget=FRACTION)
        refusal = None
    except InfeasibleBudgetError as e:  # the matrix plans again at the smallest budget named
        refusal = f"{type(e).__name__}: {e}"
        plan = optimize(model, inputs, profile_config=_flops(), autotune=False, budget_bytes=e.smallest_bytes)
    return plan, refusal, time.perf_counter() - t0


def plan_on(problem, names: list[str], plan) -> tuple[list[tuple[int, int]], list[int]]:
    """The plan's regions and kept ops as positions in another profile of the same graph, found by node name;
    a region whose first or last node is not there, or spans another number of nodes, is an error."""
    index = {n: i for i, n in enumerate(names)}
    spans, saved = [], []
    for r in plan.regions:
        s, e = index.get(r.first_node), index.get(r.last_node)
        if s is None or e is None or e - s != r.end - r.start:
            raise LookupError(f"region {r.first_node}..{r.last_node} ({r.start}..{r.end}) is not in the default "
                              f"profile's graph (found {s}..{e})")
        spans.append((s, e))
        for op in r.saved_ops:
            if op not in index:
                raise LookupError(f"kept op {op} is not in the default profile's graph")
            saved.append(index[op])
    return spans, sorted(set(saved))


def predicted(problem, spans, saved) -> dict:
    """The step-time model's overhead for a plan on `problem`, as Plan computes it, and its parts (each over
    the eager step): the captured graph's own overhead, the recompute, the checkpoint calls and policy
    dispatch, the saved-tensor hooks; per region its own recompute and call/hook seconds."""
    from ckpt_planner.solvers.simulate import simulate

    sim = simulate(problem, spans, saved=saved)
    eager = problem.base_step_s - problem.graph_overhead_s
    regions = []
    for s, e in spans:
        own = simulate(problem, [(s, e)], saved=[i for i in saved if s <= i <= e])
        regions.append({"span": [s, e], "nodes": e - s + 1, "recompute_s": own.recompute_time - own.call_time
                        - own.hook_time, "call_s": own.call_time, "hook_s": own.hook_time})
    return {
        "overhead": (problem.base_step_s + sim.recompute_time) / eager - 1.0 if eager > 0 else None,
        "eager_step_s": eager, "graph": problem.graph_overhead_s / eager if eager > 0 else None,
        "recompute": (sim.recompute_time - sim.call_time - sim.hook_time) / eager if eager > 0 else None,
        "calls": sim.call_time / eager if eager > 0 else None,
        "hooks": sim.hook_time / eager if eager > 0 else None,
        "regions": regions,
    }


def measure(model, modules: dict, inputs, repeats: int = REPEATS) -> dict:
    """Each of `modules` (name -> module taking the model's inputs) against the plain model, one training step
    each in turn, `repeats` rounds after one warm-up round: the median step in process CPU time and in wall
    time (seconds), and each module's overhead over the model's on both clocks."""
    from ckpt_planner.capture.trace import normalize_inputs
    from ckpt_planner.model_state import ModelState
    from ckpt_planner.verification import default_loss

    args, kwargs = normalize_inputs(inputs, model)
    params = list(model.parameters())
    runs = {"model": model, **modules}
    cpu: dict[str, list[float]] = {k: [] for k in runs}
    wall: dict[str, list[float]] = {k: [] for k in runs}
    with ModelState(model).preserved():
        for i in range(repeats + 1):
            for name, m in runs.items():
                for p in params:
                    p.grad = None
                c0, w0 = time.process_time(), time.perf_counter()
                default_loss(m(*args, **kwargs)).backward()
                c1, w1 = time.process_time(), time.perf_counter()
                if i:
                    cpu[name].append(c1 - c0)
                    wall[name].append(w1 - w0)
    for p in params:
        p.grad = None
    out = {"cpu_s": {k: statistics.median(v) for k, v in cpu.items()},
           "wall_s": {k: statistics.median(v) for k, v in wall.items()}}
    for clock in ("cpu", "wall"):
        base = out[f"{clock}_s"]["model"]
        out[clock] = {k: v / max(1e-9, base) - 1.0 for k, v in out[f"{clock}_s"].items() if k != "model"}
    return out


def ratio(pred: float | None, meas: float | None) -> float | None:
    if pred is None or meas is None or meas < SMALL:
        return None
    return pred / meas


def run_model(name: str, repeats: int = REPEATS, per_region: bool = True, bounded: bool = False) -> dict:
    """One held-out model, in this process: its row."""
    from ckpt_planner.api import Planner
    from ckpt_planner.lower.rewrite import rewrite
    from ckpt_planner.profile.profiler import ProfileConfig

    torch.set_num_threads(1)
    model, inputs = build(name)
    plan, refusal, plan_s = matrix_plan(model, inputs)
    t0 = time.perf_counter()
    planner = Planner(model, inputs, profile_config=ProfileConfig())  # the default profile, named: always measured
    profile_s = time.perf_counter() - t0
    problem, cost = planner.problem, planner.cost
    spans, saved = plan_on(problem, [n.name for n in cost.nodes], plan)
    default = predicted(problem, spans, saved)
    eager = default["eager_step_s"]
    extra = (default["overhead"] - default["graph"]) * eager if default["overhead"] is not None else None
    gm = planner.capture.graph_module
    modules = {"graph": rewrite(gm, (), model=model), "plan": plan.module}  # the graph every plan runs, no region
    if per_region:  # each region alone on the graph: what it costs the step by itself
        for k, (s, e) in enumerate(spans):
            modules[f"region{k}"] = rewrite(gm, [(s, e)], model=model, saved=[i for i in saved if s <= i <= e])
    m = measure(model, modules, inputs, repeats)
    eager_cpu, eager_wall = m["cpu_s"]["model"], m["wall_s"]["model"]
    for k, r in enumerate(default["regions"]):
        if f"region{k}" in m["cpu_s"]:
            r["measured_cpu_s"] = m["cpu_s"][f"region{k}"] - m["cpu_s"]["graph"]
            r["measured_wall_s"] = m["wall_s"][f"region{k}"] - m["wall_s"]["graph"]
    row = {
        "model": name, "family": FAMILY[name], "regions": len(plan.regions), "kept_ops": len(saved),
        "budget_bytes": plan.budget_bytes, "refusal": refusal, "plan_s": plan_s, "profile_s": profile_s,
        "time_source": cost.time_source, "recompute_scale": cost.recompute_scale,
        "costs": {"region_overhead_s": problem.region_overhead_s, "saved_overhead_s": problem.saved_overhead_s,
                  "op_overhead_s": problem.op_overhead_s, "step_time_s": problem.step_time_s,
                  "graph_overhead_s": problem.graph_overhead_s},
        "flop": plan.predicted_overhead, "default": default["overhead"], "default_parts": default,
        "measured_cpu": m["cpu"]["plan"], "measured_wall": m["wall"]["plan"],
        "measured_graph_cpu": m["cpu"]["graph"], "measured_graph_wall": m["wall"]["graph"],
        "step_cpu_s": {k: m["cpu_s"][k] for k in ("model", "graph", "plan")},
        "step_wall_s": {k: m["wall_s"][k] for k in ("model", "graph", "plan")},
        # seconds, not ratios: the extra the plan's checkpointing adds over the graph's step, and the eager step
        "extra_s": {"default": extra, "cpu": m["cpu_s"]["plan"] - m["cpu_s"]["graph"],
                    "wall": m["wall_s"]["plan"] - m["wall_s"]["graph"]},
        "eager_s": {"default": default["eager_step_s"], "cpu": eager_cpu, "wall": eager_wall},
    }
    if bounded:  # the profile optimize() builds at this budget: stage by stage, no whole step timed
        at = Planner(model, inputs, profile_config=ProfileConfig(), feasible_for={"budget_bytes": plan.budget_bytes})
        parts = predicted(at.problem, *plan_on(at.problem, [n.name for n in at.cost.nodes], plan))
        row["bounded"], row["bounded_stages"], row["bounded_scale"] = parts["overhead"], len(at.cost.stages), \
            at.cost.recompute_scale
        row["bounded_parts"] = {k: v for k, v in parts.items() if k != "regions"}
        if parts["overhead"] is not None:
            row["extra_s"]["bounded"] = (parts["overhead"] - parts["graph"]) * parts["eager_step_s"]
        row["eager_s"]["bounded"] = parts["eager_step_s"]
    for model_name in PREDICTIONS:
        for clock in ("cpu", "wall"):
            row[f"{model_name}_over_{clock}"] = ratio(row.get(model_name), row[f"measured_{clock}"])
    return row


def _child(name: str, repeats: int, store: str | None, bounded: bool, conn) -> None:
    os.setsid()
    try:
        warnings.simplefilter("ignore")
        with contextlib.suppress(ImportError):
            import transformers

            transformers.logging.set_verbosity_error()
        with tempfile.TemporaryDirectory() as fresh:
            os.environ["CKPT_PLANNER_TIMINGS"] = store or fresh  # profile/timing_store.py STORE_ENV
            t0 = time.perf_counter()
            row = run_model(name, repeats, bounded=bounded)
            row["model_s"] = time.perf_counter() - t0
    except BaseException as e:  # noqa: BLE001 - a model that fails is a row that says so
        where = traceback.extract_tb(e.__traceback__)[-1]
        row = {"model": name, "family": FAMILY[name], "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}",
               "raised_at": f"{Path(where.filename).name}:{where.lineno}"}
    conn.send(row)
    conn.close()


def run_one(name: str, repeats: int, timeout: float, store: str | None, bounded: bool = False) -> dict:
    """`run_model` in a forked process of its own (a crash or a hang ends only it)."""
    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(name, repeats, store, bounded, send))
    proc.start()
    send.close()
    row = None
    if recv.poll(timeout):
        with contextlib.suppress(EOFError):
            row = recv.recv()
    if row is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        row = {"model": name, "family": FAMILY[name],
               "error": f"timed out after {timeout:.0f} s" if proc.is_alive() else f"crashed (exit {proc.exitcode})"}
    proc.join()
    return row


def summary(rows: list[dict]) -> dict:
    """Per prediction and clock: how many plans measured at least SMALL over the plain step, how many of those
    the prediction is within WITHIN of, and the median predicted / measured."""
    out = {}
    for model_name in PREDICTIONS:
        for clock in ("cpu", "wall"):
            ratios = sorted(r[f"{model_name}_over_{clock}"] for r in rows
                            if r.get(f"{model_name}_over_{clock}") is not None)
            out[f"{model_name}_{clock}"] = {
                "measured": len(ratios), "within": sum(1 / WITHIN <= x <= WITHIN for x in ratios),
                "median_ratio": statistics.median(ratios) if ratios else None}
    out["region_fit"] = region_fit(rows)
    return out


def region_fit(rows: list[dict]) -> dict | None:
    """Least squares over every region measured alone (seconds, CPU): measured = a * predicted recompute
    + b * predicted calls and hooks + c. A perfect model reads a = b = 1, c = 0; c is what one region costs the
    step that no per-node time or per-call figure of the model charges."""
    import numpy as np

    pts = [(g["recompute_s"], g["call_s"] + g["hook_s"], g["measured_cpu_s"]) for r in rows
           for g in r.get("default_parts", {}).get("regions", ()) if "measured_cpu_s" in g]
    if len(pts) < 4:
        return None
    a = np.array(pts)
    (rc, calls, fixed), *_ = np.linalg.lstsq(np.c_[a[:, :2], np.ones(len(a))], a[:, 2], rcond=None)
    return {"regions": len(pts), "recompute": float(rc), "calls_hooks": float(calls), "per_region_s": float(fixed)}


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.0f}%"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1e3 * x:.2f}"


def _x(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def markdown(rows: list[dict], meta: dict) -> str:
    s = meta["summary"]
    lines = [
        "# The step-time model against the measured step (held-out models)", "",
        f"torch {meta['torch']}, CPU, {meta['platform']}, one torch thread; started {meta['started']}, "
        f"{meta['seconds']:.0f} s, commit {meta['commit']}. Load average (1 min) {meta['load_start']:.2f} at the "
        f"start, {meta['load_end']:.2f} at the end, on {os.cpu_count()} CPUs. Generated by `python -m "
        "benchmarks.step_time` (what each figure is: its docstring). The plan is the conformance matrix's "
        "`below` plan (FLOP-based times; activation_budget=0.5 or the smallest budget named). Overheads are the "
        f"plan's step over the plain model's, median of {meta['repeats']} interleaved rounds; `graph` is the "
        "captured graph with no region. Ratios are predicted / measured, where the measured overhead is at least "
        f"{100 * SMALL:.0f} %.", "",
        "| model | regions | FLOP pred | default pred | measured CPU | measured wall | FLOP/CPU | default/CPU "
        "| default/wall | graph pred | graph CPU | ckpt pred | ckpt CPU | calls+hooks pred |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | error: {r['error']} |" + " |" * 12)
            continue
        d = r["default_parts"]
        ckpt_pred = None if d["overhead"] is None else d["overhead"] - d["graph"]
        lines.append(
            f"| {r['model']} | {r['regions']} | {_pct(r['flop'])} | {_pct(r['default'])} | {_pct(r['measured_cpu'])} "
            f"| {_pct(r['measured_wall'])} | {_x(r['flop_over_cpu'])} | {_x(r['default_over_cpu'])} "
            f"| {_x(r['default_over_wall'])} | {_pct(d['graph'])} | {_pct(r['measured_graph_cpu'])} "
            f"| {_pct(ckpt_pred)} | {_pct(r['measured_cpu'] - r['measured_graph_cpu'])} "
            f"| {_pct((d['calls'] or 0) + (d['hooks'] or 0))} |")
    lines += [
        "", "In milliseconds: the eager step and the extra the plan's regions add over the captured graph's step, as "
        "the default profile predicts them and as measured (CPU, wall); the calibration's factor on node times; "
        "and each region alone on the graph, summed: predicted recompute, predicted calls and hooks, measured "
        "(CPU). A region alone also pays what any checkpointed step pays once, so that sum exceeds the plan's "
        "extra where the model leaves something out.", "",
        "| model | eager pred | eager CPU | eager wall | extra pred | extra CPU | extra wall | scale "
        "| alone: recompute pred | calls+hooks pred | measured CPU |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            continue
        e, x, regs = r["eager_s"], r["extra_s"], r["default_parts"]["regions"]
        alone = sum(g.get("measured_cpu_s", 0.0) for g in regs)
        lines.append(
            f"| {r['model']} | {_ms(e['default'])} | {_ms(e['cpu'])} | {_ms(e['wall'])} | {_ms(x['default'])} "
            f"| {_ms(x['cpu'])} | {_ms(x['wall'])} | {r['recompute_scale']:.2f} "
            f"| {_ms(sum(g['recompute_s'] for g in regs))} | {_ms(sum(g['call_s'] + g['hook_s'] for g in regs))} "
            f"| {_ms(alone)} |")
    lines.append("")
    for key, what in (("flop_cpu", "FLOP prediction, CPU time"), ("default_cpu", "default profile, CPU time"),
                      ("bounded_cpu", "stage-wise default profile, CPU time"),
                      ("flop_wall", "FLOP prediction, wall time"), ("default_wall", "default profile, wall time"),
                      ("bounded_wall", "stage-wise default profile, wall time")):
        c = s[key]
        if not c["measured"] and key.startswith("bounded"):
            continue
        lines.append(f"- {what}: within {WITHIN}x on {c['within']} of {c['measured']} (median predicted/measured "
                     f"{_x(c['median_ratio'])}).")
    fit = s.get("region_fit")
    if fit:
        lines.append(f"- Each region alone ({fit['regions']} regions, CPU time), least squares: measured = "
                     f"{fit['recompute']:.2f} x predicted recompute + {fit['calls_hooks']:.2f} x predicted calls and "
                     f"hooks + {1e3 * fit['per_region_s']:.2f} ms.")
    staged = [r for r in rows if r.get("bounded") is not None]
    if staged:
        lines += ["", "The stage-wise profile optimize() builds at the plan's budget (the plain step does not fit it: node "
                  "times from each stage's own step, the eager step as the plain graph's forward under no_grad and "
                  "each stage's measured backward, calibrated on two checkpointed steps; no plain step timed), "
                  "predicted overhead, "
                  "predicted / measured CPU, and its eager step and extra (ms) and node-time factor: "
                  + ", ".join(f"{r['model']} {_pct(r['bounded'])} ({_x(r['bounded_over_cpu'])}; eager "
                              f"{_ms(r['eager_s'].get('bounded'))}, extra {_ms(r['extra_s'].get('bounded'))}, "
                              f"x{r.get('bounded_scale', 1.0):.2f})" for r in staged) + "."]
    errors = [r for r in rows if "error" in r]
    if errors:
        lines += ["", f"{len(errors)} model(s) gave no figures: " + "; ".join(f"{r['model']}: {r['error']}"
                                                                             for r in errors) + "."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.step_time", description=__doc__.splitlines()[0])
    held = [n for n in MODELS if n in HELD_OUT]
    parser.add_argument("--models", default=None, help=f"comma-separated (default: the held-out {','.join(held)})")
    parser.add_argument("--repeats", type=int, default=REPEATS, help=f"measured rounds (default {REPEATS})")
    parser.add_argument("--timeout", type=float, default=TIMEOUT_S, help=f"seconds per model (default {TIMEOUT_S})")
    parser.add_argument("--store", default=None, help="a timing store folder to use (default: a fresh one per model)")
    parser.add_argument("--bounded", action="store_true",
                        help="also the prediction of the stage-wise profile optimize() builds at the plan's budget")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="output folder")
    args = parser.parse_args(argv)
    names = args.models.split(",") if args.models else held
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        parser.error(f"unknown model: {', '.join(unknown)}")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    meta = {"torch": torch.__version__, "platform": platform.platform(terse=True), "commit": head.stdout.strip(),
            "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_start": os.getloadavg()[0],
            "repeats": args.repeats, "fraction": FRACTION, "fresh_store": args.store is None}
    warnings.simplefilter("ignore")
    import ckpt_planner.api  # noqa: F401 - imported once here, not again in every forked model

    t0 = time.perf_counter()
    rows = []
    for name in names:
        row = run_one(name, args.repeats, args.timeout, args.store, args.bounded)
        rows.append(row)
        print(f"{name:16s} " + (row["error"] if "error" in row else
              f"flop {_pct(row['flop'])} default {_pct(row['default'])} cpu {_pct(row['measured_cpu'])} "
              f"wall {_pct(row['measured_wall'])} ({row['model_s']:.0f} s)"), flush=True)
    meta.update(seconds=time.perf_counter() - t0, load_end=os.getloadavg()[0], summary=summary(rows))
    import json

    write_files(args.out, {"step_time.json": json.dumps({"meta": meta, "rows": rows}, indent=1, default=str),
                           "step_time.md": markdown(rows, meta)})
    print(markdown(rows, meta))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

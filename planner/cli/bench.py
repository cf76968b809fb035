"""Side-by-side measurement of plans: step times, measured memory timelines and the bench file.

`bench` plans, verifies, times and traces one training step per solver on a
`planner.api.Planner`; `ckpt-planner bench` writes its result, and
`ckpt-planner report --bench` plots the measured timelines beside the predicted ones, reading the file
back with `load_bench_file`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..plan_schema import write_file
from .cli_args import EXIT_FAIL, EXIT_OK
from .outputs import bar_stage, command_output, err, note, out, progress_bar, say
from .report import _fmt_bytes, fits_text
from .report_data import _downsample

__all__ = ["measure_timeline", "step_times", "bench", "bench_table", "load_bench_file", "planner_for", "cmd_bench"]


def measure_timeline(
    module: torch.nn.Module,
    args: tuple,
    kwargs: dict,
    loss_fn: Callable[[Any], torch.Tensor],
    state: list[torch.Tensor],
) -> dict[str, Any]:
    """Measured live bytes after every op of one forward + backward (CPU: live storages; CUDA: allocated)."""
    from torch.utils import _pytree as pytree

    from ..profile.memory import LiveMemory

    inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    cuda = any(t.device.type == "cuda" for t in state + inputs)
    values: list[int] = []
    labels: list[str] = []
    phase = ["forward"]

    class Trace(LiveMemory):
        """One sample per op: the most bytes live at any moment of it (not only after it), so the
        series' maximum is the step's true peak."""

        window = 0  # bytes: the highest count since the last sample

        def _add(self, st: torch.UntypedStorage) -> None:
            super()._add(st)
            self.window = max(self.window, self.current)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.window = self.current
            out = super().__torch_dispatch__(func, types, args, kwargs)
            values.append(torch.cuda.max_memory_allocated() if cuda else max(self.window, self.current))
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            labels.append(phase[0])
            return out

    for p in state:
        if isinstance(p, torch.nn.Parameter):
            p.grad = None
    mem = Trace()
    mem.track(state, inputs)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    with mem:
        out = module(*args, **kwargs)  # held through the backward, as in verify and in the prediction
        loss = loss_fn(out)
        phase[0] = "backward"
        loss.backward()
        del out, loss
    for p in state:
        if isinstance(p, torch.nn.Parameter):
            p.grad = None
    peak = max(values + ([] if cuda else [mem.peak])) if values else mem.peak
    values, labels = _downsample(values, labels)  # keeps each bucket's maximum: the peak stays
    return {
        "bytes": values,
        "phase": labels,
        "peak_bytes": peak,
        "source": "cuda allocated" if cuda else "live storages",
    }


def step_times(
    model: torch.nn.Module,
    modules: torch.nn.Module | Sequence[torch.nn.Module],
    args: tuple,
    kwargs: dict,
    loss_fn: Callable,
    repeats: int = 3,
) -> tuple[float, Any]:
    """Median seconds of one forward + backward of `model` and of each of `modules`, in interleaved rounds
    (after one warm-up each): (model's, module's) for one module, (model's, [each module's]) for a list.
    A module that is the model itself is not timed twice: its figure is the model's."""
    from ..model_state import ModelState

    single = isinstance(modules, torch.nn.Module)
    mods = [modules] if single else list(modules)
    params = list(model.parameters())
    cuda = any(p.is_cuda for p in params)

    def once(m: torch.nn.Module) -> float:
        for p in params:
            p.grad = None
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss_fn(m(*args, **kwargs)).backward()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    timed = [m for m in mods if m is not model]
    with ModelState(model).preserved():
        model.train()
        for m in timed:
            m.train()
        once(model)
        for m in timed:
            once(m)
        rounds = [(once(model), [once(m) for m in timed]) for _ in range(max(1, repeats))]
        for p in params:
            p.grad = None
    base = statistics.median(b for b, _ in rounds)
    medians = iter([statistics.median(r[1][i] for r in rounds) for i in range(len(timed))])
    out = [base if m is model else next(medians) for m in mods]
    return (base, out[0]) if single else (base, out)


def bench(
    planner: Any,
    example_inputs: Any,
    solver_names: Sequence[str],
    budget: dict[str, Any],
    *,
    tick: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Plan, verify, time and trace one step per solver, on a `planner.api.Planner` (`none`: no budget).

    `budget` holds Planner.plan's budget_gb / budget_bytes / activation_budget.
    Returns the bench file's dict: one row per solver with predicted and
    measured peak, step time and its ratio to no checkpointing, solve time,
    exactness and the measured memory timeline; a solver that cannot meet the
    budget gets an 'infeasible' row.
    """
    from ..capture.trace import flatten_for_graph, normalize_inputs
    from ..model_state import ModelState
    from ..plan_check import graph_fingerprint
    from ..profile.loss import default_loss
    from ..solvers.registry import InfeasibleBudgetError
    from ..verification import verify

    model, cap = planner.model, planner.capture
    args, kwargs = normalize_inputs(example_inputs, model)
    state = list(model.parameters()) + list(model.buffers())
    rows: list[dict[str, Any]] = []
    modules: list[torch.nn.Module] = []
    budget_bytes = None
    for name in solver_names:
        try:
            # each solver's own plan, not the measured choice among them (autotune)
            plan = planner.plan(solver="none") if name == "none" else planner.plan(solver=name, autotune=False, **budget)
        except InfeasibleBudgetError as e:
            rows.append({"solver": name, "status": "infeasible", "error": str(e)})
            budget_bytes = e.budget_bytes
            if tick is not None:
                tick(name)
            continue
        if name != "none":
            budget_bytes = plan.budget_bytes
        report = verify(model, plan, example_inputs, repeats=1)
        modules.append(plan.module)
        with ModelState(model).preserved():
            plan.module.train()
            timeline = measure_timeline(plan.module, args, kwargs, default_loss, state)
        rows.append(
            {
                "solver": name,
                "status": "ok",
                "budget_bytes": None if name == "none" else plan.budget_bytes,
                "regions": len(plan.regions),
                "predicted_peak_bytes": plan.predicted_peak_bytes,
                "measured_peak_bytes": report.measured_peak_bytes,
                "baseline_measured_peak_bytes": report.baseline_measured_peak_bytes,
                "prediction_error": report.prediction_error,
                "predicted_recompute_s": plan.predicted_recompute_s,
                "solve_time_s": plan.solve_time_s,
                "exact": report.exact,
                "max_abs_grad_diff": report.max_abs_grad_diff,
                # the baseline (`none`) is not held to the budget; its figure is set below, once the budget is known
                "within_budget": None if name == "none" else report.within_budget,
                "timeline": timeline,
            }
        )
        if tick is not None:
            tick(name)
    for row in rows:
        if row["solver"] == "none" and row["status"] == "ok":
            row["within_budget"] = budget_bytes is None or row["measured_peak_bytes"] <= budget_bytes
    # One baseline for the header and every row: the model's own step, timed in the same interleaved
    # rounds as every plan's module (a plan with no regions runs the model itself: x1.00 by construction).
    base_s = None
    if modules:
        base_s, steps = step_times(model, modules, args, kwargs, default_loss)
        for row, step_s in zip((r for r in rows if r["status"] == "ok"), steps):
            row.update(step_s=step_s, baseline_step_s=base_s, step_time_ratio=step_s / max(1e-12, base_s))
    return {
        "schema": "ckpt-planner/bench",
        "version": 1,
        "model": type(model).__name__,
        "fingerprint": graph_fingerprint(cap.graph_module, flatten_for_graph(cap.graph_module, cap.args, cap.kwargs)),
        "budget_bytes": budget_bytes,
        "baseline_peak_bytes": planner.baseline_peak_bytes,
        "baseline_step_s": base_s,
        "rows": rows,
    }


def bench_table(result: dict[str, Any]) -> str:
    """The bench as a plain-text table."""
    budget = _fmt_bytes(result["budget_bytes"]) if result.get("budget_bytes") else "none"
    base = result.get("baseline_step_s")
    lines = [
        f"{result['model']} on {result.get('device', '?')}, budget {budget}"
        + (f", no-checkpointing step {base * 1e3:.2f} ms" if base else ""),
        f"{'solver':<10} {'predicted':>11} {'measured':>11} {'step ms':>9} {'x no ckpt':>9} {'solve s':>8}  exact  fits",
    ]
    for r in result["rows"]:
        if r["status"] != "ok":
            lines.append(f"{r['solver']:<10} {r['status']}: {r['error']}")
            continue
        fits = fits_text(r, result.get("budget_bytes"))
        lines.append(
            f"{r['solver']:<10} {_fmt_bytes(r['predicted_peak_bytes']):>11} {_fmt_bytes(r['measured_peak_bytes']):>11} "
            f"{r['step_s'] * 1e3:>9.2f} {r['step_time_ratio']:>9.2f} {r['solve_time_s']:>8.3f}  "
            f"{'yes' if r['exact'] else 'NO':<5}  {fits}"
        )
    return "\n".join(lines)


def load_bench_file(path: str) -> dict[str, Any]:
    """A bench file (`ckpt-planner bench -o`), read as data from anywhere: a file of bounded size, JSON that
    Python reads (no number past its digit limit, no nesting past its recursion limit), within the limits
    every JSON file the planner reads keeps, with the bench schema. Errors are PlanFileError naming the file."""
    from ..errors import PlanFileError
    from ..plan_schema import check_json_limits, read_plan_file

    source = f"bench file {path!r}"
    data = read_plan_file(path, source)
    if not isinstance(data, dict) or data.get("schema") != "ckpt-planner/bench":
        raise PlanFileError(f"{source} is not a ckpt-planner bench file (write one with `ckpt-planner bench -o`)")
    check_json_limits(data, source)  # finite numbers, 64-bit integers, no lone surrogates, sizes
    return data


# -- the command ------------------------------------------------------------------------------


def planner_for(args: argparse.Namespace, loaded, inputs, record: dict[str, Any], bar, feasible_for=None):
    """Capture and profile once (planner.api.Planner); refuse a model with nothing to plan, and with
    `feasible_for` (Planner.check_feasible's arguments) a budget no plan meets, before timing the model."""
    from ..api import Planner
    from ..capture.preflight import nothing_to_plan
    from .loading import inputs_named

    with bar_stage(bar, "capturing and profiling"), inputs_named(loaded, inputs, record):
        planner = Planner(
            loaded.model, inputs, device=args.device if args.device == "meta" else None, optimizer=args.optimizer,
            check_step=getattr(args, "check_step", True), feasible_for=feasible_for,
        )
    empty = nothing_to_plan(loaded.model, planner.capture.graph_module, planner.cost.total_saved_bytes)
    if empty is not None:
        raise empty
    return planner


def cmd_bench(args: argparse.Namespace) -> int:
    """Optimize + verify with each solver side by side; table or JSON."""
    from ..errors import InputError
    from ..solvers.registry import SOLVERS
    from .loading import model_and_inputs

    if args.device == "meta":
        raise InputError("device: bench runs the model; use --device cpu or cuda")
    names = [s.strip() for s in args.solvers.split(",") if s.strip()]
    if not names:
        raise InputError("--solvers: the list is empty; give comma-separated solver names")
    skipped = [n for n in names if n not in SOLVERS]
    names = [n for n in names if n in SOLVERS]
    if not names:
        raise InputError(f"--solvers: none of {args.solvers!r} is registered; choose from {', '.join(sorted(SOLVERS))}")
    for n in skipped:
        note(args, f"skipping solver {n!r}: not registered (registered: {', '.join(sorted(SOLVERS))})")
    target = command_output(args.output, "output", args) if args.output else None
    loaded, inputs, record = model_and_inputs(args)
    with progress_bar(args, 1 + len(names), "bench") as bar:
        planner = planner_for(args, loaded, inputs, record, bar)
        bar.set_description_str("solving, verifying, timing")
        result = bench(planner, inputs, names, {"budget_gb": args.budget_gb, "budget_bytes": args.budget_bytes,
                                                         "activation_budget": args.activation_budget}, tick=lambda name: _tick(bar, name))
    result.update(device=args.device, source=record, skipped=skipped)
    if not any(r["status"] == "ok" for r in result["rows"]):
        reasons = "; ".join(f"{r['solver']}: {r.get('error') or r['status']}" for r in result["rows"])
        err(f"no solver produced a plan ({reasons}); no bench file written")
        return EXIT_FAIL
    if target is not None:
        write_file(target, json.dumps(result, indent=2))
    if args.json:
        rows = [{k: v for k, v in r.items() if k != "timeline"} for r in result["rows"]]
        out(args, json.dumps({**result, "rows": rows}, indent=2))
    else:
        say(args, bench_table(result) + (f"\nbench written to {target}" if target else ""))
    bad = [r["solver"] for r in result["rows"]
           if r["status"] == "ok" and not (r["exact"] and (r["within_budget"] or r["solver"] == "none"))]
    if bad:
        err(f"verification failed for solver(s) {', '.join(bad)} (inexact or over the budget)")
        return EXIT_FAIL
    return EXIT_OK


def _tick(bar, name: str) -> None:
    bar.set_description_str(f"solver {name}")
    bar.update(1)

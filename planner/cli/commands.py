"""The `ckpt-planner` command line (also `python -m ckpt_planner`).

Subcommands: plan, apply, bench, report, profile, demo, export. Every error is one
line on stderr. Exit codes: 0 ok, 1 infeasible budget or failed
verification, 2 bad usage or bad input (missing or unreadable file, bad
shape, unknown solver, plan for another model, unwritable output), 130
interrupted (Ctrl-C). Argument parsing and validation live in cli_args.py, `bench` and
`export` beside what they run (bench.py, export.py), what is printed and written in outputs.py.
`plan` plans through planner.api.plan_model, the one place that chooses among the whole, compiled,
chunked and in-parts paths. Outputs are written to a temporary file next to the target and renamed
into place, so a failed command leaves no partial file.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from .bench import cmd_bench, planner_for
from .cli_args import EXIT_FAIL, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, build_parser
from .export import cmd_export
from .loading import inputs_named
from .loading import model_and_inputs as _model_and_inputs  # one name a timing harness wraps
from .outputs import bar_stage, command_output, err, no_logs, note, one_line, one_line_warnings, out, progress_bar, say


def _fmt(n: float) -> str:
    from ..plan_summary import fmt_bytes as _fmt_bytes

    return _fmt_bytes(n)


def cmd_demo(args: argparse.Namespace) -> int:
    """Plan the built-in GPT-style model at half its activation memory, verify, print the summary."""
    from ..api import optimize
    from ..verification import verify
    from .examples import gpt_example

    model, inputs = gpt_example(batch=args.batch, seq=args.seq, layers=args.layers)
    plan = optimize(model, inputs, activation_budget=args.fraction, solver=args.solver,
                    autotune=getattr(args, "autotune", None))
    report = verify(model, plan, inputs)
    plan.measured_peak_bytes = report.measured_peak_bytes
    plan.baseline_measured_peak_bytes = report.baseline_measured_peak_bytes
    ok = report.exact and report.within_budget
    if args.json:
        out(args, json.dumps({"plan": plan.to_dict(), "verify": _report_dict(report)}, indent=2))
    else:
        out(args, plan.summary())
        out(args, verdict_line(report, _race_band(plan)))
    return EXIT_OK if ok else EXIT_FAIL


def _race_band(plan) -> float | None:
    """The autotune race's noise band (a fraction of a step), where it raced: the spread of paired steps on
    this machine, the band a side-by-side step time measured here is read within."""
    rec = plan.stats.get("autotune")
    band = rec.get("band") if isinstance(rec, dict) and not rec.get("skipped") else None
    return float(band) if isinstance(band, (int, float)) and not isinstance(band, bool) and band >= 0 else None


def _measured_step(report, band: float | None) -> str:
    """verify's step time, marked measured, with the noise band it is read within; never a bare negative."""
    pct = report.step_time_ratio - 1.0
    text = f"step time {100 * pct:+.1f} % over the model's own step, measured side by side (median of " \
           "3 interleaved eager steps each"
    if band is None:
        return text + "; no noise band: no race ran)" + (" (below zero: noise, not a speed-up)" if pct < 0 else "")
    text += f"), +/-{100 * band:.1f} % (the race's noise band)"
    if pct < 0:
        text += " (within the noise: no faster)" if -pct <= band else " (below by more than the noise band: the steps were not steady)"
    return text


def verdict_line(report, band: float | None = None) -> str:
    """One line: did the plan's step equal the model's, and did it stay within the budget (demo, plan --verify).
    `band`: the race's noise band, the step-time figure's."""
    return (
        f"verified: outputs {'equal' if report.outputs_equal else 'DIFFER'}, "
        f"gradients {'bitwise equal' if report.grads_equal else f'max diff {report.max_abs_grad_diff:.3g}'}, "
        f"buffers {'equal' if report.buffers_equal else 'DIFFER'}; "
        f"measured peak {_fmt(report.measured_peak_bytes)} "
        f"({100 * report.prediction_error:+.1f} % predicted vs measured), "
        f"{'within' if report.within_budget else 'OVER'} the budget; "
        f"{_measured_step(report, band)}"
    )


def _report_dict(report) -> dict:
    from dataclasses import asdict

    d = asdict(report)
    d["prediction_error"] = report.prediction_error
    d["within_budget"] = report.within_budget
    return d


def cmd_profile(args: argparse.Namespace) -> int:
    """Print the per-node cost table and totals of a model (MODEL as for `plan`) or a built-in example."""
    from ..capture.trace import capture
    from ..errors import InputError
    from ..model_state import ModelState
    from ..profile.profiler import ProfileConfig, profile
    from .examples import EXAMPLES

    if args.model is not None and args.example is not None:
        raise InputError("example: give MODEL or --example, not both")
    if args.model is None:
        if args.input or args.inputs:
            raise InputError("input: --input/--inputs need a MODEL (the built-in examples bring their own)")
        model, inputs = EXAMPLES[args.example or "gpt"]()
    else:
        loaded, inputs, record = _model_and_inputs(args)
        model = loaded.model
    meta = args.meta or args.device == "meta"
    named = inputs_named(loaded, inputs, record) if args.model is not None else contextlib.nullcontext()
    with ModelState(model).preserved(), named:
        cap = capture(model, inputs)
        cost = profile(cap, ProfileConfig(meta=meta))
    rows = cost.table()
    totals = {
        "nodes": len(rows),
        "capture": cap.method,
        "saved_bytes": cost.total_saved_bytes,
        "forward_s": cost.total_time,
        "flops": sum(r["flops"] for r in rows),
        "param_bytes": cost.param_bytes,
        "time_source": cost.time_source,
        "estimated_nodes": sum(n.time_estimated for n in cost.nodes),
    }
    if args.json:
        out(args, json.dumps({"totals": totals, "nodes": rows}, indent=2))
        return EXIT_OK
    # Columns as wide as their longest entry: names are never cut (they are what `plan` files and notes cite).
    from .outputs import printable

    shown = [{**r, **{k: printable(str(r[k])) for k in ("node", "target", "module")}} for r in rows]
    w = {k: max([len(k), *(len(r[k]) for r in shown)]) for k in ("node", "target", "module")}
    out(args, f"{'node':<{w['node']}} {'target':<{w['target']}} {'module':<{w['module']}} "
               f"{'saved':>10} {'output':>10} {'time ms':>8}")
    for r in shown:
        out(
            args,
            f"{r['node']:<{w['node']}} {r['target']:<{w['target']}} {r['module']:<{w['module']}} "
            f"{_fmt(r['saved_bytes']):>10} {_fmt(r['out_bytes']):>10} {r['time_s'] * 1e3:>8.3f}"
        )
    out(
            args,
        f"total: {totals['nodes']} nodes ({cap.method}), saved for backward {_fmt(totals['saved_bytes'])}, "
        f"forward {totals['forward_s'] * 1e3:.1f} ms ({cost.time_source}"
        + (f"; {totals['estimated_nodes']} from FLOPs/bytes, their runs disagreed" if totals["estimated_nodes"] else "")
        + f"), {totals['flops'] / 1e9:.2f} GFLOP, "
        f"parameters and buffers {_fmt(totals['param_bytes'])}"
    )
    return EXIT_OK


# -- shared by plan / apply / bench / report ------------------------------------------------


def _check_output(path: str, what: str, *, folder: bool = False, args: argparse.Namespace | None = None) -> Path:
    """Fail before any work when `path` cannot be written or is one of `args`' input files (an
    InputError, exit 2; outputs.py)."""
    if not folder:  # a regular file or nothing: never a device, fifo, socket, an input or a hard link
        return command_output(path, what, args)
    from .applied import check_output_folder
    from .outputs import check_parent

    p = Path(path)
    check_parent(p, what)
    check_output_folder(p)
    return p


def _write_atomic(path: Path, text: str) -> None:
    """Renamed into place; an existing file keeps its mode; any OSError is one line, exit 2 (outputs.py)."""
    from ..plan_schema import write_file

    write_file(path, text)


def _budget_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {"budget_gb": args.budget_gb, "budget_bytes": args.budget_bytes, "activation_budget": args.activation_budget}


def _plan_settings(args: argparse.Namespace):
    """`plan`'s arguments as plan_model's (Setup, PlanRequest); the settings check their own values."""
    from ..settings import PlanRequest, Setup

    setup = Setup.of(device=args.device if args.device == "meta" else None, optimizer=args.optimizer,
                     check_step=args.check_step, exact=args.exact, compile=args.compile, lowering=args.lowering)
    return setup, PlanRequest.of(solver=args.solver, autotune=args.autotune, **_budget_kwargs(args))


@contextlib.contextmanager
def _planning_stages(bar, solver: str) -> Iterator[None]:
    """`bar`'s two planning steps, capture and profile then solve, moved on as plan_model's stages start."""
    from ..progress import stages_seen

    bar.set_description_str("capturing and profiling")
    done = 0

    def seen(name: str) -> None:
        nonlocal done
        if name == "solve" and not done:
            done = 1
            bar.update(1)
            bar.set_description_str(f"solving ({solver})")

    with stages_seen(seen):
        yield
    bar.update(2 - done)


# -- plan -----------------------------------------------------------------------------------


def cmd_plan(args: argparse.Namespace) -> int:
    """Plan checkpointing for a saved model (planner.api.plan_model, which captures, profiles and branches
    to the compiled, chunked or in-parts paths); write the plan file (with the report's data)."""
    from ..api import plan_model
    from ..errors import InputError
    from .report_data import plan_data

    setup, request = _plan_settings(args)  # a bad solver or lowering fails here, before the model loads
    if args.verify and args.device == "meta":
        raise InputError("verify: a plan made on the meta device cannot be run; drop --verify or use --device cpu/cuda")
    if args.compile and args.verify:
        raise InputError("verify: a --compile plan is measured compiled while planning (its summary shows the "
                         "measured peak); drop --verify")
    curve_solvers = _curve_solvers(args)
    target = _check_output(args.output, "output", args=args) if args.output else None
    loaded, inputs, record = _model_and_inputs(args)
    with progress_bar(args, 2 + bool(curve_solvers) + bool(args.verify), "planning") as bar:
        with _planning_stages(bar, args.solver), inputs_named(loaded, inputs, record):
            plan = plan_model(loaded.model, inputs, setup, request)
        # the timeline is two replays; the curves (asked for with --curve-points) are tens of solves
        bar.set_description_str("memory/overhead curves" if curve_solvers else "memory timeline")
        plan.stats.update(plan_data(plan, plan.problem, _curve_solvers(args, plan.problem), args.curve_points))
        if curve_solvers:
            bar.update(1)
        plan.stats["cli"] = {**record, "optimizer": args.optimizer}
        ok, failure, verdict = True, "", ""
        if args.verify:
            with bar_stage(bar, "verifying"):
                ok, failure, verdict = _verify_into(plan, loaded.model, inputs)
    if target is not None and ok:
        _write_atomic(target, json.dumps(plan.to_dict(), indent=2))  # as Plan.save writes it
    if args.json:
        out(args, json.dumps(plan.to_dict(), indent=2))
    else:
        say(args, plan.summary())
        if verdict:
            say(args, verdict)
        if target is not None and ok:
            say(args, f"plan written to {target}")
    if not ok:
        err(f"verification failed: {failure}; no plan written")
        return EXIT_FAIL
    return EXIT_OK


def _curve_solvers(args: argparse.Namespace, problem: Any = None) -> list[str]:
    """Solvers for the report's curve: --curve-solvers, else every registered one but the trivial and exhaustive,
    and, for a `problem` that cannot offload (the CPU), but ilp_offload, whose plans there are ilp's."""
    from ..solvers.registry import SOLVERS, get_solver

    if not args.curve_points:
        return []
    if args.curve_solvers is not None:
        names = [s.strip() for s in args.curve_solvers.split(",") if s.strip()]
        for name in names:
            get_solver(name)
        return names
    skip = ("none", "auto", "bruteforce") + (("ilp_offload",) if problem is not None and not problem.can_offload else ())
    return [s for s in sorted(SOLVERS) if s not in skip]


def _verify_into(plan, model, inputs) -> tuple[bool, str, str]:
    from ..verification import verify

    report = verify(model, plan, inputs)
    plan.measured_peak_bytes = report.measured_peak_bytes
    plan.baseline_measured_peak_bytes = report.baseline_measured_peak_bytes
    plan.stats["verify"] = _report_dict(report)
    problems = []
    if not (report.exact or (plan.stats.get("exact") is False and report.grads_allclose)):
        problems.append(f"results differ from the original: {report.mismatch()}")
    if not report.within_budget:
        problems.append(f"measured peak {_fmt(report.measured_peak_bytes)} is over the budget {_fmt(report.budget_bytes)}")
    return not problems, "; ".join(problems), verdict_line(report, _race_band(plan))


def _load_plan(path: str):
    """Plan.load, with a file nested too deeply for the JSON reader named as a bad plan file."""
    from ..errors import PlanFileError
    from ..plan import Plan

    try:
        return Plan.load(path)
    except RecursionError:
        raise PlanFileError(f"plan file {path!r} is nested too deeply to be a plan file") from None


# -- apply ----------------------------------------------------------------------------------


def cmd_apply(args: argparse.Namespace) -> int:
    """Rebuild a plan on a model and write the checkpointed module as a folder that loads back."""
    from .applied import write_applied

    target = _check_output(args.output, "output folder", folder=True)
    plan = _load_plan(args.plan)
    recorded = plan.stats.get("cli") if isinstance(plan.stats.get("cli"), dict) else None
    loaded, inputs, record = _model_and_inputs(args, recorded)
    with inputs_named(loaded, inputs, record):
        plan.rebuild(loaded.model, inputs)
    write_applied(target, loaded=loaded, plan=plan, example_inputs=inputs)
    regions = sum(1 for _ in plan.regions)
    if args.json:
        out(args, json.dumps({"output": str(target), "regions": regions, "fingerprint": plan.fingerprint}))
    pickled = loaded.kind == "pickle" or (loaded.kind == "pt2" and args.trust_pickle)
    flag = ", trust_code=True" if loaded.kind == "factory" else ", trust_pickle=True" if pickled else ""
    cli_flag = " --trust-code" if loaded.kind == "factory" else " --trust-pickle" if pickled else ""
    say(
        args,
        f"wrote {target}/ ({regions} checkpointed regions; generated code in {target}/code/)\n"
        f"load it:   from ckpt_planner.cli.loading import load_applied; module = load_applied({str(target)!r}{flag}).module\n"
        f"or check:  python {target}/load.py{cli_flag}   (one training step)",
    )
    return EXIT_OK


# -- bench ----------------------------------------------------------------------------------


# -- report ---------------------------------------------------------------------------------


def cmd_report(args: argparse.Namespace) -> int:
    """Render a plan file (and a bench file) as one self-contained HTML or Markdown page."""
    from ..errors import InputError, PlanFileError
    from . import report as rep

    target = _check_output(args.output, "output", args=args)
    fmt = args.format or ("md" if target.suffix.lower() in (".md", ".markdown") else "html")
    loaded_plan = _load_plan(args.plan)
    hint = None if isinstance(loaded_plan.stats.get("curves"), dict) else _report_curves(args, loaded_plan)
    plan = loaded_plan.to_dict()
    bench = None
    if args.bench:
        from .bench import load_bench_file

        bench = load_bench_file(args.bench)
    try:
        text = rep.render(plan, bench, fmt=fmt)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, OverflowError) as e:
        if isinstance(e, (InputError, PlanFileError)):
            raise
        where = f"plan file {args.plan!r}" + (f" or bench file {args.bench!r}" if args.bench else "")
        raise PlanFileError(f"{where}: a field is malformed ({type(e).__name__}: {one_line(e)[:120]})") from None
    _write_atomic(target, text)
    if hint:  # after the write: a failure is one line, the hint comes only with a report
        note(args, hint)
    if args.json:
        out(args, json.dumps({"output": str(target), "format": fmt, "bytes": len(text.encode())}))
    say(args, f"report written to {target}")
    return EXIT_OK


def _report_curves(args: argparse.Namespace, plan) -> str | None:
    """The memory/overhead curves for a plan file that has none (`plan` no longer computes them on the way to
    the plan): from MODEL (--model, with the plan's recorded inputs unless --input/--inputs), captured and
    profiled as `plan` does; a plan made for another graph is refused. Without --model, returns the note
    that says how."""
    from ..errors import PlanMismatchError
    from ..plan_check import fingerprint_of
    from .report_data import curves_for

    if args.model is None:
        if args.curve_points:
            return "the plan file has no memory/overhead curve; give the model (--model MODEL) to compute it"
        return None
    solvers = _curve_solvers(args)
    if not solvers:
        return None
    recorded = plan.stats.get("cli") if isinstance(plan.stats.get("cli"), dict) else None
    optimizer = (recorded or {}).get("optimizer", "none")
    args.optimizer = optimizer if optimizer in ("adamw", "adam", "sgd", "sgd-momentum") else "none"
    loaded, inputs, record = _model_and_inputs(args, recorded)
    with progress_bar(args, 2, "report") as bar:
        planner = planner_for(args, loaded, inputs, record, bar)
        if plan.fingerprint and fingerprint_of(planner.capture) != plan.fingerprint:
            raise PlanMismatchError(f"model {args.model!r} is not the graph the plan file {args.plan!r} was made for; "
                                    "give the model and inputs it was planned with")
        with bar_stage(bar, "memory/overhead curves"):
            plan.stats["curves"] = curves_for(plan, planner.problem, _curve_solvers(args, planner.problem),
                                              args.curve_points)
    return None


# -- export ---------------------------------------------------------------------------------


_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "plan": cmd_plan, "apply": cmd_apply, "bench": cmd_bench, "report": cmd_report, "demo": cmd_demo, "profile": cmd_profile,
    "export": cmd_export,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (0 ok, 1 failed, 2 bad usage or input, 130 interrupted)."""
    from ..errors import InputError, PlanFileError, PlanMismatchError, PlannerError
    from ..solvers.exact.bruteforce import PlanSpaceTooLargeError
    from ..solvers.registry import InfeasibleBudgetError, UnknownSolverError

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # keep errors to one line when a factory builds an HF model
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error already printed (2)
        return int(e.code or 0)
    # User code (factories, forwards) may print: its stdout goes to stderr, ours stays clean for --json.
    args.stdout = sys.stdout
    with warnings.catch_warnings(), no_logs(), contextlib.redirect_stdout(sys.stderr):
        # torch's deprecation and tracing notices are not the user's business on a command line
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.")
        warnings.showwarning = one_line_warnings(warnings.showwarning)
        try:
            return _COMMANDS[args.command](args)
        except KeyboardInterrupt:
            err("interrupted; nothing was written")
            return EXIT_INTERRUPTED
        except InfeasibleBudgetError as e:
            err(one_line(e))
            return EXIT_FAIL
        except (InputError, PlanFileError, PlanMismatchError, UnknownSolverError, PlanSpaceTooLargeError) as e:
            err(one_line(e))
            return EXIT_USAGE
        except RecursionError:
            err("an input file is nested too deeply to read")
            return EXIT_USAGE
        except (PlannerError, ImportError, OSError) as e:
            text = f"{type(e).__name__}: {one_line(e)}" if isinstance(e, OSError) else one_line(e)
            err(text)
            return EXIT_FAIL


if __name__ == "__main__":
    sys.exit(main())

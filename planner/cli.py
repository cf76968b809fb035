"""The `ckpt-planner` command line (also `python -m ckpt_planner`).

Subcommands: plan, apply, bench, report, profile, demo. Every error is one
line on stderr. Exit codes: 0 ok, 1 infeasible budget or failed
verification, 2 bad usage or bad input (missing or unreadable file, bad
shape, unknown solver, plan for another model, unwritable output). Outputs
are written to a temporary file next to the target and renamed into place,
so a failed command leaves no partial file.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2
        print(f"ckpt-planner: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def _fmt(n: float) -> str:
    from .plan import _fmt_bytes

    return _fmt_bytes(n)


def cmd_demo(args: argparse.Namespace) -> int:
    """Plan the built-in GPT-style model at half its activation memory, verify, print the summary."""
    from . import optimize, verify
    from .examples import gpt_example

    model, inputs = gpt_example(batch=args.batch, seq=args.seq, layers=args.layers)
    plan = optimize(model, inputs, activation_budget=args.fraction, solver=args.solver)
    report = verify(model, plan, inputs)
    plan.measured_peak_bytes = report.measured_peak_bytes
    plan.baseline_measured_peak_bytes = report.baseline_measured_peak_bytes
    ok = report.exact and report.within_budget
    if args.json:
        print(json.dumps({"plan": plan.to_dict(), "verify": _report_dict(report)}, indent=2))
    else:
        print(plan.summary())
        print(
            f"verified: outputs {'equal' if report.outputs_equal else 'DIFFER'}, "
            f"gradients {'bitwise equal' if report.grads_equal else f'max diff {report.max_abs_grad_diff:.3g}'}, "
            f"buffers {'equal' if report.buffers_equal else 'DIFFER'}; "
            f"measured peak {_fmt(report.measured_peak_bytes)} "
            f"({100 * report.prediction_error:+.1f} % predicted vs measured), "
            f"{'within' if report.within_budget else 'OVER'} the budget; "
            f"step time x{report.step_time_ratio:.2f} of no checkpointing"
        )
    return EXIT_OK if ok else EXIT_FAIL


def _report_dict(report) -> dict:
    from dataclasses import asdict

    d = asdict(report)
    d["prediction_error"] = report.prediction_error
    d["within_budget"] = report.within_budget
    return d


def cmd_profile(args: argparse.Namespace) -> int:
    """Print the per-node cost table and totals of a model (MODEL as for `plan`) or a built-in example."""
    from .capture import capture
    from .errors import InputError
    from .examples import EXAMPLES
    from .profile import ProfileConfig, profile
    from .state import ModelState

    if args.model is not None and args.example is not None:
        raise InputError("example: give MODEL or --example, not both")
    if args.model is None:
        if args.input or args.inputs:
            raise InputError("input: --input/--inputs need a MODEL (the built-in examples bring their own)")
        model, inputs = EXAMPLES[args.example or "gpt"]()
    else:
        loaded, inputs, _ = _model_and_inputs(args)
        model = loaded.model
    meta = args.meta or args.device == "meta"
    with ModelState(model).preserved():
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
    }
    if args.json:
        print(json.dumps({"totals": totals, "nodes": rows}, indent=2))
        return EXIT_OK
    print(f"{'node':<28} {'target':<34} {'module':<24} {'saved':>10} {'output':>10} {'time ms':>8}")
    for r in rows:
        print(
            f"{r['node'][:28]:<28} {r['target'][:34]:<34} {r['module'][:24]:<24} "
            f"{_fmt(r['saved_bytes']):>10} {_fmt(r['out_bytes']):>10} {r['time_s'] * 1e3:>8.3f}"
        )
    print(
        f"total: {totals['nodes']} nodes ({cap.method}), saved for backward {_fmt(totals['saved_bytes'])}, "
        f"forward {totals['forward_s'] * 1e3:.1f} ms ({cost.time_source}), {totals['flops'] / 1e9:.2f} GFLOP, "
        f"parameters and buffers {_fmt(totals['param_bytes'])}"
    )
    return EXIT_OK


# -- shared by plan / apply / bench / report ------------------------------------------------


def _say(args: argparse.Namespace, text: str) -> None:
    """Human-readable output: stdout, unless --quiet or --json."""
    if not args.quiet and not args.json:
        print(text)


def _note(args: argparse.Namespace, text: str) -> None:
    if not args.quiet:
        print(f"ckpt-planner: {text}", file=sys.stderr)


def _bar(args: argparse.Namespace, total: int, desc: str):
    """A tqdm bar on stderr; off with --quiet or when stderr is not a terminal."""
    from tqdm import tqdm

    return tqdm(
        total=total, desc=desc, file=sys.stderr, leave=False, disable=args.quiet or not sys.stderr.isatty(),
        bar_format="{desc:<30} {bar} {n_fmt}/{total_fmt} [{elapsed}]",
    )


@contextlib.contextmanager
def _stage(bar, desc: str) -> Iterator[None]:
    bar.set_description_str(desc)
    yield
    bar.update(1)


def _check_output(path: str, what: str, *, folder: bool = False) -> Path:
    """Fail before any work when `path` cannot be written (InputError, exit 2)."""
    from .errors import InputError

    p = Path(path)
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise InputError(f"{what} {path!r}: directory {str(parent)!r} does not exist")
    if folder:
        if p.exists() and not (p.is_dir() and (not any(p.iterdir()) or (p / "manifest.json").is_file())):
            raise InputError(f"{what} {path!r} exists and is not an empty folder or an earlier apply output")
    elif p.is_dir():
        raise InputError(f"{what} {path!r} is a directory")
    try:
        fd, probe = tempfile.mkstemp(prefix=".ckpt-planner-probe-", dir=parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise InputError(f"{what} {path!r}: directory {str(parent)!r} is not writable ({e.strerror})") from None
    return p


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent if str(path.parent) else ".")
    try:
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; a report is an ordinary file
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _default_solver() -> str:
    from .solvers import SOLVERS

    return "auto" if "auto" in SOLVERS else "uniform"


def _model_and_inputs(args: argparse.Namespace, recorded: dict[str, Any] | None = None):
    from .loading import load_model_and_inputs

    return load_model_and_inputs(
        args.model, input_specs=args.input or (), inputs_file=args.inputs, seed=args.seed, device=args.device,
        trust_pickle=args.trust_pickle, recorded=recorded,
    )


def _planner(args: argparse.Namespace, model, inputs, bar):
    """Capture and profile once (planner.api.Planner)."""
    from .api import Planner

    with _stage(bar, "capturing and profiling"):
        return Planner(model, inputs, device=args.device if args.device == "meta" else None, optimizer=args.optimizer)


def _budget_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {"budget_gb": args.budget_gb, "budget_bytes": args.budget_bytes, "activation_budget": args.activation_budget}


# -- plan -----------------------------------------------------------------------------------


def cmd_plan(args: argparse.Namespace) -> int:
    """Plan checkpointing for a saved model; write the plan file (with the report's data)."""
    from . import report as rep
    from . import solvers
    from .errors import InputError

    solvers.get_solver(args.solver)
    if args.verify and args.device == "meta":
        raise InputError("verify: a plan made on the meta device cannot be run; drop --verify or use --device cpu/cuda")
    curve_solvers = _curve_solvers(args)
    out = _check_output(args.output, "output") if args.output else None
    loaded, inputs, record = _model_and_inputs(args)
    model = loaded.model
    with _bar(args, 2 + len(curve_solvers) + bool(args.verify), "planning") as bar:
        planner = _planner(args, model, inputs, bar)
        with _stage(bar, f"solving ({args.solver})"):
            plan = planner.plan(solver=args.solver, **_budget_kwargs(args))
        bar.set_description_str("timeline and memory/overhead curves")
        plan.stats.update(rep.plan_data(plan, planner.problem, curve_solvers, args.curve_points, tick=lambda: bar.update(1)))
        plan.stats["cli"] = {**record, "optimizer": args.optimizer}
        ok, failure = True, ""
        if args.verify:
            with _stage(bar, "verifying"):
                ok, failure = _verify_into(plan, model, inputs)
    if out is not None and ok:
        plan.save(out)
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
    else:
        _say(args, plan.summary())
        if out is not None and ok:
            _say(args, f"plan written to {out}")
    if not ok:
        print(f"ckpt-planner: verification failed: {failure}; no plan written", file=sys.stderr)
        return EXIT_FAIL
    return EXIT_OK


def _curve_solvers(args: argparse.Namespace) -> list[str]:
    """Solvers for the report's curve: --curve-solvers, else every registered one but the trivial and exhaustive."""
    from . import solvers

    if not args.curve_points:
        return []
    if args.curve_solvers is not None:
        names = [s.strip() for s in args.curve_solvers.split(",") if s.strip()]
        for name in names:
            solvers.get_solver(name)
        return names
    return [s for s in sorted(solvers.SOLVERS) if s not in ("none", "auto", "bruteforce")]


def _verify_into(plan, model, inputs) -> tuple[bool, str]:
    from .verify import verify

    report = verify(model, plan, inputs)
    plan.measured_peak_bytes = report.measured_peak_bytes
    plan.baseline_measured_peak_bytes = report.baseline_measured_peak_bytes
    plan.stats["verify"] = _report_dict(report)
    problems = []
    if not report.exact:
        problems.append(f"results differ from the original (max gradient diff {report.max_abs_grad_diff:.3g})")
    if not report.within_budget:
        problems.append(f"measured peak {_fmt(report.measured_peak_bytes)} is over the budget {_fmt(report.budget_bytes)}")
    return not problems, "; ".join(problems)


# -- apply ----------------------------------------------------------------------------------


def cmd_apply(args: argparse.Namespace) -> int:
    """Rebuild a plan on a model and write the checkpointed module as a folder that loads back."""
    from .loading import write_applied
    from .plan import Plan

    out = _check_output(args.output, "output folder", folder=True)
    plan = Plan.load(args.plan)
    recorded = plan.stats.get("cli") if isinstance(plan.stats.get("cli"), dict) else None
    loaded, inputs, _ = _model_and_inputs(args, recorded)
    plan.rebuild(loaded.model, inputs)
    write_applied(out, loaded=loaded, plan=plan, example_inputs=inputs)
    regions = sum(1 for _ in plan.regions)
    if args.json:
        print(json.dumps({"output": str(out), "regions": regions, "fingerprint": plan.fingerprint}))
    flag = ", trust_pickle=True" if loaded.kind == "pickle" else ""
    _say(
        args,
        f"wrote {out}/ ({regions} checkpointed regions; generated code in {out}/code/)\n"
        f"load it:   from ckpt_planner.loading import load_applied; module = load_applied({str(out)!r}{flag}).module\n"
        f"or check:  python {out}/load.py{' --trust-pickle' if flag else ''}   (one training step)",
    )
    return EXIT_OK


# -- bench ----------------------------------------------------------------------------------


def cmd_bench(args: argparse.Namespace) -> int:
    """Optimize + verify with each solver side by side; table or JSON."""
    from . import bench as rep
    from . import solvers
    from .errors import InputError

    if args.device == "meta":
        raise InputError("device: bench runs the model; use --device cpu or cuda")
    names = [s.strip() for s in args.solvers.split(",") if s.strip()]
    if not names:
        raise InputError("solvers: the list is empty")
    skipped = [n for n in names if n not in solvers.SOLVERS]
    for n in skipped:
        _note(args, f"skipping solver {n!r}: not registered (registered: {', '.join(sorted(solvers.SOLVERS))})")
    names = [n for n in names if n in solvers.SOLVERS]
    out = _check_output(args.output, "output") if args.output else None
    loaded, inputs, record = _model_and_inputs(args)
    with _bar(args, 1 + len(names), "bench") as bar:
        planner = _planner(args, loaded.model, inputs, bar)
        bar.set_description_str("solving, verifying, timing")
        result = rep.bench(planner, inputs, names, _budget_kwargs(args), tick=lambda name: _tick(bar, name))
    result.update(device=args.device, source=record, skipped=skipped)
    if out is not None:
        _write_atomic(out, json.dumps(result, indent=2))
    if args.json:
        rows = [{k: v for k, v in r.items() if k != "timeline"} for r in result["rows"]]
        print(json.dumps({**result, "rows": rows}, indent=2))
    else:
        _say(args, rep.bench_table(result) + (f"\nbench written to {out}" if out else ""))
    bad = [r["solver"] for r in result["rows"]
           if r["status"] == "ok" and not (r["exact"] and (r["within_budget"] or r["solver"] == "none"))]
    if bad:
        print(f"ckpt-planner: verification failed for solver(s) {', '.join(bad)} (inexact or over the budget)", file=sys.stderr)
        return EXIT_FAIL
    return EXIT_OK


def _tick(bar, name: str) -> None:
    bar.set_description_str(f"solver {name}")
    bar.update(1)


# -- report ---------------------------------------------------------------------------------


def cmd_report(args: argparse.Namespace) -> int:
    """Render a plan file (and a bench file) as one self-contained HTML or Markdown page."""
    from . import report as rep
    from .errors import InputError
    from .plan import Plan

    out = _check_output(args.output, "output")
    fmt = args.format or ("md" if out.suffix.lower() in (".md", ".markdown") else "html")
    plan = Plan.load(args.plan).to_dict()
    bench = None
    if args.bench:
        path = Path(args.bench)
        if not path.is_file():
            raise InputError(f"bench file {args.bench!r} does not exist")
        try:
            bench = json.loads(path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise InputError(f"bench file {args.bench!r} is not valid JSON ({e})") from None
        if not isinstance(bench, dict) or bench.get("schema") != "ckpt-planner/bench":
            raise InputError(f"bench file {args.bench!r} is not a ckpt-planner bench file")
    text = rep.render(plan, bench, fmt=fmt)
    _write_atomic(out, text)
    if args.json:
        print(json.dumps({"output": str(out), "format": fmt, "bytes": len(text.encode())}))
    _say(args, f"report written to {out}")
    return EXIT_OK


def _model_options(p: argparse.ArgumentParser, *, budget: bool = True, optional: bool = False) -> None:
    p.add_argument("model", nargs="?" if optional else None, help="MODEL: file.pt2 (torch.export.save), path/file.py:factory, package.module:factory, "
                   "or a torch.save'd module (needs --trust-pickle)")
    p.add_argument("--input", action="append", metavar="[NAME=]SHAPE[:DTYPE[:LOW-HIGH]]",
                   help="a random example input, repeatable, in argument order (NAME= makes it a keyword "
                   "argument); e.g. 8,3,224,224 or 8,3,224,224:float16 or 2,128:int64:0-50257 (integers in "
                   "[LOW, HIGH), default 0-2; floats standard normal, or uniform in [LOW, HIGH))")
    p.add_argument("--inputs", metavar="FILE", help="a torch.save'd tensor, tuple or dict of tensors (weights_only=True)")
    p.add_argument("--seed", type=int, default=0, help="seed for --input tensors (default 0)")
    p.add_argument("--trust-pickle", action="store_true", help="allow a pickled (torch.save) model: loading it runs its code")
    p.add_argument("--device", choices=["cpu", "cuda", "meta"], default="cpu",
                   help="where to profile (meta: fake tensors, nothing runs)")
    if budget:
        g = p.add_mutually_exclusive_group()
        g.add_argument("--budget-gb", type=float, help="peak memory of one training step, in GB (1e9 bytes)")
        g.add_argument("--budget-bytes", type=int, help="the same, in bytes")
        g.add_argument("--activation-budget", type=float, metavar="F",
                       help="fixed memory plus F (0 < F <= 1) of the activation memory without checkpointing")
        p.add_argument("--optimizer", choices=["adamw", "adam", "sgd", "sgd-momentum", "none"], default="none",
                       help="count this optimizer's state in the budget (default none)")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    p.add_argument("--quiet", action="store_true", help="no progress bars, no human-readable output")


_EPILOGS = {
    "plan": "example:\n  ckpt-planner plan model.pt2 --input 8,3,224,224 --budget-gb 4 --solver dp --verify -o plan.json\n"
            "  ckpt-planner plan models.py:make_gpt --input input_ids=2,128:int64:0-8192 --input labels=2,128:int64:0-8192 "
            "--activation-budget 0.75 -o plan.json",
    "apply": "example:\n  ckpt-planner apply model.pt2 plan.json -o checkpointed/\n"
             "  python checkpointed/load.py     # loads it back and runs one training step",
    "bench": "example:\n  ckpt-planner bench models.py:make_gpt --input input_ids=2,128:int64:0-8192 "
             "--input labels=2,128:int64:0-8192 --solvers none,uniform,dp --activation-budget 0.75 -o bench.json\n"
             "  (models.py:make_gpt as in the README: GPT2LMHeadModel, 4 layers, n_embd 256, vocab 8192)",
    "report": "example:\n  ckpt-planner report plan.json --bench bench.json -o report.html\n"
              "  ckpt-planner report plan.json --format md -o report.md",
}


def build_parser() -> argparse.ArgumentParser:
    from .solvers import SOLVERS

    parser = _Parser(
        prog="ckpt-planner",
        description="Automatic activation-checkpoint placement for PyTorch.",
        epilog="exit codes: 0 ok, 1 infeasible budget or failed verification, 2 bad usage or input.\n"
               "example: ckpt-planner plan model.pt2 --input 8,3,224,224 --budget-gb 4 -o plan.json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    raw = argparse.RawDescriptionHelpFormatter

    plan = sub.add_parser("plan", help="plan checkpointing for a saved model, write plan.json",
                          epilog=_EPILOGS["plan"], formatter_class=raw)
    _model_options(plan)
    plan.add_argument("--solver", default=_default_solver(), help=f"one of {', '.join(sorted(SOLVERS))}")
    plan.add_argument("--verify", action="store_true", help="run one step side by side and record measured figures")
    plan.add_argument("--curve-points", type=int, default=8,
                      help="budgets per solver for the report's memory/overhead curve (0: none; default 8)")
    plan.add_argument("--curve-solvers", help="comma-separated solvers for that curve (default: all registered "
                      "but none, auto and bruteforce)")
    plan.add_argument("-o", "--output", help="plan file to write (JSON)")
    _common(plan)
    plan.set_defaults(func=cmd_plan)

    apply = sub.add_parser("apply", help="write the checkpointed module of a plan as a folder that loads back",
                           epilog=_EPILOGS["apply"], formatter_class=raw)
    _model_options(apply, budget=False)
    apply.add_argument("plan", help="plan file from `ckpt-planner plan`")
    apply.add_argument("-o", "--output", required=True, help="output folder")
    _common(apply)
    apply.set_defaults(func=cmd_apply)

    bench = sub.add_parser("bench", help="optimize + verify with several solvers side by side",
                           epilog=_EPILOGS["bench"], formatter_class=raw)
    _model_options(bench)
    bench.add_argument("--solvers", default="none,uniform,dp,ilp", help="comma-separated; unregistered ones are skipped")
    bench.add_argument("-o", "--output", help="bench file to write (JSON, for `report --bench`)")
    _common(bench)
    bench.set_defaults(func=cmd_bench)

    report = sub.add_parser("report", help="HTML or Markdown report of a plan, with plots",
                            epilog=_EPILOGS["report"], formatter_class=raw)
    report.add_argument("plan", help="plan file from `ckpt-planner plan`")
    report.add_argument("--bench", help="bench file from `ckpt-planner bench -o`")
    report.add_argument("--format", choices=["html", "md"], help="default: from the output's suffix, else html")
    report.add_argument("-o", "--output", required=True, help="report file to write")
    _common(report)
    report.set_defaults(func=cmd_report)

    demo = sub.add_parser(
        "demo",
        help="plan, verify and summarise a built-in GPT-style model",
        description="Plan the built-in GPT-style model at half its activation memory, verify it, print the summary.",
        epilog="example: ckpt-planner demo --fraction 0.5",
    )
    demo.add_argument("--fraction", type=float, default=0.5, help="budget as a fraction of activation memory")
    demo.add_argument("--solver", default="auto", choices=sorted(SOLVERS))
    demo.add_argument("--batch", type=int, default=8)
    demo.add_argument("--seq", type=int, default=128)
    demo.add_argument("--layers", type=int, default=4)
    demo.add_argument("--json", action="store_true", help="machine-readable output")
    demo.add_argument("--quiet", action="store_true", help="accepted for symmetry; the summary is the output")
    demo.set_defaults(func=cmd_demo)

    prof = sub.add_parser(
        "profile",
        help="per-node cost table of a model: saved bytes, output bytes, time",
        epilog="example:\n  ckpt-planner profile models.py:make_gpt --input input_ids=2,128:int64:0-8192\n"
               "  ckpt-planner profile --example cnn --json",
        formatter_class=raw,
    )
    _model_options(prof, budget=False, optional=True)
    prof.add_argument("--example", choices=["gpt", "mlp", "cnn"], help="a built-in example model instead of MODEL")
    prof.add_argument("--meta", action="store_true", help="fake tensors: exact bytes, FLOP-based time")
    prof.add_argument("--json", action="store_true")
    prof.add_argument("--quiet", action="store_true", help="accepted for symmetry; the table is the output")
    prof.set_defaults(func=cmd_profile)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from .errors import InputError, PlanFileError, PlanMismatchError, PlannerError
    from .solvers import InfeasibleBudgetError, UnknownSolverError

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # keep errors to one line when a factory builds an HF model
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error already printed (2)
        return int(e.code or 0)
    with warnings.catch_warnings():
        # torch's deprecation and tracing notices are not the user's business on a command line
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.")
        try:
            return args.func(args)
        except InfeasibleBudgetError as e:
            print(f"ckpt-planner: {e}", file=sys.stderr)
            return EXIT_FAIL
        except (InputError, PlanFileError, PlanMismatchError, UnknownSolverError) as e:
            print(f"ckpt-planner: {e}", file=sys.stderr)
            return EXIT_USAGE
        except (PlannerError, ImportError, OSError) as e:
            print(f"ckpt-planner: {type(e).__name__}: {e}" if isinstance(e, OSError) else f"ckpt-planner: {e}", file=sys.stderr)
            return EXIT_FAIL


if __name__ == "__main__":
    sys.exit(main())

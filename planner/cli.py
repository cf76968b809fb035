"""The `ckpt-planner` command line (also `python -m planner`).

Subcommands: demo, profile, plan. Exit codes: 0 ok, 1 infeasible budget or
failed verification, 2 bad usage or bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

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
    """Print the per-node cost table and totals of a built-in example model."""
    from .capture import capture
    from .examples import EXAMPLES
    from .profile import ProfileConfig, profile

    model, inputs = EXAMPLES[args.example]()
    cap = capture(model, inputs)
    cost = profile(cap, ProfileConfig(meta=args.meta))
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


def build_parser() -> argparse.ArgumentParser:
    from solvers import SOLVERS

    parser = _Parser(prog="ckpt-planner", description="Automatic activation-checkpoint placement for PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

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
    demo.set_defaults(func=cmd_demo)

    prof = sub.add_parser(
        "profile",
        help="per-node cost table of a model",
        epilog="example: ckpt-planner profile --example cnn --json",
    )
    prof.add_argument("--example", default="gpt", choices=["gpt", "mlp", "cnn"], help="built-in example model")
    prof.add_argument("--meta", action="store_true", help="fake tensors: exact bytes, FLOP-based time")
    prof.add_argument("--json", action="store_true")
    prof.set_defaults(func=cmd_profile)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from solvers import InfeasibleBudgetError, UnknownSolverError

    from .errors import InputError, PlanFileError, PlanMismatchError, PlannerError

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except InfeasibleBudgetError as e:
        print(f"ckpt-planner: {e}", file=sys.stderr)
        return EXIT_FAIL
    except (InputError, PlanFileError, PlanMismatchError, UnknownSolverError) as e:
        print(f"ckpt-planner: {e}", file=sys.stderr)
        return EXIT_USAGE
    except PlannerError as e:
        print(f"ckpt-planner: {e}", file=sys.stderr)
        return EXIT_FAIL


if __name__ == "__main__":
    sys.exit(main())

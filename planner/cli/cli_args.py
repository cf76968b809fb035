"""Argument parsing and validation for the `ckpt-planner` command line (see cli.py).

Every value is checked here, before any work: a bad one is one line on
stderr naming the option and what to give instead, and exit code 2.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable

__all__ = ["EXIT_OK", "EXIT_FAIL", "EXIT_USAGE", "EXIT_INTERRUPTED", "build_parser", "default_solver"]

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
"""Exit codes: ok; infeasible budget or failed verification; bad usage or input; interrupted (Ctrl-C)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2
        print(f"ckpt-planner: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def _positive(unit: str) -> Callable[[str], float]:
    def parse(text: str) -> float:
        value = _number(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number of {unit} > 0")
        return value

    parse.__name__ = f"number of {unit}"
    return parse


def _fraction(text: str) -> float:
    value = _number(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a fraction F with 0 < F <= 1")
    return value


def _count(low: int, high: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer in {low} .. {high}")
        return value

    parse.__name__ = "integer"
    return parse


_seed = _count(0, 2**64 - 1)


def default_solver() -> str:
    from ..solvers.registry import SOLVERS

    return "auto" if "auto" in SOLVERS else "uniform"


def _model_options(p: argparse.ArgumentParser, *, budget: bool = True, optional: bool = False) -> None:
    p.add_argument("model", nargs="?" if optional else None, help="MODEL: file.pt2 (torch.export.save), path/file.py:factory, package.module:factory, "
                   "or a torch.save'd module (needs --trust-pickle)")
    p.add_argument("--input", action="append", metavar="[NAME=]SHAPE[:DTYPE[:LOW-HIGH]]",
                   help="a random example input, repeatable, in argument order (NAME= makes it a keyword "
                   "argument); e.g. 8,3,224,224 or 8,3,224,224:float16 or 2,128:int64:0-50257 (integers in "
                   "[LOW, HIGH), default 0-2; floats standard normal, or uniform in [LOW, HIGH))")
    p.add_argument("--inputs", metavar="FILE", help="a torch.save'd tensor, tuple or dict of tensors (weights_only=True)")
    p.add_argument("--seed", type=_seed, default=0, help="seed for --input tensors (default 0)")
    p.add_argument("--trust-pickle", action="store_true", help="allow a pickled (torch.save) model, or a .pt2 with pickled members: loading it runs code from the file")
    p.add_argument("--device", choices=["cpu", "cuda", "meta"], default="cpu",
                   help="where to profile (meta: fake tensors, nothing runs)")
    if budget:
        g = p.add_mutually_exclusive_group()
        g.add_argument("--budget-gb", type=_positive("GB"), help="peak memory of one training step, in GB (1e9 bytes)")
        g.add_argument("--budget-bytes", type=_count(1, 2**63 - 1), help="the same, in bytes")
        g.add_argument("--activation-budget", type=_fraction, metavar="F",
                       help="fixed memory plus F (0 < F <= 1) of the activation memory without checkpointing")
        p.add_argument("--optimizer", choices=["adamw", "adam", "sgd", "sgd-momentum", "none"], default="none",
                       help="count this optimizer's state in the budget (default none)")


_CURVE_SOLVERS = ("comma-separated solvers for that curve (default: all registered but none, auto and bruteforce, "
                  "and but ilp_offload where nothing can be offloaded)")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    p.add_argument("--quiet", action="store_true", help="no progress bars, no human-readable output")


_EPILOGS = {
    "plan": "example:\n  ckpt-planner plan model.pt2 --input 8,3,32,32 --activation-budget 0.5 --solver dp --verify -o plan.json\n"
            "  ckpt-planner plan models.py:make_gpt --input input_ids=2,128:int64:0-8192 --input labels=2,128:int64:0-8192 "
            "--activation-budget 0.75 -o plan.json",
    "apply": "example:\n  ckpt-planner apply model.pt2 plan.json -o checkpointed/\n"
             "  python checkpointed/load.py     # loads it back and runs one training step",
    "bench": "example:\n  ckpt-planner bench models.py:make_gpt --input input_ids=2,128:int64:0-8192 "
             "--input labels=2,128:int64:0-8192 --solvers none,uniform,dp --activation-budget 0.75 -o bench.json\n"
             "  (models.py:make_gpt as in the README: GPT2LMHeadModel, 4 layers, n_embd 256, vocab 8192)",
    "export": "example:\n  ckpt-planner export models.py:make_gpt --input input_ids=2,128:int64:0-8192 "
              "--input labels=2,128:int64:0-8192 -o gpt.pt2\n"
              "  ckpt-planner plan gpt.pt2 --activation-budget 0.75 -o gpt-plan.json",
    "report": "example:\n  ckpt-planner report plan.json --bench bench.json -o report.html\n"
              "  ckpt-planner report plan.json --format md -o report.md\n"
              "  ckpt-planner report plan.json --model model.pt2 -o report.html   # with the memory/overhead curve",
}


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="ckpt-planner",
        description="Automatic activation-checkpoint placement for PyTorch.",
        epilog="exit codes: 0 ok, 1 infeasible budget or failed verification, 2 bad usage or input.\n"
               "example: ckpt-planner plan model.pt2 --input 8,3,224,224 --budget-gb 4 -o plan.json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for add in (_add_plan, _add_apply, _add_bench, _add_export, _add_report, _add_demo, _add_profile):
        add(sub)
    return parser


_RAW = argparse.RawDescriptionHelpFormatter


def _add_plan(sub) -> None:
    from ..solvers.registry import SOLVERS

    plan = sub.add_parser("plan", help="plan checkpointing for a saved model, write plan.json",
                          epilog=_EPILOGS["plan"], formatter_class=_RAW)
    _model_options(plan)
    plan.add_argument("--solver", default=default_solver(), help=f"one of {', '.join(sorted(SOLVERS))}")
    plan.add_argument("--verify", action="store_true", help="run one step side by side and record measured figures")
    plan.add_argument("--no-check-step", "--no-exact-check", dest="check_step", action="store_false",
                      help="skip the safety net: the plan's step is not compared with the model's before it is "
                           "returned (--no-exact-check is its former name)")
    plan.add_argument("--no-exact", dest="exact", action="store_false",
                      help="also admit plans that run token-wise work (MLPs, the LM head and loss) in chunks, where the "
                           "exact plan cannot fit: gradients allclose to the model's, not bitwise")
    plan.add_argument("--autotune", action=argparse.BooleanOptionalAction, default=None,
                      help="time the best plans that fit for a few steps on the device and keep the fastest "
                           "(default: on where node times are measured; at most 30 model steps)")
    plan.add_argument("--compile", action="store_true",
                      help="plan for the step under torch.compile (inductor, fullgraph): the budget is its measured "
                           "allocator peak, re-planned tighter while over it")
    plan.add_argument("--lowering", choices=("best", "regions", "knapsack"), default="best",
                      help="with --compile: whole checkpoint regions, our knapsack inside compile's partitioner, "
                           "or best (both; the faster compiled step that fits)")
    plan.add_argument("--curve-points", type=_count(0, 1000), default=0,
                      help="budgets per solver for the report's memory/overhead curve, computed now and stored in "
                           "the plan file (default 0: none; tens of solves, so `report --model` computes it instead)")
    plan.add_argument("--curve-solvers", help=_CURVE_SOLVERS)
    plan.add_argument("-o", "--output", help="plan file to write (JSON)")
    _common(plan)
    plan.set_defaults(command="plan")


def _add_apply(sub) -> None:
    apply = sub.add_parser("apply", help="write the checkpointed module of a plan as a folder that loads back",
                           epilog=_EPILOGS["apply"], formatter_class=_RAW)
    _model_options(apply, budget=False)
    apply.add_argument("plan", help="plan file from `ckpt-planner plan`")
    apply.add_argument("-o", "--output", required=True, help="output folder")
    _common(apply)
    apply.set_defaults(command="apply")


def _add_bench(sub) -> None:
    bench = sub.add_parser("bench", help="optimize + verify with several solvers side by side",
                           epilog=_EPILOGS["bench"], formatter_class=_RAW)
    _model_options(bench)
    bench.add_argument("--solvers", default="none,uniform,dp,ilp", help="comma-separated; unregistered ones are skipped")
    bench.add_argument("-o", "--output", help="bench file to write (JSON, for `report --bench`)")
    _common(bench)
    bench.set_defaults(command="bench")


def _add_export(sub) -> None:
    export = sub.add_parser("export", help="save a model as a .pt2 that returns plain tensors, for plan/apply/bench",
                            description="Export MODEL with torch.export in training mode, wrapped so that it returns "
                            "plain tensors (a transformers ModelOutput cannot be loaded where transformers is not "
                            "imported), and save it with its inputs as the default ones.",
                            epilog=_EPILOGS["export"], formatter_class=_RAW)
    _model_options(export, budget=False)
    export.add_argument("--returns", choices=["auto", "loss", "logits", "tensors"], default="auto",
                        help="what the program returns: the loss (give labels), the logits, or every tensor of the "
                             "output as a flat tuple; auto (default): the loss when there is one, else the logits, "
                             "else every tensor")
    export.add_argument("-o", "--output", required=True, help=".pt2 file to write")
    _common(export)
    export.set_defaults(command="export")


def _add_report(sub) -> None:
    report = sub.add_parser("report", help="HTML or Markdown report of a plan, with plots",
                            epilog=_EPILOGS["report"], formatter_class=_RAW)
    report.add_argument("plan", help="plan file from `ckpt-planner plan`")
    report.add_argument("--bench", help="bench file from `ckpt-planner bench -o`")
    report.add_argument("--format", choices=["html", "md"], help="default: from the output's suffix, else html")
    report.add_argument("--model", metavar="MODEL", help="the planned model (as for `plan`): computes the "
                        "memory/overhead curve of a plan file that has none, with the plan's recorded inputs")
    report.add_argument("--input", action="append", metavar="[NAME=]SHAPE[:DTYPE[:LOW-HIGH]]",
                        help="with --model: the inputs, when not the plan's recorded ones (as for `plan`)")
    report.add_argument("--inputs", metavar="FILE", help="with --model: a torch.save'd tensor, tuple or dict of tensors")
    report.add_argument("--seed", type=_seed, default=0, help="seed for --input tensors (default 0)")
    report.add_argument("--trust-pickle", action="store_true", help="allow a pickled --model (loading it runs code)")
    report.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="with --model: where to profile")
    report.add_argument("--curve-points", type=_count(0, 1000), default=8,
                        help="with --model: budgets per solver for the curve (default 8)")
    report.add_argument("--curve-solvers", help=_CURVE_SOLVERS)
    report.add_argument("-o", "--output", required=True, help="report file to write")
    _common(report)
    report.set_defaults(command="report")


def _add_demo(sub) -> None:
    from ..solvers.registry import SOLVERS

    demo = sub.add_parser(
        "demo",
        help="plan, verify and summarise a built-in GPT-style model",
        description="Plan the built-in GPT-style model at half its activation memory, verify it, print the summary.",
        epilog="example: ckpt-planner demo --fraction 0.5",
    )
    demo.add_argument("--fraction", type=_fraction, default=0.5, help="budget as a fraction of activation memory")
    demo.add_argument("--solver", default="auto", choices=sorted(SOLVERS))
    demo.add_argument("--batch", type=_count(1, 1 << 16), default=8)
    demo.add_argument("--seq", type=_count(1, 1 << 16), default=128)
    demo.add_argument("--layers", type=_count(1, 256), default=4)
    demo.add_argument("--autotune", action=argparse.BooleanOptionalAction, default=None,
                      help="race the best plans that fit for a few steps (default: on where node times are measured)")
    demo.add_argument("--json", action="store_true", help="machine-readable output")
    demo.add_argument("--quiet", action="store_true", help="accepted for symmetry; the summary is the output")
    demo.set_defaults(command="demo")


def _add_profile(sub) -> None:
    prof = sub.add_parser(
        "profile",
        help="per-node cost table of a model: saved bytes, output bytes, time",
        epilog="example:\n  ckpt-planner profile models.py:make_gpt --input input_ids=2,128:int64:0-8192\n"
               "  ckpt-planner profile --example cnn --json",
        formatter_class=_RAW,
    )
    _model_options(prof, budget=False, optional=True)
    prof.add_argument("--example", choices=["gpt", "mlp", "cnn"], help="a built-in example model instead of MODEL")
    prof.add_argument("--meta", action="store_true", help="fake tensors: exact bytes, FLOP-based time")
    prof.add_argument("--json", action="store_true")
    prof.add_argument("--quiet", action="store_true", help="accepted for symmetry; the table is the output")
    prof.set_defaults(command="profile")

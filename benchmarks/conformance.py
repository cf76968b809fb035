"""Conformance matrix: every architecture of benchmarks/conformance_models.py by every path a user takes.

A cell plans one model on one path and runs one training step of the plan against the model's own
(`planner.verify`). It passes when the plan is within its budget on the allocator, its own prediction is
within the budget, and its gradients are bitwise equal (allclose where exact=False or compiled, the
difference reported; a compiled plan allclose to plain `torch.compile(model)` where compile's own kernels
already part from eager's beyond allclose); or when it refuses with one line from the planner's own errors. A refusal that names a
smallest budget is planned again at exactly that budget, and that plan must pass. A crash, a raw torch or
transformers exception, a hang past the timeout, a plan over budget or inexact gradients is a FAIL.

Paths (eager paths at half the activation memory unless said; plans use FLOP-based times, no autotune race,
so each cell's plan is deterministic):
  above           budget_bytes 1.1x the plain step's measured peak: the plain step fits (the full profile)
  below           activation_budget=0.5, fp32: the plain step does not fit (the bounded stage-by-stage profile)
  bf16_autocast   as below, planned and run under torch.autocast("cpu", torch.bfloat16)
  bf16_model      as below, on model.to(torch.bfloat16) (float inputs cast too)
  inexact         exact=False at activation_budget=0.3 (chunked token-wise work allowed)
  compile_bytes   compile=True, budget_bytes 0.75x the plain step's measured peak
  compile_frac    compile=True, activation_budget=0.5
                  (inductor's fallback_random on: its dropout draws from the eager step's random stream)
                  (both compile paths on COMPILE_MODELS only unless --all-compile or --models names them)
  peft            a PEFT LoRA wrap (rank 4 on every Linear/Conv layer peft takes), activation_budget=0.5
  cli             exported to .pt2 (export_for_cli) and planned by `ckpt-planner plan --verify`, fraction 0.5

Each cell runs in a forked process of its own (its own session: a crash or a hang kills only it) with one
torch thread and a timeout.

    python -m benchmarks.conformance                         # the whole matrix
    python -m benchmarks.conformance --quick                 # a small sample
    python -m benchmarks.conformance --models gpt2,tv_resnet --paths below,cli --jobs 2 --update

Writes benchmarks/results/conformance.md and conformance.json (written again after every cell).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported: every cell forks from this process

import argparse  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import multiprocessing  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from .conformance_models import FAMILY, HELD_OUT, MODELS, build  # noqa: E402
from .conformance_report import COMPILE_MODELS, COMPILE_PATHS, PATHS, markdown  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
QUICK_MODELS = ("gpt2", "bert", "tv_resnet", "tied_autoencoder", "custom_function")
QUICK_PATHS = ("above", "below", "bf16_autocast", "cli")
RUN_ORDER = ("below", "above", "bf16_autocast", "bf16_model", "peft", "cli", "inexact", "compile_frac", "compile_bytes")
"""The order paths run in (--order path): the slowest (compiled) last, so a matrix cut short has the most cells."""
TIMEOUT_S = {"compile_bytes": 600, "compile_frac": 600, "cli": 300}
DEFAULT_TIMEOUT_S = 240
SLOW_CAPTURE = {"swin": 3.0}
"""Timeout factors. Swin's capture is torch.export with every input dimension symbolic (capture/shapes.py), and
its window padding and partition reshapes put sympy's simplifier in the middle of every view: 230 s of a 240 s
cell on a loaded 2-core machine, and a refusal's re-plan at its named budget captures again."""
CAPTURES = {"inexact": 2}
"""Captures per planning call where it is more than one (exact=False captures for the exact plan, then again
for the chunked one): a slow capture's factor applies to each."""
FRACTION = 0.5
INEXACT_FRACTION = 0.3


class SetupError(Exception):
    """The path does not apply to the model (raised before the planner is called): the cell is skipped."""


def _flops():
    from ckpt_planner.profile.profiler import ProfileConfig

    return ProfileConfig(warmup=0, repeats=1, flop_times=True)  # deterministic times: one plan per cell


def _is_refusal(e: BaseException) -> bool:
    """A planner error (its own classes, ValueError/RuntimeError subclasses), not a raw library exception.
    A ProfileError is not one: a node of the model's own graph failed to run under the profile, which is the
    planner failing on a model that trains, not a reason the user can act on."""
    from ckpt_planner.errors import ProfileError

    return type(e).__module__.split(".")[0] == "ckpt_planner" and not isinstance(e, ProfileError)


def _line(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _plain_peak(model, inputs) -> int:
    """The allocator's peak of one plain training step (bytes), as verify() meters it."""
    from ckpt_planner.capture.trace import normalize_inputs
    from ckpt_planner.model_state import ModelState
    from ckpt_planner.verification import default_loss, measure_step_peaks

    args, kwargs = normalize_inputs(inputs, model)
    params = list(model.parameters())
    with ModelState(model).preserved():
        peaks, _ = measure_step_peaks(model, args, kwargs, params, params + list(model.buffers()), default_loss,
                                      torch.device("cpu"))
    for p in params:
        p.grad = None
    return peaks.allocator


def _to_bf16(inputs):
    from torch.utils import _pytree as pytree

    return pytree.tree_map(lambda t: t.to(torch.bfloat16) if isinstance(t, torch.Tensor) and t.is_floating_point()
                           else t, inputs)


def _peft_wrap(model):
    try:
        import peft  # optional: the cell is skipped where it is not installed
    except ImportError as e:
        raise SetupError("peft is not installed") from e
    from transformers.pytorch_utils import Conv1D

    kinds = (torch.nn.Linear, torch.nn.Conv2d, torch.nn.Conv1d, Conv1D)
    names = [n for n, m in model.named_modules() if isinstance(m, kinds) and n]  # full names: peft matches them
    if not names:
        raise SetupError("no layer that LoRA wraps")
    try:
        return peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=names, lora_dropout=0.0))
    except Exception as e:  # noqa: BLE001 - peft's own refusal: the path does not apply
        raise SetupError(f"peft: {str(e).splitlines()[0][:160]}") from e


def _setting(path: str, model, inputs) -> tuple[object, object, dict, contextlib.AbstractContextManager]:
    """(model, inputs, optimize() keywords, context) for one path."""
    ctx: contextlib.AbstractContextManager = contextlib.nullcontext()
    kw: dict = {"activation_budget": FRACTION}
    if path == "above":
        kw = {"budget_bytes": int(1.1 * _plain_peak(model, inputs))}
    elif path == "bf16_autocast":
        ctx = torch.autocast("cpu", dtype=torch.bfloat16)
    elif path == "bf16_model":
        model, inputs = model.to(torch.bfloat16), _to_bf16(inputs)
    elif path == "inexact":
        kw = {"activation_budget": INEXACT_FRACTION, "exact": False}
    elif path == "compile_bytes":
        kw = {"budget_bytes": int(0.75 * _plain_peak(model, inputs)), "compile": True}
    elif path == "compile_frac":
        kw = {"activation_budget": FRACTION, "compile": True}
    if kw.get("compile"):
        # inductor draws dropout's masks from its own generator unless told to fall back to aten's random ops:
        # without it the compiled step trains with other masks than the eager one it is compared against
        import torch._inductor.config as inductor_config

        inductor_config.fallback_random = True
    elif path == "peft":
        model = _peft_wrap(model)
    return model, inputs, kw, ctx


def _judge(row: dict, plan, report, *, exact_required: bool, check_prediction: bool,
           cpu_overhead: float | None = None) -> dict:
    """Fill `row` from a plan and its verify() report; status PASS or FAIL with the reasons."""
    budget = plan.budget_bytes
    row.update(
        budget_bytes=budget, predicted_bytes=report.predicted_peak_bytes, measured_bytes=report.measured_peak_bytes,
        baseline_measured_bytes=report.baseline_measured_peak_bytes, regions=len(plan.regions),
        capture=plan.capture_method, exact=report.exact, grads_allclose=report.grads_allclose,
        max_abs_grad_diff=report.max_abs_grad_diff, max_rel_grad_diff=report.max_rel_grad_diff,
        prediction_error=report.prediction_error if check_prediction else None,
        predicted_overhead=getattr(plan, "predicted_overhead", None),
        measured_overhead_wall=(report.step_time_ratio - 1.0) if hasattr(report, "step_time_ratio") else None,
        measured_overhead_cpu=cpu_overhead,
    )
    problems = []
    if budget is not None and report.measured_peak_bytes > budget:
        problems.append(f"measured {report.measured_peak_bytes} B over the budget {budget} B "
                        f"({100 * (report.measured_peak_bytes / budget - 1):+.1f} %)")
    if check_prediction and budget is not None and plan.predicted_peak_bytes > budget:
        problems.append(f"its own prediction {plan.predicted_peak_bytes} B is over the budget {budget} B")
    if exact_required and not report.exact:
        problems.append(f"not bitwise: {report.mismatch()}")
    if not exact_required and not report.grads_allclose:
        problems.append(f"not allclose: {report.mismatch()}")
    row["status"] = "FAIL" if problems else "PASS"
    if problems:
        row["reason"] = "; ".join(problems)
    return row


@dataclasses.dataclass
class CompiledReport:
    """verify()'s figures for a compiled plan: verify() meters its step under a dispatch mode, which dynamo
    refuses, so the peak is the one the compiled planner measured (its own allocator meter) and the step is
    compared here, plain, against the eager model's."""

    predicted_peak_bytes: int
    measured_peak_bytes: int
    baseline_measured_peak_bytes: int
    max_abs_grad_diff: float
    max_rel_grad_diff: float
    exact: bool
    grads_allclose: bool
    prediction_error: float = 0.0

    def mismatch(self) -> str:
        return f"gradients differ (max abs diff {self.max_abs_grad_diff:.3g}, relative {self.max_rel_grad_diff:.3g})"


def _step_grads(module, model, args, kwargs) -> tuple[list, list]:
    from ckpt_planner.verification import default_loss
    from torch.utils import _pytree as pytree

    for p in model.parameters():
        p.grad = None
    torch.manual_seed(0)
    out = module(*args, **kwargs)
    default_loss(out).backward()
    outs = [t.detach().clone() for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    grads = [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    return outs, grads


def _allclose(pairs: list) -> bool:
    for a, b in pairs:
        try:
            torch.testing.assert_close(b, a, equal_nan=True)
        except AssertionError:
            return False
    return True


def _compiled_report(model, plan, inputs) -> CompiledReport:
    from ckpt_planner.capture.trace import normalize_inputs
    from ckpt_planner.model_state import ModelState

    args, kwargs = normalize_inputs(inputs, model)
    with ModelState(model).preserved():
        start = [b.detach().clone() for b in model.buffers()]
        o0, g0 = _step_grads(model, model, args, kwargs)
        with torch.no_grad():
            for b, v in zip(model.buffers(), start):
                b.copy_(v)
        o1, g1 = _step_grads(plan.module, model, args, kwargs)
    pairs = [(a, b) for a, b in zip(o0 + g0, o1 + g1) if a is not None and b is not None]
    nones_match = [a is None for a in g0] == [b is None for b in g1] and len(o0) == len(o1)
    diff = max((float((a.float() - b.float()).abs().max()) for a, b in pairs if a.numel()), default=0.0)
    scale = max((float(a.float().abs().max()) for a, _ in pairs if a.numel()), default=1.0) or 1.0
    close = nones_match and _allclose(pairs)
    if nones_match and not close:  # compile's own kernels may differ from eager: judged against plain compile
        with ModelState(model).preserved():
            with torch.no_grad():
                for b, v in zip(model.buffers(), start):
                    b.copy_(v)
            o2, g2 = _step_grads(torch.compile(model), model, args, kwargs)
        close = _allclose([(a, b) for a, b in zip(o2 + g2, o1 + g1) if a is not None and b is not None])
    exact = nones_match and all(torch.equal(a, b) for a, b in pairs)
    measured = plan.measured_peak_bytes
    return CompiledReport(plan.predicted_peak_bytes, measured, plan.baseline_measured_peak_bytes or 0, diff,
                          diff / scale, exact, close, (plan.predicted_peak_bytes - measured) / max(1, measured))


CPU_REPEATS = 3


def _cpu_overhead(model, module, inputs) -> float:
    """The plan's step over the plain step, minus one, in process CPU time (one torch thread: CPU seconds are the
    step's own work, far less moved by other processes on the machine than wall time); median of CPU_REPEATS
    interleaved pairs, after one warm-up pair."""
    from ckpt_planner.capture.trace import normalize_inputs
    from ckpt_planner.model_state import ModelState
    from ckpt_planner.verification import default_loss

    args, kwargs = normalize_inputs(inputs, model)
    params = list(model.parameters())

    def step(m) -> float:
        for p in params:
            p.grad = None
        t0 = time.process_time()
        default_loss(m(*args, **kwargs)).backward()
        return time.process_time() - t0

    base, ours = [], []
    with ModelState(model).preserved():
        for i in range(CPU_REPEATS + 1):
            b, o = step(model), step(module)
            if i:
                base.append(b)
                ours.append(o)
    for p in params:
        p.grad = None
    return sorted(ours)[len(ours) // 2] / max(1e-9, sorted(base)[len(base) // 2]) - 1.0


def _plan_python(path: str, model, inputs, kw: dict, ctx) -> tuple:
    from ckpt_planner import optimize
    from ckpt_planner.verification import verify

    with ctx:
        t0 = time.perf_counter()
        plan = optimize(model, inputs, profile_config=_flops(), autotune=False, **kw)
        plan_s = time.perf_counter() - t0
        report = _compiled_report(model, plan, inputs) if kw.get("compile") else verify(model, plan, inputs, repeats=1)
        cpu = None
        if not kw.get("compile"):
            with contextlib.suppress(Exception):  # a figure for the report, never the cell's result
                cpu = _cpu_overhead(model, plan.module, inputs)
    return plan, report, plan_s, cpu


def _python_cell(path: str, name: str) -> dict:
    from ckpt_planner.errors import InfeasibleBudgetError

    model, inputs = build(name)
    model, inputs, kw, ctx = _setting(path, model, inputs)
    compiled = kw.get("compile", False)
    exact_required = kw.get("exact", True) and not compiled
    row: dict = {}
    try:
        plan, report, plan_s, cpu = _plan_python(path, model, inputs, kw, ctx)
    except InfeasibleBudgetError as e:
        row.update(refusal=_line(e), smallest_bytes=e.smallest_bytes)
        kw = {k: v for k, v in kw.items() if k not in ("activation_budget", "budget_bytes")}
        kw["budget_bytes"] = e.smallest_bytes
        if compiled:
            torch._dynamo.reset()
        try:
            plan, report, plan_s, cpu = _plan_python(path, model, inputs, kw, ctx)
        except Exception as e2:  # noqa: BLE001 - the smallest budget named must plan
            return {**row, "status": "FAIL", "reason": f"refused again at the smallest budget it named: {_line(e2)}"}
        row["at_smallest"] = True
    row["plan_s"] = plan_s
    if compiled:
        row["compiled_measured_bytes"] = getattr(plan, "measured_peak_bytes", None)
    return _judge(row, plan, report, exact_required=exact_required, check_prediction=not compiled, cpu_overhead=cpu)


def _cli_plan(pt2: Path, out: Path, budget: list[str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "ckpt_planner", "plan", str(pt2), *budget, "--no-autotune", "--verify", "--quiet",
           "--curve-points", "0",
           "-o", str(out)]
    return subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _cli_cell(name: str) -> dict:
    from ckpt_planner import export_for_cli

    model, inputs = build(name)
    row: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        pt2, out = Path(tmp) / "model.pt2", Path(tmp) / "plan.json"
        export_for_cli(model, inputs, pt2)  # a planner error here is the cell's refusal
        t0 = time.perf_counter()
        done = _cli_plan(pt2, out, ["--activation-budget", str(FRACTION)])
        row["plan_s"] = time.perf_counter() - t0
        err = [line for line in done.stderr.strip().splitlines() if line.strip()]
        smallest = re.search(r"\((\d+) bytes", done.stderr)
        if done.returncode == 1 and "infeasible" in done.stderr and smallest:
            row.update(refusal=err[-1], smallest_bytes=int(smallest.group(1)), at_smallest=True)
            done = _cli_plan(pt2, out, ["--budget-bytes", smallest.group(1)])
        if done.returncode != 0:
            err = [line for line in done.stderr.strip().splitlines() if line.strip()]
            one_line = len(err) == 1 and "Traceback" not in done.stderr
            if done.returncode == 2 and one_line and not row.get("at_smallest"):
                return {**row, "status": "REFUSE", "reason": err[0]}
            why = err[-1] if err else f"exit {done.returncode}"
            return {**row, "status": "FAIL", "reason": f"ckpt-planner plan exit {done.returncode}: {why}"[:400]}
        data = json.loads(out.read_text())
    v = data["stats"]["verify"]
    budget = data.get("budget_bytes")
    row.update(
        budget_bytes=budget, predicted_bytes=v["predicted_peak_bytes"], measured_bytes=v["measured_peak_bytes"],
        baseline_measured_bytes=v["baseline_measured_peak_bytes"], regions=len(data.get("regions", [])),
        capture=data.get("capture_method"), exact=v["outputs_equal"] and v["grads_equal"] and v["buffers_equal"],
        max_abs_grad_diff=v["max_abs_grad_diff"], max_rel_grad_diff=v.get("max_rel_grad_diff"),
        prediction_error=v["prediction_error"],
    )
    problems = []
    if budget is not None and v["measured_peak_bytes"] > budget:
        problems.append(f"measured {v['measured_peak_bytes']} B over the budget {budget} B")
    if budget is not None and v["predicted_peak_bytes"] > budget:
        problems.append(f"its own prediction {v['predicted_peak_bytes']} B is over the budget {budget} B")
    if not row["exact"]:
        problems.append("not bitwise")
    row["status"] = "FAIL" if problems else "PASS"
    if problems:
        row["reason"] = "; ".join(problems)
    return row


def run_cell(name: str, path: str) -> dict:
    """One cell, in this process: its row (status PASS, REFUSE, SKIP or FAIL, and the figures)."""
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    with contextlib.suppress(ImportError):
        import transformers

        transformers.logging.set_verbosity_error()  # tiny configs warn about token ids: noise in the log
    t0 = time.perf_counter()
    try:
        row = _cli_cell(name) if path == "cli" else _python_cell(path, name)
    except SetupError as e:
        row = {"status": "SKIP", "reason": str(e)}
    except Exception as e:  # noqa: BLE001 - a failure is the cell's result
        text = _line(e)
        if _is_refusal(e) and "\n" not in str(e).strip():
            row = {"status": "REFUSE", "reason": text}
        else:
            where = traceback.extract_tb(e.__traceback__)[-1]
            why = ("a refusal of more than one line" if _is_refusal(e) else
                   "the planner failed" if type(e).__module__.startswith("ckpt_planner") else "a raw exception")
            row = {"status": "FAIL", "reason": f"{why}: {text.splitlines()[0][:300]}",
                   "raised_at": f"{Path(where.filename).name}:{where.lineno}"}
    row["cell_s"] = time.perf_counter() - t0
    return row


def _child(name: str, path: str, conn) -> None:
    os.setsid()  # its own process group: a timeout kills it with anything it started (the CLI's process)
    try:
        row = run_cell(name, path)
    except BaseException as e:  # noqa: BLE001
        row = {"status": "FAIL", "reason": f"harness: {_line(e)}"[:300]}
    conn.send(row)
    conn.close()


def warm(cells: list[tuple[str, str]]) -> None:
    """Import here, once, what every cell imports (the planner, transformers' model classes, peft, dynamo): each
    cell forks from this process, and importing them again in every cell costs seconds of CPU apiece."""
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    import ckpt_planner.api  # noqa: F401
    import ckpt_planner.cli.commands  # noqa: F401
    import ckpt_planner.cli.export  # noqa: F401
    import ckpt_planner.verification  # noqa: F401

    with contextlib.suppress(ImportError):
        import transformers

        transformers.logging.set_verbosity_error()
    for name in sorted({n for n, _ in cells}):
        with contextlib.suppress(Exception):
            build(name)  # imports the model's classes; the cell builds it again, seeded the same
    paths = {p for _, p in cells}
    if "peft" in paths:
        with contextlib.suppress(ImportError):
            import peft  # noqa: F401
    if paths & set(COMPILE_PATHS):
        import ckpt_planner.compile.compiled  # noqa: F401
        from torch._inductor import compile_fx  # noqa: F401


def run_matrix(cells: list[tuple[str, str]], jobs: int, on_row) -> None:
    """Run each cell in a forked process, `jobs` at a time; `on_row(name, path, row)` as each ends."""
    ctx = multiprocessing.get_context("fork")
    pending, running = list(cells), {}
    while pending or running:
        while pending and len(running) < jobs:
            name, path = pending.pop(0)
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_child, args=(name, path, send), daemon=False)
            proc.start()
            send.close()
            slow = SLOW_CAPTURE.get(name, 1.0)
            limit = TIMEOUT_S.get(path, DEFAULT_TIMEOUT_S) * slow * (CAPTURES.get(path, 1) if slow > 1 else 1)
            running[(name, path)] = (proc, recv, time.monotonic(), limit)
        for key, (proc, recv, start, limit) in list(running.items()):
            row = None
            if recv.poll():
                try:
                    row = recv.recv()
                except EOFError:
                    row = None
                proc.join(10)
            if row is None and not proc.is_alive():
                proc.join()
                row = {"status": "FAIL", "reason": f"crashed (exit code {proc.exitcode})"}
            elif row is None and time.monotonic() - start > limit:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.join()
                row = {"status": "FAIL", "reason": f"timed out after {limit:.0f} s", "timeout": True}
            if row is not None:
                row.setdefault("cell_s", time.monotonic() - start)
                del running[key]
                on_row(*key, row)
        time.sleep(0.2)


def _head() -> str:
    """The checkout's commit as a cell ends: cells run over a while, and the code may move under them."""
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return done.stdout.strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.conformance", description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=None, help=f"comma-separated (default: all {len(MODELS)})")
    parser.add_argument("--paths", default=None, help=f"comma-separated of {','.join(PATHS)} (default: all)")
    parser.add_argument("--quick", action="store_true", help="a small sample: " + ",".join(QUICK_MODELS) + " x "
                        + ",".join(QUICK_PATHS))
    parser.add_argument("--jobs", type=int, default=1, help="cells run at once (default 1)")
    parser.add_argument("--update", action="store_true", help="keep the other cells of an existing conformance.json")
    parser.add_argument("--resume", action="store_true",
                        help="keep every cell of an existing conformance.json and run only the cells it lacks")
    parser.add_argument("--order", choices=("model", "path"), default="path",
                        help="path: every model on a path before the next path (default), model: the other way")
    parser.add_argument("--all-compile", action="store_true",
                        help="the compile paths on every model chosen (default: " + ",".join(COMPILE_MODELS) + ")")
    parser.add_argument("--timeout", type=float, default=None,
                        help=f"seconds a cell may take (default {DEFAULT_TIMEOUT_S}, compiled and CLI cells longer)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="output folder")
    args = parser.parse_args(argv)
    names = args.models.split(",") if args.models else list(QUICK_MODELS if args.quick else MODELS)
    paths = args.paths.split(",") if args.paths else list(QUICK_PATHS if args.quick else PATHS)
    unknown = [n for n in names if n not in MODELS] + [p for p in paths if p not in PATHS]
    if unknown:
        parser.error(f"unknown model or path: {', '.join(unknown)}")
    cells = ([(n, p) for p in sorted(paths, key=RUN_ORDER.index) for n in names] if args.order == "path"
             else [(n, p) for n in names for p in paths])
    if not args.all_compile and not args.models:
        cells = [(n, p) for n, p in cells if p not in COMPILE_PATHS or n in COMPILE_MODELS]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    earlier: dict = {}
    if (args.update or args.resume) and (out / "conformance.json").is_file():
        earlier = json.loads((out / "conformance.json").read_text())
        old = earlier["rows"]
        done = {(r["model"], r["path"]) for r in old}
        cells = [c for c in cells if c not in done] if args.resume else cells
        rows = [r for r in old if (r["model"], r["path"]) not in set(cells)]
    meta = {"torch": torch.__version__, "device": "cpu", "platform": platform.platform(terse=True),
            "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "jobs": args.jobs,
            "paths": list(PATHS), "held_out": sorted(HELD_OUT), "fraction": FRACTION,
            "inexact_fraction": INEXACT_FRACTION, "not_run": [f"{n}/{p}" for n, p in cells]}
    if earlier:  # one matrix run in several sittings: its first start, and the seconds of all of them
        meta["started"] = earlier["meta"].get("started", meta["started"])
    t0 = time.perf_counter() - earlier.get("meta", {}).get("seconds", 0.0)

    def on_row(name: str, path: str, row: dict) -> None:
        rows.append({"model": name, "path": path, "family": FAMILY[name], "held_out": name in HELD_OUT, **row,
                     "ran_at": time.strftime("%H:%M:%S", time.gmtime()), "commit": _head()})
        meta["not_run"].remove(f"{name}/{path}")
        meta["seconds"] = time.perf_counter() - t0
        meta["commits"] = sorted({r["commit"] for r in rows if r.get("commit")})
        print(f"{name:18s} {path:14s} {row['status']:6s} {row.get('cell_s', 0):6.1f}s {row.get('reason', '')[:150]}",
              flush=True)
        order = {n: i for i, n in enumerate(MODELS)}
        rows.sort(key=lambda r: (order.get(r["model"], 999), PATHS.index(r["path"])))
        (out / "conformance.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))
        (out / "conformance.md").write_text(markdown(rows, meta))

    if args.timeout:
        globals()["DEFAULT_TIMEOUT_S"] = int(args.timeout)  # read by run_matrix as each cell starts
        TIMEOUT_S.update(dict.fromkeys(TIMEOUT_S, int(args.timeout)))
    warm(cells)
    run_matrix(cells, max(1, args.jobs), on_row)
    fails = sum(r["status"] == "FAIL" for r in rows)
    print(f"{len(rows)} cells, {fails} FAIL; written to {out / 'conformance.md'}")
    return 1 if fails else 0


if __name__ == "__main__":
    raise SystemExit(main())

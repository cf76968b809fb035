"""Memory vs step time: our plans against the checkpointing users pick today, measured in one process.

For each model, every contender runs the same training step (forward + backward)
in the same process, timed round-robin (in a new shuffled order each round, so that no contender
always follows the same one and inherits its allocator state) so that machine noise hits them alike;
a contender's step time is the fastest of its rounds (`--statistic median` for the median):

- none: no checkpointing (the baseline);
- per-block: every transformer layer checkpointed (HF `gradient_checkpointing_enable`,
  non-reentrant), or each stage/block of a CNN wrapped by hand in torch.utils.checkpoint;
- sequential: `torch.utils.checkpoint.checkpoint_sequential` with sqrt(n) segments, where the
  model is a plain chain of blocks;
- compile: `torch.compile` (inductor) with `torch._functorch.config.activation_memory_budget`
  in 0.1 .. 0.9, and without a budget (its own baseline);
- ours: every registered solver at activation budgets 0.25 / 0.5 / 0.75, at the least memory it
  reaches, and at per-block's measured peak; `selective` is the baseline policy (a region per
  block, matmul/conv/attention outputs kept). Each plan's predicted overhead (the planner's
  predicted step time against the eager step it measured) stands beside the measured one.
- largest batch (gpt2, llama by default): within no checkpointing's measured peak at batch 4,
  the largest batch each of none, per-block and ours trains (tradeoff_batch.py).

Peak memory on CPU is the allocator's: the running sum of the `[memory]` events
of `torch.profiler` (profile_memory=True), which sees allocations inside
compiled code too; `LiveMemory` (a dispatch mode, blind inside compiled code)
is recorded beside it for the no-checkpoint, per-block and sequential steps as
a cross-check. On CUDA it
is `max_memory_allocated` (and `max_memory_reserved`). Both include
parameters, buffers and inputs. The model's output is held through the
backward (`out = model(x); loss(out).backward()`), the step the planner
predicts; `model(x).loss.backward()` frees the logits before the backward.

    python -m benchmarks.tradeoff                      # CPU sizes, all models (minutes)
    python -m benchmarks.tradeoff --scale tiny --models gpt2 --out /tmp/t
    python -m benchmarks.tradeoff --device cuda --scale full
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # the profiler's memory meter, without a log line per start

import ckpt_planner.solvers as solvers  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from ckpt_planner.api import Planner  # noqa: E402
from ckpt_planner.capture.trace import capture, normalize_inputs  # noqa: E402
from ckpt_planner.choose.assemble import plan_from_solution  # noqa: E402
from ckpt_planner.choose.race.calibration import with_step_times  # noqa: E402
from ckpt_planner.lower.rewrite import rewrite  # noqa: E402
from ckpt_planner.profile.memory import LiveMemory  # noqa: E402
from ckpt_planner.profile.profiler import ProfileConfig, profile  # noqa: E402
from ckpt_planner.profile.timing_store import STORE_ENV  # noqa: E402
from ckpt_planner.solvers.heuristics.selective import block_regions  # noqa: E402
from ckpt_planner.verification import default_loss  # noqa: E402

from ._io import out_dir, write_files  # noqa: E402
from .tradeoff_batch import largest_batches  # noqa: E402
from .tradeoff_models import MODELS, SIZES  # noqa: E402
from .tradeoff_report import write_report  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
OUR_BUDGETS = (0.25, 0.5, 0.75)
COMPILE_BUDGETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
# A contender's step time from its interleaved rounds. The fastest: load on a shared machine only adds
# time (one contender's steps in one run spread by 30 % and more on two cores), and the planner's
# calibration takes the fastest of its rounds too, so prediction and measurement read alike.
STATISTICS = {"fastest": min, "median": statistics.median}


class Contender:
    """One way to run the training step: a module, its family and its knob."""

    def __init__(self, name: str, family: str, setting: float | None, module: nn.Module,
                 params: list[nn.Parameter], **extra) -> None:
        self.name, self.family, self.setting, self.module = name, family, setting, module
        self.params = params  # aligned with the original model's parameters(), for the gradient check
        self.extra = extra
        self.times: list[float] = []
        self.result: dict = {"name": name, "family": family, "setting": setting, **extra}


def _step(c: Contender, args: tuple, kwargs: dict, device: torch.device) -> None:
    for p in c.params:
        p.grad = None
    default_loss(c.module(*args, **kwargs)).backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _resident(c: Contender, args: tuple, kwargs: dict) -> int:
    """Bytes of the parameters, buffers and inputs the step starts with (unique storages)."""
    ts = list(c.module.parameters()) + list(c.module.buffers()) + [t for t in list(args) + list(kwargs.values()) if isinstance(t, torch.Tensor)]
    return sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in ts}.values())


def _alloc_peak(c: Contender, args: tuple, kwargs: dict, device: torch.device) -> int:
    """Peak bytes allocated above the start of one step, from the profiler's allocator events."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    for p in c.params:
        p.grad = None
    with tprofile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = c.module(*args, **kwargs)  # held through backward, as the planner assumes
        default_loss(out).backward()
        del out
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns())
    current = peak = 0
    for e in events:
        if e.device_type() == torch.autograd.DeviceType.CPU:
            current += e.nbytes()  # bytes; negative for a free
            peak = max(peak, current)
    return peak


def measure_memory(c: Contender, args: tuple, kwargs: dict, device: torch.device, base_grads) -> None:
    """Peak memory of one step (allocator meter, LiveMemory for eager code) and the gradients' agreement."""
    r = c.result
    r["resident_bytes"] = _resident(c, args, kwargs)
    torch.manual_seed(0)
    if device.type == "cuda":
        for p in c.params:
            p.grad = None
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        out = c.module(*args, **kwargs)  # held through backward, as the planner assumes
        default_loss(out).backward()
        del out
        torch.cuda.synchronize(device)
        r["measured_peak_bytes"] = torch.cuda.max_memory_allocated(device) - before + r["resident_bytes"]
        r["reserved_peak_bytes"] = torch.cuda.max_memory_reserved(device)
    else:
        r["measured_peak_bytes"] = _alloc_peak(c, args, kwargs, device) + r["resident_bytes"]
        if c.family in ("none", "per-block", "sequential"):  # the cross-check; ours run the same eager ops
            for p in c.params:
                p.grad = None
            mem = LiveMemory()
            mem.track(list(c.module.parameters()), list(c.module.buffers()), args, kwargs)
            torch.manual_seed(0)
            with mem:
                out = c.module(*args, **kwargs)  # held through backward, as the planner assumes
                default_loss(out).backward()
                del out
            r["live_memory_peak_bytes"] = mem.peak
    grads = [p.grad for p in c.params]
    if base_grads is not None and len(grads) == len(base_grads):
        diffs = [0.0 if a is None and b is None else float("inf") if (a is None) != (b is None)
                 else (a.double() - b.double()).abs().max().item() for a, b in zip(grads, base_grads)]
        r["max_abs_grad_diff"] = max(diffs, default=0.0)
    for p in c.params:
        p.grad = None


def _compiled(model: nn.Module, budget: float | None) -> tuple[nn.Module, list[nn.Parameter]]:
    """torch.compile(model) whose AOT partitioner runs under activation_memory_budget=budget."""
    import torch._functorch.config as fconfig
    from torch._inductor.compile_fx import compile_fx

    def backend(gm, example_inputs):
        if budget is None:
            return compile_fx(gm, example_inputs)
        with fconfig.patch(activation_memory_budget=budget):
            return compile_fx(gm, example_inputs)

    # A copy per budget: dynamo's guards then tell the variants apart and all stay alive for interleaving.
    twin = copy.deepcopy(model)
    return torch.compile(twin, backend=backend), list(twin.parameters())


def _contender(name: str, family: str, f, cost, problem, sol, cap, case, wall: float,
               budget: int | None = None) -> Contender:
    plan = plan_from_solution(cost, problem, sol, cap)
    module = rewrite(cap.graph_module, plan.spans(), model=case.model, saved=plan.saved_indices())
    return Contender(name, family, f, module, list(case.model.parameters()), budget_bytes=budget,
                     predicted_peak_bytes=plan.predicted_peak_bytes, solve_time_s=wall,
                     regions=len(plan.regions), predicted_recompute_s=plan.predicted_recompute_s,
                     predicted_overhead=plan.predicted_overhead, saved_ops=len(plan.saved_indices()),
                     predicted_call_s=plan.call_overhead_s)


def _twice(case, problem, solver: str = "auto", fractions: tuple[float, ...] = (0.5, 0.75)) -> dict:
    """optimize() twice (Planner: capture, profile, solve), from an empty timing store, at the same
    budget (the first of `fractions` of the activations the profile can meet): is the plan the same?
    And a third time from scratch with the store off (every figure timed again), which shows what the
    store holds still."""
    base = solvers.simulate(problem, ()).peak_bytes
    fraction = fractions[-1]
    for f in fractions:
        try:
            solvers.solve(problem, int(problem.fixed_bytes + f * (base - problem.fixed_bytes)), "dp")
        except (solvers.InfeasibleBudgetError, ValueError, RuntimeError):
            continue
        fraction = f
        break

    def optimized(stored: bool):
        try:
            plan = Planner(case.model, case.inputs, profile_config=ProfileConfig(timing_store=stored)).plan(
                activation_budget=fraction, solver=solver)
        except (solvers.InfeasibleBudgetError, ValueError, RuntimeError) as e:
            return ("error", str(e)[:120]), None
        return (tuple(map(tuple, plan.spans())), tuple(plan.saved_indices())), plan

    before = os.environ.get(STORE_ENV)
    with tempfile.TemporaryDirectory(prefix="ckpt-planner-twice-") as empty:
        os.environ[STORE_ENV] = empty
        try:
            first, plan1 = optimized(True)
            runs = {"store": optimized(True), "scratch": optimized(False)}
        finally:
            if before is None:
                os.environ.pop(STORE_ENV, None)
            else:
                os.environ[STORE_ENV] = before
    out = {"solver": solver, "activation_budget": fraction}
    for label, (second, plan2) in runs.items():
        times_equal = gap = None
        if plan1 is not None and plan2 is not None:
            p1, p2 = plan1.problem, plan2.problem
            times_equal = f"{sum(a.time == b.time for a, b in zip(p1.nodes, p2.nodes))} of {p1.n}"
            if p1.base_step_s > 0:
                # Both plans priced on the first run's figures: a difference between near-equal plans, or a worse one?
                t1 = solvers.simulate(p1, first[0], saved=first[1]).recompute_time
                t2 = solvers.simulate(p1, second[0], saved=second[1]).recompute_time
                gap = (t2 - t1) / p1.base_step_s
        result = {"same_plan": first == second, "regions": [len(p[0]) if p[0] != "error" else None for p in (first, second)],
                  "node_times_equal": times_equal, "step_gap": gap,
                  "kept_earlier_plan": plan2 is not None and any("kept the plan an earlier run chose" in n for n in plan2.notes)}
        if label == "store":
            out.update(result)
        else:
            out["from_scratch"] = result
    return out


def _headroom(problem) -> dict | None:
    """The memory a plan may keep beyond the per-block plan's at that plan's predicted peak (simulated).

    Every byte a plan keeps from the forward is alive when the backward starts (at the loss), so the
    most any plan within the per-block peak keeps beyond the per-block plan is that peak less the
    per-block plan's own memory over the backward before its first recompute. `None` without blocks.
    """
    regions = block_regions(problem)
    if not regions:
        return None
    sim = solvers.simulate(problem, regions, timeline=True)
    before = []
    for phase, _node, nbytes in sim.timeline:
        if phase == "recompute":
            break
        if phase == "backward":
            before.append(nbytes)
    start = max(before, default=sim.peak_bytes)
    activations = solvers.simulate(problem, ()).peak_bytes - problem.fixed_bytes
    return {"per_block_peak_bytes": sim.peak_bytes, "backward_start_bytes": start,
            "headroom_bytes": sim.peak_bytes - start, "activation_bytes": activations}


def ours(case, args, kwargs, solver_names, budgets, meta: dict, extra_budgets: dict | None = None) -> list[Contender]:
    """Capture and profile once, then solve and rewrite per (solver, activation budget), as optimize() does.

    `extra_budgets`: {label: bytes}, budgets in bytes solved for besides the activation fractions.
    """
    t0 = time.perf_counter()
    cap = capture(case.model, case.inputs)
    cost = profile(cap, ProfileConfig())
    cost = with_step_times(cost, case.model, cap.graph_module, cap.args, cap.kwargs)
    problem = cost.to_problem(name=case.name)
    meta["profile_overheads"] = {"region_s": cost.region_overhead_s, "op_s": cost.op_overhead_s, "saved_s": cost.saved_overhead_s,
                                 "eager_step_s": cost.step_time_s, "graph_overhead_s": cost.graph_overhead_s,
                                 "recompute_scale": cost.recompute_scale}
    meta["capture_profile_s"] = time.perf_counter() - t0
    meta["headroom"] = _headroom(problem)
    meta["determinism"] = _twice(case, problem)
    meta["capture_method"] = cap.method
    meta["graph_nodes"] = len(cost.nodes)
    base_peak = solvers.simulate(problem, ()).peak_bytes
    meta["predicted_baseline_peak_bytes"] = base_peak
    out = []
    act = base_peak - problem.fixed_bytes
    for name in solver_names:
        smallest = None
        for f in budgets:
            budget = int(problem.fixed_bytes + f * act)
            t1 = time.perf_counter()
            try:
                sol = solvers.solve(problem, budget, name)
            except (solvers.InfeasibleBudgetError, ValueError, RuntimeError) as e:
                meta.setdefault("infeasible", []).append({"solver": name, "activation_budget": f, "error": str(e)[:200]})
                if isinstance(e, solvers.InfeasibleBudgetError) and smallest is None:
                    smallest = e.smallest_bytes
                continue
            out.append(_contender(f"ours-{name}@{f}", f"ours-{name}", f, cost, problem, sol, cap, case,
                                  time.perf_counter() - t1, budget))
        for label, budget in (extra_budgets or {}).items():
            t1 = time.perf_counter()
            try:
                sol = solvers.solve(problem, budget, name)
            except (solvers.InfeasibleBudgetError, ValueError, RuntimeError) as e:
                meta.setdefault("infeasible", []).append({"solver": name, "activation_budget": label, "error": str(e)[:200]})
                continue
            f = round((budget - problem.fixed_bytes) / act, 3) if act > 0 else 1.0
            out.append(_contender(f"ours-{name}@{label}", f"ours-{name}", f, cost, problem, sol, cap, case,
                                  time.perf_counter() - t1, budget))
        if smallest is not None and act > 0:
            # The least memory this solver reaches: the smallest budget its infeasible error named.
            t1 = time.perf_counter()
            try:
                sol = solvers.solve(problem, smallest, name)
            except (solvers.InfeasibleBudgetError, ValueError, RuntimeError) as e:
                meta.setdefault("infeasible", []).append({"solver": name, "activation_budget": "min", "error": str(e)[:200]})
                continue
            f = round((smallest - problem.fixed_bytes) / act, 3)
            out.append(_contender(f"ours-{name}@min", f"ours-{name}", f, cost, problem, sol, cap, case,
                                  time.perf_counter() - t1, smallest))
    # Per-block checkpointing's own plan, run through our rewrite and priced by our cost model: the same
    # plan as the per-block contender, so the two measure our execution against theirs, and its
    # prediction beside our solvers' is what the cost model believes the best plan saves over it.
    regions = block_regions(problem)
    if regions and act > 0:
        sim = solvers.simulate(problem, regions)
        sol = solvers.Solution(regions=regions, solver="blocks", peak_bytes=sim.peak_bytes,
                               recompute_time=sim.recompute_time)
        out.append(_contender("per-block-plan", "per-block-plan", round((sim.peak_bytes - problem.fixed_bytes) / act, 3),
                              cost, problem, sol, cap, case, 0.0))
    return out


def run_model(case, args, kwargs, device, solver_names, compile_budgets, repeats, warmup, log,
              batch_solvers: tuple[str, ...] = (), statistic: str = "fastest") -> dict:
    meta: dict = {"name": case.name, "title": case.title, "shapes": case.shapes, "statistic": statistic,
                  "parameters": sum(p.numel() for p in case.model.parameters())}
    contenders = [Contender("none", "none", None, case.model, list(case.model.parameters()))]
    twin = copy.deepcopy(case.model)
    contenders.append(Contender("per-block", "per-block", None, case.per_block(twin), list(twin.parameters()),
                                how=case.per_block_how))
    if case.sequential is not None:
        twin = copy.deepcopy(case.model)
        seq_module, n_blocks = case.sequential(twin)
        contenders.append(Contender("sequential", "sequential", None, seq_module, list(twin.parameters()),
                                    blocks=n_blocks, segments=round(math.sqrt(n_blocks))))
    else:
        meta["sequential"] = case.sequential_why
    log(f"[{case.name}] capture + profile + solve")
    per_block = contenders[1]
    per_block_peak = None
    try:  # our plans are also solved at per-block's measured peak
        _step(per_block, args, kwargs, device)
        measure_memory(per_block, args, kwargs, device, None)
        per_block_peak = per_block.result["measured_peak_bytes"]
    except Exception as e:  # noqa: BLE001 - reported with the contender below
        meta["per_block_budget_error"] = str(e)[:200]
    extra = {"per-block": per_block_peak} if per_block_peak else {}
    contenders += ours(case, args, kwargs, solver_names, OUR_BUDGETS, meta, extra)
    if compile_budgets:
        contenders.append(Contender("compile", "compile", 1.0, *_compiled(case.model, None)))
        contenders += [Contender(f"compile@{b}", "compile", b, *_compiled(case.model, b)) for b in compile_budgets]
    log(f"[{case.name}] {len(contenders)} contenders; warm-up (compiles {len(compile_budgets) + 1 if compile_budgets else 0})")
    for c in contenders:
        t0 = time.perf_counter()
        try:
            for _ in range(warmup):
                _step(c, args, kwargs, device)
        except Exception as e:  # a contender that fails is reported, not fatal
            c.result["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        c.result["warmup_s"] = time.perf_counter() - t0
    contenders = [c for c in contenders if "error" not in c.result] + [c for c in contenders if "error" in c.result]
    live = [c for c in contenders if "error" not in c.result]
    log(f"[{case.name}] memory")
    torch.manual_seed(0)
    measure_memory(live[0], args, kwargs, device, None)
    torch.manual_seed(0)
    _step(live[0], args, kwargs, device)
    base_grads = [None if p.grad is None else p.grad.detach().clone() for p in live[0].params]
    for c in live[1:]:
        measure_memory(c, args, kwargs, device, base_grads)
    log(f"[{case.name}] timing, {repeats} interleaved rounds")
    order = random.Random(0)
    for _ in range(repeats):
        for c in order.sample(live, len(live)):  # glibc's heap after a large step makes the next one pay page faults
            t0 = time.perf_counter()
            _step(c, args, kwargs, device)
            c.times.append(time.perf_counter() - t0)
    pick = STATISTICS[statistic]
    base = pick(live[0].times)
    compile_base = next((pick(c.times) for c in live if c.name == "compile"), None)
    for c in live:
        r = c.result
        r["step_s"] = pick(c.times)
        r["median_step_s"] = statistics.median(c.times)
        r["step_times_s"] = c.times
        r["time_vs_none"] = r["step_s"] / base
        ref = compile_base if c.family == "compile" else base
        r["overhead"] = r["step_s"] / ref - 1 if ref else None
    meta["contenders"] = [c.result for c in contenders]
    if batch_solvers:
        log(f"[{case.name}] largest batch within no checkpointing's peak at batch 4")

        def measure(module, a, k) -> int:
            c = Contender("batch", "batch", None, module, list(module.parameters()))
            measure_memory(c, a, k, device, None)
            return c.result["measured_peak_bytes"]

        meta["largest_batch"] = largest_batches(case, measure, batch_solvers, log)
    return meta


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.tradeoff", description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--scale", choices=("tiny", "cpu", "wide", "full"), default="cpu",
                    help="model sizes (tradeoff_models.SIZES); 'wide' (d=256, seq 256, batch 4) is for gpt2 and llama only")
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma list of {', '.join(MODELS)}")
    ap.add_argument("--solvers", default=None,
                    help="comma list (default: every registered solver but 'none', 'auto' and the test oracle 'bruteforce')")
    ap.add_argument("--compile-budgets", default=",".join(map(str, COMPILE_BUDGETS)), help="'' skips torch.compile")
    ap.add_argument("--compile-models", default=None, help="models that get the torch.compile contenders (default: all)")
    ap.add_argument("--warm-compile", action="store_true",
                    help="only compile every torch.compile variant and run one step (fills inductor's on-disk caches)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--statistic", choices=tuple(STATISTICS), default="fastest",
                    help="a contender's step time from its rounds (default: the fastest)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads (default: torch's own; 1 keeps a shared machine's load from "
                         "stalling a thread pool)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--note", default="", help="a line for the report (e.g. the machine was shared)")
    ap.add_argument("--batch-models", default="gpt2,llama",
                    help="models that get the largest-batch search ('' skips it)")
    ap.add_argument("--batch-solvers", default="auto,selective", help="our solvers in the largest-batch search")
    ap.add_argument("--timings", default=None,
                    help="the timing store's folder (default: a new empty one, so that this run times every "
                         "figure itself; 'off' turns the store off)")
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    names = [m for m in a.models.split(",") if m]
    unknown = [m for m in names if m not in MODELS]
    if unknown:
        ap.error(f"--models: unknown {unknown}; valid: {', '.join(MODELS)}")
    unsized = [m for m in names if a.scale not in SIZES.get(m, {a.scale: None})]
    if unsized:
        ap.error(f"--scale {a.scale}: no sizes for {unsized}; choose other --models or another --scale")
    # 'auto' runs the others and keeps the best predicted plan, so its plan is one of theirs
    registered = sorted(s for s in solvers.SOLVERS if s not in ("none", "bruteforce", "auto"))
    solver_names = [s for s in a.solvers.split(",") if s] if a.solvers else registered
    compile_budgets = [float(b) for b in a.compile_budgets.split(",") if b]
    if a.threads is not None:
        if a.threads < 1:
            ap.error(f"--threads: {a.threads} must be at least 1")
        torch.set_num_threads(a.threads)
    # A store of this run's own (removed at the end) unless --timings names one.
    store_folder = a.timings or tempfile.mkdtemp(prefix="ckpt-planner-timings-")
    os.environ[STORE_ENV] = store_folder
    try:
        return _run(a, device, names, solver_names, compile_budgets, store_folder)
    finally:
        if a.timings is None:
            shutil.rmtree(store_folder, ignore_errors=True)


def _run(a: argparse.Namespace, device: torch.device, names: list[str], solver_names: list[str],
         compile_budgets: list[float], store_folder: str) -> int:
    import torch._dynamo as dynamo

    dynamo.config.cache_size_limit = 64
    dynamo.config.accumulated_cache_size_limit = 1024
    start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"{time.perf_counter() - start:7.1f}s {msg}", flush=True)

    results = {
        "meta": {
            "scale": a.scale, "device": str(device), "torch": torch.__version__,
            "transformers": __import__("transformers").__version__, "python": platform.python_version(),
            "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "solvers_registered": sorted(solvers.SOLVERS),
            "solvers_run": solver_names, "our_activation_budgets": list(OUR_BUDGETS),
            "compile_budgets": compile_budgets, "repeats": a.repeats, "statistic": a.statistic, "warmup": a.warmup,
            "note": a.note,
            "timing_store": "off" if store_folder == "off" else ("given" if a.timings else "new, empty"),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "memory_meter": "CUDA max_memory_allocated" if device.type == "cuda"
            else "CPU allocator events (torch.profiler profile_memory) + resident parameters/buffers/inputs",
        },
        "models": [],
    }
    compile_models = a.compile_models.split(",") if a.compile_models is not None else names
    results["meta"]["compile_models"] = compile_models
    for name in names:
        case = MODELS[name](a.scale, device)
        args, kwargs = normalize_inputs(case.inputs, case.model)
        case.model.train()
        budgets = compile_budgets if name in compile_models else []
        if a.warm_compile:
            for b in [None, *budgets]:
                module, params = _compiled(case.model, b)
                _step(Contender("compile", "compile", b, module, params), args, kwargs, device)
                log(f"[{name}] compiled and ran torch.compile at budget {b}")
            continue
        batch_solvers = tuple(x for x in a.batch_solvers.split(",") if x) if name in a.batch_models.split(",") else ()
        results["models"].append(run_model(case, args, kwargs, device, solver_names, budgets, a.repeats, a.warmup, log,
                                           batch_solvers, a.statistic))
        del case
        dynamo.reset()
        results["meta"]["total_s"] = time.perf_counter() - start
        out = Path(a.out)
        out_dir(out)
        write_report(results, out)  # after every model, so that a cut-short run keeps what it measured
        write_files(out, {"tradeoff.json": json.dumps(results, indent=1, default=float)})
        log(f"wrote {out / 'tradeoff.json'} and {out / 'tradeoff.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

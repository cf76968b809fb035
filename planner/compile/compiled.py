"""The plan lowered into torch.compile, judged on the compiled step's allocator peak.

Two lowerings (`lowering=`): "regions", below; "knapsack", the model compiled without regions with our
knapsack choosing which single ops compile's partitioner may recompute, under a byte target searched
against the measured peak (planner/compile/knapsack.py); "best" (default) makes both for the budget and keeps the
one that fits with the faster compiled step: the median, over `timing_repeats` interleaved rounds, of the
ratio of their step times; both figures in `plan.stats["compiled"]["lowerings"]` and the notes. Time is measured, not estimated, because the two
lowerings' own estimates (eager node times summed over whole regions; a FLOP/bytes roofline per op) are
not on one scale, and inductor's fusion changes what either costs.

Region lowering: the eager plan's checkpointed module (non-reentrant `checkpoint` regions) is compiled
whole with inductor, `fullgraph=True` (a plan with no regions: the captured graph, never the model's own
code, whose Python may log or branch where fullgraph compilation refuses it); dynamo turns each region into a `tag_activation_checkpoint`
call and the AOT partitioner recomputes it in the compiled backward, fused with its neighbours.
Selective regions lose their kept ops under compile (their cache is entered by `keep_begin`,
which the trace skips): they are recomputed whole, which saves more and costs more than planned.

Inductor plans its own buffers, so the eager prediction is not the compiled peak. Each compiled
plan runs one warm-up step (the compile) and one metered step (`AllocatorMeter`: the CPU
profiler's allocator events, on CUDA `max_memory_allocated`); the peak counted is the resident
state (parameters, buffers, inputs, optimizer state named by the plan) plus the step's allocator
peak above it. A plan over its budget is planned again for the budget scaled by the overshoot
(activation part only), at most `max_replans` times; then `CompiledBudgetError`. A plan well under
its budget is planned again looser (at most `max_loosen` times), kept while it fits and is predicted
to recompute less: the eager prediction errs both ways under compile.

`CompiledPlanner.sweep` makes a curve whose measured peaks never rise as the budget falls: where
a tighter budget measures above a looser one, the looser plan (which fits it too, and was planned
with more room, so it is no slower by the planner's model) is used for it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._dynamo.exc import TorchDynamoException
from torch.utils import _pytree as pytree

from ..capture.shapes import ShapeGuard, input_shapes
from ..choose.base import BasePlanner
from ..choose.budget import ResolvedBudget, budget_of
from ..errors import InputError
from ..lower.rewrite import rewrite
from ..plan import Plan
from ..settings import LOWERINGS, Budget, PlanRequest
from ..solvers.registry import InfeasibleBudgetError
from .compiled_measure import _device_of, _loss, _quartiles, interleaved_step_times, measure_compiled_step
from .knapsack import KnapsackLowering, KnapsackSolver, inductor_backend, remembered

__all__ = ["LOWERINGS", "CompiledBudgetError", "CompiledPlanModule", "CompiledPlanner", "compile_plan_module", "compile_saved_plan",
           "interleaved_step_times", "measure_compiled_step"]

_MODEL_ITSELF = "plan.module is the model itself"  # lower/build.py's note on a plan with no regions


class CompiledBudgetError(InfeasibleBudgetError):
    """No compiled plan tried measured within the budget; `smallest_bytes` is the least peak measured."""

    def __init__(self, budget_bytes: int, smallest_bytes: int, solver: str, fixed_bytes: int, tries: int) -> None:
        self.budget_bytes = budget_bytes
        self.smallest_bytes = smallest_bytes
        self.solver = solver
        RuntimeError.__init__(
            self,
            f"budget {budget_bytes / 1e6:.3f} MB is infeasible under torch.compile: every compiled plan of solver "
            f"{solver!r} tried ({tries}) measured over it, the least at {smallest_bytes / 1e6:.3f} MB ({smallest_bytes} bytes, "
            f"of which {fixed_bytes / 1e6:.3f} MB is parameters, inputs and optimizer state); raise the budget to "
            "at least that or reduce the batch size",
        )


class CompiledPlanModule(torch.nn.Module):
    """A plan's checkpointed module with its training forward compiled (inductor, fullgraph).

    It shares the checkpointed module's parameters, buffers and submodules (same `state_dict`
    keys as the model). Eval mode, and inputs above the planned shape, go through the eager
    checkpointed module (its shape guard and the original model), uncompiled.
    """

    def __init__(self, eager: torch.nn.Module, **compile_options: Any) -> None:
        super().__init__()
        self._modules = eager._modules  # same objects: parameters(), state_dict() as the model's
        self._parameters = eager._parameters
        self._buffers = eager._buffers
        object.__setattr__(self, "eager", eager)
        # The GraphModule's forward is its own code object per plan, so dynamo's per-code cache
        # holds one entry per plan (compiling the shared __call__ would hit its recompile limit).
        object.__setattr__(self, "compiled_forward", torch.compile(eager.forward, fullgraph=True, **compile_options))

    def train(self, mode: bool = True) -> CompiledPlanModule:
        super().train(mode)
        self.eager.training = mode
        return self

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        eager = self.eager
        if not (self.training and torch.is_grad_enabled()):
            return eager(*args, **kwargs)
        guard = eager.__dict__.get("shape_guard")
        if guard is not None:
            args, kwargs = guard.bind(args, kwargs)
            if guard.module_for(args, kwargs) is not None:  # above the planned shape: its own plan, eager
                return eager(*args, **kwargs)
        return self.compiled_forward(*args, **kwargs)


def compile_plan_module(module: torch.nn.Module, **compile_options: Any) -> CompiledPlanModule:
    """Wrap a plan's checkpointed module so that its training step runs compiled."""
    return CompiledPlanModule(module, **compile_options)


@dataclasses.dataclass
class _Tried:
    module: CompiledPlanModule
    measured: int
    compile_s: float


class CompiledPlanner(BasePlanner):
    """Plans from a `Planner`, compiled and measured; re-planned tighter while over the budget.

        cp = CompiledPlanner(Planner(model, inputs))
        plan = cp.plan(budget_bytes=...)          # plan.module is compiled, plan.measured_peak_bytes <= budget
        curve = cp.sweep([b1, b2, ...])           # measured peaks never rise as the budget falls
    """

    def __init__(self, planner: Any, *, max_replans: int = 3, max_loosen: int = 2, slack: float = 0.05, loss_fn: Callable[[Any], torch.Tensor] = _loss,
                 compile_options: dict[str, Any] | None = None, lowering: str = "best", timing_repeats: int = 7) -> None:
        if max_replans < 0:
            raise InputError(f"max_replans: {max_replans} must be >= 0")
        if lowering not in LOWERINGS:
            raise InputError(f"lowering: {lowering!r} is not one of {', '.join(LOWERINGS)}")
        if timing_repeats < 1:
            raise InputError(f"timing_repeats: {timing_repeats} must be >= 1")
        if lowering == "knapsack" and {"backend", "mode"} & set(compile_options or {}):
            raise InputError("lowering 'knapsack' compiles with inductor and our solver: drop compile_options "
                             "backend/mode, or use lowering='regions'")
        planner.autotune = False  # compiled plans are measured and re-planned here, their own way
        cap = planner.capture
        if getattr(planner.cost, "meta", False) or any(
            t.is_meta for t in pytree.tree_leaves((cap.args, cap.kwargs)) if isinstance(t, torch.Tensor)
        ):
            raise InputError("compile: a plan made on the meta device cannot be compiled and measured; "
                             "plan on cpu/cuda or drop compile=True")
        if planner.sharding:
            raise InputError("compile: sharded plans (world_size > 1) are not measured under torch.compile; "
                             "drop compile=True or plan one rank with world_size=1")
        self.planner = planner
        self.max_replans = max_replans
        self.max_loosen = max_loosen
        """Plans tried at looser targets when the compiled step measures well under the budget."""
        self.slack = slack
        """Room (fraction of the budget's activation part) under which a looser plan is tried."""
        self.loss_fn = loss_fn
        self.compile_options = dict(compile_options or {})
        self.device = _device_of(planner.model)
        self.lowering = lowering
        self.timing_repeats = timing_repeats
        """Interleaved rounds when both lowerings fit ("best"): the median ratio of their step times decides."""
        self._tried: dict[tuple, _Tried] = {}
        self._knapsack: KnapsackLowering | None = None

    @property
    def extra_bytes(self) -> int:
        """Optimizer state: resident, counted in the budget, not allocated by the step."""
        return int(getattr(self.planner.problem, "optimizer_bytes", 0) or 0)

    def _compiled(self, plan: Plan, budget: int | None = None) -> _Tried:
        """The plan compiled and measured; not compiled (module None) where this process measured it over `budget`
        before: a refusal's budget planned again meets the plans measured the first time."""
        key = (tuple(plan.spans()), tuple(plan.saved_indices()))
        memory = self._memory("regions")
        if key not in self._tried and budget is not None and memory.get(key, -1) > budget:
            return _Tried(None, memory[key], 0.0)
        if key not in self._tried:
            cap = self.planner.capture
            t0 = time.perf_counter()
            eager = self._graph_step() if plan.module is self.planner.model else plan.module
            module = compile_plan_module(eager, **self.compile_options)
            measured = measure_compiled_step(
                module, self.planner.model, cap.args, cap.kwargs, device=self.device,
                extra_bytes=self.extra_bytes, loss_fn=self.loss_fn,
            )
            self._tried[key] = _Tried(module, measured, time.perf_counter() - t0)
            memory[key] = measured
        return self._tried[key]

    def _memory(self, lowering: str) -> dict:
        """This process's measured peaks of the model's compiled steps for one lowering (knapsack.remembered)."""
        return remembered(self.planner.model, self.planner.capture, {**self.compile_options, "loss": self.loss_fn,
                          "lowering": lowering}, self.extra_bytes, self.planner.setup.profile)

    def plan_for(self, request: PlanRequest) -> Plan:
        """A compiled plan whose measured peak is within the budget, lowered as `self.lowering` says; "best"
        lowers it both ways and keeps the faster one that fits."""
        try:
            return self._plan_for(request)
        except TorchDynamoException as e:  # dynamo's and inductor's failures: one line
            first = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
            raise InputError(f"compile: torch.compile could not compile the planned step ({type(e).__name__}: "
                             f"{first[:300]}); plan it with compile=False") from None

    def _plan_for(self, request: PlanRequest) -> Plan:
        # resolved once: the regions side plans with this record, the knapsack side holds its measured peak
        # to the budget as asked (unclamped)
        resolved = budget_of(self.planner.profiled, request)
        knapsack_ok = not ({"backend", "mode"} & set(self.compile_options))
        if self.lowering == "regions" or (self.lowering == "best" and not knapsack_ok):
            return self._plan_regions(request, resolved)
        if self.lowering == "knapsack":
            return self._plan_knapsack(resolved.asked, request)
        if resolved.asked is None:  # no budget: the knee plan; the knapsack's own loosest point has no budget to meet
            return self._plan_regions(request, resolved)
        got: dict[str, Plan] = {}
        errors: dict[str, CompiledBudgetError] = {}
        for name, make in (("regions", lambda: self._plan_regions(request, resolved)),
                           ("knapsack", lambda: self._plan_knapsack(resolved.asked, request))):
            try:
                got[name] = make()
            except CompiledBudgetError as e:
                errors[name] = e
        if not got:
            raise min(errors.values(), key=lambda e: e.smallest_bytes)
        return self._choose(got, errors)

    @property
    def baseline_peak_bytes(self) -> int:
        return self.planner.baseline_peak_bytes

    def _choose(self, got: dict[str, Plan], errors: dict[str, CompiledBudgetError]) -> Plan:
        """The faster of the lowerings that fit, by the median over interleaved rounds of the ratio of their step
        times: a round runs both back to back, so load on the machine that hits the round hits both (on a shared
        CPU a step takes either its own time or many times it, and a median per lowering can fall in either)."""
        figures: dict[str, dict[str, Any]] = {
            name: {"fits": False, "least_measured_peak_bytes": e.smallest_bytes} for name, e in errors.items()}
        for name, p in got.items():
            figures[name] = {"fits": True, "measured_peak_bytes": p.measured_peak_bytes}
        if len(got) == 1:
            (name, chosen), = got.items()
            other = next(iter(errors))
            note = (f"lowering {name}: the {other} lowering measured over the budget "
                    f"(least {errors[other].smallest_bytes / 1e6:.3f} MB)")
        else:
            cap = self.planner.capture
            times = interleaved_step_times({n: p.module for n, p in got.items()}, self.planner.model, cap.args,
                                           cap.kwargs, loss_fn=self.loss_fn, repeats=self.timing_repeats)
            for n, ts in times.items():
                q = _quartiles(ts)
                figures[n].update(step_s_median=q[1], step_s_iqr=[q[0], q[2]], step_times_s=ts)
            a, b = got  # regions, knapsack
            ratio = _quartiles([x / y for x, y in zip(times[b], times[a])])
            name, other = (b, a) if ratio[1] < 1 else (a, b)
            chosen = got[name]
            figures[b]["step_ratio_to_" + a] = {"median": ratio[1], "iqr": [ratio[0], ratio[2]]}
            f, g = figures[name], figures[other]
            note = (f"lowering {name}: {b}/{a} step time {ratio[1]:.3f} (median of {self.timing_repeats} interleaved "
                    f"rounds, IQR {ratio[0]:.3f}-{ratio[2]:.3f}); {name} {f['step_s_median'] * 1e3:.1f} ms median, "
                    f"{other} {g['step_s_median'] * 1e3:.1f} ms at {g['measured_peak_bytes'] / 1e6:.3f} MB")
        chosen.stats["compiled"]["lowerings"] = figures
        chosen.stats["compiled"]["chosen_by"] = "interleaved step-time ratio" if len(got) > 1 else "only one fits"
        chosen.notes = tuple(chosen.notes) + (note,)
        return chosen

    def _plan_knapsack(self, budget: int | None, request: PlanRequest) -> Plan:
        """Our knapsack inside the partitioner, its byte target searched until the measured peak fits."""
        fixed = self.planner.problem.fixed_bytes
        lowering = self._knapsack_lowering(request)
        best, log = lowering.fit(budget if budget is not None else 2**62, fixed)
        if best is None:
            least = min(t.measured for t in lowering.tries.values())
            raise CompiledBudgetError(budget, least, "knapsack", fixed + self.extra_bytes, len(log))
        base = self._base_plan(request)
        base.notes = tuple(n for n in base.notes if "no-op plan" not in n)  # the eager plan's, not this one's
        n = len(lowering.candidates or ())
        kept = lowering.choice(best.target_bytes) or frozenset()
        info = {"target_bytes": best.target_bytes, "candidates": n, "kept_saved": len(kept),
                "saved_bytes": best.saved_bytes, "candidate_bytes": lowering.total_bytes,
                "estimated_recompute_s": best.recompute_s,
                "peak_flops": lowering.config.peak_flops, "bandwidth": lowering.config.bandwidth}  # its cost model
        tries = [{**t, "planned_for_bytes": t["target_bytes"]} for t in log]
        return self._finish(base, _Tried(best.module, best.measured, best.compile_s), tries, budget,
                            lowering="knapsack", knapsack=info)

    def _base_plan(self, request: PlanRequest) -> Plan:
        """The model's step with no regions (its own fresh module: dynamo caches per code object); of the
        request, only its solver and on_larger_shape apply."""
        planner = self.planner
        base = planner.plan_for(PlanRequest.of(budget_bytes=planner.no_checkpoint_peak_bytes, solver=request.solve.solver,
                                               on_larger_shape=request.on_larger_shape))
        if base.regions:
            raise InputError("lowering 'knapsack': the step with no checkpoint regions did not plan empty; "
                             "use lowering='regions'")
        if base.module is planner.model:
            base.module = self._graph_step()
        return base

    def _graph_step(self) -> torch.nn.Module:
        """The model's step with no regions, as the captured graph runs it: the model's own code may log or
        branch in Python (transformers' loss logs a warning once), which fullgraph compilation refuses, while
        the graph holds only its ops. Each call builds a fresh module (dynamo caches per code object)."""
        planner, cap = self.planner, self.planner.capture
        module = rewrite(cap.graph_module, [], model=planner.model)
        guard = ShapeGuard(input_shapes(cap.args, cap.kwargs), "error", None, dynamic_dims=cap.dynamic_dims)
        object.__setattr__(module, "shape_guard", guard)
        return module

    def _knapsack_lowering(self, request: PlanRequest) -> KnapsackLowering:
        if self._knapsack is None:
            cap = self.planner.capture
            options = self.compile_options.get("options")
            rest = {k: v for k, v in self.compile_options.items() if k != "options"}

            def compile_measure(solver):
                module = self._base_plan(request).module
                t0 = time.perf_counter()
                compiled = compile_plan_module(module, backend=inductor_backend(solver, options), **rest)
                measured = measure_compiled_step(compiled, self.planner.model, cap.args, cap.kwargs, device=self.device,
                                                 extra_bytes=self.extra_bytes, loss_fn=self.loss_fn)
                return compiled, measured, time.perf_counter() - t0

            config = self.planner.setup.profile
            self._knapsack = KnapsackLowering(compile_measure, config=config,
                                              max_tries=self.max_replans + self.max_loosen, slack=self.slack,
                                              memory=self._memory("knapsack"))
        return self._knapsack

    def _plan_regions(self, request: PlanRequest, resolved: ResolvedBudget) -> Plan:
        """Whole checkpoint regions compiled; re-planned tighter while over the budget, looser well under it.
        `resolved`: the request's budget for the planner's profile; each other target is a request in bytes."""
        planner = self.planner
        try:
            first = planner.plan_for(request, resolved)
        except InfeasibleBudgetError as e:
            # Below the eager floor: the least-memory plan may still fit once inductor has planned its buffers.
            first = planner.plan_for(_in_bytes(request, e.smallest_bytes))
            first.budget_bytes = e.budget_bytes
        budget = first.budget_bytes
        if budget is None:  # no budget: the knee plan, compiled and measured, nothing to meet
            return self._finish(first, self._compiled(first), [], None)
        fixed = planner.problem.fixed_bytes
        plan, target, tries, best = first, budget, [], None
        tries_spans = [first.spans()]
        for attempt in range(1 + self.max_replans):
            tried = self._compiled(plan, budget)
            tries.append({"planned_for_bytes": target, "predicted_peak_bytes": plan.predicted_peak_bytes,
                          "measured_peak_bytes": tried.measured, "regions": len(plan.regions)})
            if best is None or tried.measured < best[1].measured:
                best = (plan, tried)
            if tried.measured <= budget:
                plan, tried = self._loosen(plan, tried, target, budget, tries, request)
                return self._finish(plan, tried, tries, budget)
            if attempt == self.max_replans:
                break
            # The activation part scaled by the overshoot, and always below the last target.
            scaled = fixed + int((target - fixed) * (budget - fixed) / max(1, tried.measured - fixed))
            target = min(scaled, target - (tried.measured - budget) // 2, target - 1)
            if target <= fixed:
                break
            try:
                plan = planner.plan_for(_in_bytes(request, target))
            except InfeasibleBudgetError as e:  # below the eager floor: the least-memory plan, once
                plan = planner.plan_for(_in_bytes(request, e.smallest_bytes))
                if plan.spans() in tries_spans:
                    break
            if plan.spans() == tries_spans[-1]:
                continue  # the same plan again: only a tighter target can change it
            tries_spans.append(plan.spans())
        raise CompiledBudgetError(budget, best[1].measured, first.solver, fixed + self.extra_bytes, len(tries))

    def _loosen(self, plan: Plan, tried: _Tried, target: int, budget: int, tries: list[dict],
                request: PlanRequest) -> tuple[Plan, _Tried]:
        """The compiled step often needs less than the eager prediction: plan again for the target scaled
        up by the room left, and keep that plan while it still fits and is predicted to recompute less."""
        fixed = self.planner.problem.fixed_bytes
        lo, hi = target, None  # targets: the kept plan's, and the least one that measured over the budget
        for _ in range(self.max_loosen):
            if tried.measured >= budget - self.slack * (budget - fixed):  # close enough to the budget
                break
            scaled = fixed + int((lo - fixed) * (budget - fixed) / max(1, tried.measured - fixed))
            up = scaled if hi is None else (lo + hi) // 2  # bisect once a looser plan went over
            if up <= lo:
                break
            try:
                other = self.planner.plan_for(_in_bytes(request, up))
            except InfeasibleBudgetError:
                break
            if other.spans() == plan.spans() and other.saved_indices() == plan.saved_indices():
                lo = up  # the same plan: a still looser target may change it
                continue
            t = self._compiled(other, budget)
            tries.append({"planned_for_bytes": up, "predicted_peak_bytes": other.predicted_peak_bytes,
                          "measured_peak_bytes": t.measured, "regions": len(other.regions), "looser": True})
            if t.measured > budget:
                hi = up
                continue
            lo = up
            if other.predicted_recompute_s < plan.predicted_recompute_s:
                plan, tried = other, t
        return plan, tried

    def _finish(self, plan: Plan, tried: _Tried, tries: list[dict], budget: int | None, *, lowering: str = "regions",
                knapsack: dict[str, Any] | None = None) -> Plan:
        out = dataclasses.replace(plan, budget_bytes=budget if budget is not None else plan.budget_bytes)
        out.module = tried.module
        out.problem = plan.problem
        out.measured_peak_bytes = tried.measured
        out.stats = {**plan.stats, "compiled": {
            "backend": self.compile_options.get("backend", "inductor"), "fullgraph": True, "lowering": lowering,
            "predicted_peak_bytes": plan.predicted_peak_bytes, "measured_peak_bytes": tried.measured,
            "compile_and_measure_s": round(tried.compile_s, 3), "tries": tries,
            "replans": sum(1 for t in tries[1:] if not t.get("looser")),
            "loosened": sum(1 for t in tries if t.get("looser")),
            **({"knapsack": knapsack} if knapsack else {}),
        }}
        if knapsack:
            notes = [f"compiled (inductor, fullgraph), knapsack lowering: measured peak {tried.measured / 1e6:.3f} MB; "
                     f"the partitioner may recompute {knapsack['candidates'] - knapsack['kept_saved']} of "
                     f"{knapsack['candidates']} candidate ops (our knapsack keeps {knapsack['saved_bytes'] / 1e6:.3f} of "
                     f"{knapsack['candidate_bytes'] / 1e6:.3f} MB saved, estimated recompute "
                     f"{knapsack['estimated_recompute_s'] * 1e3:.2f} ms)"]
        else:
            notes = [f"compiled (inductor, fullgraph), regions lowering: measured peak {tried.measured / 1e6:.3f} MB "
                     f"against {plan.predicted_peak_bytes / 1e6:.3f} MB predicted for the eager plan"]
        if any(not t.get("looser") for t in tries[1:]):
            notes.append(f"re-planned {len(tries) - 1}x at tighter budgets: the compiled step measured over the budget")
        if plan.saved_indices():
            notes.append("selective regions run as whole regions under torch.compile (their kept ops are recomputed)")
        kept = tuple(plan.notes)
        if plan.module is self.planner.model:  # compiled as its captured graph (_graph_step), not as the model
            kept = tuple(n for n in kept if _MODEL_ITSELF not in n)
            notes.append("no checkpoint regions: plan.module runs the model's captured graph compiled (the model's "
                         "own code may log or branch in Python, which fullgraph compilation refuses)")
        out.notes = kept + tuple(notes)
        return out

    def sweep(self, budgets: Sequence[int], request: PlanRequest | None = None, **plan_args: Any) -> list[Plan | None]:
        """One compiled plan per budget (bytes), None where infeasible; measured peaks never rise
        as the budget falls (a tighter budget measuring above a looser one gets the looser plan).
        `request` as `plan_for` takes it, its budget replaced by each of `budgets` (or `plan()`'s keywords)."""
        named = sorted({"budget_gb", "budget_bytes", "activation_budget"} & set(plan_args))
        if named or (request is not None and plan_args):
            raise InputError("sweep: the budgets (bytes) come first, then a PlanRequest or plan()'s keywords: "
                             f"drop {', '.join(named or sorted(plan_args))}")
        request = request or PlanRequest.of(**plan_args)
        out: dict[int, Plan | None] = {}
        looser: Plan | None = None
        for b in sorted(set(int(x) for x in budgets), reverse=True):
            try:
                plan = self.plan_for(_in_bytes(request, b))
            except InfeasibleBudgetError:
                out[b] = None
                continue
            if looser is not None and plan.measured_peak_bytes > looser.measured_peak_bytes:
                kept = dataclasses.replace(looser, budget_bytes=b)
                kept.module, kept.problem = looser.module, looser.problem
                kept.measured_peak_bytes = looser.measured_peak_bytes
                kept.stats = {**looser.stats, "kept_looser_plan": {
                    "budget_bytes": looser.budget_bytes, "own_measured_peak_bytes": plan.measured_peak_bytes}}
                kept.notes = tuple(looser.notes) + (
                    f"the plan for this budget measured {plan.measured_peak_bytes / 1e6:.3f} MB compiled, above the "
                    f"plan for {looser.budget_bytes / 1e6:.3f} MB; that plan is kept (it fits, with no more recompute)",)
                plan = kept
            out[b] = looser = plan
        return [out[int(b)] for b in budgets]


def compile_saved_plan(model: torch.nn.Module, plan: Plan, example_inputs: Any = None,
                       **compile_options: Any) -> CompiledPlanModule:
    """The training step of a compiled plan (one loaded from a file, say) compiled as it was planned:
    its checkpoint regions (regions lowering), or the model without regions with our knapsack at the
    plan's byte target inside the partitioner (knapsack lowering; the same graph gives the same choice).
    `model`: a fresh instance of the planned model; `example_inputs` as for `plan.rebuild`."""
    compiled = plan.stats.get("compiled")
    if not isinstance(compiled, dict):
        raise InputError("compile_saved_plan: the plan was not made with compile=True; use plan.rebuild(model) "
                         "(and torch.compile the module it returns)")
    module = plan._rebuild(model, example_inputs)
    if compiled.get("lowering") != "knapsack":
        return compile_plan_module(module, **compile_options)
    info = compiled.get("knapsack") or {}
    if "target_bytes" not in info:
        raise InputError("compile_saved_plan: the plan's stats.compiled.knapsack has no target_bytes; re-plan "
                         "with optimize(..., compile=True)")
    from ..profile.profiler import ProfileConfig

    config = ProfileConfig(peak_flops=info.get("peak_flops"), bandwidth=info.get("bandwidth"))
    solver = KnapsackSolver(int(info["target_bytes"]), config=config)
    options = compile_options.pop("options", None)
    return compile_plan_module(module, backend=inductor_backend(solver, options), **compile_options)


def _in_bytes(request: PlanRequest, nbytes: int) -> PlanRequest:
    """`request` with its budget `nbytes` bytes (a tighter or looser target; the same safety margin)."""
    return request.replace(budget=Budget(nbytes=nbytes, safety_margin=request.budget.safety_margin))

"""A plan from a file, checked against the model it is given: the graph it was made for (fingerprint,
regions, kept ops and offloads found by name), every figure it states re-derived on this model, its
budget, and one training step against the model's own. `Plan.rebuild` and `Plan.apply` run these before
anything changes. (`plan` is a `plan.Plan`, which imports this module.)"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx

from .errors import CaptureError, InputError, PlanMismatchError
from .plan_summary import fmt_bytes

__all__ = ["FIGURE_TOLERANCE", "graph_fingerprint", "fingerprint_of", "refuse_knapsack", "as_made_for",
           "matching_capture", "check_figures", "check_budget", "race_granted", "race_record", "module_paths",
           "ranks_here", "step_checked", "several_ranks"]

FIGURE_TOLERANCE = 0.01
"""How far (a fraction) a loaded plan's recorded peaks may be from their re-simulation on the model."""


def graph_fingerprint(gm: fx.GraphModule, example: list[Any]) -> str:
    """Hash of the captured graph: compute nodes, their wiring, constant arguments, the type (and
    settings) of every called module, and the input shapes.

    Module types count: a GELU swapped for a Tanh keeps the graph's wiring and names (symbolic_trace
    calls the module by its path) but not the memory or the gradients the plan was made for.
    """
    items: list[Any] = []
    for n in gm.graph.nodes:
        if n.op in ("call_function", "call_method", "call_module", "placeholder", "get_attr"):
            target = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))
            item = [n.op, n.name, str(target), [a.name for a in n.all_input_nodes]]
            constants = [_constant(a) for a in (*n.args, *n.kwargs.values()) if not isinstance(a, fx.Node)]
            if constants:
                item.append(constants)
            if n.op == "call_module":
                try:
                    mod = gm.get_submodule(str(n.target))
                except AttributeError:
                    mod = None
                if mod is not None:
                    item.append(f"{type(mod).__module__}.{type(mod).__qualname__}({mod.extra_repr()})")
            items.append(item)
    for t in example:
        if isinstance(t, torch.Tensor):
            items.append([list(t.shape), str(t.dtype)])
    return hashlib.sha256(json.dumps(items, default=str).encode()).hexdigest()[:20]


def _constant(value: Any) -> Any:
    """A node's constant argument as it enters the fingerprint: scalars and strings as they are, other
    objects (devices, dtypes, memory formats) by type, so a plan made on the meta device fits the real model."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_constant(v) if not isinstance(v, fx.Node) else "node" for v in value]
    return type(value).__name__


def step_checked(plan: Any, model: torch.nn.Module, module: torch.nn.Module, cap: Any,
                       check_step: bool | None) -> None:
    """A loaded plan's step against the model's (the safety net), then its measured figures."""
    from .verification import check_loaded_step, check_measured

    if check_step is None:
        check_step = not several_ranks()
    if check_step:
        check_loaded_step(plan, model, module, cap.args, cap.kwargs)
    check_measured(plan, model, module, cap.args, cap.kwargs)


def refuse_knapsack(plan: Any, what: str) -> None:
    """A knapsack-lowered compiled plan has no regions: its saving lives in the compiled partitioner."""
    compiled = plan.stats.get("compiled")
    if isinstance(compiled, dict) and compiled.get("lowering") == "knapsack":
        raise InputError(
            f"{what}: this plan's saving is a choice inside torch.compile's partitioner (knapsack lowering), "
            "not checkpoint regions; compile the model with ckpt_planner.compile.compiled.compile_saved_plan(model, plan)"
        )


def as_made_for(plan: Any, model: torch.nn.Module, example_inputs: Any) -> torch.nn.Module:
    """`model` as the plan was made for it: returning its loss alone for a plan made with outputs="loss"."""
    if plan.stats.get("outputs") != "loss":
        return model
    from .lower.outputs import loss_outputs

    return loss_outputs(model, example_inputs)


def matching_capture(plan: Any, model: torch.nn.Module, example_inputs: Any) -> Any:
    """Capture `model`; PlanMismatchError unless its graph is the one the plan was made for.

    An exported plan made on the meta device (a model too large for the planning machine) was made
    for the graph the meta device gives, the same computation as the real device's but not the same
    graph: the model is captured as on the meta device (trace.py `capture_as_on_meta`). So is an
    exported graph that does not match, for a plan file that does not say where it was captured.
    """
    from .capture.mutation import compute_nodes
    from .capture.trace import capture, capture_as_on_meta

    method = plan.capture_method if plan.capture_method in ("symbolic_trace", "export") else "auto"
    if plan.capture_method == "export" and plan.stats.get("captured_on") == "meta":
        cap, fp = _as_planned(plan, capture_as_on_meta(model, example_inputs, method="export"))
    else:
        first = capture(model, example_inputs, method=method)
        cap, fp = _as_planned(plan, first)
        if fp != plan.fingerprint and first.method == "export" and not first.on_meta:
            try:
                again = _as_planned(plan, capture_as_on_meta(model, example_inputs, method="export"))
            except CaptureError:  # not capturable on meta, so not what a plan made there was made for
                again = (None, "")
            if again[1] == plan.fingerprint:
                cap, fp = again
    if cap is None:
        raise PlanMismatchError(f"plan chunked regions do not match this model's graph ({fp})")
    if fp != plan.fingerprint:
        raise PlanMismatchError(
            f"plan fingerprint {plan.fingerprint} was made for another model or input shape "
            f"(this model's graph: {fp}); re-plan with optimize() or `ckpt-planner plan`"
        )
    nodes = compute_nodes(cap.graph_module.graph)
    for r in plan.regions:
        if r.end >= len(nodes) or nodes[r.start].name != r.first_node or nodes[r.end].name != r.last_node:
            raise PlanMismatchError(f"plan region {r.first_node}..{r.last_node} does not match this model's graph")
        for i, name in zip(r.saved_positions, r.saved_ops):
            if i >= len(nodes) or nodes[i].name != name:
                raise PlanMismatchError(f"plan saved op {name} does not match this model's graph")
    names = {n.name for n in nodes}
    for o in plan.offloaded:
        if o.node not in names:
            raise PlanMismatchError(f"plan offloaded node {o.node} does not match this model's graph")
    return cap


def _as_planned(plan: Any, cap: Any) -> tuple[Any, str]:
    """(`cap` as the plan was made on it, its fingerprint): with the plan's token-wise groups run in
    chunks (exact=False). (None, why) when those groups do not fit this graph."""
    if plan.stats.get("chunks"):
        from .lower.chunk import ChunkSpec, chunk_capture

        try:
            cap = chunk_capture(cap, [ChunkSpec.from_dict(c) for c in plan.stats["chunks"]])[0]
        except (ValueError, KeyError, TypeError, IndexError) as e:
            return None, str(e)
    return cap, fingerprint_of(cap)


def check_figures(plan: Any, model: torch.nn.Module, cap: Any, *, rel_tol: float = FIGURE_TOLERANCE,
                  eager: bool = True) -> Any:
    """Re-profile `model` (captured as `cap`) and re-derive every figure this plan states; returns the Problem.

    Raises PlanMismatchError, naming the field, when one differs from its re-simulation by more than
    `rel_tol` of it: `baseline_peak_bytes` (the model as given: its own checkpoint calls, found in
    this capture, else none), `stats.no_checkpoint_peak_bytes` (no checkpointing at all) and
    `predicted_peak_bytes` (these regions and kept ops). The file was edited, or the model, inputs or
    planner changed since it was made. Then PlanMismatchError when the plan is predicted over its own
    budget (`check_budget`). Bytes are compared, not times (times are measured and vary; here they
    come from FLOPs). The optimizer state is taken from the file's breakdown (which optimizer the plan
    assumed is not known here). Sharding is this process's: a plan made for another number of ranks is
    refused (`ranks_here`). Offloads are priced on this graph's storages: an entry's `bytes` that is not
    its storage's, or offloads over the host budget, are refused (`_check_offload_bytes`). `eager`: the
    plan runs as the eager module `rebuild` and `apply` give, judged on its eager prediction whatever the
    file says about a compiled step (False only where the caller compiles it, `compile_saved_plan`).
    """
    from .capture.own_checkpoint import own_spans
    from .distributed import rank_problem
    from .model_state import ModelState
    from .profile.profiler import ProfileConfig, profile
    from .solvers.plans import normalize_regions
    from .solvers.problem import ProblemError
    from .solvers.simulate import simulate

    with ModelState(model).preserved():
        # profiled as the plan was: a stage at a time (bounded memory) or the step whole; a plan made on
        # the meta device on fake tensors there, which are the figures it states (no workspaces, no
        # generator state in device memory)
        by_stage = plan.stats.get("profile") == "stages"
        config = ProfileConfig(warmup=0, repeats=1, flop_times=True, bounded=by_stage, meta=cap.as_on_meta)
        cost = profile(cap, config, device=torch.device("meta") if cap.as_on_meta else None)
    world, sharding = ranks_here(plan)
    optimizer = plan.baseline_breakdown.get("optimizer", plan.breakdown.get("optimizer", 0))
    # offloads priced at the bandwidths they were planned at (they change no byte figure); the host
    # budget as the file records it, which the offloads' bytes, re-derived here, are held to below
    info = plan.stats.get("offload") if plan.offloaded and isinstance(plan.stats.get("offload"), dict) else {}
    problem, _ = rank_problem(cost, model, optimizer_bytes=0, world_size=world, sharding=sharding,
                              rank_optimizer_bytes=int(optimizer or 0), **_copies(info))
    fixed = {k: float(info[k]) for k in ("d2h_fixed_s", "h2d_fixed_s")
             if isinstance(info.get(k), (int, float)) and not isinstance(info.get(k), bool)}
    if fixed:  # each copy's fixed cost (seconds), absent from plans made before copies had one
        problem = dataclasses.replace(problem, **fixed)
    nodes = cost.nodes
    own, _ = own_spans(cap.own_checkpoints, [n.name for n in nodes], [n.module for n in nodes],
                       [n.recomputable for n in nodes])
    sources = problem.meta.get("storage_outputs") or ()
    for o in plan.offloaded:  # each offloaded storage is the same node output on this model
        if not 0 <= o.storage < len(sources) or tuple(sources[o.storage]) != (o.node, o.output):
            raise PlanMismatchError(f"plan offloaded[{o.storage}]: {o.node} output {o.output} is not that storage "
                                    "of this model's graph; re-plan with optimize() or `ckpt-planner plan`")
    if plan.offloaded:
        _check_offload_bytes(plan, problem)
    try:
        spans = normalize_regions(problem, plan.spans())
        plain = simulate(problem, ()).peak_bytes
        given = simulate(problem, _nested(problem, own)).peak_bytes if own else plain
        offloaded = {"offloaded": tuple(plan.offloaded_storages())} if plan.offloaded else {}
        planned = simulate(problem, spans, saved=plan.saved_indices(), **offloaded).peak_bytes
    except ProblemError as e:
        raise PlanMismatchError(f"plan regions do not fit this model's graph: {e}") from None
    figures = [("baseline_peak_bytes", plan.baseline_peak_bytes, given),
               ("predicted_peak_bytes", plan.predicted_peak_bytes, planned)]
    if "no_checkpoint_peak_bytes" in plan.stats:  # the plain step, where the model checkpoints itself
        figures.insert(1, ("stats.no_checkpoint_peak_bytes", int(plan.stats["no_checkpoint_peak_bytes"]), plain))
    for name, recorded, actual in figures:
        if abs(recorded - actual) > rel_tol * max(actual, 1):
            raise PlanMismatchError(
                f"plan {name}: the file says {fmt_bytes(recorded)} ({recorded} bytes) but its regions "
                f"re-simulated on this model give {fmt_bytes(actual)} ({actual} bytes); the plan was edited "
                "or the model or planner changed: re-plan with optimize() or `ckpt-planner plan`"
            )
    check_budget(plan, problem.fixed_bytes, device_type=_device_type(model), eager=eager)
    return problem


def check_budget(plan: Any, fixed_bytes: int = 0, *, device_type: str | None = None, eager: bool = True) -> None:
    """PlanMismatchError when this plan is predicted over its own `budget_bytes`.

    One exception, as optimize() makes them: the prediction is over the budget by no more than the
    default safety margin of the activation part (`fixed_bytes`: parameters, inputs, optimizer state),
    and the step's peak was measured within the budget on this kind of device (`device_type`), where
    `verification.check_measured` measures it again before the plan is used. What the file says about
    itself (a race record's `fits`, a measured peak on another device) grants nothing: a plan loaded
    without a model to measure on gets no margin. A compiled plan's budget is its compiled step's
    measured peak only where the caller compiles it (`eager=False`); `rebuild` and `apply` run the
    eager module, judged on its eager prediction.
    """
    from .lower.apply import measured_fit
    from .settings import Budget

    budget = plan.budget_bytes
    if budget is None:
        return
    compiled = plan.stats.get("compiled")
    if isinstance(compiled, dict) and not eager:
        measured = plan.measured_peak_bytes
        if measured is not None and measured > budget:
            raise PlanMismatchError(
                f"plan measured_peak_bytes: {fmt_bytes(measured)} ({measured} bytes) is over the plan's own "
                f"budget_bytes {fmt_bytes(budget)} ({budget} bytes); re-plan at this budget"
            )
        return
    allowed = budget
    if measured_fit(plan, plan.spans()) and _measured_here(plan, device_type):
        allowed += int(Budget().safety_margin * max(0, budget - fixed_bytes))
    if plan.predicted_peak_bytes > allowed:
        compiled_note = (" (run eagerly: the file's compiled figures are not this module's)"
                         if isinstance(compiled, dict) else "")
        raise PlanMismatchError(
            f"plan predicted_peak_bytes: {fmt_bytes(plan.predicted_peak_bytes)} ({plan.predicted_peak_bytes} "
            f"bytes) is over the plan's own budget_bytes {fmt_bytes(budget)} ({budget} bytes){compiled_note}; "
            "a plan over its budget is not applied: re-plan at this budget with optimize() or `ckpt-planner plan`"
        )


def race_granted(plan: Any, model: torch.nn.Module) -> bool:
    """Whether a loaded plan's race record may let it past its budget by the margin: it names these regions
    as chosen and fitting, and the plan's measured peak, within the budget, is measured again on `model`."""
    from .lower.apply import measured_fit

    return measured_fit(plan, plan.spans()) and _measured_here(plan, _device_type(model))


def _measured_here(plan: Any, device_type: str | None) -> bool:
    """Whether the plan's measured peak is within its budget and will be measured again on this model:
    recorded on this kind of device (`stats.verify.device`), which `check_measured` re-measures."""
    measured = plan.measured_peak_bytes
    record = plan.stats.get("verify")
    recorded_on = record.get("device") if isinstance(record, dict) else None
    return (device_type is not None and device_type != "meta" and recorded_on == device_type
            and measured is not None and plan.budget_bytes is not None and measured <= plan.budget_bytes)


def _device_type(model: torch.nn.Module) -> str:
    """The kind of device `model`'s parameters (else buffers) live on; cpu for a model with neither."""
    tensor = next(iter([*model.parameters(), *model.buffers()]), None)
    return tensor.device.type if tensor is not None else "cpu"


def ranks_here(plan: Any) -> tuple[int, str | None]:
    """(world size, sharding) to re-simulate `plan` at: the ranks this process runs, never the file's.

    A plan made for N ranks (`stats.sharding`) counts parameters at 1/N under fsdp; re-simulated as
    sharded in a process that is not, it would pass a budget its step does not keep. PlanMismatchError
    when a sharded plan's world size is not this process group's (1 without one); a plan made unsharded
    is re-simulated unsharded."""
    stated = plan.stats.get("sharding")
    if not isinstance(stated, dict) or stated.get("sharding") is None:
        return 1, None  # made for one rank's state, unscaled: as the user planned it, wherever it runs
    dist = torch.distributed
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    claimed = stated.get("world_size", 1)
    if claimed != world:
        raise PlanMismatchError(
            f"plan stats.sharding: made for {str(stated.get('sharding'))[:20]} over {str(claimed)[:20]} ranks, but "
            f"this process runs {world}; a plan is checked at the ranks it runs on: re-plan with optimize() "
            "or `ckpt-planner plan` here"
        )
    return world, str(stated.get("sharding"))


def _check_offload_bytes(plan: Any, problem: Any) -> None:
    """Each offload entry's `bytes` is its storage's on this graph, and all of them fit the host budget the
    file records and the host memory free now; PlanMismatchError naming the field otherwise."""
    from .profile.copy_bandwidth import free_host_bytes

    total = 0
    for i, o in enumerate(plan.offloaded):
        actual = int(problem.storages[o.storage].nbytes)
        if o.nbytes != actual:
            raise PlanMismatchError(
                f"plan offloaded[{i}].bytes: the file says {o.nbytes} bytes but {o.node} output {o.output} is "
                f"{actual} bytes on this model; re-plan with optimize() or `ckpt-planner plan`"
            )
        total += actual
    info = plan.stats.get("offload") if isinstance(plan.stats.get("offload"), dict) else {}
    host = info.get("host_budget_bytes")
    limits = [("the plan's own stats.offload.host_budget_bytes", host if isinstance(host, int) else 0),
              ("the host memory free now", free_host_bytes())]
    for what, limit in limits:
        if total > limit:
            raise PlanMismatchError(
                f"plan offloaded: {len(plan.offloaded)} activations copy {fmt_bytes(total)} ({total} bytes) to host "
                f"memory, over {what} ({limit} bytes); re-plan with optimize() or `ckpt-planner plan`"
            )


class _Paths(Exception):
    """The module paths apply_plan would checkpoint, raised from its `check` so that nothing is changed."""

    def __init__(self, paths: list[str]) -> None:
        super().__init__("module paths")
        self.paths = paths


def module_paths(plan: Any, model: torch.nn.Module, allow_over_budget: bool, trusted: bool) -> list[str]:
    """The submodules `apply_plan` checkpoints for `plan` on `model` (its own errors as it raises them),
    found without changing the model: the same choice runs again when the plan is applied."""
    from .lower.apply import apply_plan

    def stop(paths: list[str]) -> None:
        raise _Paths(list(paths))

    try:
        with race_record(plan, trusted):
            apply_plan(plan, model, allow_over_budget=allow_over_budget, check=stop)
    except _Paths as found:
        return found.paths
    return []


@contextlib.contextmanager
def race_record(plan: Any, trusted: bool) -> Iterator[None]:
    """`plan` as apply_plan judges it: without its race record (`stats.autotune`, which lets a plan over its
    budget by less than the margin through) unless `trusted`: made in this process, or measured here."""
    stats = plan.stats
    if not trusted and "autotune" in stats:
        plan.stats = {k: v for k, v in stats.items() if k != "autotune"}
    try:
        yield
    finally:
        plan.stats = stats


def fingerprint_of(cap: Any) -> str:
    from .capture.trace import flatten_for_graph

    return graph_fingerprint(cap.graph_module, flatten_for_graph(cap.graph_module, cap.args, cap.kwargs))


def _nested(problem: Any, spans: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """The model's own checkpoint spans that nest properly, in order, as the planner takes them for the
    model as given (choose/regions.py `laminar`): a span crossing an earlier one is left out."""
    from .solvers.plans import normalize_regions
    from .solvers.problem import ProblemError

    kept: list[tuple[int, int]] = []
    for span in spans:
        try:
            kept = list(normalize_regions(problem, [*kept, span]))
        except ProblemError:
            continue
    return tuple(kept)


def _copies(info: dict[str, Any]) -> dict[str, Any]:
    """The copy bandwidths and host budget a plan's `stats.offload` records, as `rank_problem` takes them."""
    return {k: info[k] for k in ("d2h_bytes_per_s", "h2d_bytes_per_s", "host_budget_bytes")
            if isinstance(info.get(k), (int, float)) and not isinstance(info.get(k), bool)}


def several_ranks() -> bool:
    """Whether a process group of several ranks is running."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1

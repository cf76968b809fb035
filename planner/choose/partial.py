"""Plans for models the capture cannot take whole.

When neither symbolic_trace nor torch.export captures the model (a loss that
branches on data-dependent lengths, a data-dependent branch around the
layers), the largest submodules that do capture are planned and the rest runs
eagerly, as torch.compile does at graph breaks:

1. One eager forward (no grad) records each submodule's first call.
2. From the root down, each called submodule is captured with those inputs;
   where it fails, its children are tried. Single torch.nn layers are not
   tried on their own (nothing to checkpoint inside them), nor a module that
   carries a hook or holds one that does (a graph in its place would never run
   it): its own code runs, and its children are tried.
3. The pieces' Problems are joined in call order into one Problem, separated
   by a node that cannot be recomputed (no region spans two pieces). What
   runs eagerly between two pieces, or after the last, is that node (or a
   last one): the activations it saves for backward (measured with
   saved_tensors_hooks) are its own, held from its forward to its backward,
   as in a real step, where the loss's saved tensors are gone before the
   last piece's backward starts. The activations of the eager code before the
   first piece, the gradients of the eager code's parameters and the pieces'
   inputs that no piece made are counted resident for the whole step; a piece's
   input that an earlier piece returns, or that the model was called with, is
   counted once, with that piece's outputs or the inputs. Under autocast the
   pieces' casts of parameters come with their profiles, and the casts only
   the eager code takes are counted resident. The prediction is an upper bound.
4. The solution's regions are split back per piece; each piece is rewritten
   and put in place of its submodule in a shallow copy of the model, which
   shares every parameter and buffer and keeps the state_dict keys. With
   the Setup's check_step, one step of it is compared with the model's.

One concept (a plan made of captured pieces and eager code) in one module: its
four steps share the pieces' records and would only pass them between files.

Other shapes: a smaller call runs the plan. A piece whose capture pinned its
dimensions is captured again at the call's shape and given the same regions
(by node name; activations only shrink, so the peak stays under the budget).
A call with a larger input is refused with `ShapeError`, or with
`on_larger_shape="replan"` the whole model is planned again at its shape.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..capture.mutation import compute_nodes
from ..capture.shapes import ShapeGuard, guard_model, input_shapes
from ..capture.trace import Capture, capture, normalize_inputs
from ..distributed import optimizer_state_bytes
from ..errors import CaptureError, CheckOutOfMemoryError, InexactPlanError, ModelInputError, PlannerError, ShapeError
from ..lower.apply import with_replaced
from ..lower.rewrite import rewrite, safe_regions
from ..model_state import ModelState
from ..plan import Plan, Region
from ..profile.graph import CostGraph
from ..profile.memory import autocast_dtypes, fresh_autocast_cache, storage_key
from ..profile.profiler import ProfileConfig, profile
from ..profile.record import AutocastCasts
from ..settings import PlanRequest, Setup
from ..solvers.plans import normalize_regions
from ..solvers.problem import Cast, Node, Problem, Storage
from ..solvers.simulate import simulate
from ..verification import OUT_OF_MEMORY, REFERENCE_OUT_OF_MEMORY, step_differences
from .base import BasePlanner
from .budget import ResolvedBudget
from .choice import held_to_budget
from .solve import solve_partial

__all__ = ["Piece", "PartialPlanner", "find_pieces"]


@dataclass(frozen=True)
class Piece:
    """A captured submodule, its costs, and where its nodes sit in the joined Problem."""

    path: str
    capture: Capture
    cost: CostGraph
    offset: int
    """Index of its first node in the joined Problem."""


def _record_calls(model: torch.nn.Module, args: tuple, kwargs: dict) -> dict[str, dict[str, Any]]:
    """Each submodule's first call in one eager forward, as keyword arguments of its forward."""
    calls: dict[str, dict[str, Any]] = {}
    handles = []

    def hook(path: str):
        def pre(mod: torch.nn.Module, a: tuple, k: dict) -> None:
            if path in calls:
                return
            try:
                bound = inspect.signature(mod.forward).bind(*a, **k)
            except TypeError:
                return
            if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in inspect.signature(mod.forward).parameters.values()):
                return  # *args cannot be passed by name
            detached = pytree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, dict(bound.arguments))
            calls[path] = detached

        return pre

    for path, mod in model.named_modules():
        if path:
            handles.append(mod.register_forward_pre_hook(hook(path), with_kwargs=True))
    try:
        with ModelState(model).preserved(), torch.no_grad():
            model.train()
            model(*args, **kwargs)
    except PlannerError:
        raise
    except Exception as e:  # the model's own code refused the inputs (a shape, a dtype, a missing argument)
        first = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
        raise ModelInputError(f"inputs: {type(model).__name__} raised {type(e).__name__} on the example inputs, run "
                              f"as given to find its capturable parts ({first[:300]})", f"{type(e).__name__}: {e}") from None
    finally:
        for h in handles:
            h.remove()
    return calls


def _single_layer(mod: torch.nn.Module) -> bool:
    return not any(True for _ in mod.children()) and type(mod).__module__.startswith("torch.nn.")


# A captured piece is one graph in place of its module: a hook on the module or on one inside it would
# never run again (transformers collects MoE router logits, hidden states and attentions by forward hooks
# on module classes, and its loss reads what they collect).
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def _hooked(mod: torch.nn.Module) -> str | None:
    """The path (relative to `mod`, '' for itself) of the first module in `mod` that carries a hook, else None."""
    for path, sub in mod.named_modules():
        if any(getattr(sub, name, None) for name in _HOOKS):
            return path
    return None


def find_pieces(
    model: torch.nn.Module, args: tuple, kwargs: dict, *, method: str = "auto"
) -> tuple[list[tuple[str, Capture]], list[str]]:
    """(captured submodules by path in call order, module paths whose own code runs eagerly)."""
    calls = _record_calls(model, args, kwargs)
    order = {path: float(i) for i, path in enumerate(calls)}
    pieces: list[tuple[str, Capture]] = []
    left_out: list[str] = [f"{type(model).__name__} (own code)"]

    def visit(prefix: str, mod: torch.nn.Module) -> None:
        siblings = {type(c): calls[f"{prefix}{n}"] for n, c in mod.named_children() if f"{prefix}{n}" in calls}
        last = -1.0
        for name, child in mod.named_children():
            path = f"{prefix}{name}"
            if path not in calls and isinstance(mod, (torch.nn.ModuleList, torch.nn.Sequential)) and type(child) in siblings:
                # a layer skipped in the recorded forward (layerdrop): its siblings show how it is called
                calls[path] = siblings[type(child)]
                order[path] = last + 1e-3
            last = order.get(path, last)
            if path not in calls:  # a container (ModuleList) or a module not called
                visit(path + ".", child)
                continue
            if _single_layer(child):
                left_out.append(path)
                continue
            hooked = _hooked(child)
            if hooked is not None:  # its hooks run only where the module's own code runs
                left_out.append(f"{path} (own code: hooks on {f'{path}.{hooked}' if hooked else path})")
                visit(path + ".", child)
                continue
            try:
                pieces.append((path, capture(child, calls[path], method=method)))
            except CaptureError:
                left_out.append(f"{path} (own code)")
                visit(path + ".", child)

    visit("", model)
    pieces.sort(key=lambda p: order[p[0]])
    return pieces, left_out


@dataclass(frozen=True)
class EagerCosts:
    """What the eager code (outside every piece) holds in one forward (bytes)."""

    saved: tuple[int, ...]
    """Activations it saves for backward, per stretch of eager code: before the first piece, between
    each two, after the last (one more than the pieces)."""
    edges: int
    """The pieces' inputs that no piece returned, nor the model was called with: made by the eager code."""
    casts: int = 0
    """Under autocast, the casts of parameters that only the eager code takes: its cache holds them through
    the step (the pieces' own are in their profiles)."""


def _eager_costs(model: torch.nn.Module, args: tuple, kwargs: dict, pieces: list[str]) -> EagerCosts:
    """One forward with grad: the eager code's saved activations per stretch, the pieces' inputs it made, and
    under autocast the casts of parameters it alone takes (a cast it saves is one of those, or a piece's: not
    an activation either way)."""
    own = {p.untyped_storage().data_ptr() for p in list(model.parameters()) + list(model.buffers())}
    own |= {t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
    inside, done = [0], [0]  # pieces running now; pieces whose forward has returned
    saved: list[dict[int, int]] = [{} for _ in range(len(pieces) + 1)]  # per stretch: storage address -> bytes
    made = dict.fromkeys(own, 0)  # storages resident already: state, inputs, the pieces' outputs
    kept: list[Any] = []  # the pieces' outputs' storages, held through the forward
    edges: dict[int, int] = {}

    dtypes = autocast_dtypes()
    casts = AutocastCasts(dtypes) if dtypes else None

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not inside[0] and t.device.type != "meta":
            ptr = t.untyped_storage().data_ptr()
            # a piece's output is counted alive for the whole step with its piece: not again here
            if ptr not in made and (casts is None or storage_key(t) not in casts.made):
                saved[done[0]][ptr] = t.untyped_storage().nbytes()
        return t

    def tensors(value: Any) -> list[torch.Tensor]:
        return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor) and t.device.type != "meta"]

    def enter(_mod: torch.nn.Module, a: tuple, k: dict) -> None:
        inside[0] += 1
        if casts is not None:
            casts.node = "piece"
        for t in tensors((a, k)):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in made:
                edges[ptr] = t.untyped_storage().nbytes()

    def leave(_mod: torch.nn.Module, _a: tuple, _k: dict, out: Any) -> None:
        inside[0] -= 1
        done[0] += 1
        if casts is not None and not inside[0]:
            casts.node = "eager"
        kept.extend(t.untyped_storage() for t in tensors(out))  # no later tensor takes their addresses
        made.update(dict.fromkeys(t.untyped_storage().data_ptr() for t in tensors(out)))

    handles = []
    for path in pieces:
        mod = model.get_submodule(path)
        handles.append(mod.register_forward_pre_hook(enter, with_kwargs=True))
        handles.append(mod.register_forward_hook(leave, with_kwargs=True))
    fresh_autocast_cache()  # every cast is made, and seen, in this forward
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(ModelState(model).preserved())
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
            if casts is not None:
                casts.node = "eager"
                stack.enter_context(casts)
            model.train()
            out = model(*args, **kwargs)
            del out
    finally:
        for h in handles:
            h.remove()
    alone = sum(casts.made[key] for key, by in casts.readers.items() if by == {"eager"}) if casts is not None else 0
    return EagerCosts(tuple(sum(s.values()) for s in saved), sum(edges.values()), alone)


def _eager_node(name: str, index: int, saved_bytes: int, before: list[Node], offset: int) -> tuple[Node, list[Storage]]:
    """A stretch of eager code as a node that cannot be recomputed; what it saves is held to its backward.
    It reads the outputs of the piece before it (`before`, from node `offset`): their gradients are made by
    its backward and held until the piece's own."""
    reads = tuple(offset + i for i, n in enumerate(before) if n.is_output)
    node = Node(name=name, recomputable=False, inputs=reads)
    if not saved_bytes:
        return node, []
    return node, [Storage(producer=index, nbytes=saved_bytes, last_use=index, saved_by=(index,))]


def _join(pieces: list[tuple[str, Capture, CostGraph]], fixed_bytes: int,
          eager_saved: tuple[int, ...] = ()) -> tuple[Problem, list[int]]:
    """One Problem: the pieces in call order, a non-recomputable node for the eager code between two and
    after the last (`eager_saved`: its saved bytes per stretch, see EagerCosts), `fixed_bytes` resident."""
    nodes: list[Node] = []
    storages: list[Storage] = []
    offsets: list[int] = []
    eager_saved = tuple(eager_saved) + (0,) * (len(pieces) + 1 - len(eager_saved))
    casts: list[Cast] = []  # autocast's casts of the pieces' parameters, counted with the fixed bytes
    base = 0
    for k, (path, _, cost) in enumerate(pieces):
        if k:
            node, own = _eager_node(f"eager before {path}", len(nodes), eager_saved[k], nodes[base:], base)
            nodes.append(node)
            storages += own
        base, sbase = len(nodes), len(storages)
        offsets.append(base)
        for n in cost.to_problem().nodes:
            nodes.append(
                dataclasses.replace(
                    n,
                    name=f"{path}/{n.name}",
                    module=f"{path}.{n.module}" if n.module else path,
                    inputs=tuple(i + base for i in n.inputs),
                    reads=tuple(s + sbase for s in n.reads),
                )
            )
        for s in cost.to_problem().storages:
            storages.append(
                dataclasses.replace(
                    s, producer=s.producer + base, last_use=s.last_use + base, saved_by=tuple(i + base for i in s.saved_by)
                )
            )
        casts += [Cast(c.nbytes, tuple(i + base for i in c.readers), tuple(i + base for i in c.savers)) for c in cost.casts]
    if pieces:  # the loss and whatever else follows the last piece
        node, own = _eager_node(f"eager after {pieces[-1][0]}", len(nodes), eager_saved[len(pieces)], nodes[base:], base)
        nodes.append(node)
        storages += own
    cleared = any(cost.casts_cleared for _, _, cost in pieces)
    return Problem(nodes=tuple(nodes), storages=tuple(storages), param_bytes=fixed_bytes + sum(c.nbytes for c in casts),
                   casts=tuple(casts), casts_cleared=cleared), offsets


class PartialPlanner(BasePlanner):
    """Capture and profile the largest capturable submodules once; plan them for any budget."""

    def __init__(
        self,
        model: torch.nn.Module,
        example_inputs: Any = None,
        *,
        setup: Setup | None = None,
        reason: str = "",
        replan: Callable[[tuple, dict[str, Any], PlanRequest], torch.nn.Module] | None = None,
        **keywords: Any,
    ) -> None:
        """`setup`, or `optimize()`'s keywords that make one (capture_method, profile_config, optimizer,
        check_step, ...), as `Planner` takes them."""
        setup = setup or Setup.of(**keywords)
        self.setup = setup
        self.replan = replan
        """`replan(args, kwargs, request)` plans the whole model at a larger call's shape (on_larger_shape='replan')."""
        args, kwargs = normalize_inputs(example_inputs, model)
        self.model_shapes = input_shapes(args, kwargs)
        """The shapes of the call the model was planned for."""
        self.args, self.kwargs = args, kwargs
        found, self.left_out = find_pieces(model, args, kwargs, method=setup.capture_method)
        if not found:
            raise CaptureError(f"{reason}; no submodule of {type(model).__name__} could be captured either")
        self.model, self.reason = model, reason
        config = ProfileConfig.or_default(setup.profile)
        with ModelState(model).preserved():
            costs = [(path, cap, profile(cap, config)) for path, cap in found]
        paths = [path for path, _, _ in costs]
        eager = _eager_costs(model, args, kwargs, paths)
        self.eager_saved_bytes = sum(eager.saved)  # bytes
        in_pieces = {id(p) for path in paths for p in model.get_submodule(path).parameters()}
        state = {id(t): t for t in list(model.parameters()) + list(model.buffers())}.values()
        eager_grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad and id(p) not in in_pieces)
        self.eager_bytes = eager.saved[0] + eager_grads + eager.edges + eager.casts  # bytes resident for the step
        optimizer_bytes = optimizer_state_bytes(model, setup.optimizer)
        fixed = sum(t.untyped_storage().nbytes() for t in state) + optimizer_bytes + self.eager_bytes
        fixed += sum(t.untyped_storage().nbytes() for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
        self.problem, offsets = _join(costs, fixed, eager.saved)
        self.pieces = [Piece(path, cap, cost, off) for (path, cap, cost), off in zip(costs, offsets)]

    @property
    def baseline_peak_bytes(self) -> int:
        return simulate(self.problem, ()).peak_bytes

    def plan_for(self, request: PlanRequest) -> Plan:
        device = self.pieces[0].cost.device if self.pieces else "cpu"
        resolved = ResolvedBudget.of(request.budget, self.problem.fixed_bytes, self.baseline_peak_bytes, device)
        cfg = request.solve
        solution, notes = solve_partial(self.problem, resolved, cfg.solver, dict(cfg.options))
        solution, gated = held_to_budget(self.problem, solution, resolved.nbytes)  # the gate every plan passes
        notes = [*resolved.notes, *notes, *gated]
        replan = None
        if self.replan is not None:
            again = request.replace(on_larger_shape="error", autotune=None)  # as Planner replans

            def replan(args: tuple, kwargs: dict[str, Any]) -> torch.nn.Module:
                return self.replan(args, kwargs, again)

        plan = self.build(solution, notes, on_larger_shape=request.on_larger_shape, replan=replan)
        if self.setup.exactness.check_step and plan.regions:
            plan.notes = (*plan.notes, *self._checked(plan))
        return plan

    def _checked(self, plan: Plan) -> tuple[str, ...]:
        """One step of the plan's module against one of the model (outputs, gradients, buffers), as a whole
        graph's plan is checked (choose/safety_net.py); a plan that differs is refused: its regions span the
        pieces' own code, which cannot be narrowed region by region here."""
        tensors = list(self.model.parameters()) + list(self.model.buffers())
        if any(t.device.type == "meta" for t in tensors):  # nothing runs on fake tensors
            return ()
        found = step_differences(self.model, plan.module, self.args, self.kwargs)
        if found == [OUT_OF_MEMORY] or found == [REFERENCE_OUT_OF_MEMORY]:
            raise CheckOutOfMemoryError("the step that checks the partially captured plan ran out of device memory; "
                                        "plan for a budget about 10 % under the device's limit or pass check_step=False")
        if found is None:
            return ("not checked against the model's own step: that step raises as given (its backward fails)",)
        if found:
            raise InexactPlanError(f"the partially captured plan's training step differs from the model's in "
                                   f"{', '.join(found[:6])}; pass check_step=False to keep it, or report the model")
        return ()

    def build(
        self,
        solution,
        notes: list[str],
        *,
        on_larger_shape: str = "error",
        replan: Callable[[tuple, dict[str, Any]], torch.nn.Module] | None = None,
    ) -> Plan:
        """Build the plan and its module from a Solution of `self.problem`. `replan(args, kwargs)` plans
        the whole model at a larger call's shape (with on_larger_shape='replan')."""
        problem, regions, built, moved = self.problem, [], {}, []
        for k, piece in enumerate(self.pieces):
            end = self.pieces[k + 1].offset - 1 if k + 1 < len(self.pieces) else problem.n
            local = [(s - piece.offset, e - piece.offset) for s, e in solution.regions if piece.offset <= s and e < end]
            safe, why = safe_regions(piece.capture.graph_module, local)
            moved += why
            regions += [(s + piece.offset, e + piece.offset) for s, e in safe]
            sub = self.model.get_submodule(piece.path)
            module = rewrite(piece.capture.graph_module, safe, model=sub)
            guard = ShapeGuard(
                input_shapes(piece.capture.args, piece.capture.kwargs), "error", _piece_rebuild(sub, piece.capture, safe),
                dynamic_dims=piece.capture.dynamic_dims, signature=inspect.signature(sub.forward),
            )
            object.__setattr__(module, "shape_guard", guard)
            built[piece.path] = module
        if moved:
            solution = dataclasses.replace(solution, regions=normalize_regions(problem, regions))
        base, sim = simulate(problem, ()), simulate(problem, solution.regions)
        saved = [0] * problem.n
        for st in problem.storages:
            if st.saved_by:
                saved[st.producer] += st.nbytes
        plan = Plan(
            solver=solution.solver,
            budget_bytes=solution.budget_bytes,
            baseline_peak_bytes=base.peak_bytes,
            predicted_peak_bytes=sim.peak_bytes,
            predicted_recompute_s=sim.recompute_time,
            baseline_step_s=problem.total_time,
            regions=tuple(
                Region(s, e, problem.nodes[s].name, problem.nodes[e].name, (problem.nodes[s].module,), 0,
                       sum(n.time for n in problem.nodes[s : e + 1]), sum(saved[s : e + 1]))
                for s, e in solution.regions
            ),
            fingerprint=problem.fingerprint(),
            capture_method="partial",
            solve_time_s=solution.solve_time,
            breakdown=dict(sim.breakdown),
            baseline_breakdown=dict(base.breakdown),
            notes=tuple(notes) + tuple(moved) + self.notes(),
            stats={k: v for k, v in solution.stats.items() if k != "breakdown"},
            num_nodes=problem.n,
            model_name=type(self.model).__name__,
        )
        plan.problem = problem
        plan.module = with_replaced(self.model, built)
        guard_model(plan.module, self.model_shapes, on_larger_shape, replan)
        return plan

    def notes(self) -> tuple[str, ...]:
        shown = ", ".join(self.left_out[:8]) + (f" ... {len(self.left_out) - 8} more" if len(self.left_out) > 8 else "")
        return (
            "the whole model could not be captured" + (f" ({_short(self.reason)})" if self.reason else "")
            + f"; planned {len(self.pieces)} captured "
            f"submodules: {', '.join(p.path for p in self.pieces)}",
            f"left out, run eagerly: {shown}; their saved activations ({self.eager_saved_bytes / 1e6:.2f} MB) are "
            "held from their forward to their backward, and those before the first piece, their parameters' "
            "gradients, the pieces' inputs they make and, under autocast, the casts of parameters they alone take "
            f"({self.eager_bytes / 1e6:.2f} MB in all) for the whole step, so the predicted peak is an upper bound",
        )


def _piece_rebuild(sub: torch.nn.Module, cap: Capture, regions: list[tuple[int, int]]):
    """A piece's module at another call shape: `sub` captured again at it, with the same regions (by
    node name). For a piece whose capture pinned its dimensions (its guard asks only for smaller shapes)."""
    names = [n.name for n in compute_nodes(cap.graph_module.graph)]
    spans = [(names[s], names[e]) for s, e in regions]

    def rebuild(args: tuple, kwargs: dict[str, Any]) -> torch.nn.Module:
        inputs = pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, dict(kwargs) if kwargs else tuple(args))
        with ModelState(sub).preserved():  # capturing runs the piece: no trace on its buffers or the RNG
            again = capture(sub, inputs, method=cap.method)
        index = {n.name: i for i, n in enumerate(compute_nodes(again.graph_module.graph))}
        if any(a not in index or b not in index for a, b in spans):
            raise ShapeError(
                f"input shape: {type(sub).__name__} captured at {input_shapes(again.args, again.kwargs)} has "
                "other nodes than the planned graph; plan the model at this shape"
            )
        safe, _ = safe_regions(again.graph_module, [(index[a], index[b]) for a, b in spans])
        return rewrite(again.graph_module, safe, model=sub)

    return rebuild


def _short(reason: str) -> str:
    """The failure that decided it (torch.export's, when both tracers were tried), in one short clause."""
    text = reason.split("torch.export: ", 1)[-1]
    return text.split(". ", 1)[0][:200]

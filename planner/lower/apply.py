"""Plan.apply(model): checkpoint whole submodules of the user's own module object, in place.

`plan.module` runs the plan's regions exactly, but it is a new GraphModule.
Users who must keep their module (DDP/FSDP wrapping, HF Trainer, hooks,
an optimizer already built) apply the plan to it instead: the forward of
each chosen submodule is replaced, on that instance only, by a method that
calls the original forward through `torch.utils.checkpoint.checkpoint(...,
use_reentrant=False, preserve_rng_state=True)`. Nothing is wrapped or
renamed, so the module object, its `state_dict` keys, its parameters, its
hooks and any optimizer stay as they were; `remove_checkpointing` undoes it.

Regions of a plan are runs of graph nodes and need not coincide with module
boundaries. When the plan knows its Problem (made by `optimize()` in this
process), `module_aligned` picks the nearest plan made of whole modules that
fits the budget, by simulation, and says how it differs. A plan loaded from
JSON has only the module paths it recorded: those are applied as recorded.
"""

from __future__ import annotations

import contextlib
import copy
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from ..errors import InputError, PlanMismatchError
from ..solvers.problem import Problem
from ..solvers.registry import InfeasibleBudgetError
from ..solvers.simulate import simulate
from .rewrite import _restore_buffers

__all__ = [
    "Application", "apply_plan", "checkpoint_modules", "remove_checkpointing", "module_aligned", "module_spans",
    "with_replaced", "checkpointed_copy", "measured_fit", "whole_module_spans",
]

_STATE = "_ckpt_planner_state"  # instance attribute marking a checkpointed module


@dataclass(frozen=True)
class Application:
    """What `Plan.apply` did to a model."""

    modules: tuple[str, ...]
    """Paths of the submodules whose forward now runs under checkpoint."""
    aligned: bool
    """True when those modules run exactly the plan's regions."""
    regions: tuple[tuple[int, int], ...] = ()
    """Node spans of the applied modules (empty for a plan loaded from a file)."""
    predicted_peak_bytes: int | None = None
    """Simulated peak of the module-level plan (None when the plan has no Problem)."""
    predicted_recompute_s: float | None = None
    """Simulated recompute seconds of the module-level plan."""
    budget_bytes: int | None = None
    notes: tuple[str, ...] = ()

    @property
    def within_budget(self) -> bool | None:
        """Whether the module-level plan fits the budget (None when unknown)."""
        if self.predicted_peak_bytes is None:
            return None
        return self.budget_bytes is None or self.predicted_peak_bytes <= self.budget_bytes


@dataclass(frozen=True)
class _State:
    previous: Any
    """The instance-level forward that was there before (None: the class's forward)."""
    buffers: tuple[str, ...]
    """Persistent buffers of the module, restored after a recompute (BatchNorm statistics)."""


def measured_fit(plan: Any, spans: Sequence[tuple[int, int]]) -> bool:
    """True when autotune chose exactly these regions and measured their step within the plan's budget
    (a plan predicted over its budget by less than the safety margin can win on its measurement). Kept
    ops only add memory, so the regions without them fit too."""
    record = plan.stats.get("autotune") if isinstance(plan.stats, dict) else None
    if not isinstance(record, dict):
        return False
    for c in record.get("candidates", []):
        if isinstance(c, dict) and c.get("chosen") and c.get("fits") is True:
            try:
                return [tuple(int(x) for x in r) for r in c.get("regions", [])] == [tuple(r) for r in spans]
            except (TypeError, ValueError):
                return False
    return False


# -- the checkpointed forward ---------------------------------------------------


def _original_forward(module: torch.nn.Module):
    state: _State = module.__dict__[_STATE]
    return state.previous if state.previous is not None else type(module).forward.__get__(module, type(module))


def _contexts(module: torch.nn.Module):
    """context_fn: nothing around the forward; buffers put back after the recompute."""
    return contextlib.nullcontext(), _restore_buffers(module, module.__dict__[_STATE].buffers)


def _checkpointed_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    forward = _original_forward(self)
    if not torch.is_grad_enabled():  # eval / no_grad: nothing saved, nothing to recompute
        return forward(*args, **kwargs)
    if torch.compiler.is_compiling():
        # Under torch.compile the recompute is part of the compiled backward, which never
        # re-applies buffer mutations; dynamo accepts no custom context_fn here.
        return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)
    return checkpoint(
        forward, *args, use_reentrant=False, preserve_rng_state=True, context_fn=partial(_contexts, self), **kwargs
    )


def _persistent_buffers(module: torch.nn.Module) -> tuple[str, ...]:
    names = []
    for prefix, mod in module.named_modules():
        for leaf, buf in mod._buffers.items():
            if buf is not None and leaf not in mod._non_persistent_buffers_set:
                names.append(f"{prefix}.{leaf}" if prefix else leaf)
    return tuple(names)


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """DistributedDataParallel(model) -> model: paths are those of the user's module."""
    inner = getattr(model, "module", None)
    if isinstance(inner, torch.nn.Module) and type(model).__name__ == "DistributedDataParallel":
        return inner
    return model


def _checkpointable(module: torch.nn.Module) -> bool:
    """Modules with a forward of their own (not ModuleList/ModuleDict containers)."""
    forward = type(module).forward
    return forward is not torch.nn.Module.forward and not isinstance(module, (torch.nn.ModuleList, torch.nn.ModuleDict))


def checkpoint_modules(model: torch.nn.Module, paths: Sequence[str]) -> tuple[str, ...]:
    """Run the forward of each submodule in `paths` under non-reentrant checkpoint, in place.

    Parent and child may both be listed (nested checkpoints). Raises
    PlanMismatchError for a path the model lacks and InputError for a module
    that is already checkpointed, has no forward of its own, or is the root.
    """
    model = _unwrap(model)
    if any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules()):  # transformers' flag
        raise InputError(
            "model: transformers gradient checkpointing is enabled; call model.gradient_checkpointing_disable() "
            "before applying a plan (checkpointing twice recomputes twice)"
        )
    chosen: list[tuple[str, torch.nn.Module]] = []
    for path in dict.fromkeys(paths):
        if path == "":
            raise InputError("modules: the root module cannot be checkpointed in place; use plan.module")
        try:
            mod = model.get_submodule(path)
        except AttributeError:
            raise PlanMismatchError(f"module path {path!r} is not in this {type(model).__name__}") from None
        if _STATE in mod.__dict__:
            raise InputError(f"module {path!r} is already checkpointed; call plan.remove(model) first")
        if not _checkpointable(mod):
            raise InputError(f"module {path!r} ({type(mod).__name__}) has no forward of its own to checkpoint")
        chosen.append((path, mod))
    for _path, mod in chosen:
        mod.__dict__[_STATE] = _State(previous=mod.__dict__.get("forward"), buffers=_persistent_buffers(mod))
        mod.forward = types.MethodType(_checkpointed_forward, mod)
    return tuple(p for p, _ in chosen)


def remove_checkpointing(model: torch.nn.Module) -> tuple[str, ...]:
    """Undo `checkpoint_modules` / `Plan.apply` everywhere in `model`; returns the paths restored."""
    model = _unwrap(model)
    removed = []
    for path, mod in model.named_modules(remove_duplicate=False):
        state = mod.__dict__.pop(_STATE, None)
        if state is None:
            continue
        if state.previous is not None:
            mod.forward = state.previous
        else:
            mod.__dict__.pop("forward", None)
        removed.append(path)
    return tuple(removed)


def checkpointed_modules(model: torch.nn.Module) -> tuple[str, ...]:
    """Paths of the submodules currently checkpointed in place."""
    return tuple(p for p, m in _unwrap(model).named_modules() if _STATE in m.__dict__)


def with_replaced(model: torch.nn.Module, replacements: dict[str, torch.nn.Module]) -> torch.nn.Module:
    """A shallow copy of `model` with the submodules at `replacements`' paths swapped; all else shared."""
    root = copy.copy(model)
    root._modules = dict(model._modules)
    copied = {"": root}
    for path, new in replacements.items():
        *parents, leaf = path.split(".")
        mod, prefix = root, ""
        for p in parents:
            prefix = f"{prefix}.{p}" if prefix else p
            if prefix not in copied:
                child = copy.copy(mod._modules[p])
                child._modules = dict(child._modules)
                mod._modules[p] = copied[prefix] = child
            mod = copied[prefix]
        mod._modules[leaf] = new
    return root


def checkpointed_copy(model: torch.nn.Module, paths: Sequence[str]) -> torch.nn.Module:
    """The model with the submodules at `paths` run under checkpoint, as `checkpoint_modules` does, on a
    shallow copy: parameters, buffers and every other submodule are the model's own objects (its
    state_dict keys too), and the model itself is left as it was. A plan made of whole modules runs
    this way as `plan.module` when the clock says so (no captured graph: the model's own code)."""
    model = _unwrap(model)
    replaced = {}
    for path in dict.fromkeys(paths):
        try:
            mod = model.get_submodule(path)
        except AttributeError:
            raise PlanMismatchError(f"module path {path!r} is not in this {type(model).__name__}") from None
        replaced[path] = copy.copy(mod)  # its own __dict__ (the checkpointed forward), the same children
    root = with_replaced(model, replaced)
    checkpoint_modules(root, list(replaced))
    return root


# -- choosing whole modules ---------------------------------------------------------


def module_spans(problem: Problem, model: torch.nn.Module) -> dict[tuple[int, int], str]:
    """Node span (first, last) -> outermost module path, for modules that can be checkpointed whole.

    A module qualifies when its nodes form one contiguous run of recomputable
    nodes, it has a forward of its own, and it is not the root.
    """
    model = _unwrap(model)
    modules = dict(model.named_modules())
    nodes_of: dict[str, list[int]] = {}
    for i, node in enumerate(problem.nodes):
        parts = node.module.split(".") if node.module else []
        for k in range(1, len(parts) + 1):
            nodes_of.setdefault(".".join(parts[:k]), []).append(i)
    spans: dict[tuple[int, int], str] = {}
    caching = getattr(getattr(model, "config", None), "use_cache", False) is True
    for path, idx in nodes_of.items():
        mod = modules.get(path)
        if mod is None or not _checkpointable(mod) or (caching and _takes_cache(mod)):
            continue
        lo, hi = idx[0], idx[-1]
        if hi - lo + 1 != len(idx) or not all(problem.nodes[i].recomputable for i in idx):
            continue
        best = spans.get((lo, hi))
        if best is None or path.count(".") < best.count("."):
            spans[(lo, hi)] = path
    return spans


_CACHE_ARGS = ("cache", "past_key_values", "past_key_value", "layer_past", "cache_params")


def _takes_cache(module: torch.nn.Module) -> bool:
    """Whether the module's forward is handed the model's key/value cache (transformers' names for it).
    Run again under checkpoint, it would write its keys and values into the cache a second time (the
    recompute then reads a cache twice as long), so with the model's config caching it is not
    checkpointed as eager code; the captured graph's regions recompute without touching the cache."""
    import inspect

    try:
        params = inspect.signature(type(module).forward).parameters
    except (TypeError, ValueError):
        return False
    return any(name in params for name in _CACHE_ARGS)


def _inner(spans: dict[tuple[int, int], str], s: int, e: int) -> list[tuple[int, int]]:
    """The largest module spans inside [s, e], disjoint."""
    inside = sorted((sp for sp in spans if s <= sp[0] and sp[1] <= e), key=lambda sp: (sp[0], -sp[1]))
    out: list[tuple[int, int]] = []
    for sp in inside:
        if not out or sp[0] > out[-1][1]:
            out.append(sp)
    return out


def _outer(spans: dict[tuple[int, int], str], s: int, e: int) -> tuple[int, int] | None:
    """The smallest module span containing [s, e]."""
    around = [sp for sp in spans if sp[0] <= s and e <= sp[1]]
    return min(around, key=lambda sp: sp[1] - sp[0]) if around else None


def whole_module_spans(
    problem: Problem, model: torch.nn.Module, regions: Sequence[tuple[int, int]], slack: float = 0.1,
) -> list[tuple[tuple[int, int], str]] | None:
    """(span, path) of the whole module around each region, where every region is one module's run of
    nodes less at most `slack` of them (a block region that leaves out the block's last residual add is
    the block); None when a region has no such module or two regions share one."""
    spans = module_spans(problem, model)
    out: list[tuple[tuple[int, int], str]] = []
    for s, e in regions:
        around = _outer(spans, s, e)
        if around is None or (around[1] - around[0] + 1) - (e - s + 1) > slack * (e - s + 1):
            return None
        out.append((around, spans[around]))
    picked = sorted(sp for sp, _ in out)
    if any(b[0] <= a[1] for a, b in zip(picked, picked[1:])):
        return None
    return out


def module_aligned(
    problem: Problem,
    model: torch.nn.Module,
    regions: Sequence[tuple[int, int]],
    budget_bytes: int | None,
) -> tuple[list[tuple[int, int]], dict[tuple[int, int], str], int]:
    """The nearest plan made of whole modules: (spans, span -> path, regions that were not aligned).

    Each region starts as the largest whole modules inside it (less recompute,
    more memory); while the simulated peak exceeds the target (the budget, else
    the plan's own peak), the region whose switch to its smallest enclosing
    module lowers the peak most is switched. Last, modules whose checkpoint does
    not lower the peak below that target are dropped (their recompute is saved).
    """
    spans = module_spans(problem, model)
    regions = [tuple(r) for r in regions]
    target = budget_bytes if budget_bytes is not None else simulate(problem, regions).peak_bytes
    inner: list[list[tuple[int, int]]] = []
    outer: list[tuple[int, int] | None] = []
    misaligned = 0
    for s, e in regions:
        if (s, e) in spans:
            inner.append([(s, e)])
            outer.append(None)
        else:
            misaligned += 1
            inner.append(_inner(spans, s, e))
            outer.append(_outer(spans, s, e))
    # ancestors[i]: regions that contain region i in the plan itself (intended nesting)
    ancestors = [
        {j for j, (s2, e2) in enumerate(regions) if j != i and s2 <= s and e <= e2 and (s2, e2) != (s, e)}
        for i, (s, e) in enumerate(regions)
    ]

    def chosen(switched: set[int]) -> list[tuple[int, int]]:
        """Union of the chosen spans; a region swallowed by another's enclosing module is dropped."""
        out = set()
        for i in range(len(regions)):
            if i in switched:
                out.add(outer[i])
                continue
            for sp in inner[i]:
                swallowed = any(
                    j != i and j not in ancestors[i] and outer[j][0] <= sp[0] and sp[1] <= outer[j][1]
                    for j in switched
                )
                if not swallowed:
                    out.add(sp)
        return sorted(out, key=lambda sp: (sp[0], -sp[1]))

    switched: set[int] = set()
    current = chosen(switched)
    peak = simulate(problem, current).peak_bytes
    while peak > target:
        best = None
        for i, alt in enumerate(outer):
            if alt is None or i in switched:
                continue
            trial = chosen(switched | {i})
            sim = simulate(problem, trial)
            key = (sim.peak_bytes, sim.recompute_time)
            if sim.peak_bytes < peak and (best is None or key < best[0]):
                best = (key, i, trial)
        if best is None:
            break
        (peak, _), i, current = best
        switched.add(i)
    # Drop modules whose checkpoint buys nothing (a lone dropout or embedding): less recompute.
    limit = max(target, peak)
    for sp in sorted(current, key=lambda sp: sp[0] - sp[1]):
        if misaligned == 0:
            break
        trial = [r for r in current if r != sp]
        if simulate(problem, trial).peak_bytes <= limit:
            current = trial
    return current, spans, misaligned


def apply_plan(plan: Any, model: torch.nn.Module, *, allow_over_budget: bool = False,
               check: Callable[[list[str]], None] | None = None) -> Application:
    """Checkpoint, in place, the submodules of `model` that carry out `plan` (see module docstring).

    The module-level plan is simulated before anything is changed; when it is over the plan's
    budget, InfeasibleBudgetError names the least peak a module-level plan reaches, and the model
    is left untouched, unless `allow_over_budget=True` (then it is applied and a note says so).
    `check(paths)` runs last before the model is changed (a loaded plan's step against the model's):
    whatever it raises leaves the model untouched.
    """
    problem: Problem | None = getattr(plan, "problem", None)
    if problem is None:
        paths: list[str] = []
        truncated = False
        for r in plan.regions:
            for p in r.modules:
                if p.startswith("... "):
                    truncated = True
                elif p and p not in paths:
                    paths.append(p)
        applied = checkpoint_modules(model, paths)
        notes = [
            "plan loaded from a file: applied the module paths it records; the memory of this module-level "
            "variant was not re-checked (re-plan with optimize() to check it)"
        ]
        if truncated:
            notes.append("the plan file lists only the first modules of some regions; the rest were not applied")
        return Application(modules=applied, aligned=False, budget_bytes=plan.budget_bytes, notes=tuple(notes))
    spans_used, spans, misaligned = module_aligned(problem, model, plan.spans(), plan.budget_bytes)
    sim = simulate(problem, spans_used)
    over = plan.budget_bytes is not None and sim.peak_bytes > plan.budget_bytes and not measured_fit(plan, spans_used)
    if over and not allow_over_budget:
        least = simulate(problem, module_aligned(problem, model, plan.spans(), 0)[0]).peak_bytes
        raise InfeasibleBudgetError(
            plan.budget_bytes,
            least,
            f"{plan.solver} applied per module",
            problem.fixed_bytes,
            detail=(
                f"; the nearest whole-module plan peaks at {sim.peak_bytes / 1e6:.2f} MB: use plan.module for the "
                "exact plan, re-plan at that budget, or pass allow_over_budget=True"
            ),
        )
    paths = [spans[sp] for sp in spans_used]
    if check is not None:
        check(paths)
    applied = checkpoint_modules(model, paths)
    notes = []
    if misaligned:
        notes.append(
            f"{misaligned} of {len(plan.regions)} regions do not follow module boundaries: applied {len(applied)} "
            f"whole modules instead; predicted peak {sim.peak_bytes / 1e6:.2f} MB (plan {plan.predicted_peak_bytes / 1e6:.2f} MB), "
            f"recompute {sim.recompute_time * 1e3:.1f} ms (plan {plan.predicted_recompute_s * 1e3:.1f} ms)"
        )
    if over:
        notes.append(
            f"applied over budget (allow_over_budget=True): no module-level plan near this one fits "
            f"({sim.peak_bytes / 1e6:.2f} MB > {plan.budget_bytes / 1e6:.2f} MB); use plan.module for the exact plan"
        )
    return Application(
        modules=applied,
        aligned=misaligned == 0,
        regions=tuple(spans_used),
        predicted_peak_bytes=sim.peak_bytes,
        predicted_recompute_s=sim.recompute_time,
        budget_bytes=plan.budget_bytes,
        notes=tuple(notes),
    )

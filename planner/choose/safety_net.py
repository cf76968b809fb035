"""The safety net: a plan's training step against the model's own, before `optimize` returns it.

One step of the model and one of the checkpointed module run from the same state (buffers, generator
state), and their outputs, parameter gradients and buffers are compared: bitwise on the CPU, and
within the dtype's `assert_close` tolerance on other devices, whose atomics may sum in another order
from run to run. A wrong replay (a random op the planner did not see, a kept op that a cache hid)
differs by far more than that. `inexact_parts` then finds what is at fault: the kept ops, or the
regions that differ on their own, so that the planner can forbid them and solve again.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..errors import InexactPlanError
from ..lower.apply import checkpointed_copy
from ..lower.rewrite import rewrite
from ..model_state import ModelState
from ..profile.loss import default_loss
from ..settings import PlanRequest
from ..solvers.problem import Solution
from ..solvers.registry import InfeasibleBudgetError
from .budget import reference_over_budget
from .profiled import Profiled
from .solve import solve_budget

__all__ = ["step_differences", "inexact_parts", "reference_module", "checked"]


def _digest(t: torch.Tensor) -> tuple:
    """A tensor's shape, dtype and bytes, hashed: what a bitwise comparison needs of it."""
    h = hashlib.sha256()
    flat = t.contiguous().reshape(-1)
    if flat.numel():
        h.update(flat.view(torch.uint8).cpu().numpy().tobytes())
    return (tuple(t.shape), t.dtype, h.hexdigest())


def _same(a: Any, b: Any, bitwise: bool) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if isinstance(a, tuple):  # digests (bitwise)
        return a == b
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if bitwise:
        return torch.equal(a, b)
    return bool(torch.allclose(a.double(), b.double(), rtol=_rtol(a.dtype), atol=_rtol(a.dtype), equal_nan=True))


def _rtol(dtype: torch.dtype) -> float:
    return {torch.float16: 1e-3, torch.bfloat16: 1.6e-2, torch.float32: 1.3e-6}.get(dtype, 1e-7) * 10


def step_differences(
    model: torch.nn.Module, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any],
    bitwise: bool | None = None, reference: torch.nn.Module | None = None,
) -> list[str] | None:
    """What differs after one training step of `module` against one of `model` (the model's own
    parameters and buffers, from the same starting state): 'output', parameter and buffer names, or
    the step itself where the module's raises and the model's does not. None where the model's own
    step raises: there is nothing to compare with.
    bitwise=False judges allclose in the dtype (plans made with exact=False); None: bitwise on the CPU.
    `reference`: the module whose step stands for the model's (the step checkpointed per block, where
    the plain step does not fit the budget); its parameters are the model's.
    The first step's figures are kept off the device where they can be: a digest of each tensor's bytes
    when judged bitwise, host copies on an accelerator, so comparing needs no second set of gradients
    beside the step. The model is left as it was found (buffers, grads, modes, RNG)."""
    params = list(model.named_parameters())
    buffers = list(model.named_buffers())
    device = next((t.device for _, t in params + buffers), torch.device("cpu"))
    bitwise = device.type == "cpu" if bitwise is None else bitwise
    with ModelState(model).preserved():
        model.train()
        module.train()
        start = [b.detach().clone() for _, b in buffers]
        cpu_rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state_all() if device.type == "cuda" else None

        def run(m: torch.nn.Module) -> tuple[list, list, list]:
            with torch.no_grad():
                for (_, b), v in zip(buffers, start):
                    b.copy_(v)
            torch.set_rng_state(cpu_rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state_all(cuda_rng)
            for _, p in params:
                p.grad = None
            out = m(*args, **kwargs)
            default_loss(out).backward()
            outs = [kept(t) for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
            del out
            grads = [None if p.grad is None else kept(p.grad) for _, p in params]
            for _, p in params:
                p.grad = None
            return outs, grads, [kept(b) for _, b in buffers]

        def kept(t: torch.Tensor) -> Any:
            t = t.detach()
            if bitwise:
                return _digest(t)
            return t.to("cpu", copy=True) if t.device.type != "cpu" else t.clone()

        try:
            ref = run(model if reference is None else reference)
        except Exception:  # noqa: BLE001 - the model cannot train one step as given: nothing to judge by
            return None
        try:
            got = run(module)
        except Exception as e:  # noqa: BLE001 - a plan whose step fails where the model's runs differs from it
            return [f"the step ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})"]
    differ = []
    if len(ref[0]) != len(got[0]) or not all(_same(a, b, bitwise) for a, b in zip(ref[0], got[0])):
        differ.append("output")
    differ += [name for (name, _), a, b in zip(params, ref[1], got[1]) if not _same(a, b, bitwise)]
    differ += [name for (name, _), a, b in zip(buffers, ref[2], got[2]) if not _same(a, b, bitwise)]
    return differ


def inexact_parts(
    regions: Sequence[tuple[int, int]],
    saved: Sequence[int],
    differs: Callable[[Sequence[tuple[int, int]], Sequence[int]], bool],
) -> tuple[bool, list[tuple[int, int]]]:
    """What to forbid in a plan whose step differs: (its kept ops, when the plan without them is exact;
    else the regions whose step differs each on its own). `differs(regions, saved)` builds and steps
    a plan. An empty list with False: no single region differs (the fault needs them together)."""
    if saved and not differs(regions, ()):
        return True, []
    bad = [r for r in regions if differs([r], ())]
    return False, bad


def reference_module(p: Profiled) -> torch.nn.Module | None:
    """The module whose step stands for the model's (None: the model's own): the graph checkpointed per
    block, in the model's own code, where the plain step was never run (`Profiled.reference_paths`)."""
    return checkpointed_copy(p.model, p.reference_paths) if p.reference_paths else None


def checked(p: Profiled, solution: Solution, notes: list[str], budget: int | None,
            request: PlanRequest) -> tuple[Solution, list[str]]:
    """`solution` when its step equals the model's, else the plan solved again with what differed
    forbidden (kept ops, else regions) in `p.problem`, and a note that says so."""
    gm, model, cap = p.capture.graph_module, p.model, p.capture
    reference = reference_module(p)
    over = reference_over_budget(p, budget) if budget is not None else 0
    if over:
        what = "the step checkpointed per block" if p.reference_regions else "the model's own step"
        notes = [*notes, (
            f"the check ran {what}, predicted {over / 1e6:.1f} MB over the budget, as the device had room for it; "
            "check_step=False keeps planning within the budget")]

    def differs(regions, saved) -> bool | None:
        found = step_differences(model, rewrite(gm, regions, model=model, saved=saved), cap.args, cap.kwargs,
                                 bitwise=None if p.exact else False, reference=reference)
        return None if found is None else bool(found)

    names = p.names
    if p.chunks and differs((), ()):
        raise InexactPlanError("exact=False: the chunked step's gradients are not allclose to the model's; "
                               "plan with exact=True or report the model")
    for _ in range(3):
        verdict = differs(solution.regions, solution.saved) if solution.regions else False
        if verdict is None:
            note = "not checked against the model's own step: that step raises as given (its backward fails)"
            return solution, [*notes, note]
        if not verdict:
            return solution, notes
        kept_only, bad = inexact_parts(solution.regions, solution.saved, differs)
        nodes = list(p.problem.nodes)
        if kept_only:
            for i in solution.saved:
                nodes[i] = dataclasses.replace(nodes[i], saveable=False)
            what = f"its kept ops ({', '.join(names[i] for i in solution.saved[:6])})"
        else:
            spans = bad or list(solution.regions)
            for s, e in spans:
                for i in range(s, e + 1):
                    nodes[i] = dataclasses.replace(nodes[i], recomputable=False)
            what = "the regions " + ", ".join(f"{names[s]}..{names[e]}" for s, e in spans[:6])
        notes = [*notes, (
            f"the plan's training step differed from the model's with {what}: they are not recomputed "
            "(or kept) by this plan, solved again"
        )]
        p.narrowed(dataclasses.replace(p.problem, nodes=tuple(nodes)))
        try:
            solution, more = solve_budget(p, budget, request)
        except InfeasibleBudgetError as e:
            raise InexactPlanError(f"{notes[-1]}; without them: {e}") from e
        notes += more
    if solution.regions and differs(solution.regions, solution.saved):
        raise InexactPlanError(
            f"no plan found whose training step equals the model's: {'; '.join(notes[-3:])}; "
            "run the model without checkpointing or report the model"
        )
    return solution, notes

"""verify(): one training step of the original and of plan.module side by side.

Both steps start from the same state (buffers, no gradients, RNG), so
outputs, every parameter gradient and every buffer can be compared exactly.
Peak memory is read on two meters (planner/profile/memory.py), both including the
parameters, buffers and inputs the step starts with: the allocator's
(`torch.cuda.max_memory_allocated` on CUDA, the profiler's allocator events
on CPU: kernel workspaces included), which judges the budget, and the live
tensor storages (`LiveMemory`). The model is left as it was found.

`step_differences` is the same comparison without the timing, for the safety net (choose/safety_net.py)
and for plans read from a file (`Plan.rebuild`: `check_loaded_step`, `check_measured`).

One concept, so one module over 500 lines: comparing a plan's step with the model's; `verify` (timed,
measured) and `step_differences` (the safety net, loaded plans) share the state set-up that makes the
comparison exact.
"""

from __future__ import annotations

import hashlib
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils import _pytree as pytree

from .capture.trace import normalize_inputs
from .errors import CheckOutOfMemoryError, PlanMismatchError
from .model_state import ModelState
from .profile.loss import default_loss  # re-exported: callers import it from here
from .profile.memory import StepPeaks, fresh_autocast_cache, measure_step_peaks  # the first and last re-exported
from .progress import logger, progress_enabled, stage

__all__ = [
    "Report", "StepPeaks", "verify", "default_loss", "measure_step", "measure_step_peaks", "step_differences",
    "check_loaded_step", "check_measured", "MEASURED_TOLERANCE", "OUT_OF_MEMORY", "REFERENCE_OUT_OF_MEMORY",
    "COMPARED_ELEMENTS",
]

MEASURED_TOLERANCE = 0.05
"""How far (a fraction) a loaded plan's measured peaks may be from the same step measured again on the same
kind of device: the allocator's own spread between runs is well inside it."""


@dataclass(frozen=True)
class Report:
    measured_peak_bytes: int
    """The plan's step, on the allocator (bytes): what the budget is judged on."""
    baseline_measured_peak_bytes: int
    """The original model's step, on the allocator (bytes)."""
    predicted_peak_bytes: int
    max_abs_grad_diff: float
    outputs_equal: bool
    buffers_equal: bool
    grads_equal: bool
    """Every gradient bitwise equal (None gradients in the same places)."""
    step_time_ratio: float
    """Median step time of plan.module over the original's."""
    budget_bytes: int | None
    device: str = ""
    """The kind of device both steps ran on ('cpu', 'cuda'): where a plan's measured figures can be re-measured."""
    differences: tuple[tuple[str, str, float], ...] = ()
    """What differs from the original: (kind, worst name, max abs difference), kind being
    'outputs', 'gradients' or 'buffers' (empty when the step is exact)."""

    max_rel_grad_diff: float = 0.0
    """Largest |difference| / max |model's gradient| over the parameters (0 when bitwise equal)."""
    grads_allclose: bool = True
    """Outputs and gradients allclose in their dtype (what an exact=False plan is judged on)."""

    measured_live_peak_bytes: int = 0
    """The plan's step, live tensor storages only (bytes)."""
    baseline_measured_live_peak_bytes: int = 0
    """The original model's step, live tensor storages only (bytes)."""

    def mismatch(self) -> str:
        """One line naming what differs (outputs, gradients, buffers), with the worst name and difference."""
        if self.differences:
            return "; ".join(f"{kind} differ (worst {name}: max abs diff {diff:.3g})" for kind, name, diff in self.differences)
        flags = (("outputs", self.outputs_equal), ("gradients", self.grads_equal), ("buffers", self.buffers_equal))
        parts = [f"{kind} differ" for kind, equal in flags if not equal]
        if not self.grads_equal:
            parts[[p.split()[0] for p in parts].index("gradients")] += f" (max abs diff {self.max_abs_grad_diff:.3g})"
        return "; ".join(parts)

    @property
    def prediction_error(self) -> float:
        """(predicted - measured) / measured."""
        return (self.predicted_peak_bytes - self.measured_peak_bytes) / max(1, self.measured_peak_bytes)

    @property
    def within_budget(self) -> bool:
        return self.budget_bytes is None or self.measured_peak_bytes <= self.budget_bytes

    @property
    def exact(self) -> bool:
        return self.outputs_equal and self.buffers_equal and self.grads_equal


def measure_step(
    module: torch.nn.Module,
    args: tuple,
    kwargs: dict,
    params: list[torch.nn.Parameter],
    state: list[torch.Tensor],
    loss_fn: Callable[[Any], torch.Tensor],
    device: torch.device,
) -> tuple[int, Any]:
    """Run forward + backward once; return (the allocator's peak bytes, output)."""
    peaks, out = measure_step_peaks(module, args, kwargs, params, state, loss_fn, device)
    return peaks.allocator, out


def _clone(value: Any) -> Any:
    return pytree.tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, value)


def _equal(a: Any, b: Any) -> bool:
    la, lb = pytree.tree_leaves(a), pytree.tree_leaves(b)
    if len(la) != len(lb):
        return False
    for x, y in zip(la, lb):
        if isinstance(x, torch.Tensor):
            if not isinstance(y, torch.Tensor) or x.shape != y.shape or not torch.equal(x, y):
                return False
        elif x != y:
            return False
    return True


def _allclose(a: Any, b: Any) -> bool:
    """allclose in the dtype of each tensor (torch.testing's default tolerances), None where None."""
    la, lb = pytree.tree_leaves(a), pytree.tree_leaves(b)
    if len(la) != len(lb):
        return False
    for x, y in zip(la, lb):
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            try:
                torch.testing.assert_close(y, x, equal_nan=True)
            except AssertionError:
                return False
        elif x != y:
            return False
    return True


def verify(
    model: torch.nn.Module,
    plan: Any,
    example_inputs: Any = None,
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    repeats: int = 3,
    progress: bool = False,
) -> Report:
    """Run one training step of `model` and of `plan.module` from the same state and compare.

    progress=True shows the stage on stderr (see optimize()).
    """
    with progress_enabled(progress):
        with stage("verify", f"one step of each module, {repeats} timed repeats"):
            report = _verify(model, plan, example_inputs, loss_fn=loss_fn, repeats=repeats)
        logger.info(
            "verify: measured peak %.1f MB (predicted %.1f MB, without checkpointing %.1f MB), %s, step time x%.2f",
            report.measured_peak_bytes / 1e6, report.predicted_peak_bytes / 1e6,
            report.baseline_measured_peak_bytes / 1e6, "exact" if report.exact else "NOT exact", report.step_time_ratio,
        )
    return report


def _verify(model, plan, example_inputs, *, loss_fn, repeats) -> Report:
    if plan.module is None:
        raise ValueError("plan.module: the plan has no module; call plan.rebuild(model, example_inputs) first")
    args, kwargs = normalize_inputs(example_inputs, model)
    loss_fn = loss_fn or default_loss
    params = [p for p in model.parameters()]
    state = params + list(model.buffers())
    device = next((t.device for t in state), torch.device("cpu"))
    guard = ModelState(model)
    with guard.preserved():
        model.train()
        plan.module.train()
        start = [b.detach().clone() for b in model.buffers()]
        rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state_all() if device.type == "cuda" else None

        def run(module):
            with torch.no_grad():
                for b, v in zip(model.buffers(), start):
                    b.copy_(v)
            torch.set_rng_state(rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state_all(cuda_rng)
            peak, out = measure_step_peaks(module, args, kwargs, params, state, loss_fn, device)
            grads = [None if p.grad is None else p.grad.detach().clone() for p in params]
            buffers = [b.detach().clone() for b in model.buffers()]
            return peak, _clone(out), grads, buffers

        base_peak, out0, grads0, bufs0 = run(model)
        peak, out1, grads1, bufs1 = run(plan.module)
        diff = rel = 0.0
        grads_equal = True
        for g0, g1 in zip(grads0, grads1):
            if (g0 is None) != (g1 is None):
                grads_equal, diff = False, float("inf")
                continue
            if g0 is not None:
                grads_equal &= torch.equal(g0, g1)
                d = (g0.double() - g1.double()).abs().max().item() if g0.numel() else 0.0
                diff = max(diff, d)
                rel = max(rel, d / max(g0.double().abs().max().item(), 1e-30) if d else 0.0)
        ratio = _time_ratio(model, plan.module, args, kwargs, params, loss_fn, device, repeats, start)
        for p in params:
            p.grad = None
    names = [n for n, _ in model.named_parameters()]
    differences = tuple(
        d
        for d in (
            _worst("outputs", [f"output[{i}]" for i in range(len(pytree.tree_leaves(out0)))], pytree.tree_leaves(out0), pytree.tree_leaves(out1)),
            _worst("gradients", names, grads0, grads1),
            _worst("buffers", [n for n, _ in model.named_buffers()], bufs0, bufs1),
        )
        if d is not None
    )
    return Report(
        differences=differences,
        measured_peak_bytes=peak.allocator,
        baseline_measured_peak_bytes=base_peak.allocator,
        measured_live_peak_bytes=peak.live,
        baseline_measured_live_peak_bytes=base_peak.live,
        predicted_peak_bytes=plan.predicted_peak_bytes,
        max_abs_grad_diff=diff,
        max_rel_grad_diff=rel,
        grads_allclose=_allclose(out0, out1) and all(
            _allclose(a, b) for a, b in zip(grads0, grads1)
        ) and all(_allclose(a, b) for a, b in zip(bufs0, bufs1)),
        outputs_equal=_equal(out0, out1),
        buffers_equal=all(torch.equal(a, b) for a, b in zip(bufs0, bufs1)),
        grads_equal=grads_equal,
        step_time_ratio=ratio,
        budget_bytes=plan.budget_bytes,
        device=device.type,
    )


def _digest(t: torch.Tensor) -> str:
    """A hash of a tensor's bytes, read in place where it lives on the host (no copy of its bytes)."""
    h = hashlib.sha256()
    flat = t.contiguous().reshape(-1)
    if flat.numel():
        h.update(flat.view(torch.uint8).cpu().numpy())
    return h.hexdigest()


@dataclass(frozen=True)
class _Held:
    """A tensor of the first step, kept off the device through the second: its digest when judged bitwise,
    else its bytes (`data`, a uint8 numpy array) outside torch's allocator, which is what a budget is judged
    on: host memory beside an accelerator; on the CPU the same memory, but not the allocator's."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    digest: str = ""
    data: Any = None


def _held(t: torch.Tensor | None, bitwise: bool) -> _Held | None:
    if t is None:
        return None
    t = t.detach()
    if bitwise:
        return _Held(tuple(t.shape), t.dtype, digest=_digest(t))
    data = t.contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
    if t.device.type == "cpu":  # the array shares the tensor's memory there
        data = data.copy()
    return _Held(tuple(t.shape), t.dtype, data=data)


COMPARED_ELEMENTS = 1 << 15
"""Elements compared at a time: the float64 copies and masks of an allclose stay under a megabyte each,
whatever the tensor's size, instead of several copies of the largest gradient or output."""


def _matches(held: _Held | None, t: torch.Tensor | None) -> bool:
    """Whether `t` (the second step's) equals the first step's `held`: bitwise, or allclose in its dtype
    (torch.allclose at `_rtol`, NaN equal to NaN), compared a slice at a time on the host."""
    if held is None or t is None:
        return held is None and t is None
    t = t.detach()
    if tuple(t.shape) != held.shape or t.dtype != held.dtype:
        return False
    if held.data is None:
        return _digest(t) == held.digest
    if not t.numel():
        return True
    ref = torch.from_numpy(held.data).view(held.dtype)  # [numel], host, no copy
    got = t.reshape(-1).cpu()  # on an accelerator one tensor at a time comes to the host
    tol = _rtol(held.dtype)
    wide = torch.complex128 if held.dtype.is_complex else torch.float64
    for i in range(0, got.numel(), COMPARED_ELEMENTS):
        a, b = ref[i:i + COMPARED_ELEMENTS], got[i:i + COMPARED_ELEMENTS]
        if torch.equal(a, b):
            continue
        if not torch.allclose(a.to(wide), b.to(wide), rtol=tol, atol=tol, equal_nan=True):
            return False
    return True


def _rtol(dtype: torch.dtype) -> float:
    return {torch.float16: 1e-3, torch.bfloat16: 1.6e-2, torch.float32: 1.3e-6}.get(dtype, 1e-7) * 10


OUT_OF_MEMORY = "the step (out of device memory)"
"""What `step_differences` reports alone when the module's step ran out of device memory."""

REFERENCE_OUT_OF_MEMORY = "the reference step (out of device memory)"
"""What `step_differences` reports alone when the step it compares with ran out of device memory."""


def _fresh_step(device: torch.device) -> None:
    """Start a step as the profile measured one: autocast's cache of parameter casts empty (the other step's
    casts are not held through this one), and on CUDA no blocks cached by the other step, which would
    fragment this one's and count against a per-process memory cap."""
    fresh_autocast_cache()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def step_differences(
    model: torch.nn.Module, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any],
    bitwise: bool | None = None, reference: torch.nn.Module | None = None,
) -> list[str] | None:
    """What differs after one training step of `module` against one of `model` (the model's own
    parameters and buffers, from the same starting state): 'output', parameter and buffer names, or
    the step itself where the module's raises and the model's does not (`[OUT_OF_MEMORY]` where it ran out
    of device memory; `[REFERENCE_OUT_OF_MEMORY]` where the model's did). None where the model's own step
    raises otherwise: there is nothing to compare with.
    bitwise=False judges allclose in the dtype (plans made with exact=False); None: bitwise on the CPU.
    `reference`: the module whose step stands for the model's (the step checkpointed per block, where
    the plain step does not fit the budget); its parameters are the model's.

    Each step holds on the device only its own: the first step's outputs, gradients and buffers are kept off
    it (`_Held`) before the second starts, whose are compared with them a slice at a time after its backward.
    The model is left as it was found (buffers, grads, modes, RNG)."""
    params = list(model.named_parameters())
    buffers = list(model.named_buffers())
    device = next((t.device for _, t in params + buffers), torch.device("cpu"))
    bitwise = device.type == "cpu" if bitwise is None else bitwise
    with ModelState(model).preserved():
        model.train()
        module.train()
        start = [b.detach().to("cpu", copy=True) for _, b in buffers]  # host: not beside either step
        cpu_rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state_all() if device.type == "cuda" else None
        np_rng = np.random.get_state()  # eager code that draws from numpy (SpecAugment's masks) draws alike in both

        def run(m: torch.nn.Module) -> tuple[list, list, list]:
            """One step of `m`: its tensor outputs, the parameters' gradients and the buffers after it."""
            with torch.no_grad():
                for (_, b), v in zip(buffers, start):
                    b.copy_(v)
            torch.set_rng_state(cpu_rng)
            np.random.set_state(np_rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state_all(cuda_rng)
            for _, p in params:
                p.grad = None
            _fresh_step(device)
            out = m(*args, **kwargs)
            default_loss(out).backward()
            outs = [t.detach() for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
            del out
            grads = [p.grad for _, p in params]
            for _, p in params:
                p.grad = None
            return outs, grads, [b for _, b in buffers]

        try:
            ref = tuple([_held(t, bitwise) for t in group] for group in run(model if reference is None else reference))
        except torch.cuda.OutOfMemoryError:
            return [REFERENCE_OUT_OF_MEMORY]
        except Exception:  # noqa: BLE001 - the model cannot train one step as given: nothing to judge by
            return None
        try:
            outs, grads, bufs = run(module)
        except torch.cuda.OutOfMemoryError:
            # a step that does not fit says nothing of exactness: the caller decides (safety_net.py)
            return [OUT_OF_MEMORY]
        except Exception as e:  # noqa: BLE001 - a plan whose step fails where the model's runs differs from it
            return [f"the step ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})"]
        differ = []
        if len(ref[0]) != len(outs) or not all(_matches(h, t) for h, t in zip(ref[0], outs)):
            differ.append("output")
        del outs
        differ += [name for (name, _), h, t in zip(params, ref[1], grads) if not _matches(h, t)]
        del grads
        differ += [name for (name, _), h, t in zip(buffers, ref[2], bufs) if not _matches(h, t)]
    return differ


def _worst(kind: str, names: list[str], a: list[Any], b: list[Any]) -> tuple[str, str, float] | None:
    """(kind, name, max abs difference) of the worst-differing pair, or None when all are equal."""
    worst: tuple[str, str, float] | None = None
    if len(a) != len(b):
        return (kind, f"{len(a)} against {len(b)} values", float("inf"))
    for name, x, y in zip(names, a, b):
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            if x.shape == y.shape and torch.equal(x, y):
                continue
            same = x.shape == y.shape and x.device.type != "meta"
            diff = (x.double() - y.double()).abs().max().item() if same and x.numel() else float("inf")
        elif isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor) or x != y:
            diff = float("inf")  # a None gradient against a tensor, or a changed non-tensor output
        else:
            continue
        if worst is None or diff > worst[2] or diff != diff:
            worst = (kind, name, diff)
    return worst


def _time_ratio(model, module, args, kwargs, params, loss_fn, device, repeats, start) -> float:
    def step(m) -> float:
        for p in params:
            p.grad = None
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        loss_fn(m(*args, **kwargs)).backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0

    base, ours = [], []
    for _ in range(max(1, repeats)):
        base.append(step(model))
        ours.append(step(module))
    with torch.no_grad():
        for b, v in zip(model.buffers(), start):
            b.copy_(v)
    return statistics.median(ours) / max(1e-12, statistics.median(base))


# -- plans read from a file ------------------------------------------------------------------------


def check_loaded_step(plan: Any, model: torch.nn.Module, module: torch.nn.Module, args: tuple,
                      kwargs: dict[str, Any]) -> None:
    """PlanMismatchError unless one training step of `module` (a loaded plan, rebuilt on `model`) equals the
    model's own: bitwise on the CPU, allclose in the dtype for a plan made with exact=False. A file's
    regions and kept ops are whatever its writer chose, and the simulator cannot see a wrong replay (a
    kept op whose output a later op changes, a random op): this is the check optimize() runs on every
    plan it returns. A step that cannot be compared is refused too."""
    exact = plan.stats.get("exact") is not False
    found = step_differences(model, module, args, kwargs, bitwise=None if exact else False)
    if found in ([OUT_OF_MEMORY], [REFERENCE_OUT_OF_MEMORY]):  # says nothing of the plan's regions
        which = "the plan's step" if found == [OUT_OF_MEMORY] else "the model's own step, which the plan's is checked against,"
        raise CheckOutOfMemoryError(
            f"plan: {which} ran out of device memory, so the plan cannot be checked here; free device memory, "
            "or rebuild with check_step=False to use the plan unchecked"
        )
    if found is None:
        raise PlanMismatchError(
            "plan: its training step cannot be checked against the model's own, which raises on these inputs "
            "(or runs on no real device); rebuild with check_step=False to use the plan unchecked"
        )
    if found:
        shown = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
        raise PlanMismatchError(
            f"plan: one training step of its module differs from the model's own ({shown}); the plan's regions or "
            "kept ops do not replay this model exactly: re-plan with optimize() or `ckpt-planner plan`"
        )


def check_measured(plan: Any, model: torch.nn.Module, module: torch.nn.Module, args: tuple,
                   kwargs: dict[str, Any]) -> None:
    """Re-measure a loaded plan's measured peaks where they can be: on the kind of device the file says they
    were measured on (`stats.verify.device`), one step of `module` and one of `model` on the allocator.
    A figure off by more than MEASURED_TOLERANCE raises PlanMismatchError naming it. Figures that cannot
    be re-measured here (no device recorded, another device) are dropped from the plan, with a note: a
    plan read from a file states only what was checked."""
    fields = ("measured_peak_bytes", "baseline_measured_peak_bytes")
    if all(getattr(plan, f) is None for f in fields):
        return
    params = list(model.parameters())
    state = params + list(model.buffers())
    device = next((t.device for t in state), torch.device("cpu"))
    record = plan.stats.get("verify")
    recorded_on = record.get("device") if isinstance(record, dict) else None
    if recorded_on != device.type or device.type == "meta":
        for f in fields:
            setattr(plan, f, None)
        where = f"on {recorded_on!r}" if isinstance(recorded_on, str) and recorded_on else "on a device it does not name"
        plan.notes = (*plan.notes, f"the file's measured peaks (measured {where[:80]}) were dropped: they cannot be "
                                   f"re-measured on this {device.type} model; verify() measures them again")
        return
    with ModelState(model).preserved():
        model.train()
        module.train()
        start = [b.detach().clone() for b in model.buffers()]
        for name, step in (("measured_peak_bytes", module), ("baseline_measured_peak_bytes", model)):
            recorded = getattr(plan, name)
            if recorded is None:
                continue
            with torch.no_grad():
                for b, v in zip(model.buffers(), start):
                    b.copy_(v)
            try:
                actual = measure_step_peaks(step, args, kwargs, params, state, default_loss, device)[0].allocator
            finally:
                for p in params:
                    p.grad = None
            if abs(recorded - actual) > MEASURED_TOLERANCE * max(actual, 1):
                raise PlanMismatchError(
                    f"plan {name}: the file says {recorded} bytes but one step on this {device.type} measures "
                    f"{actual} bytes; the plan was edited or the model changed: re-plan with optimize() or "
                    "`ckpt-planner plan`"
                )

"""The callbacks' closed loop: the plan made for the loop's own step, then corrected by what it measured.

Two corrections, each made between two training steps and never past the budget:

1. On the first batch (`fit_loop`): the plan is made for the step `optimize()` captures, which holds
   the model's outputs through the backward. The frameworks' loops do not (`loop.py`); the plan's own
   Problem simulated as the loop runs it gives the difference, and the captured step is planned once
   more for the budget moved by it (less for a heavier loop, more for a lighter one). A plan made to
   spend a saving is measured once, its own module on the planned inputs, before it runs, so that what
   the profile did not see cannot take the loop over the budget (a stage-wise profile once planned a
   padded batch as unpadded: a 2-layer Qwen2 step measured 6.79 MB against 5.78 MB predicted, the
   masks and repeated key/value heads of its attentions, now counted). What it measured over the
   captured step's plan beyond the predicted difference is added to its prediction; over the budget,
   it is planned once more for that much less, else the captured step's plan stays. The first plan there
   is the solver's alone (`first_plan`): the safety net's check and the race run for the plan that runs,
   and the race's measured peak of a plan's step stands for its measurement before it runs.
2. After the planned shape is measured (`note_measured`, `replan_measured`): where the measured peak parts
   from the prediction by more than 3 % either way, the difference is taken as fixed bytes (it does not
   depend on what is recomputed) and the shape is planned once more for the budget less it; the next
   step at the planned shape is measured again. One log line says what was measured, what changed and
   why; the plan's notes carry it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterator
from typing import Any

from ..lower.apply import remove_checkpointing
from ..lower.inplace import restore_forward
from .calibrate import BUDGET_KEYS, THRESHOLD, measure_peak, preserved, replan_within, state_tensors
from .logs import _log, through_bars
from .loop import HELD, loop_prediction

__all__ = ["first_plan", "fit_loop", "note_measured", "replan_measured"]


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.2f} MB"


REQUEST_KEYS = ("budget_gb", "budget_bytes", "activation_budget", "solver", "solver_options", "safety_margin",
                "on_larger_shape", "own_checkpointing", "autotune")
"""optimize()'s keywords that `Planner.plan` takes; the others make the Planner (its Setup)."""


def _reusable(kwargs: dict[str, Any]) -> bool:
    """A Planner kept from one planning to the next (one capture and profile, several budgets) plans these
    keywords as optimize() does; the others take optimize()'s own paths (compiled, inexact, loss alone,
    in parts across ranks)."""
    from ..distributed import planning_is_collective

    return (not kwargs.get("compile") and kwargs.get("exact", True) and kwargs.get("world_size", 1) == 1
            and kwargs.get("outputs", "all") == "all" and not planning_is_collective()
            and not ({"progress", "exact_check"} & set(kwargs)))


@contextlib.contextmanager
def _solved_only(kept: Any) -> Iterator[None]:
    """A kept Planner's plans solved and lowered, not checked against the model's step, for now: a plan made
    only to size the loop's difference, which the plan that runs is checked for itself."""
    profiled = kept.profiled
    setup = profiled.setup
    profiled.setup = dataclasses.replace(setup, exactness=dataclasses.replace(setup.exactness, check_step=False))
    try:
        yield
    finally:
        profiled.setup = setup


RACE_SHARE = 0.02
"""The share of a run's training steps the default race may take. A race ranks plans whose predicted steps
differ by a few percent of a step; more of the run than this it could seldom win back."""


def race_for_run(run_steps: int | None) -> tuple[int | None, str]:
    """(autotune steps, a note) for a run of `run_steps` training steps: at most RACE_SHARE of them, and none
    where that leaves no room for two candidates (race/rules.py `schedule`); (None, '') where the run's
    length is unknown (the race is held to the planning's time alone)."""
    from ..choose.race.rules import AUTOTUNE_STEPS, schedule

    if not run_steps or run_steps <= 0:
        return None, ""
    steps = min(AUTOTUNE_STEPS, int(RACE_SHARE * run_steps))
    if schedule(2, steps) == (0, 0):
        return 0, (f"autotune: off: {100 * RACE_SHARE:.0f} % of the run's {run_steps} training steps is too few "
                   "model steps to race two plans (the solver's plan runs; autotune= sets it)")
    return steps, f"autotune: held to {steps} model steps, {100 * RACE_SHARE:.0f} % of the run's {run_steps} training steps"


PROBE_SOLVER = "dp"
"""The solver of the plan that only sizes the loop's step (`probe`): fast, and never the plan that runs."""


def plan_captured(planner: Any, *, probe: bool = False, **budget: Any) -> Any:
    """The captured step at the planned shape planned for `budget` (optimize()'s budget keywords), the other
    keywords as given. Where they allow it, one Planner captures and profiles once for every budget.
    `probe`: with such a Planner, a solver's plan alone (PROBE_SOLVER's where the solver is 'auto', neither
    checked nor raced), `.probe` set on it; a plan that only sizes the loop's step costs no model step and
    little solving. Without one, the plan as optimize() makes it."""
    from ..api import Planner, optimize
    from ..errors import CaptureError, PlannerError
    from ..solvers.registry import InfeasibleBudgetError
    kwargs = {k: v for k, v in planner.optimize_kwargs.items() if k not in BUDGET_KEYS}
    race, _ = race_for_run(getattr(planner, "run_steps", None))
    if race is not None:
        kwargs.setdefault("autotune", race)
    planner._inside = True  # the model's own code is captured; no step is measured meanwhile
    try:
        with preserved(planner._target), through_bars():
            if planner._planner is None and _reusable(kwargs):
                setup = {k: v for k, v in kwargs.items() if k not in REQUEST_KEYS}
                request = {k: v for k, v in {**kwargs, **budget}.items() if k in REQUEST_KEYS}
                try:
                    planner._planner = Planner(planner._root, planner._planning_inputs, feasible_for=request, **setup)
                except CaptureError:
                    planner._planner = False  # optimize() plans it in parts
            if planner._planner and probe:
                request = {k: v for k, v in kwargs.items() if k in REQUEST_KEYS and k != "autotune"}
                with _solved_only(planner._planner):
                    plan = None
                    if request.get("solver", "auto") == "auto":
                        with contextlib.suppress(InfeasibleBudgetError, PlannerError):  # where it finds none: the solver's own
                            plan = planner._planner.plan(**{**request, "solver": PROBE_SOLVER}, **budget, autotune=False)
                    if plan is None:
                        plan = planner._planner.plan(**request, **budget, autotune=False)
                plan.probe = True
                return plan
            if planner._planner:
                return planner._planner.plan(**{k: v for k, v in kwargs.items() if k in REQUEST_KEYS}, **budget)
            return optimize(planner._root, planner._planning_inputs, **kwargs, **budget)
    finally:
        planner._inside = False


def _make_plan(planner: Any, budget: int) -> Any:
    return plan_captured(planner, budget_bytes=budget)


def _predict(planner: Any) -> Any:
    return lambda plan: loop_prediction(plan, None, planner.loop)[0]


def first_plan(planner: Any, budget: dict[str, Any]) -> tuple[Any, str]:
    """The plan the loop runs, made on the first batch for `budget` (optimize()'s budget keywords), with the
    race held to the run's length where the loop gives it (`race_for_run`; the plan's notes say so)."""
    plan, line = _first_plan(planner, budget)
    _, note = race_for_run(getattr(planner, "run_steps", None))
    if note and "autotune" not in planner.optimize_kwargs:
        plan.notes = (*plan.notes, note)
    return plan, line


def _first_plan(planner: Any, budget: dict[str, Any]) -> tuple[Any, str]:
    """The plan the loop runs, made on the first batch for `budget` (optimize()'s budget keywords).

    For a loop that runs the captured step (HELD) it is optimize()'s plan. Else the solver's plan alone
    (`probe`) sizes the loop's difference, and `fit_loop` plans again where it is over 3 % of the budget:
    the safety net's check and the measured race then run once, for the plan that runs, not also for a
    first plan it replaces (a race held to the planning's time ran twice: 21 model steps each for the
    Trainer's LoRA Llama in benchmarks/results/finetune.md). Where the probe stands, the plan for the
    budget is made in full, and fitted to the loop itself where the probe's loop was within 3 %."""
    if planner.loop == HELD:
        return fit_loop(planner, plan_captured(planner, **budget))
    probe = plan_captured(planner, probe=True, **budget)
    plan, line = fit_loop(planner, probe)
    if plan is not probe or not getattr(probe, "probe", False):
        return plan, line
    full = plan_captured(planner, **budget)  # the same budget, checked and raced
    if not line:  # the probe's loop within 3 %: the raced plan's may not be (its peak elsewhere), fitted as before
        return fit_loop(planner, full)
    full.notes = (*full.notes, line)
    return full, line


def fit_loop(planner: Any, plan: Any) -> tuple[Any, str]:
    """The first plan, made again for the loop's step where it parts from the captured one by more than 3 %
    of the budget. Returns (the plan, a line saying what was done; '' where nothing was)."""
    if planner.loop == HELD or plan.budget_bytes is None:
        return plan, ""
    budget = int(plan.budget_bytes)
    held = int(plan.predicted_peak_bytes)
    ran, delta = loop_prediction(plan, None, planner.loop)
    if abs(delta) <= THRESHOLD * budget:
        return plan, ""
    predict, extras = (_measured_predictor(planner, plan) if delta < 0 else (_predict(planner), {}))
    new, peak, target, why = replan_within(plan, budget, 0, lambda b: _make_plan(planner, b), predict)
    line = (f"the loop's step ({planner.loop.describe()}) is {_mb(abs(delta))} "
            f"{'lighter' if delta < 0 else 'heavier'} than the captured step's {_mb(held)} for this plan, "
            f"{_mb(ran)}; ")
    tried = "; ".join(f"{_mb(m)} measured, {_mb(p)} predicted" for p, m in extras.values())
    if new is plan:
        line += f"kept the plan: {why}" if why else "kept the plan"
        if len(extras) > 1:  # what stopped it: each plan tried, its captured step measured against the model's
            line += (f": no plan made for {_mb(target)} or less was predicted within the budget once its captured "
                     f"step was measured (first plan, then each tried: {tried}; the loop's step predicted "
                     f"{', '.join(_mb(v) for v in extras_loop(extras, planner, plan))})")
    else:
        line += (f"planned again for the captured step at {_mb(target)}: "
                 f"{len(plan.regions)} -> {len(new.regions)} regions, the loop's step predicted {_mb(peak)} "
                 f"(budget {_mb(budget)})")
        if extras:
            planner.correction = extras.loop[id(new)] - loop_prediction(new, None, planner.loop)[0]
            line += (f"; each plan's captured step measured before it ran ({tried}): this plan's "
                     f"{_mb(planner.correction)} past the model is in its prediction")
        new.budget_bytes = budget  # the user's budget, which the loop's step is planned to
    new.notes = (*new.notes, line)
    return new, line


def _measure_captured(planner: Any, plan: Any) -> int:
    """Peak bytes of one step of `plan.module` at the planned inputs, as `optimize()` captured it (the output
    held through the backward), counted as the callbacks count a training step; gradients and random
    generators put back."""
    from ..profile.loss import default_loss

    loss_of = planner.optimize_kwargs.get("loss_fn") or default_loss
    inputs = planner._planning_inputs

    def run() -> None:
        out = plan.module(**inputs)
        loss_of(out).backward()
        del out

    state = state_tensors(planner._optimizer)
    # the optimizer's state the Problem counts but an optimizer that makes it lazily has not made yet
    missing = max(0, int(getattr(plan.problem, "optimizer_bytes", 0)) - sum(t.nbytes for t in state))
    raced = raced_peak(plan)
    if raced is not None:  # the race ran this very step: the same meter, less the optimizer's state
        return raced + sum(t.nbytes for t in state) + missing
    planner._inside = True  # the measurement is not a training step
    try:
        with preserved(planner._target), through_bars():
            return measure_peak(planner._root, run, (inputs, state)) + missing
    finally:
        planner._inside = False


def raced_peak(plan: Any) -> int | None:
    """The peak the race measured of `plan`'s own step in this planning (bytes: parameters, buffers, inputs
    and the step's tensors, gradients dropped before it, no optimizer state), or None where it did not."""
    record = plan.stats.get("autotune") if isinstance(getattr(plan, "stats", None), dict) else None
    if not isinstance(record, dict) or record.get("from_store"):
        return None
    if plan.offloaded_storages():
        return None
    own = (sorted(list(r) for r in plan.spans()), sorted(plan.saved_indices()))
    for c in record.get("candidates", ()):
        if (c.get("measured_peak_bytes") is not None and not c.get("modules") and not c.get("failed")
                and (sorted(c.get("regions", ())), sorted(c.get("saved", ()))) == own):
            return int(c["measured_peak_bytes"])
    return None


def extras_loop(extras: dict[int, tuple[int, int]], planner: Any, reference: Any) -> list[int]:
    """The loop's predicted peak of each plan tried after the first, its measured excess included."""
    return [v for k, v in getattr(extras, "loop", {}).items() if k != id(reference)]


def _extra(extras: dict[int, tuple[int, int]], reference: Any, plan: Any) -> int:
    """Bytes `plan`'s measured captured step exceeds `reference`'s by beyond their predicted difference."""
    (ref_pred, ref_meas), (pred, meas) = extras[id(reference)], extras[id(plan)]
    return int((meas - ref_meas) - (pred - ref_pred))


class _Tried(dict):
    """(predicted, measured) captured step of each plan tried, by id; `.loop`: the loop's prediction of each."""

    def __init__(self) -> None:
        super().__init__()
        self.loop: dict[int, int] = {}


def _measured_predictor(planner: Any, reference: Any) -> tuple[Any, dict[int, tuple[int, int]]]:
    """predict(plan) for `replan_within`: the loop's predicted peak of `plan`, plus what one measured step of
    its module exceeds the reference plan's by beyond the predicted difference. Returns (predict, the
    (predicted, measured) captured step of each plan it was asked about, by id)."""
    extras = _Tried()

    def measured(plan: Any) -> None:
        if id(plan) not in extras:
            extras[id(plan)] = (int(plan.predicted_peak_bytes), _measure_captured(planner, plan))

    def predict(plan: Any) -> int:
        loop = loop_prediction(plan, None, planner.loop)[0]
        if plan is reference:
            return loop
        measured(reference)
        measured(plan)
        pred, meas = extras[id(plan)]
        # what its captured step measured over the model, or over the first plan's excess where that is more
        extras.loop[id(plan)] = loop + max(meas - pred, _extra(extras, reference, plan))
        return extras.loop[id(plan)]

    return predict, extras


def note_measured(planner: Any, step: int, shapes: Any, peak: int) -> None:
    """After a measured step: the planned shape parting from its prediction by more than 3 % starts one
    more planning, at the next step's start."""
    predicted = planner.predicted_peak_bytes
    if shapes != planner.planned_shapes or planner._corrected or predicted is None or planner.plan.budget_bytes is None:
        return
    if abs(peak - predicted) > THRESHOLD * max(1, predicted) or peak > planner.plan.budget_bytes:
        planner._pending = (step, peak, predicted)


def replan_measured(planner: Any) -> None:
    """Plan once more with the fixed bytes corrected by the measured difference; apply the new plan."""
    step, peak, predicted = planner._pending
    planner._pending, planner._corrected = None, True
    plan, budget = planner.plan, int(planner.plan.budget_bytes)
    correction = planner.correction + (peak - predicted)
    t0 = time.perf_counter()
    restore_running(planner)
    new, new_peak, target, why = replan_within(plan, budget, correction, lambda b: _make_plan(planner, b),
                                               _predict(planner))
    planner.planning_s = (planner.planning_s or 0.0) + time.perf_counter() - t0
    off = f"{100 * (peak - predicted) / max(1, predicted):+.1f} %"
    line = (f"step {step} at {planner.planned_shapes}: measured peak {_mb(peak)}, predicted {_mb(predicted)} ({off}, "
            f"over the {100 * THRESHOLD:.0f} % the loop allows): the step is {_mb(abs(peak - predicted))} "
            f"{'heavier' if peak > predicted else 'lighter'} than modelled, taken as fixed bytes; ")
    if new is plan:
        line += f"kept the plan ({why})" if why else "kept the plan"
    else:
        line += (f"planned again for the captured step at {_mb(target)} "
                 f"in {time.perf_counter() - t0:.1f} s: {len(plan.regions)} -> {len(new.regions)} regions, "
                 f"predicted {_mb(new_peak)} (budget {_mb(budget)}); the planned shape is measured again")
        new.budget_bytes = budget
        planner.plan = new
        planner._remeasure = True
    planner.correction = correction
    planner.plan.notes = (*planner.plan.notes, line)
    planner.replans.append(line)
    _log(logging.WARNING if peak > budget else logging.INFO, "%s", line)
    planner._apply(planner._target)


def restore_running(planner: Any) -> None:
    """The target's own forward and modules back, before it is planned again."""
    restore_forward(planner._target)
    if planner.application is not None and planner.application.kind == "modules":
        remove_checkpointing(planner._target)

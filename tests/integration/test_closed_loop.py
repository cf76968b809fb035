"""The closed loop: the planned shape measured off its prediction by more than 3 % is planned once more.

A small MLP whose output holds its logits (512 x 512 fp32, 1.0 MB) beside the loss trains 4 steps at one
shape in a plain loop driving `FirstBatchPlanner` (the callbacks' framework-free part). The planner is
told the loop holds the outputs through the backward, as `optimize()` captures the step:

- the loop drops them (`loss = model(...)["loss"]`): the captured step is heavier than the real one, the
  measured peak falls short of the prediction, and the planner plans once more with that much more room,
  after which the measured peak is closer to the budget and within it;
- the loop keeps a copy of the logits through the backward: the captured step is lighter than the real
  one; a 15 % safety margin leaves the first step within the budget, and the planner plans once more
  with that much less room before a later step could go over it.

In both the losses are bitwise those of the model trained without the planner, and the log line says
what was measured, what changed and why. Plan costs come from FLOPs, so plans do not depend on the clock.
"""

from __future__ import annotations

import logging

import pytest
import torch
from ckpt_planner.integrations import FirstBatchPlanner
from ckpt_planner.profile.profiler import ProfileConfig
from torch import nn

STEPS, ROWS, WIDTH, CLASSES = 4, 512, 256, 512
PLAN = {"solver": "dp", "autotune": False, "check_step": False,
        "profile_config": ProfileConfig(flop_times=True, count_flops=True)}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(12))
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        logits = self.head(x)
        return {"loss": nn.functional.cross_entropy(logits, y), "logits": logits}


def _batches() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [{"x": torch.randn(ROWS, WIDTH, generator=g), "y": torch.randint(0, CLASSES, (ROWS,), generator=g)}
            for _ in range(STEPS)]


def _train(step, planner: FirstBatchPlanner | None) -> tuple[list[torch.Tensor], Net]:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if planner is not None:
        planner.attach(model, opt)
    losses = []
    for batch in _batches():
        if planner is not None:
            planner.step_begin(model, opt)
        losses.append(step(model, batch))
        if planner is not None:
            planner.step_end()
        opt.step()
        opt.zero_grad(set_to_none=True)
    if planner is not None:
        planner.close()
    return losses, model


def _drops_outputs(model: nn.Module, batch: dict) -> torch.Tensor:
    loss = model(**batch)["loss"]
    loss.backward()
    return loss.detach()


def _keeps_a_copy(model: nn.Module, batch: dict) -> torch.Tensor:
    out = model(**batch)
    copy = out["logits"].detach().clone()  # held through the backward: 1.0 MB the captured step never saw
    out["loss"].backward()
    del copy
    return out["loss"].detach()


def _same_training(step, planner: FirstBatchPlanner) -> None:
    base, base_model = _train(step, None)
    losses, model = _train(step, planner)
    assert len(losses) == len(base) == STEPS
    for a, b in zip(losses, base):
        assert torch.equal(a, b)
    for (name, p), q in zip(model.named_parameters(), base_model.parameters()):
        assert torch.equal(p, q), name


def test_captured_step_heavier_replans_once_and_uses_the_budget(caplog) -> None:
    planner = FirstBatchPlanner(activation_budget=0.75, **PLAN)  # the loop is taken to hold the outputs
    with caplog.at_level(logging.INFO, logger="ckpt_planner"):
        _same_training(_drops_outputs, planner)
    budget = planner.plan.budget_bytes
    first, *later = planner.measurements
    assert first.step == 1 and [m.step for m in later] == [2]  # measured, planned again, measured again
    assert len(planner.replans) == 1 and planner.correction < 0
    assert first.peak_bytes < 0.97 * budget  # the logits went before the backward: budget left unused
    after = later[0].peak_bytes
    assert first.peak_bytes < after <= budget and after >= 0.95 * budget
    assert abs(after - planner.predicted_peak_bytes) <= 0.02 * after  # the corrected prediction holds
    lines = [r.getMessage() for r in caplog.records if "taken as fixed bytes" in r.getMessage()]
    assert len(lines) == 1 and "lighter than modelled" in lines[0] and "planned again" in lines[0]
    assert lines[0].removeprefix("callback: ") in planner.plan.notes


def test_captured_step_lighter_replans_before_it_exceeds_the_budget(caplog) -> None:
    planner = FirstBatchPlanner(activation_budget=0.8, safety_margin=0.15, **PLAN)
    with caplog.at_level(logging.INFO, logger="ckpt_planner"):
        _same_training(_keeps_a_copy, planner)
    budget = planner.plan.budget_bytes
    first, *later = planner.measurements
    assert len(planner.replans) == 1 and planner.correction > 0
    assert first.peak_bytes > 1.03 * planner.plan.predicted_peak_bytes - planner.correction
    assert all(m.peak_bytes <= budget for m in planner.measurements)
    assert [m.step for m in later] == [2] and later[0].peak_bytes < first.peak_bytes
    assert abs(later[0].peak_bytes - planner.predicted_peak_bytes) <= 0.02 * later[0].peak_bytes
    lines = [r.getMessage() for r in caplog.records if "taken as fixed bytes" in r.getMessage()]
    assert len(lines) == 1 and "heavier than modelled" in lines[0] and "planned again" in lines[0]


def test_a_lighter_loops_saving_is_spent_up_front_within_the_budget(caplog) -> None:
    """The loop drops the logits (1.0 MB) and the planner is told so: the first plan is made for the loop's
    step at the budget, each plan tried measured once before it runs, and the first measured step of the
    planned shape uses the budget without a re-plan."""
    from ckpt_planner.integrations.loop import LoopStep

    planner = FirstBatchPlanner(activation_budget=0.75, **PLAN)
    planner.loop = LoopStep(outputs_dropped=True)  # as the callbacks set theirs
    with caplog.at_level(logging.INFO, logger="ckpt_planner"):
        _same_training(_drops_outputs, planner)
    budget = planner.plan.budget_bytes
    first = planner.measurements[0]
    assert not planner.replans and first.step == 1
    assert first.peak_bytes <= budget and first.peak_bytes >= 0.95 * budget  # spent, not left unused
    assert abs(first.peak_bytes - planner.predicted_peak_bytes) <= 0.02 * first.peak_bytes
    lines = [r.getMessage() for r in caplog.records if "captured step measured before it ran" in r.getMessage()]
    assert len(lines) == 1 and "planned again for the captured step at" in lines[0]
    assert lines[0].removeprefix("callback: ") in planner.plan.notes


def test_calibrate_plans_an_optimize_users_step_again() -> None:
    from ckpt_planner import calibrate, optimize

    torch.manual_seed(0)
    model = Net()
    batch = _batches()[0]
    plan = optimize(model, batch, activation_budget=0.75, **PLAN)
    rng = torch.get_rng_state()
    new = calibrate(plan, model, batch, lambda m: _drops_outputs(m, batch), **PLAN)
    assert torch.equal(rng, torch.get_rng_state()) and all(p.grad is None for p in model.parameters())
    record = new.stats["calibration"]
    assert new is not plan and record["replanned"] and record["correction_bytes"] < 0
    assert record["measured_bytes"] < record["measured_after_bytes"] <= plan.budget_bytes
    assert "calibrated on the caller's step" in new.notes[-1]
    with pytest.raises(ValueError, match="budget is the plan's own"):
        calibrate(plan, model, batch, lambda m: None, budget_gb=1.0)


def _accumulates(model: nn.Module, batch: dict) -> torch.Tensor:
    """Two micro-batches per optimizer step: the second runs with the first one's gradients alive."""
    losses = []
    for rows in (batch, {k: v.flip(0) for k, v in batch.items()}):  # each micro-batch at the planned shape
        loss = model(**rows)["loss"] / 2
        loss.backward()
        losses.append(loss.detach())
    return torch.stack(losses)


def _backward_outside_autocast(model: nn.Module, batch: dict) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(**batch)["loss"]
    loss.backward()  # outside: leaving autocast emptied its cache of parameter casts
    return loss.detach()


@pytest.mark.slow
@pytest.mark.parametrize("case", ["accumulation", "amp"])
def test_the_loops_step_is_predicted_within_3_percent(case) -> None:
    """Accumulation is modelled whole (no re-plan). Under AMP with the backward outside autocast the casts
    go at the forward's end, sooner than the model lets them go (at the first recompute): the closed loop
    takes the rest as fixed bytes, once."""
    from ckpt_planner.integrations.loop import LoopStep

    step = _accumulates if case == "accumulation" else _backward_outside_autocast
    modelled = LoopStep(outputs_dropped=True, accumulating=case == "accumulation", backward_outside_autocast=case == "amp")
    for loop in (LoopStep(), modelled):
        # accumulation: the gradients held from the forward's start need a budget near the plain step's
        planner = FirstBatchPlanner(activation_budget=1.0 if case == "accumulation" else 0.75, **PLAN)
        planner.loop = loop  # as the callbacks set theirs; the held step (optimize()'s) misses by over 3 %
        _same_training(step, planner)
        first, last = planner.measurements[0], planner.measurements[-1]
        if loop != modelled:  # optimize()'s step is not this loop's: the first measurement misses
            assert abs(first.peak_bytes - planner.plan.predicted_peak_bytes) > 0.03 * first.peak_bytes
            continue
        if case == "accumulation":
            assert not planner.replans and first is last
        else:
            assert len(planner.replans) <= 1 and last.step == 1 + len(planner.replans)
        assert abs(last.peak_bytes - planner.predicted_peak_bytes) <= 0.03 * last.peak_bytes
        assert all(m.peak_bytes <= planner.plan.budget_bytes for m in planner.measurements)


def test_the_races_verdict_on_the_budget_reaches_the_callbacks_log(caplog, monkeypatch) -> None:
    from ckpt_planner.choose.base import BasePlanner

    real = BasePlanner.plan
    said = "autotune: no candidate measured within the budget; the solver's plan stands"

    def plan(self, **kwargs):
        p = real(self, **kwargs)
        p.notes = (*p.notes, said)  # as the race writes it when every candidate measured over the budget
        return p

    monkeypatch.setattr(BasePlanner, "plan", plan)
    with caplog.at_level(logging.INFO, logger="ckpt_planner"):
        _train(_drops_outputs, FirstBatchPlanner(activation_budget=0.75, **PLAN))
    lines = [r.getMessage() for r in caplog.records if said in r.getMessage()]
    assert lines and all(line.startswith("callback: ") and "holds the outputs" in line for line in lines)


def test_a_lighter_loops_plan_is_checked_and_raced_once(monkeypatch) -> None:
    """Planning for a loop that drops the outputs: one capture and profile, one safety-net check and one race
    (for the plan that runs, not also for a first plan it replaces), and one measured step before it runs
    (the race already measured the new plan's step on the same meter). Counts calls, not seconds."""
    import ckpt_planner.api as api
    import ckpt_planner.choose.choice as choice
    import ckpt_planner.integrations.closed_loop as closed_loop
    from ckpt_planner.integrations.loop import LoopStep

    calls = {"capture": 0, "check": 0, "race": 0, "measured": 0}

    def counted(module, name, key):
        real = getattr(module, name)

        def wrapper(*args, **kwargs):
            calls[key] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)

    counted(api, "capture", "capture")
    counted(choice, "checked", "check")
    counted(choice, "autotuned", "race")
    counted(closed_loop, "measure_peak", "measured")
    # checked and raced among the solvers and hand-written plans (a solver named races its variants alone)
    plan = {**PLAN, "autotune": 8, "check_step": True, "solver": "auto"}
    planner = FirstBatchPlanner(activation_budget=0.75, **plan)
    planner.loop = LoopStep(outputs_dropped=True)
    _same_training(_drops_outputs, planner)
    assert calls == {"capture": 1, "check": 1, "race": 1, "measured": 1}
    assert "autotune" in planner.plan.stats and any("planned again for the captured step" in n for n in planner.plan.notes)
    first = planner.measurements[0]
    assert first.peak_bytes <= planner.plan.budget_bytes
    assert abs(first.peak_bytes - planner.predicted_peak_bytes) <= 0.02 * first.peak_bytes


def test_the_race_is_held_to_a_share_of_the_run() -> None:
    from ckpt_planner.choose.race.rules import AUTOTUNE_STEPS, schedule
    from ckpt_planner.integrations.closed_loop import RACE_SHARE, race_for_run

    assert race_for_run(None) == (None, "")  # a run of unknown length: the planning's time holds the race
    steps, note = race_for_run(300)  # 2 % of 300 is 6 model steps: too few for two candidates
    assert steps == 0 and schedule(2, int(RACE_SHARE * 300)) == (0, 0)
    assert note.startswith("autotune: off") and "300 training steps" in note
    steps, note = race_for_run(1000)
    assert steps == int(RACE_SHARE * 1000) and schedule(2, steps) != (0, 0) and "20 model steps" in note
    assert race_for_run(10**6)[0] == AUTOTUNE_STEPS


@pytest.mark.parametrize("run_steps", [300, 1000])
def test_a_run_of_known_length_races_within_its_share(monkeypatch, run_steps) -> None:
    """The callbacks give the planner the run's length: a short run is not raced (the note says why), a longer
    one is raced for at most its share; the plan that only sizes the loop's step is dp's. Counts calls and
    steps, not seconds."""
    import ckpt_planner.choose.choice as choice
    from ckpt_planner.choose.base import BasePlanner
    from ckpt_planner.integrations.loop import LoopStep

    raced: list[int] = []
    solvers: list[str] = []
    real_tune, real_plan = choice.autotuned, BasePlanner.plan

    def tuned(p, solution, resolved, request, steps):
        raced.append(steps)
        return real_tune(p, solution, resolved, request, steps)

    def plan(self, **kwargs):
        solvers.append(kwargs.get("solver"))
        return real_plan(self, **kwargs)

    monkeypatch.setattr(choice, "autotuned", tuned)
    monkeypatch.setattr(BasePlanner, "plan", plan)
    settings = {k: v for k, v in PLAN.items() if k != "autotune"} | {"solver": "auto"}
    planner = FirstBatchPlanner(activation_budget=0.75, **settings)
    planner.loop = LoopStep(outputs_dropped=True)
    planner.run_steps = run_steps
    _same_training(_drops_outputs, planner)
    assert solvers[0] == "dp" and all(s == "auto" for s in solvers[1:])  # the probe, then the plan that runs
    if run_steps == 300:
        assert raced == [] and any(n.startswith("autotune: off") for n in planner.plan.notes)
    else:
        assert raced == [20] and any("held to 20 model steps" in n for n in planner.plan.notes)

"""The stage-wise profile's step times: the eager step as each stage's forward and measured backward summed
(not three forwards), and node times calibrated on the step checkpointed per block, never on the plain step
that does not fit. Clocks are replaced by deterministic ones: no measured time is asserted."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch
from ckpt_planner.api import Planner
from ckpt_planner.capture.trace import capture
from ckpt_planner.choose.race import calibration as calibration_mod
from ckpt_planner.choose.race.calibration import calibration_plan, with_step_times
from ckpt_planner.lower.rewrite import CheckpointRegion
from ckpt_planner.profile import stagewise
from ckpt_planner.profile.profiler import ProfileConfig, profile
from ckpt_planner.profile.timing import quantize
from ckpt_planner.solvers import simulate

from tests.unit.profile.test_stagewise import Blocks

TICK = 1e-3  # seconds: each stage's backward reads 3 ms on the fake step clock, the seeded loss's alone 1 ms
TIMED = ProfileConfig(warmup=0, repeats=1, overheads=False, timing_store=False)


def _blocks():
    torch.manual_seed(0)
    return Blocks(d=32, blocks=4), (torch.randn(512, 32),)  # [N, d]: activations well above the weights


def _ticking(monkeypatch) -> None:
    """The stage-wise profile's step clock, read four times per timed stage: around the stage's backward
    (3 TICK apart), then around its seeded loss's backward alone (1 TICK apart): 2 TICK of the stage's own."""
    steps = itertools.cycle((0.0, 3 * TICK, 0.0, TICK))
    now = [0.0]

    def clock() -> float:
        now[0] += next(steps)
        return now[0]

    monkeypatch.setattr(stagewise, "step_clock", lambda device: clock)


@pytest.mark.parametrize("anchor", [False, True])
def test_the_eager_step_is_the_stages_forward_and_their_measured_backward(monkeypatch, anchor):
    """Without the plain step, the eager step was guessed as three forwards (`Problem.base_step_s`); it is
    the node times and each stage's backward as its own step times it, summed, also once the node times
    are fitted (anchored) after the stages ran."""
    _ticking(monkeypatch)
    model, inputs = _blocks()
    cap = capture(model, inputs)
    cost = profile(cap, dataclasses.replace(TIMED, bounded=True, anchor=anchor))
    assert len(cost.stages) > 1
    # every stage hands its outputs on (or is the loss): each has a backward, less its seeded loss's
    assert math.isclose(cost.step_time_s, cost.total_time + len(cost.stages) * 2 * TICK, rel_tol=1e-9)
    assert cost.to_problem().base_step_s == cost.step_time_s


def test_a_stage_whose_backward_fails_leaves_the_estimate_unset(monkeypatch):
    _ticking(monkeypatch)
    monkeypatch.setattr(stagewise, "_backward_time", lambda *a, **k: None)
    model, inputs = _blocks()
    cost = profile(capture(model, inputs), dataclasses.replace(TIMED, bounded=True))
    assert cost.stages and cost.step_time_s == 0.0


def _staged(monkeypatch):
    _ticking(monkeypatch)
    model, inputs = _blocks()
    cap = capture(model, inputs)
    cost = profile(cap, dataclasses.replace(TIMED, bounded=True, anchor=False))
    return model, cap, dataclasses.replace(cost, time_source="measured")


def test_the_stagewise_calibration_recovers_the_factor_from_the_checkpointed_step(monkeypatch):
    """No plain step: the step checkpointed per block is timed, the plain graph's forward under no_grad (F),
    and the same blocks each cut in two. With the eager step F + the stages' backwards (B), a step at `spans` pays
    F + B + s * recompute + calls and hooks + k per region: the factor s and the cost per region k are
    recovered, node times scaled by s, and the eager step is F + B, not the node times (which, each timed
    alone, overstate a step's forward). The plain model and the plain graph are never stepped."""
    model, cap, cost = _staged(monkeypatch)
    regions = calibration_plan(cost)
    split = calibration_mod.split_plan(cost, regions)
    assert len(split) > len(regions) > 0
    backward = cost.step_time_s - cost.total_time
    forward = 0.7 * cost.total_time  # the plain graph's forward under no_grad, as timed
    s, k = 2 ** 0.5, 2e-4  # the factor (on the time grid); seconds per region no call or hook figure charges

    def step(spans):  # what a step checkpointed at `spans` pays, as the model has it
        sim = simulate(cost.to_problem(), spans)
        calls = sim.call_time + sim.hook_time
        return forward + backward + s * (sim.recompute_time - calls) + calls + k * len(spans)

    seen = []

    def fake_steps(modules, args, kwargs, device):
        seen.extend(modules)
        return (step(regions), step(regions) + 1e-3, forward, step(split))

    monkeypatch.setattr(calibration_mod, "timed_steps", fake_steps)
    got = with_step_times(cost, model, cap.graph_module, cap.args, cap.kwargs, timing_store=False)
    assert len(seen) == 4 and model not in seen and cap.graph_module not in seen
    assert [any(isinstance(m, CheckpointRegion) for m in mod.modules()) for mod in seen] == [True, True, False, True]
    assert isinstance(seen[2], calibration_mod._NoGradForward)
    assert math.isclose(got.recompute_scale, s, rel_tol=1e-9)
    for a, b in zip(cost.nodes, got.nodes):
        assert math.isclose(b.time, a.time * s, rel_tol=1e-12)
    assert math.isclose(got.step_time_s, forward + backward, rel_tol=1e-9)
    assert got.graph_overhead_s == 0.0 and got.region_overhead_s == quantize(cost.region_overhead_s + k)
    ops = sum(cost.nodes[i].dispatch_ops for a, b in regions for i in range(a, b + 1))
    assert math.isclose(got.op_overhead_s, 1e-3 / (2 * ops), rel_tol=1e-9)
    # each calibration step as the calibrated profile predicts it is the step measured (to the grid's rounding)
    for spans in (regions, split):
        again = simulate(got.to_problem(), spans)
        assert math.isclose(got.step_time_s + again.recompute_time, step(spans), rel_tol=0.03)


def test_the_forward_timed_alone_runs_no_backward():
    """The calibration's forward step: the plain graph under no_grad, no output asking for a gradient."""
    model, inputs = _blocks()
    cap = capture(model, inputs)
    out = calibration_mod._NoGradForward(cap.graph_module)(*cap.args, **cap.kwargs)
    assert all(not t.requires_grad for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor))


def test_no_calibration_step_where_the_device_has_no_room_for_it(monkeypatch):
    model, cap, cost = _staged(monkeypatch)
    monkeypatch.setattr(calibration_mod, "device_room", lambda device: 0)
    monkeypatch.setattr(calibration_mod, "timed_steps", lambda *a, **k: pytest.fail("a step was run"))
    got = with_step_times(cost, model, cap.graph_module, cap.args, cap.kwargs, timing_store=False)
    assert got.recompute_scale == 1.0 and got.step_time_s == cost.step_time_s


def test_a_planner_below_the_plain_step_gets_the_stagewise_step_times(monkeypatch):
    """The profile optimize() builds where the plain step does not fit goes through the calibration too."""
    _ticking(monkeypatch)
    monkeypatch.setattr(calibration_mod, "timed_steps", lambda modules, *a: (1.0, 1.0, 1e-3, 1.0)[: len(modules)])
    model, inputs = _blocks()
    config = dataclasses.replace(TIMED, overheads=True)  # the default profile's: step times with the call costs
    whole = Planner(model, inputs, profile_config=config)
    budget = int(0.6 * simulate(whole.problem, ()).peak_bytes)
    staged = Planner(model, inputs, profile_config=config, feasible_for={"budget_bytes": budget})
    assert staged.cost.stages
    assert staged.cost.recompute_scale == 4.0  # a 1 s checkpointed step: the factor at its bound
    # the eager step: the checkpointed graph's forward (1 ms) and the stages' backwards
    assert math.isclose(staged.cost.step_time_s, 1e-3 + len(staged.cost.stages) * 2 * TICK, rel_tol=1e-6)

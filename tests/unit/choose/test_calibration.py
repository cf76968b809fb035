"""The calibration on real steps (choose/race/calibration.py): node times scaled by what a recompute costs in
a step checkpointed per block, and the selective policy's cost per op measured on the model's own ops."""

import dataclasses
import math

import torch
from ckpt_planner import ProfileConfig
from ckpt_planner.capture import capture
from ckpt_planner.choose.race import calibration as calibration_mod
from ckpt_planner.choose.race.calibration import calibration_plan, with_step_times
from ckpt_planner.lower import selective
from ckpt_planner.profile import profile
from ckpt_planner.profile.timing import quantize
from ckpt_planner.solvers import simulate

from tests.models.examples import TinyGPT


def _tiny():
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d=32, layers=2, heads=2, seq=16).train()
    x = torch.randint(0, 64, (2, 16))
    return model, capture(model, (x, x))


def test_recompute_calibration_scales_every_node_time_by_one_grid_factor():
    """with_step_times times a per-block checkpointed step and scales node times by one factor: the
    plan ranking the solvers see is the profile's, in the units of a real step."""
    model, cap = _tiny()
    cost = dataclasses.replace(profile(cap, ProfileConfig(warmup=0, repeats=1, overheads=False)), time_source="measured")
    plain = with_step_times(cost, model, cap.graph_module, cap.args, cap.kwargs, calibrate=False)
    assert plain.recompute_scale == 1.0 and [n.time for n in plain.nodes] == [n.time for n in cost.nodes]
    assert plain.step_time_s > 0
    scaled = with_step_times(cost, model, cap.graph_module, cap.args, cap.kwargs)
    k = scaled.recompute_scale
    assert 0.5 <= k <= 4.0 and (k in (0.5, 4.0) or quantize(k) == k)
    for a, b in zip(cost.nodes, scaled.nodes):
        assert math.isclose(b.time, a.time * k, rel_tol=1e-12)
    for p in model.parameters():
        p.grad = None


def test_the_selective_dispatch_cost_is_calibrated_on_the_model_itself(monkeypatch):
    """with_step_times also times the per-block plan under a selective policy that keeps nothing: the
    extra seconds over the plain per-block step, per op dispatched in the forward and the recompute, is
    the policy's cost per op on this model's own ops (a tiny-op microbenchmark read 2-9 us where GPT-2's
    ops cost 16 us)."""
    model, cap = _tiny()
    cost = profile(cap, ProfileConfig(warmup=0, repeats=1, timing_store=False))
    regions = calibration_plan(cost)
    ops = sum(cost.nodes[i].dispatch_ops for s, e in regions for i in range(s, e + 1))
    seen = {}

    def fake_times(model_, graph, args, kwargs, device, *checked):
        seen["checked"] = checked
        return (1.0, 1.0, 1.2, 1.2 + 2 * ops * 7e-6)

    monkeypatch.setattr(calibration_mod, "step_times", fake_times)
    got = with_step_times(cost, model, cap.graph_module, cap.args, cap.kwargs, timing_store=False)
    assert abs(got.op_overhead_s - 7e-6) < 1e-12
    assert (got.step_time_s, got.graph_overhead_s) == (1.0, 0.0)
    # The timed variant really runs every region under the policy, and computes what the plain one does.
    plain, caching_nothing = seen["checked"][:2]  # then the split plan's step (test_a_fixed_cost_per_region...)
    calls = []
    real = selective.dispatch_probe_contexts
    monkeypatch.setattr(selective, "dispatch_probe_contexts", lambda *a, **k: calls.append("probe") or real(*a, **k))
    grads = []
    for module in (plain, caching_nothing):
        torch.manual_seed(1)
        out = module(*cap.args, **cap.kwargs)
        loss = out[0] if isinstance(out, (tuple, list)) else out
        loss.float().sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        for p in model.parameters():
            p.grad = None
    assert len(regions) > 0 and calls == ["probe"] * len(regions)
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_a_fixed_cost_per_region_comes_apart_from_the_node_time_factor(monkeypatch):
    """The per-block plan and the same blocks each cut in two recompute about the same nodes in twice the
    regions: from the two steps, the node-time factor and a cost per region that no call or hook figure
    charges are both recovered (one plan alone folded that cost into the factor: plans of many small regions
    read low, of few large ones high)."""
    model, cap = _tiny()
    cost = dataclasses.replace(profile(cap, ProfileConfig(warmup=0, repeats=1, timing_store=False)),
                               time_source="measured")
    regions = calibration_plan(cost)
    split = calibration_mod.split_plan(cost, regions)
    assert len(split) > len(regions) > 0
    s, k, graph = 2 ** 0.25, 3e-4, 1e-2  # the factor (on the time grid), seconds per region, the graph's step

    def step(spans):  # what a step checkpointed at `spans` pays, as the model has it
        sim = simulate(cost.to_problem(), spans)
        calls = sim.call_time + sim.hook_time
        return graph + s * (sim.recompute_time - calls) + calls + k * len(spans)

    monkeypatch.setattr(calibration_mod, "step_times", lambda m, g, a, kw, d, *checked: (
        graph, graph, step(regions), step(regions), step(split))[: 2 + len(checked)])
    got = with_step_times(cost, model, cap.graph_module, cap.args, cap.kwargs, timing_store=False)
    assert math.isclose(got.recompute_scale, s, rel_tol=1e-9)
    assert got.region_overhead_s == quantize(cost.region_overhead_s + k)
    for spans in (regions, split):  # each calibration step as the calibrated profile predicts it (the time grid's rounding)
        sim = simulate(got.to_problem(), spans)
        assert math.isclose(graph + sim.recompute_time, step(spans), rel_tol=0.05)


def test_one_plan_alone_folds_the_region_cost_into_the_factor(monkeypatch):
    model, cap = _tiny()
    cost = dataclasses.replace(profile(cap, ProfileConfig(warmup=0, repeats=1, timing_store=False)),
                               time_source="measured")
    monkeypatch.setattr(calibration_mod, "split_plan", lambda cost, regions: ())
    regions = calibration_plan(cost)
    sim = simulate(cost.to_problem(), regions)
    calls = sim.call_time + sim.hook_time
    checkpointed = 1e-2 + 2 * (sim.recompute_time - calls) + calls
    monkeypatch.setattr(calibration_mod, "step_times", lambda m, g, a, kw, d, *checked: (
        1e-2, 1e-2, checkpointed, checkpointed)[: 2 + len(checked)])
    got = with_step_times(cost, model, cap.graph_module, cap.args, cap.kwargs, timing_store=False)
    assert got.recompute_scale == 2.0 and got.region_overhead_s == cost.region_overhead_s


def test_a_clearly_faster_calibration_heals_the_stored_one(monkeypatch, tmp_path):
    """The stored snapshot (both plans' steps) gives way whole to a run that measures it clearly faster: a
    machine's load slowed the first, not the model."""
    monkeypatch.setenv("CKPT_PLANNER_TIMINGS", str(tmp_path))
    model, cap = _tiny()
    cost = dataclasses.replace(profile(cap, ProfileConfig(warmup=0, repeats=1, timing_store=False)),
                               time_source="fitted")
    regions = calibration_plan(cost)
    split = calibration_mod.split_plan(cost, regions)
    assert split

    def steps(graph, s):  # the eager and graph steps, then the three calibration steps, at factor s
        def step(spans):
            sim = simulate(cost.to_problem(), spans)
            calls = sim.call_time + sim.hook_time
            return graph + s * (sim.recompute_time - calls) + calls
        return lambda m, g, a, kw, d, *checked: (graph, graph, step(regions), step(regions), step(split))

    factors = []
    for graph, s in ((2e-2, 2.0), (1e-2, 1.0)):  # a loaded run, then a quiet one at half its times
        monkeypatch.setattr(calibration_mod, "step_times", steps(graph, s))
        factors.append(with_step_times(cost, model, cap.graph_module, cap.args, cap.kwargs).recompute_scale)
    assert factors == [2.0, 1.0]

"""Measured choice (planner/choose/autotune.py), the hand-written plans in the race
(solvers/structured.py) and the cost model's refit from the clock (planner/choose/race/refit.py).

Measurements are injected (a function of each candidate's regions), so every assertion is about the
choice rule, the step cap, the records and the store, never about this machine's clock."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from ckpt_planner import api, optimize
from ckpt_planner.choose import autotune as at
from ckpt_planner.choose import choice, safety_net
from ckpt_planner.choose.race import candidates as race_cands
from ckpt_planner.choose.race import device, rules
from ckpt_planner.choose.race import refit as costfit
from ckpt_planner.errors import InputError
from ckpt_planner.plan import Plan
from ckpt_planner.profile.loss import default_loss
from ckpt_planner.profile.timing_store import TimingStore
from ckpt_planner.solvers import Node, Problem, Storage, simulate, solve
from ckpt_planner.solvers.heuristics.selective import block_regions
from ckpt_planner.solvers.heuristics.structured import every_n_plans, structured, structured_plans

from tests.models.small import mlp


def blocks_problem(layers: int = 5, per_block: int = 3) -> Problem:
    """A chain of `layers` blocks (module paths layers.0 ... ) of `per_block` nodes, each saving its input."""
    nodes, storages = [], []
    n = layers * per_block
    for i in range(n):
        storages.append(Storage(producer=i, nbytes=100 + 10 * (i % per_block), last_use=min(i + 1, n - 1),
                                saved_by=(min(i + 1, n - 1),)))
        nodes.append(Node(name=f"n{i}", time=1.0 + i % per_block, grad_bytes=4, inputs=(i - 1,) if i else (),
                          reads=(i - 1,) if i else (), module=f"layers.{i // per_block}.op", op="aten.mm.default"
                          if i % per_block == 0 else "aten.gelu.default", saveable=True))
    return Problem(nodes=tuple(nodes), storages=tuple(storages), param_bytes=50, step_time_s=100.0)


# -- the hand-written plans ------------------------------------------------------------------------------


def test_every_n_plans_are_transformers_layers_and_each_without_the_last():
    problem = blocks_problem(layers=5)
    blocks = block_regions(problem)
    assert len(blocks) == 5
    listed = every_n_plans(problem)
    plans = {p.name: p.regions for p in listed}
    assert len({p.regions for p in listed}) == len(listed)  # each plan once (every_5 is every_4 but the last)
    # transformers checkpoints the layers whose index is a multiple of n
    for n in range(1, 6):
        assert tuple(b for k, b in enumerate(blocks) if k % n == 0) in plans.values()
    assert plans["every_2"] == (blocks[0], blocks[2], blocks[4])
    assert plans["every_1_but_last"] == blocks[:-1]
    assert plans["every_2_but_last"] == (blocks[0], blocks[2])  # blocks 0, 2, 4: the last is 4
    assert "every_3_but_last" not in plans  # blocks 0, 3: the last block is not among them


def test_structured_solver_returns_the_fastest_hand_written_plan_that_fits():
    problem = blocks_problem(layers=5)
    for frac in (0.3, 0.5, 0.8):
        base = simulate(problem, ()).peak_bytes
        budget = int(problem.fixed_bytes + frac * (base - problem.fixed_bytes))
        fitting = [
            simulate(problem, p.regions, saved=p.saved).recompute_time
            for p in structured_plans(problem, budget)
            if simulate(problem, p.regions, saved=p.saved).peak_bytes <= budget
        ]
        result = structured(problem, budget)
        sim = simulate(problem, result.regions, saved=result.saved)
        if fitting:
            assert sim.peak_bytes <= budget and sim.recompute_time == pytest.approx(min(fitting))
            # auto runs it: auto is never predicted slower than the best hand-written plan
            assert solve(problem, budget, "auto").recompute_time <= min(fitting) + 1e-12


def test_no_blocks_no_hand_written_plans():
    problem = dataclasses.replace(blocks_problem(), nodes=tuple(
        dataclasses.replace(n, module="") for n in blocks_problem().nodes))
    assert structured_plans(problem, 10**9) == [] and structured(problem, 10**9).regions == ()


# -- the choice rule, the cap ---------------------------------------------------------------------------


def cand(label: str, extra: float, peak: int = 100) -> rules.Candidate:
    return rules.Candidate(label, ((0, 1),), (), peak, extra)


def m(peak: int, *times: float) -> rules.Measured:
    return rules.Measured(peak, tuple(times))


def test_fastest_measured_within_the_budget_wins():
    cands = [cand("solver", 1.0), cand("every_2", 2.0), cand("dp", 3.0)]
    measured = [m(90, 1.5, 1.6), m(90, 1.1, 1.2), m(90, 1.3, 1.4)]
    assert rules.choose(cands, measured, budget=100, band=0.02) == 1


def test_a_candidate_over_the_budget_on_the_clock_loses_even_when_fastest():
    cands = [cand("solver", 1.0), cand("every_2", 2.0)]
    measured = [m(100, 1.5), m(101, 1.0)]
    assert rules.choose(cands, measured, budget=100, band=0.02) == 0
    assert rules.choose(cands, [m(101, 1.5), m(101, 1.0)], budget=100, band=0.02) is None


def test_a_prediction_inside_the_margin_takes_part_its_measurement_decides():
    problem = blocks_problem()
    every_2 = next(p for p in every_n_plans(problem) if p.name == "every_2")
    budget = simulate(problem, every_2.regions).peak_bytes  # every_2's prediction is exactly the budget
    inner = budget - 40  # the solvers plan for less: every_2 sits inside the margin
    solver = race_cands.candidate(problem, "solver", solve(problem, inner, "dp").regions, (), None)
    picked = race_cands.candidates(problem, solver, budget, inner, limit=100)
    expected = {(p.regions, p.saved) for p in structured_plans(problem, inner)  # never one over the budget
                if simulate(problem, p.regions, saved=p.saved).peak_bytes <= budget} - {(solver.regions, solver.saved)}
    assert picked[0] == solver
    assert {(c.regions, c.saved) for c in picked[1:]} == expected
    assert (every_2.regions, ()) in expected


def test_a_plan_predicted_just_over_the_budget_never_races_whatever_it_would_measure(tmp_path):
    problem = blocks_problem(layers=6)
    every_2 = next(p for p in every_n_plans(problem) if p.name == "every_2")
    predicted = simulate(problem, every_2.regions).peak_bytes
    budget = predicted - 10  # every_2 is predicted 10 bytes over the budget ...
    inner = budget - 40  # ... less than the safety margin
    solution = solve(problem, inner, "dp")
    assert tuple(solution.regions) != every_2.regions

    def measure(cands, rounds, racing=None):  # every plan measures 20 bytes under its prediction; every_2 is fastest
        return ([m(c.predicted_peak_bytes - 20, *[1.0 if c.regions == every_2.regions else 2.0] * rounds)
                 for c in cands], [0.5] * rounds)

    result, notes = at.autotune_solution(problem, solution, budget, inner, steps=30, key="k",
                                         store=TimingStore(tmp_path / "t.json"), measure=measure,
                                         differs=lambda r, s, m: False, learn=False)
    assert tuple(result.regions) != every_2.regions and result.peak_bytes <= budget
    raced = [tuple(tuple(r) for r in c["regions"]) for c in result.stats["autotune"].get("candidates", [])]
    assert every_2.regions not in raced


def test_ties_within_the_noise_band_go_to_the_predicted_fastest():
    cands = [cand("slow-predicted", 3.0), cand("fast-predicted", 1.0), cand("mid", 2.0)]
    measured = [m(90, 1.00), m(90, 1.04), m(90, 1.30)]  # 4 % apart: a tie in a 5 % band
    assert rules.choose(cands, measured, budget=100, band=0.05) == 1
    assert rules.choose(cands, measured, budget=100, band=0.02) == 0  # outside a 2 % band the clock decides


def test_noise_band_is_the_rounds_spread_within_its_bounds():
    quiet = [m(1, 1.0, 1.0, 1.0, 1.0)]
    noisy = [m(1, 1.0, 2.0, 3.0, 4.0)]
    assert rules.noise_band(quiet, [1.0] * 4) == rules.MIN_BAND
    assert rules.noise_band(noisy, [1.0] * 4) == rules.MAX_BAND
    assert rules.noise_band(noisy, []) == rules.MAX_BAND  # no plain-graph steps: the candidates' own spread


def test_noise_band_is_paired_so_a_load_on_the_whole_round_cancels():
    # every module slowed alike, round by round (another process on the machine): the plans are still
    # told apart, where the spread of each candidate's steps alone would call everything a tie
    load = [1.0, 1.6, 1.1, 2.0, 1.3]
    measured = [m(1, *[1.05 * x for x in load]), m(1, *[1.20 * x for x in load])]
    assert rules.noise_band(measured, load) == rules.MIN_BAND
    assert rules.noise_band(measured, []) == rules.MAX_BAND
    assert rules.choose([cand("a", 2.0), cand("b", 1.0)], measured, budget=100, band=rules.MIN_BAND) == 0


@pytest.mark.parametrize("cap", [0, 3, 7, 12, 30, 100])
def test_steps_never_exceed_the_cap(cap):
    calls = []

    def measure(cands, rounds, racing=None):
        calls.append((len(cands), rounds))
        return [m(1, *[1.0] * rounds) for _ in cands], [1.0] * rounds

    cands = [cand(f"c{k}", float(k)) for k in range(4)]
    tuned = rules.tune(cands, 10, measure, steps=cap)
    if calls:
        n, rounds = calls[0]
        model_steps = (n + 1) * (rounds + 1)  # a peak (or warm-up) step and one per round, plain graph included
        assert tuned.record["steps"] == model_steps and model_steps + rules.CHECK_STEPS <= cap
        assert n >= 2 and rounds >= 1
    else:
        assert tuned.index is None and "skipped" in tuned.record
    assert rules.schedule(4, 30) == (4, 3)  # the default: 4 candidates, 3 rounds, 20 steps + 2 for the check


def test_a_race_of_few_plans_gets_the_rounds_of_four_not_the_whole_cap():
    assert rules.schedule(2, 30) == (2, rules.MAX_ROUNDS)
    assert rules.schedule(3, 30) == (3, rules.MAX_ROUNDS)
    assert rules.schedule(2, 8) == (2, 1)  # a small cap still bounds it


def _kept_twin_field(step_s: float) -> tuple[Problem, rules.Candidate, list[rules.Candidate]]:
    """The solver's plan (the blocks, nothing kept), its twin that keeps one op inside (same checkpoint calls,
    2 s slower) and a plan with other calls, on a step of `step_s` seconds."""
    problem = dataclasses.replace(blocks_problem(layers=5), step_time_s=step_s)
    blocks = block_regions(problem)
    budget = simulate(problem, ()).peak_bytes  # everything fits: the field is decided by the calls and times
    kept = blocks[1][0] + 1  # a gelu (2 s) inside the second block
    solver = race_cands.candidate(problem, "solver", blocks, (kept,), None)
    twin = ("dp", blocks, ())  # the same calls, recomputing the gelu: 2 s slower
    other = ("uniform", blocks[::2], ())
    return problem, solver, race_cands.candidates(problem, solver, budget, budget, [twin, other], hand_written=False)


def test_a_tie_with_the_same_checkpoint_calls_is_not_raced():
    _, solver, picked = _kept_twin_field(step_s=1000.0)  # 2 s is 0.2 % of the step: within MIN_BAND, a tie
    assert picked[0] is solver and [c.label for c in picked] == ["solver", "uniform"]


def test_the_same_calls_predicted_apart_beyond_the_band_both_race():
    _, solver, picked = _kept_twin_field(step_s=100.0)  # 2 s is 2 % of the step: the clock can tell
    assert picked[0] is solver and {c.label for c in picked} == {"solver", "dp", "uniform"}


def test_the_default_race_costs_at_most_the_planning_before_it():
    assert rules.race_steps(30, planning_s=8.0, step_s=0.4) == 20  # the Quickstart: its 17 steps fit
    assert rules.race_steps(30, planning_s=20.0, step_s=2.0) == 10  # a 24-layer model: half the steps
    assert rules.race_steps(30, planning_s=100.0, step_s=0.1) == 30  # never beyond the cap
    assert rules.race_steps(30, planning_s=1.0, step_s=5.0) == 1  # one: a stored choice is still read back
    assert rules.race_steps(30, planning_s=1.0, step_s=0.0) == 30  # no step time known: the cap
    assert rules.race_steps(0, planning_s=100.0, step_s=0.1) == 0  # off stays off
    n, rounds = rules.schedule(3, rules.race_steps(30, 20.0, 2.0))
    assert (n + 1) * (rounds + 1) + rules.CHECK_STEPS <= 10


def test_steps_for_defaults():
    assert at.steps_for(None, clock=False) == 0
    assert at.steps_for(True, clock=False) == rules.AUTOTUNE_STEPS
    assert at.steps_for(False, clock=True) == 0
    assert at.steps_for(12, clock=False) == 12
    with pytest.raises(InputError, match="autotune"):
        at.steps_for(-1, clock=True)
    with pytest.raises(InputError, match="autotune"):
        at.steps_for("yes", clock=True)  # type: ignore[arg-type]


def test_steps_for_default_on_the_clock_unless_the_environment_says_off(monkeypatch):
    monkeypatch.delenv(at.AUTOTUNE_ENV, raising=False)
    assert at.steps_for(None, clock=True) == rules.AUTOTUNE_STEPS
    monkeypatch.setenv(at.AUTOTUNE_ENV, "off")
    assert at.steps_for(None, clock=True) == 0


# -- through optimize: the choice, the plan file, the store, the safety net -------------------------------


class FakeClock:
    """Measurements as a function of the regions: the plan with the fewest regions is fastest (as many
    small regions are on a real CPU); peaks are the predictions. Counts calls and steps."""

    def __init__(self, over: set[str] = frozenset(), slow: set[str] = frozenset()):
        self.calls = 0
        self.steps = 0
        self.over, self.slow = over, slow

    def __call__(self, *args, **kwargs):
        def measure(cands, rounds, racing=None):
            self.calls += 1
            self.steps += (len(cands) + 1) * (rounds + 1)
            out = [m(c.predicted_peak_bytes + (10**9 if c.label in self.over else 0),
                     *[1.0 + 0.1 * len(c.regions) + 10.0 * (c.label in self.slow) + 0.001 * k
                       for k in range(rounds)]) for c in cands]
            return out, [1.0] * rounds
        return measure


def _budget(model, inputs):
    planner = api.Planner(model, inputs)
    base = planner.no_checkpoint_peak_bytes
    return planner, int(planner.problem.fixed_bytes + 0.45 * (base - planner.problem.fixed_bytes))


@pytest.fixture
def store_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("CKPT_PLANNER_TIMINGS", str(tmp_path))
    return tmp_path


def test_optimize_takes_the_fastest_on_the_clock_records_it_and_the_next_run_agrees(store_dir, monkeypatch, tmp_path):
    clock = FakeClock()
    monkeypatch.setattr(at, "device_measure", clock)
    model, inputs = mlp()
    planner, budget = _budget(model, inputs)
    plan = planner.plan(budget_bytes=budget, autotune=True)
    rec = plan.stats["autotune"]
    assert clock.calls == 1 and rec["steps"] <= rules.AUTOTUNE_STEPS and not rec["from_store"]
    cands = rec["candidates"]
    assert len(cands) >= 2 and sum(c["chosen"] for c in cands) == 1
    winner = next(c for c in cands if c["chosen"])
    fastest = min(c["measured_step_s"] for c in cands if c["fits"])
    assert winner["measured_step_s"] <= fastest * (1 + rec["band"])
    assert [list(r) for r in plan.spans()] == winner["regions"]
    assert plan.predicted_peak_bytes == simulate(planner.problem, plan.spans(), saved=plan.saved_indices()).peak_bytes
    assert "autotune" in plan.summary() and winner["label"] in plan.summary()
    # every candidate's figures survive the plan file
    path = plan.save(tmp_path / "plan.json")
    loaded = Plan.load(path)
    assert loaded.stats["autotune"] == json.loads(json.dumps(rec))
    assert "autotune" in loaded.summary()
    # the next run (a fresh optimize) returns the same plan from the store, measuring nothing
    again = optimize(model, inputs, budget_bytes=budget, autotune=True)
    assert clock.calls == 1 and again.stats["autotune"]["from_store"]
    assert again.spans() == plan.spans() and again.saved_indices() == plan.saved_indices()
    # the chosen module trains exactly like the model
    out = again.module(*inputs)
    assert torch.isfinite(out).all()


def test_the_default_race_is_held_to_the_planning_time_and_says_so(store_dir, monkeypatch):
    from ckpt_planner.profile.profiler import ProfileConfig

    clock, seen = FakeClock(), []
    monkeypatch.setattr(at, "device_measure", clock)
    monkeypatch.delenv(at.AUTOTUNE_ENV, raising=False)  # the default: on where times are measured

    def held(steps, planning_s, step_s):
        seen.append((steps, planning_s, step_s))
        return 12

    monkeypatch.setattr(choice, "race_steps", held)
    model, inputs = mlp()
    planner = api.Planner(model, inputs, profile_config=ProfileConfig(warmup=0, repeats=1))
    base = planner.no_checkpoint_peak_bytes
    budget = int(planner.problem.fixed_bytes + 0.45 * (base - planner.problem.fixed_bytes))
    plan = planner.plan(budget_bytes=budget)
    assert seen and seen[0][0] == rules.AUTOTUNE_STEPS and seen[0][1] >= planner.prepared_s > 0
    assert seen[0][2] > planner.problem.base_step_s  # counted at a racing plan's step: the plain one's and its recompute
    # the whole race within the 12 steps it was held to; the record counts the winner's check steps where
    # a plan other than the solver's won (and was checked), so they are not added again here
    assert clock.calls == 1 and plan.stats["autotune"]["steps"] <= 12
    assert any(n.startswith("autotune: held to 12 model steps") for n in plan.notes)
    seen.clear()
    planner.plan(budget_bytes=budget, autotune=True)  # asked for: the whole cap, not held
    assert not seen


def test_a_candidate_over_the_budget_on_the_clock_is_not_chosen(store_dir, monkeypatch):
    model, inputs = mlp()
    planner, budget = _budget(model, inputs)
    first = FakeClock()
    monkeypatch.setattr(at, "device_measure", first)
    tuned = planner.plan(budget_bytes=budget, autotune=True).stats["autotune"]
    winner = tuned["chosen"]
    assert winner is not None
    # a fresh store; the same race with the winner measured over the budget
    monkeypatch.setenv("CKPT_PLANNER_TIMINGS", str(store_dir / "second"))
    monkeypatch.setattr(at, "device_measure", FakeClock(over={winner}))
    again = planner.plan(budget_bytes=budget, autotune=True).stats["autotune"]
    assert again["chosen"] != winner
    assert all(c["fits"] or not c["chosen"] for c in again["candidates"])


def test_a_winner_whose_step_differs_from_the_models_is_not_returned(store_dir, monkeypatch):
    monkeypatch.setattr(at, "device_measure", FakeClock(slow={"auto plan"}))  # the solver's plan loses
    model, inputs = mlp()
    planner, budget = _budget(model, inputs)
    solver_plan = planner.plan(budget_bytes=budget, autotune=False)
    calls = []

    def differences(*args, **kwargs):  # the solver's plan passes the safety net; any later plan differs
        calls.append(1)
        return [] if len(calls) == 1 else ["gradients differ"]

    monkeypatch.setattr(safety_net, "step_differences", differences)
    monkeypatch.setattr(at, "step_differences", differences)
    plan = planner.plan(budget_bytes=budget, autotune=True)
    rec = plan.stats["autotune"]
    assert len(calls) == 2  # the race was won by another plan, which the safety net then refused
    assert rec["chosen"] == rec["candidates"][0]["label"] and rec["candidates"][0]["chosen"]
    assert plan.spans() == solver_plan.spans() and any("differs" in n for n in plan.notes)


class ModulesFastest(FakeClock):
    """The hand-written plans that run as the model's own code measure fastest."""

    def __call__(self, *args, **kwargs):
        def measure(cands, rounds, racing=None):
            self.calls += 1
            return [m(c.predicted_peak_bytes, *[(0.5 if c.modules else 1.0) + 0.001 * k for k in range(rounds)])
                    for c in cands], [0.4] * rounds
        return measure


def test_a_whole_module_plan_runs_as_the_models_own_code_exactly_and_leaves_the_model_alone(store_dir, monkeypatch):
    from ckpt_planner.errors import ShapeError
    from ckpt_planner.lower.apply import checkpointed_modules

    from tests.models.small import tiny_gpt

    monkeypatch.setattr(at, "device_measure", ModulesFastest())
    model, inputs = tiny_gpt()  # dropout in every block: the recompute must replay the generator
    planner = api.Planner(model, inputs)
    every_1 = next(p for p in every_n_plans(planner.problem) if p.name == "every_1")
    budget = simulate(planner.problem, every_1.regions).peak_bytes + 4096
    plan = planner.plan(budget_bytes=budget, autotune=True)
    rec = plan.stats["autotune"]
    assert rec["chosen"].endswith("(modules)"), rec["chosen"]
    paths = plan.stats[rules.WHOLE_MODULES]
    assert paths and all(p.startswith("blocks.") for p in paths)
    assert not isinstance(plan.module, torch.fx.GraphModule) and plan.graph_overhead_s == 0.0
    assert any("model's own code" in n for n in plan.notes)
    # the model's own objects, its keys, and nothing of the model changed
    assert list(plan.module.state_dict()) == list(model.state_dict())
    assert all(a is b for a, b in zip(plan.module.parameters(), model.parameters()))
    assert checkpointed_modules(model) == () and set(checkpointed_modules(plan.module)) == set(paths)
    # one training step of each from the same generator state: the same loss and bitwise the same grads
    grads = []
    for module in (model, plan.module):
        for q in model.parameters():
            q.grad = None
        torch.manual_seed(7)
        default_loss(module(*inputs)).backward()
        grads.append([q.grad.clone() for q in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    # a larger batch than planned is refused, as the graph's plan does
    with pytest.raises(ShapeError):
        plan.module(*[torch.cat([t, t]) for t in inputs])
    # the next run takes the same lowering from the store
    again = api.Planner(model, inputs).plan(budget_bytes=budget, autotune=True)
    assert again.stats["autotune"]["from_store"] and again.stats[rules.WHOLE_MODULES] == paths


def test_autotune_false_and_meta_measure_nothing(store_dir, monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(at, "device_measure", clock)
    model, inputs = mlp()
    planner, budget = _budget(model, inputs)
    plan = planner.plan(budget_bytes=budget, autotune=False)
    assert "autotune" not in plan.stats and clock.calls == 0
    plan = planner.plan(budget_bytes=budget)  # the default on FLOP times: off
    assert "autotune" not in plan.stats and clock.calls == 0
    meta = optimize(model, inputs, budget_bytes=budget, device="meta", autotune=True)
    assert "autotune" not in meta.stats and clock.calls == 0


def test_old_plan_files_without_autotune_load(tmp_path):
    model, inputs = mlp()
    plan = optimize(model, inputs, activation_budget=0.5, autotune=False)
    data = plan.to_dict()
    data["stats"].pop("autotune", None)
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    assert "autotune" not in Plan.load(path).stats and Plan.load(path).summary()


# -- the cost model's refit ------------------------------------------------------------------------------


def _rows(scale: float, per_region: float, call: float = 1e-4) -> list[list[float]]:
    rows = []
    for x, k, step in [(0.01, 2, 0.2), (0.02, 8, 0.2), (0.005, 1, 0.1), (0.03, 13, 0.4), (0.015, 4, 0.3)]:
        rows.append([x, k, scale * x + per_region * k, 1 / step, call])
    return rows


def test_refit_recovers_scale_and_per_region_cost():
    found = costfit.fit(_rows(1.7, 3e-4))
    assert found.scale == pytest.approx(1.7) and found.per_region_s == pytest.approx(3e-4)
    assert costfit.fit(_rows(1.7, 3e-4)[:2]) is None  # too few rows


def test_refit_with_one_region_count_fits_the_scale_alone():
    rows = [[x, 3.0, 2.0 * x + 3 * 1e-4, 1.0, 1e-4] for x in (0.01, 0.02, 0.04)]
    found = costfit.fit(rows)
    assert found.scale == pytest.approx(2.0) and found.per_region_s == pytest.approx(1e-4)


def test_refit_applies_to_the_next_solve_and_does_not_feed_on_itself(tmp_path):
    store = TimingStore(tmp_path / "t.json")
    store.keep(costfit.TABLE, costfit.KEY, {"rows": _rows(2.0, 5.0)})
    problem = dataclasses.replace(blocks_problem(), region_overhead_s=1.0)
    refit, found = costfit.learned(problem, store)
    assert found.scale == pytest.approx(2.0) and refit.region_overhead_s == pytest.approx(5.0)
    plan = block_regions(problem)[:2]
    raw = simulate(problem, plan).recompute_time - 2 * problem.region_overhead_s
    new = simulate(refit, plan).recompute_time
    assert new == pytest.approx(2.0 * raw + 2 * 5.0)
    # a record measured on the refit problem gives rows in the raw terms
    record = {"graph_step_s": 100.0, "candidates": [
        {"regions": [list(r) for r in plan], "predicted_extra_s": new, "measured_extra_s": new}]}
    (row,) = costfit.rows_of(refit, record)
    assert row[0] == pytest.approx(raw) and row[1] == 2 and row[4] == pytest.approx(1.0)


def test_remember_keeps_the_last_rows_in_the_store(tmp_path):
    path = tmp_path / "t.json"
    problem = blocks_problem()
    record = {"graph_step_s": 10.0, "candidates": [
        {"regions": [[0, 2]], "predicted_extra_s": 1.0, "measured_extra_s": 1.5} for _ in range(40)]}
    store = TimingStore(path)
    costfit.remember(store, problem, record)
    costfit.remember(store, problem, record)
    rows = TimingStore(path).get(costfit.TABLE, costfit.KEY)["rows"]
    assert len(rows) == costfit.MAX_ROWS


@pytest.mark.parametrize("noisy", [False, True])
def test_rounds_teach_the_refit_only_when_quiet_enough(tmp_path, noisy):
    problem = blocks_problem(layers=5)
    base = simulate(problem, ()).peak_bytes
    budget = int(problem.fixed_bytes + 0.6 * (base - problem.fixed_bytes))
    solution = solve(problem, budget, "dp")
    store = TimingStore(tmp_path / "t.json")

    def measure(cands, rounds, racing=None):
        # noise of each candidate's own (the plain graph's steps stay put), so the paired band sees it
        spread = (lambda k: 1.0 + k) if noisy else (lambda k: 1.0)
        return ([m(c.predicted_peak_bytes, *[(100 + 2 * c.predicted_extra_s) * spread(k) for k in range(rounds)])
                 for c in cands], [100.0] * rounds)

    result, _ = at.autotune_solution(problem, solution, budget, budget, steps=30, key="k", store=store,
                                     measure=measure, differs=lambda r, s, m: False)
    rec = result.stats["autotune"]
    assert len(rec["candidates"]) >= 2 and rec["band"] == (rules.MAX_BAND if noisy else rules.MIN_BAND)
    rows = (TimingStore(tmp_path / "t.json").get(costfit.TABLE, costfit.KEY) or {}).get("rows", [])
    assert (rows == []) == noisy
    if not noisy:  # every row says: measured extra = 2 x predicted
        assert all(r[2] == pytest.approx(2 * r[0] + r[1] * r[4]) for r in rows)


def test_cli_autotune_flags():
    from ckpt_planner.cli.cli_args import build_parser

    base = ["plan", "m.py:f", "--input", "2x3", "--budget-gb", "1"]
    parser = build_parser()
    assert parser.parse_args(base).autotune is None  # the library's default decides
    assert parser.parse_args([*base, "--autotune"]).autotune is True
    assert parser.parse_args([*base, "--no-autotune"]).autotune is False


def test_an_eval_mode_model_races_without_its_own_code(store_dir, monkeypatch):
    """Where the model's own code differs from the planned step (eval mode here), no candidate races as that
    code: every plan in the race is the captured graph (this once crashed: `modules` was False, not None)."""
    monkeypatch.setattr(at, "device_measure", FakeClock())
    model, inputs = mlp()
    model.eval()
    planner, budget = _budget(model, inputs)
    plan = planner.plan(budget_bytes=budget, autotune=True)
    cands = plan.stats["autotune"]["candidates"]
    assert len(cands) >= 2 and not any("(modules)" in c["label"] for c in cands)
    assert plan.predicted_peak_bytes <= budget and not model.training


def test_a_candidate_whose_step_raises_is_dropped_from_the_race():
    """Found on a U-Net: a whole module checkpointed by torch whose input a later ReLU(inplace=True) writes
    raised a raw RuntimeError out of optimize(). Its step raising now drops it; the others race on."""
    model, x = mlp()

    class Raises(torch.nn.Module):
        def forward(self, *args, **kwargs):
            raise RuntimeError("one of the variables needed for gradient computation has been modified")

    def build(regions, saved, paths):
        return Raises() if paths else model

    measure = device.device_measure(model, None, x if isinstance(x, tuple) else (x,), {}, torch.device("cpu"), build)
    cands = [cand("solver", 0.01, 10**6), dataclasses.replace(cand("whole modules", 0.0, 10**5), modules=("0",)),
             cand("other", 0.02, 10**6)]
    measured, base = measure(cands, 2)
    assert measured[1].failed.startswith("RuntimeError: one of the variables") and measured[1].times == ()
    assert all(m.failed is None and len(m.times) == 2 for k, m in enumerate(measured) if k != 1)
    tuned = rules.tune(cands, 10**9, measure, steps=20)
    assert tuned.index in (0, 2) and tuned.record["chosen"] != "whole modules"
    entry = tuned.record["candidates"][1]
    assert entry["fits"] is False and entry["measured_step_s"] is None and "RuntimeError" in entry["failed"]
    json.dumps(tuned.record, allow_nan=False)  # the record goes to the timing store as strict JSON


# -- the race ends early where it is decided -----------------------------------------------------------


def test_a_plan_that_cannot_win_leaves_the_race():
    base = [1.0, 1.0]
    measured = [m(90, 1.00, 1.02), m(90, 1.10, 1.12),  # the leader, and one 10 % behind: a race still
                m(90, 1.40, 1.45),  # 40 % behind on every round: out
                m(101, 0.90, 0.90),  # fastest, but over the budget: out
                rules.Measured(0, (), "RuntimeError: boom")]  # its step raised: out
    assert rules.in_the_race(measured, base, budget=100) == {0, 1}
    # a load slowed the whole second round but the second plan's step: paired with the plain graph's step of
    # the same round it is 8 % behind there, so it stays although its fastest step alone is 40 % behind
    loaded = [m(90, 1.00, 1.30), m(90, 1.40, 1.40)]
    assert rules.in_the_race(loaded, [1.0, 1.30], budget=100) == {0, 1}
    assert rules.in_the_race(loaded, [1.0, 1.0], budget=100) == {0}
    assert rules.in_the_race([m(101, 1.0)], [1.0], budget=100) == set()


def test_the_device_race_stops_timing_what_left_and_ends_when_one_is_left():
    model, x = mlp()
    built = []

    def build(regions, saved, paths, offloaded=()):
        built.append(regions)
        return model

    measure = device.device_measure(model, None, x if isinstance(x, tuple) else (x,), {}, torch.device("cpu"), build)
    cands = [cand("a", 1.0, 10**9), cand("b", 2.0, 10**9), cand("c", 3.0, 10**9)]
    seen = []

    def drop_c(measured, base):  # after the rounds every candidate runs, "c" leaves; after the next, "b"
        seen.append([len(mm.times) for mm in measured])
        return {0, 1} if len(seen) == 1 else {0}

    measured, base = measure(cands, 5, drop_c)
    assert seen == [[rules.LEAVE_AFTER] * 3, [rules.LEAVE_AFTER + 1, rules.LEAVE_AFTER + 1, rules.LEAVE_AFTER]]
    assert [len(mm.times) for mm in measured] == [rules.LEAVE_AFTER + 1, rules.LEAVE_AFTER + 1, rules.LEAVE_AFTER]
    assert len(base) == rules.LEAVE_AFTER + 1  # the race ended with one candidate left, two rounds early
    # 3 peak steps, the plain graph's warm-up, 3 + 3 + 2 candidate steps and 3 of the plain graph
    assert rules.model_steps(measured, base, warm_up=True) == 3 + 1 + 8 + 3
    full, full_base = measure(cands, 5, None)  # without racing, every round runs
    assert [len(mm.times) for mm in full] == [5, 5, 5] and len(full_base) == 5
    assert rules.model_steps(full, full_base, warm_up=True) == (3 + 1) * (5 + 1)

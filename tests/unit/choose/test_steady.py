"""Plans that stay put: a later run returns the plan an earlier one chose for the same graph and budget
while it fits (choose/plan_store.py), so a heal of the timing store never swaps the plan a user got first."""

import dataclasses
import json

import pytest
from ckpt_planner.api import Planner
from ckpt_planner.choose import plan_store as steady_mod
from ckpt_planner.choose.plan_store import KEEP_WITHIN, kept_plan, plan_key
from ckpt_planner.profile.profiler import ProfileConfig
from ckpt_planner.profile.timing_store import STORE_ENV, TimingStore
from ckpt_planner.solvers import Node, Problem, Solution, Storage, simulate

from tests.models.examples import TinyGPT


def chain(n: int = 8, step: float = 100.0) -> Problem:
    nodes, storages = [], []
    for i in range(n):
        storages.append(Storage(producer=i, nbytes=10, last_use=min(i + 1, n - 1), saved_by=(min(i + 1, n - 1),)))
        nodes.append(Node(name=f"n{i}", time=1.0 + i % 3, grad_bytes=2, inputs=(i - 1,) if i else (),
                          reads=(i - 1,) if i else ()))
    return Problem(nodes=tuple(nodes), storages=tuple(storages), param_bytes=5, step_time_s=step)


def _as_solution(problem, regions, budget):
    sim = simulate(problem, regions)
    return Solution(regions=tuple(regions), solver="test", peak_bytes=sim.peak_bytes,
                    recompute_time=sim.recompute_time, budget_bytes=budget)


# Two plans of the chain, both within BUDGET; SLOWER recomputes more.
FASTER, SLOWER = ((1, 2), (4, 5)), ((1, 3), (4, 6))
BUDGET = 10_000


def _gap(problem):
    return simulate(problem, SLOWER).recompute_time - simulate(problem, FASTER).recompute_time


def test_a_stored_plan_stays_while_the_new_one_is_within_the_band(tmp_path):
    problem = chain()
    gap = _gap(problem)
    assert gap > 0
    problem = dataclasses.replace(problem, step_time_s=gap / KEEP_WITHIN * 1.5)  # the gain is 2/3 of the band
    store = TimingStore(tmp_path / "t.json")
    first, notes = kept_plan(problem, _as_solution(problem, SLOWER, BUDGET), BUDGET, "k", store)
    assert first.regions == SLOWER and notes == []
    again, notes = kept_plan(problem, _as_solution(problem, FASTER, BUDGET), BUDGET, "k", TimingStore(tmp_path / "t.json"))
    assert again.regions == SLOWER and again.stats["kept_plan"]
    assert again.recompute_time == pytest.approx(simulate(problem, SLOWER).recompute_time)
    assert len(notes) == 1 and "kept the plan an earlier run chose" in notes[0]
    assert json.loads((tmp_path / "t.json").read_text())["plans"]["k"]["regions"] == [list(r) for r in SLOWER]


def test_a_stored_plan_faster_than_the_new_one_is_kept_and_the_note_says_so(tmp_path):
    problem = dataclasses.replace(chain(), step_time_s=1.0)  # a band far narrower than the plans' gap
    kept_plan(problem, _as_solution(problem, FASTER, BUDGET), BUDGET, "k", TimingStore(tmp_path / "t.json"))
    kept, notes = kept_plan(problem, _as_solution(problem, SLOWER, BUDGET), BUDGET, "k", TimingStore(tmp_path / "t.json"))
    assert kept.regions == FASTER and kept.stats["kept_plan"]
    assert len(notes) == 1 and "predicted no slower than this run's test plan" in notes[0]


def test_a_clearly_faster_plan_is_named_but_the_stored_one_stays(tmp_path):
    problem = chain()
    problem = dataclasses.replace(problem, step_time_s=_gap(problem) / KEEP_WITHIN / 1.5)  # 1.5 bands faster
    store = TimingStore(tmp_path / "t.json")
    kept_plan(problem, _as_solution(problem, SLOWER, BUDGET), BUDGET, "k", store)
    again, notes = kept_plan(problem, _as_solution(problem, FASTER, BUDGET), BUDGET, "k", TimingStore(tmp_path / "t.json"))
    assert again.regions == SLOWER and again.stats["kept_plan"]
    assert len(notes) == 1 and "of a step faster on this run's times" in notes[0] and "time afresh" in notes[0]
    assert TimingStore(tmp_path / "t.json").get("plans", "k")["regions"] == [list(r) for r in SLOWER]


def test_a_stored_plan_over_the_budget_or_not_of_this_graph_is_solved_afresh(tmp_path):
    problem = dataclasses.replace(chain(), step_time_s=1e9)  # any gain is inside the band
    tight = simulate(problem, SLOWER).peak_bytes
    assert simulate(problem, FASTER).peak_bytes > tight  # the stored plan does not fit the new budget
    store = TimingStore(tmp_path / "t.json")
    kept_plan(problem, _as_solution(problem, FASTER, BUDGET), BUDGET, "k", store)
    new, _ = kept_plan(problem, _as_solution(problem, SLOWER, tight), tight, "k", TimingStore(tmp_path / "t.json"))
    assert new.regions == SLOWER
    for entry in ({"regions": [[3, 99]], "saved": []}, {"regions": [[1, 2]], "saved": [7]}, ["junk"], {"saved": []}):
        store = TimingStore(tmp_path / "t.json")
        store.keep("plans", "k", entry)
        store.save()
        new, notes = kept_plan(problem, _as_solution(problem, FASTER, BUDGET), BUDGET, "k", TimingStore(tmp_path / "t.json"))
        assert new.regions == FASTER and notes == []
        assert TimingStore(tmp_path / "t.json").get("plans", "k")["regions"] == [list(r) for r in FASTER]


def test_the_key_tells_graphs_budgets_and_solvers_apart():
    a, b = chain(8), chain(9)
    keys = {plan_key(a, 100, "dp", {}, False), plan_key(b, 100, "dp", {}, False), plan_key(a, 101, "dp", {}, False),
            plan_key(a, 100, "ilp", {}, False), plan_key(a, 100, "dp", {"time_limit": 5}, False),
            plan_key(a, 100, "dp", {}, True)}
    assert len(keys) == 6
    assert plan_key(a, 100, "dp", {}, False) == plan_key(dataclasses.replace(a, step_time_s=1.0), 100, "dp", {}, False)


def test_optimize_twice_reads_the_plan_the_first_run_stored(tmp_path, monkeypatch):
    """Wiring through Planner: the first run stores its plan under the graph's key, a later run on
    measured times finds it there. A stored plan that fits is kept when the band is wide, replaced by
    the new solve when the band is closed. (Measured times move the plans; nothing here depends on
    which plan a solve finds.)"""
    import torch

    monkeypatch.setenv(STORE_ENV, str(tmp_path))
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d=32, layers=3, heads=2, seq=16).train()
    x = torch.randint(0, 64, (2, 16))
    config = ProfileConfig(warmup=0, repeats=1)
    first = Planner(model, (x, x), profile_config=config).plan(activation_budget=0.8, solver="dp")
    [path] = tmp_path.glob("*.json")
    [(key, entry)] = TimingStore(path).data["plans"].items()
    assert entry["regions"] == [list(r) for r in first.spans()] and entry["saved"] == first.saved_indices()
    # another plan that fits the same budget: another solver's, or dp's at a lower budget
    planner = Planner(model, (x, x), profile_config=config)
    others = (planner.plan(activation_budget=f, solver=s)
              for s, f in (("uniform", 0.8), ("greedy", 0.8), ("dp", 0.75), ("dp", 0.72), ("uniform", 0.75)))
    lower = next((p for p in others if p.spans() != first.spans()), None)
    assert lower is not None
    store = TimingStore(path)
    store.keep("plans", key, {"regions": [list(r) for r in lower.spans()], "saved": lower.saved_indices(), "solver": "dp"})
    store.save()
    monkeypatch.setattr(steady_mod, "KEEP_WITHIN", 1e6)
    kept = Planner(model, (x, x), profile_config=config).plan(activation_budget=0.8, solver="dp")
    assert kept.spans() == lower.spans()  # kept, with a note, or solved alike on this run's times
    assert kept.stats.get("kept_plan", False) == any("kept the plan an earlier run chose" in n for n in kept.notes)
    monkeypatch.setattr(steady_mod, "KEEP_WITHIN", -1e6)  # any gain is named; the stored plan still stays
    again = Planner(model, (x, x), profile_config=config).plan(activation_budget=0.8, solver="dp")
    assert again.spans() == lower.spans()
    raw = json.loads(path.read_text())
    raw["plans"] = {}  # the stored plan removed: the new solve is stored
    path.write_text(json.dumps(raw))
    fresh = Planner(model, (x, x), profile_config=config).plan(activation_budget=0.8, solver="dp")
    assert not any("kept the plan" in n for n in fresh.notes)
    assert TimingStore(path).get("plans", key)["regions"] == [list(r) for r in fresh.spans()]

"""What autotune and the timing store may return: never a plan over the budget, never a crash, and only
the named solver's plans when the user named one.

* A store entry edited to another plan (`[[0, 0]]`) is re-simulated: over the budget, it is not taken.
* The store's remembered solver plan (plan_store.py) is re-checked against the budget too.
* An explicit solver races its own variants only; "auto" still races every solver and hand-written plan.
* No whole-module maker (None or False) races the captured graph; a model that checkpoints itself, at its
  own peak, with autotune on, is planned.

Measurements are injected (FakeClock: a function of each candidate's regions); node times come from FLOPs.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
from ckpt_planner import api
from ckpt_planner.choose import autotune as at
from ckpt_planner.choose.plan_store import kept_plan, plan_key
from ckpt_planner.choose.race import candidates as race_cands
from ckpt_planner.choose.race import stored
from ckpt_planner.profile.timing_store import TimingStore
from ckpt_planner.solvers import simulate, solve
from torch.utils.checkpoint import checkpoint

from tests.models.small import mlp
from tests.unit.choose.test_autotune import FakeClock, _budget, blocks_problem


@pytest.fixture
def store_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("CKPT_PLANNER_TIMINGS", str(tmp_path))
    return tmp_path


def _store_files(store_dir):
    return [p for p in store_dir.rglob("*.json")]


# -- item 6: a store entry over the budget ----------------------------------------------------------


def test_a_store_entry_edited_to_a_plan_over_the_budget_is_not_returned(store_dir, monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(at, "device_measure", clock)
    model, inputs = mlp()
    planner, budget = _budget(model, inputs)
    first = planner.plan(budget_bytes=budget, autotune=True)
    assert first.predicted_peak_bytes <= budget and clock.calls == 1
    # every stored autotune choice now names one tiny region: a plan far over the budget
    edited = 0
    for path in _store_files(store_dir):
        data = json.loads(path.read_text())
        for table in data.values() if isinstance(data, dict) else ():
            if not isinstance(table, dict):
                continue
            for entry in table.values():
                if isinstance(entry, dict) and isinstance(entry.get("record"), dict):
                    entry["regions"], entry["saved"], entry["modules"] = [[0, 0]], [], []
                    edited += 1
        path.write_text(json.dumps(data))
    assert edited
    assert simulate(planner.problem, [(0, 0)]).peak_bytes > budget  # the edited plan is over
    again = api.Planner(model, inputs).plan(budget_bytes=budget, autotune=True)
    assert again.predicted_peak_bytes <= budget
    assert again.spans() != [(0, 0)] and not again.stats["autotune"].get("from_store")


def test_stored_choice_is_resimulated_against_the_budget():
    problem = blocks_problem(layers=6)
    base = simulate(problem, ()).peak_bytes
    budget = int(problem.fixed_bytes + 0.5 * (base - problem.fixed_bytes))
    inner = budget - 40
    good = solve(problem, inner, "dp")
    record = {"budget_bytes": budget, "chosen": "dp plan", "candidates": []}
    entry = {"regions": [list(r) for r in good.regions], "saved": list(good.saved), "record": record}
    assert stored.stored_choice(problem, entry, budget, inner) is not None
    over = {**entry, "regions": [[0, 0]], "saved": []}
    assert simulate(problem, [(0, 0)]).peak_bytes > budget
    assert stored.stored_choice(problem, over, budget, inner) is None


def test_the_stores_remembered_plan_is_rechecked_against_the_budget(tmp_path):
    problem = blocks_problem(layers=6)
    base = simulate(problem, ()).peak_bytes
    budget = int(problem.fixed_bytes + 0.5 * (base - problem.fixed_bytes))
    solution = solve(problem, budget, "dp")
    store = TimingStore(tmp_path / "t.json")
    key = plan_key(problem, budget, "dp", {}, False)
    store.keep("plans", key, {"regions": [[0, 0]], "saved": [], "solver": "uniform"})
    got, notes = kept_plan(problem, solution, budget, key, store)
    assert got.regions == solution.regions and got.peak_bytes <= budget and not notes


# -- item 8: an explicit solver is the user's choice --------------------------------------------------------


def test_an_explicit_solver_races_only_its_own_variants(store_dir, monkeypatch):
    clock = FakeClock()  # fewest regions fastest: a uniform or hand-written plan would win if it raced
    monkeypatch.setattr(at, "device_measure", clock)
    model, inputs = mlp()
    planner, budget = _budget(model, inputs)
    own = planner.plan(budget_bytes=budget, solver="dp", autotune=False)
    plan = planner.plan(budget_bytes=budget, solver="dp", autotune=True)
    rec = plan.stats["autotune"]
    labels = [c["label"] for c in rec.get("candidates", [])]
    assert all(label == "dp plan" or label.startswith("dp at ") for label in labels), labels
    if not labels:  # dp makes one plan across the margin here: nothing else races, dp's plan stands
        assert "skipped" in rec and plan.spans() == own.spans() and plan.saved_indices() == own.saved_indices()
    assert plan.solver == "dp" and plan.predicted_peak_bytes <= budget
    # "auto" still races the other solvers and the hand-written plans
    monkeypatch.setenv("CKPT_PLANNER_TIMINGS", str(store_dir / "auto"))
    auto = planner.plan(budget_bytes=budget, solver="auto", autotune=True).stats["autotune"]
    assert any(not (c["label"] == "dp plan" or c["label"].startswith("dp at ")) for c in auto["candidates"][1:])


def test_a_stored_choice_of_another_solver_is_not_the_named_solvers():
    problem = blocks_problem(layers=6)
    base = simulate(problem, ()).peak_bytes
    budget = int(problem.fixed_bytes + 0.5 * (base - problem.fixed_bytes))
    found = solve(problem, budget, "uniform")
    entry = {"regions": [list(r) for r in found.regions], "saved": list(found.saved),
             "record": {"budget_bytes": budget, "chosen": "uniform", "candidates": []}}
    assert stored.stored_choice(problem, entry, budget, budget) is not None
    assert stored.stored_choice(problem, entry, budget, budget, solver="dp") is None
    entry["record"]["chosen"] = "dp at 1.00 MB"
    assert stored.stored_choice(problem, entry, budget, budget, solver="dp") is not None


# -- items 14 and 20: no whole-module maker is no crash -----------------------------------------------


@pytest.mark.parametrize("maker", [None, False])
def test_candidates_take_no_whole_module_maker_as_none(maker):
    problem = blocks_problem(layers=5)
    base = simulate(problem, ()).peak_bytes
    budget = int(problem.fixed_bytes + 0.6 * (base - problem.fixed_bytes))
    chosen = race_cands.candidate(problem, "solver", solve(problem, budget, "dp").regions, (), None)
    picked = race_cands.candidates(problem, chosen, budget, budget, modules=maker)
    assert picked[0] == chosen and len(picked) >= 2 and not any(c.modules for c in picked)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.g, self.b = nn.Linear(128, 512), nn.GELU(), nn.Linear(512, 128)

    def forward(self, x):
        return self.b(self.g(self.a(x)))


class _SelfCheckpointing(nn.Module):
    """8 blocks, each under torch.utils.checkpoint: the held-out case of a model that checkpoints itself."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(8))

    def forward(self, x):
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=False)
        return x


@pytest.mark.parametrize("eval_mode", [False, True], ids=["train", "eval"])
def test_a_self_checkpointing_model_at_its_own_peak_is_planned_with_autotune_on(store_dir, monkeypatch, eval_mode):
    monkeypatch.setattr(at, "device_measure", FakeClock())
    torch.manual_seed(0)
    model, x = _SelfCheckpointing(), torch.randn(1024, 128)
    if eval_mode:
        model.eval()
    planner = api.Planner(model, x)
    budget = planner.baseline_peak_bytes  # the model as given: its own checkpointing
    plan = planner.plan(budget_bytes=budget, autotune=True)
    assert plan.predicted_peak_bytes <= budget
    assert model.training is not eval_mode  # left as found
    cands = plan.stats.get("autotune", {}).get("candidates", [])
    assert not any("(modules)" in c["label"] for c in cands)  # its own code differs from the planned step

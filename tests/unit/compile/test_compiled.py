"""optimize(..., compile=True): the plan compiled whole (inductor, fullgraph), judged on the compiled step's
allocator peak, re-planned tighter while over it; sweeps monotone in the measured peak.

Compiling is slow on CPU: the model is small, and the compiled plans are shared through one module-scoped
CompiledPlanner. `torch._dynamo.reset()` runs before and after this module so that no cached graph or
recompile count leaks into other tests (or from them). The re-plan loop and the sweep rule are also tested
without compiling, on a stand-in measurement.
"""

import dataclasses
import json
import logging

import pytest
import torch
import torch.nn as nn
from ckpt_planner import InfeasibleBudgetError, InputError, Planner, optimize
from ckpt_planner.compile import compiled as compiled_mod
from ckpt_planner.compile.compiled import (
    CompiledBudgetError,
    CompiledPlanModule,
    CompiledPlanner,
    measure_compiled_step,
)

from tests.support.profiles import FLOP_TIMES

from .compiled_checks import assert_trains, step_grads

TOL = {"rtol": 1e-4, "atol": 1e-6}  # inductor fuses and reorders float math differently per graph


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[Block(16) for _ in range(6)])


@pytest.fixture(scope="module", autouse=True)
def _dynamo_clean():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def setup():
    model = _model()
    x = torch.randn(32, 64, 16)
    planner = Planner(model, (x,), profile_config=FLOP_TIMES)
    base = measure_compiled_step(torch.compile(model, fullgraph=True), model, (x,), {})
    fixed = planner.problem.fixed_bytes
    return model, x, planner, CompiledPlanner(planner, lowering="regions"), base, fixed


def test_compiled_plan_fits_its_budget_trains_and_matches_compiled_gradients(setup):
    model, x, planner, cp, base, fixed = setup
    budget = int(fixed + 0.6 * (base - fixed))
    plan = cp.plan(budget_bytes=budget)
    assert isinstance(plan.module, CompiledPlanModule) and plan.regions
    assert plan.measured_peak_bytes <= budget < base
    stats = plan.stats["compiled"]
    assert stats["fullgraph"] and stats["measured_peak_bytes"] == plan.measured_peak_bytes
    assert "measured" in plan.summary()
    assert sorted(plan.module.state_dict()) == sorted(model.state_dict())
    # Measured again, independently: still within the budget.
    assert measure_compiled_step(plan.module, model, (x,), {}) <= budget
    # Gradients: those of the compiled step without checkpointing, up to inductor's reordering.
    counters = torch._dynamo.utils.counters
    breaks = sum(counters["graph_break"].values())
    ref = step_grads(torch.compile(model, fullgraph=True), model, x)
    got = step_grads(plan.module, model, x)
    assert sum(counters["graph_break"].values()) == breaks
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, **TOL)
    # It trains: an optimizer made on the model's parameters steps them through the compiled module.
    assert_trains(plan.module, model, x)


@pytest.mark.slow
def test_compiled_sweep_is_monotone_and_within_budgets(setup):
    model, x, planner, cp, base, fixed = setup
    budgets = [int(fixed + f * (base - fixed)) for f in (0.9, 0.75, 0.6, 0.45)]
    plans = cp.sweep(budgets)
    got = [(b, p.measured_peak_bytes) for b, p in zip(budgets, plans) if p is not None]
    assert len(got) >= 2
    assert all(m <= b for b, m in got)
    peaks = [m for _, m in got]  # budgets falling
    assert all(a >= b for a, b in zip(peaks, peaks[1:])), got


# -- the re-plan loop and the sweep rule on a stand-in measurement (no compiling) -----------------

@pytest.fixture
def scale(monkeypatch):
    """Each plan 'compiles' to its eager module and 'measures' its predicted peak times `scale[0]`."""
    factor = [1.0]

    def compiled(self, plan, budget=None):
        return compiled_mod._Tried(plan.module, int(plan.predicted_peak_bytes * factor[0]), 0.0)

    monkeypatch.setattr(CompiledPlanner, "_compiled", compiled)
    return factor


@pytest.fixture
def stand_in(scale):
    return Planner(_model(), (torch.randn(32, 64, 16),), profile_config=FLOP_TIMES), scale


def test_over_budget_plan_is_replanned_tighter_until_it_fits(stand_in):
    planner, scale = stand_in
    base, fixed = planner.baseline_peak_bytes, planner.problem.fixed_bytes
    budget = int(fixed + 0.7 * (base - fixed))
    scale[0] = 1.15  # the compiled step measures 15 % over the eager prediction
    plan = CompiledPlanner(planner, lowering="regions").plan(budget_bytes=budget)
    tries = plan.stats["compiled"]["tries"]
    assert plan.measured_peak_bytes <= budget and plan.budget_bytes == budget
    assert len(tries) >= 2 and tries[0]["measured_peak_bytes"] > budget
    assert all(a["planned_for_bytes"] > b["planned_for_bytes"] for a, b in zip(tries, tries[1:]))
    assert any("re-planned" in n for n in plan.notes)


def test_plan_well_under_budget_compiled_is_replanned_looser_while_it_fits(stand_in):
    planner, scale = stand_in
    base, fixed = planner.baseline_peak_bytes, planner.problem.fixed_bytes
    budget = int(fixed + 0.5 * (base - fixed))
    eager = planner.plan(budget_bytes=budget)
    scale[0] = 0.8  # the compiled step measures 20 % under the eager prediction
    plan = CompiledPlanner(planner, lowering="regions").plan(budget_bytes=budget)
    looser = [t for t in plan.stats["compiled"]["tries"] if t.get("looser")]
    assert looser and plan.stats["compiled"]["loosened"] == len(looser), plan.stats["compiled"]["tries"]
    assert plan.measured_peak_bytes <= budget
    assert plan.predicted_recompute_s < eager.predicted_recompute_s, (budget, plan.stats["compiled"]["tries"])
    assert plan.predicted_peak_bytes > eager.predicted_peak_bytes


def test_budget_never_met_compiled_raises_one_clear_line(stand_in):
    planner, scale = stand_in
    base, fixed = planner.baseline_peak_bytes, planner.problem.fixed_bytes
    scale[0] = 3.0
    with pytest.raises(CompiledBudgetError) as info:
        CompiledPlanner(planner, max_replans=2, lowering="regions").plan(budget_bytes=int(fixed + 0.5 * (base - fixed)))
    msg = str(info.value)
    assert isinstance(info.value, InfeasibleBudgetError) and "\n" not in msg
    assert "under torch.compile" in msg and "raise the budget" in msg
    assert info.value.smallest_bytes > info.value.budget_bytes


def test_plans_measured_over_a_budget_are_not_compiled_again_for_it(monkeypatch):
    """A refusal's budget planned again (a new CompiledPlanner on the same model, in the same process) does not
    compile again the plans this process measured over it: only the plans it had not measured."""
    planner = Planner(_model(), (torch.randn(32, 64, 16),), profile_config=FLOP_TIMES)
    base, fixed = planner.baseline_peak_bytes, planner.problem.fixed_bytes
    compiles = []
    monkeypatch.setattr(compiled_mod, "compile_plan_module", lambda module, **kw: module)
    monkeypatch.setattr(compiled_mod, "measure_compiled_step", lambda *a, **k: compiles.append(1) or 3 * base)
    budget = int(fixed + 0.5 * (base - fixed))
    with pytest.raises(CompiledBudgetError) as first:
        CompiledPlanner(planner, lowering="regions").plan(budget_bytes=budget)
    assert compiles
    compiles.clear()
    with pytest.raises(CompiledBudgetError) as again:
        CompiledPlanner(planner, lowering="regions").plan(budget_bytes=budget)
    assert not compiles and again.value.smallest_bytes == first.value.smallest_bytes == 3 * base


def test_sweep_gives_a_tighter_budget_the_looser_plan_when_it_measures_lower(monkeypatch, stand_in):
    planner, _ = stand_in
    base, fixed = planner.baseline_peak_bytes, planner.problem.fixed_bytes
    budgets = [int(fixed + f * (base - fixed)) for f in (0.9, 0.7, 0.5)]
    cp = CompiledPlanner(planner, lowering="regions")
    real = CompiledPlanner.plan_for
    low = fixed + 1

    def plan_for(self, request):  # the loosest budget's plan measures below every other
        p = real(self, request)
        return dataclasses.replace(p, measured_peak_bytes=low) if request.budget.nbytes == budgets[0] else p

    monkeypatch.setattr(CompiledPlanner, "plan_for", plan_for)
    loose, mid, tight = cp.sweep(budgets)
    assert loose.measured_peak_bytes == mid.measured_peak_bytes == tight.measured_peak_bytes == low
    assert (mid.budget_bytes, tight.budget_bytes) == (budgets[1], budgets[2])
    assert mid.stats["kept_looser_plan"]["own_measured_peak_bytes"] > low
    assert mid.spans() == loose.spans() and any("is kept" in n for n in mid.notes)


# -- bad input ------------------------------------------------------------------------------------

class Branchy(nn.Module):
    """A data-dependent branch: no single graph captures it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = Block(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return h if h.mean() > 0 else -h


@pytest.mark.parametrize(
    "model, kwargs, words",
    [
        (Branchy, {}, "needs the whole model as one graph"),
        (_model, {"device": "meta"}, "meta device"),
        (_model, {"world_size": 2, "sharding": "ddp"}, "world_size"),
    ],
)
def test_compile_refuses_what_it_cannot_compile_whole_in_one_line(model, kwargs, words):
    with pytest.raises(InputError) as info:
        optimize(model(), (torch.randn(8, 16),), budget_bytes=10**6, compile=True, profile_config=FLOP_TIMES, **kwargs)
    assert words in str(info.value) and "\n" not in str(info.value)


def test_cli_compile_plans_and_records_the_measured_peak(tmp_path, scale, capsys):
    from ckpt_planner.cli.commands import main

    (tmp_path / "f.py").write_text(
        "import torch\nfrom ckpt_planner.cli.examples import MLPChain\n\n\ndef make():\n"
        "    torch.manual_seed(0)\n    return MLPChain(d=32, blocks=4), (torch.randn(64, 32),)\n"
    )
    scale[0] = 1.1
    out = tmp_path / "plan.json"
    code = main(["plan", f"{tmp_path}/f.py:make", "--compile", "--activation-budget", "0.85", "--curve-points", "0",
                 "--lowering", "regions", "--quiet", "-o", str(out)])
    assert code == 0, capsys.readouterr().err
    data = json.loads(out.read_text())
    c = data["stats"]["compiled"]
    assert c["measured_peak_bytes"] == data["measured_peak_bytes"] <= data["budget_bytes"]
    assert c["replans"] >= 1  # 10 % over the prediction: planned again tighter
    code = main(["plan", f"{tmp_path}/f.py:make", "--compile", "--verify", "--activation-budget", "0.6"])
    err = capsys.readouterr().err
    assert code == 2 and "drop --verify" in err and len(err.strip().splitlines()) == 1


class Logs(nn.Module):
    """Logs once per call, as transformers' loss does: fullgraph compilation refuses a Logger method."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = _model()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logging.getLogger("ckpt_planner.tests.logs").warning("a warning from the model's own code")
        return self.blocks(x)


def test_knapsack_lowering_compiles_the_graph_of_a_model_that_logs(caplog):
    torch.manual_seed(0)
    model, x = Logs(), torch.randn(32, 64, 16)
    planner = Planner(model, (x,), profile_config=FLOP_TIMES)
    plan = CompiledPlanner(planner, lowering="knapsack").plan(budget_bytes=planner.baseline_peak_bytes)
    assert isinstance(plan.module, CompiledPlanModule) and plan.module.eager is not model
    assert plan.measured_peak_bytes <= plan.budget_bytes
    assert_trains(plan.module, model, x)

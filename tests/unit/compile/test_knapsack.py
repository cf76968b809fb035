"""The knapsack lowering of compiled plans (planner/compile/knapsack.py): the exact knapsack against brute force,
the cost of a joint-graph node, the cache key, the byte-target search on a stand-in compile, the choice
between lowerings, and one real compile whose partitioner asks our solver.
"""

import itertools
import random

import pytest
import torch
import torch.nn as nn
from ckpt_planner import InputError, Plan, Planner, ProfileConfig, optimize
from ckpt_planner.compile import compiled as compiled_mod
from ckpt_planner.compile.compiled import (
    CompiledBudgetError,
    CompiledPlanModule,
    CompiledPlanner,
    compile_saved_plan,
    measure_compiled_step,
)
from ckpt_planner.compile.knapsack import (
    KnapsackCall,
    KnapsackLowering,
    KnapsackSolver,
    estimate_candidate,
    solve_knapsack,
)
from ckpt_planner.profile.profiler import _roofline

from tests.support.profiles import FLOP_TIMES

from .compiled_checks import assert_trains, step_grads

TOL = {"rtol": 1e-4, "atol": 1e-6}


def _best_by_enumeration(sizes, values, capacity) -> float:
    best = 0.0
    for keep in itertools.product((0, 1), repeat=len(sizes)):
        if sum(s for s, k in zip(sizes, keep) if k) <= capacity:
            best = max(best, sum(v for v, k in zip(values, keep) if k))
    return best


@pytest.mark.parametrize("seed", range(12))
def test_knapsack_choice_is_the_brute_force_optimum(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 9)
    sizes = [rng.choice((0, 4096, 8192, 131072, rng.randint(1, 10**6))) for _ in range(n)]
    values = [rng.choice((0.0, 1e-6, rng.random() * 1e-3)) for _ in range(n)]
    capacity = rng.choice((0, rng.randint(0, sum(sizes) or 1), sum(sizes)))
    kept = solve_knapsack(sizes, values, capacity)
    assert sum(sizes[i] for i in kept) <= capacity
    assert sum(values[i] for i in kept) == pytest.approx(_best_by_enumeration(sizes, values, capacity), rel=1e-9, abs=1e-15)


def test_knapsack_edge_cases():
    assert solve_knapsack([], [], 0) == frozenset()
    assert solve_knapsack([5, 0], [1.0, 1.0], 0) == {1}  # a free item is always kept, nothing else fits
    assert solve_knapsack([3, 4], [1.0, 2.0], 7) == {0, 1}
    assert solve_knapsack([3, 4, 5], [3.0, 4.0, 6.9], 8) == {0, 2}  # not the greedy value/byte order
    with pytest.raises(InputError, match="sizes but"):
        solve_knapsack([1], [], 1)


def test_candidate_cost_is_the_roofline_of_its_flops_and_bytes():
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(lambda a, b: torch.mm(a, b).relu(), tracing_mode="fake")(torch.randn(8, 16), torch.randn(16, 32))
    mm, relu = [n for n in gm.graph.nodes if n.op == "call_function"]
    cfg = ProfileConfig()
    c = estimate_candidate(mm, cfg)
    assert c.nbytes == 8 * 32 * 4
    assert c.seconds == _roofline(2 * 8 * 16 * 32, 4 * (8 * 16 + 16 * 32 + 8 * 32), "cpu", cfg)
    r = estimate_candidate(relu, cfg)
    assert r.seconds == _roofline(0, 4 * 2 * 8 * 32, "cpu", cfg) and r.seconds < c.seconds


def test_solver_uuid_changes_with_its_target():
    assert KnapsackSolver(100).uuid() == KnapsackSolver(100).uuid()
    assert KnapsackSolver(100).uuid() != KnapsackSolver(101).uuid()
    assert KnapsackSolver(100).uuid() != KnapsackSolver(100, config=ProfileConfig(bandwidth=1e9)).uuid()
    with pytest.raises(InputError, match="target_bytes"):
        KnapsackSolver(-1)


# -- the byte-target search on a stand-in compile (no compiling) ---------------------------------

def _stand_in(cands, fixed, extra):
    """'Compiles' by running the solver on fixed candidates; the step 'measures' fixed + extra + kept bytes."""
    compiles = []

    def compile_measure(solver):
        kept = solve_knapsack([c.nbytes for c in cands], [c.seconds for c in cands], solver.target_bytes)
        solver.calls.append(KnapsackCall(cands, kept))
        compiles.append(kept)
        return object(), fixed + extra + sum(cands[i].nbytes for i in kept), 0.0

    return compile_measure, compiles


def _cands(seed, n=10):
    from ckpt_planner.compile.knapsack import Candidate

    rng = random.Random(seed)
    return tuple(Candidate(f"n{i}", "op", rng.choice((4096, 8192, 65536, rng.randint(1000, 90000))),
                           rng.random() * 1e-4) for i in range(n))


@pytest.mark.parametrize("seed", range(6))
def test_search_finds_the_least_recompute_choice_that_fits(seed):
    cands = _cands(seed)
    fixed, extra = 10**6, 50_000
    total = sum(c.nbytes for c in cands)
    budget = fixed + extra + random.Random(seed).randint(total // 5, total - 1)
    measure, compiles = _stand_in(cands, fixed, extra)
    lowering = KnapsackLowering(measure, max_tries=5)
    best, log = lowering.fit(budget, fixed)
    assert best is not None and best.measured <= budget
    assert len(compiles) == len(set(compiles)) == len(log)  # no choice compiled twice
    optimum = solve_knapsack([c.nbytes for c in cands], [c.seconds for c in cands], budget - fixed - extra)
    assert best.recompute_s == pytest.approx(sum(c.seconds for i, c in enumerate(cands) if i not in optimum), abs=1e-15)
    # A second, looser budget reuses what was measured: the first try ("keep every candidate") is not repeated.
    before = len(compiles)
    lowering.fit(fixed + extra + total, fixed)
    assert len(compiles) == before


def test_search_reports_none_when_even_recomputing_everything_is_over():
    cands = _cands(0)
    measure, compiles = _stand_in(cands, 10**6, 50_000)
    best, log = KnapsackLowering(measure, max_tries=5).fit(10**6 + 10, 10**6)
    assert best is None and log[-1]["saved_bytes"] == 0 and len(compiles) <= 6


def test_search_stops_when_keeping_fewer_bytes_no_longer_lowers_the_peak():
    """Past a floor the compiled peak rises as more is recomputed (inductor's own buffers): no more compiles."""
    cands = _cands(1)
    total = sum(c.nbytes for c in cands)
    fixed, extra = 10**6, 50_000
    floor = total // 2
    compiles = []

    def compile_measure(solver):
        kept = solve_knapsack([c.nbytes for c in cands], [c.seconds for c in cands], solver.target_bytes)
        solver.calls.append(KnapsackCall(cands, kept))
        compiles.append(kept)
        saved = sum(cands[i].nbytes for i in kept)
        return object(), fixed + extra + max(saved, floor) + (total - saved) // 4, 0.0

    memory = {}
    best, log = KnapsackLowering(compile_measure, max_tries=5, memory=memory).fit(fixed + extra + floor // 2, fixed)
    assert best is None and log[-1].get("stopped") and len(compiles) == len(log) < 6
    assert log[-1]["saved_bytes"] < log[-2]["saved_bytes"]
    assert log[-1]["measured_peak_bytes"] >= log[-2]["measured_peak_bytes"]

    # The least peak measured (what the refusal names) is met again by a new search on the same graph in one
    # compile: the remembered target, not a search whose path depends on the budget.
    least = min(t["measured_peak_bytes"] for t in log)
    compiles.clear()
    again, log = KnapsackLowering(compile_measure, max_tries=5, memory=memory).fit(least, fixed)
    assert again is not None and again.measured == least and len(compiles) == 1
    compiles.clear()
    fresh, _ = KnapsackLowering(compile_measure, max_tries=5).fit(least, fixed)  # without the memory: a new path
    assert fresh is None or len(compiles) > 1


def test_remembered_measurements_are_per_model_and_graph():
    from ckpt_planner.compile.knapsack import remembered

    a, b = _model(), _model()
    cap = Planner(a, (torch.randn(4, 16),), profile_config=FLOP_TIMES).capture
    mem = remembered(a, cap, {}, 0, FLOP_TIMES)
    mem[100] = 5
    assert remembered(a, cap, {}, 0, FLOP_TIMES) is mem
    assert remembered(b, cap, {}, 0, FLOP_TIMES) == {}  # another model
    assert remembered(a, cap, {"mode": "x"}, 0, FLOP_TIMES) == {}  # other options


# -- choosing a lowering ----------------------------------------------------------------------------

def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)) for _ in range(6)])


@pytest.fixture
def stand_in_planner():
    return Planner(_model(), (torch.randn(32, 64, 16),), profile_config=FLOP_TIMES)


def _fake_plan(planner, measured):
    p = planner.plan(budget_bytes=planner.no_checkpoint_peak_bytes)
    p.measured_peak_bytes = measured
    p.stats["compiled"] = {"measured_peak_bytes": measured}
    return p


def test_best_keeps_the_faster_lowering_and_records_both(monkeypatch, stand_in_planner):
    planner = stand_in_planner
    fixed = planner.problem.fixed_bytes
    budget = fixed + 10**6
    monkeypatch.setattr(CompiledPlanner, "_plan_regions", lambda self, request, resolved: _fake_plan(planner, budget - 10))
    monkeypatch.setattr(CompiledPlanner, "_plan_knapsack", lambda self, b, a: _fake_plan(planner, budget - 20))
    # Rounds: knapsack faster in two of three (paired), though its own median is not the lower one.
    monkeypatch.setattr(compiled_mod, "interleaved_step_times",
                        lambda mods, *a, **k: {"regions": [0.02, 0.50, 0.03], "knapsack": [0.01, 0.40, 0.45]})
    plan = CompiledPlanner(planner, timing_repeats=3).plan(budget_bytes=budget)
    figs = plan.stats["compiled"]["lowerings"]
    assert plan.measured_peak_bytes == budget - 20 and plan.stats["compiled"]["chosen_by"] == "interleaved step-time ratio"
    assert figs["knapsack"]["step_s_median"] == 0.40 and figs["regions"]["step_s_median"] == 0.03
    assert figs["knapsack"]["step_ratio_to_regions"]["median"] == pytest.approx(0.8)
    assert figs["regions"]["measured_peak_bytes"] == budget - 10
    assert any(n.startswith("lowering knapsack: knapsack/regions step time 0.800") for n in plan.notes)
    # Slower in two rounds of three: regions kept.
    monkeypatch.setattr(compiled_mod, "interleaved_step_times",
                        lambda mods, *a, **k: {"regions": [0.02, 0.50, 0.03], "knapsack": [0.03, 0.40, 0.04]})
    plan = CompiledPlanner(planner, timing_repeats=3).plan(budget_bytes=budget)
    assert plan.measured_peak_bytes == budget - 10 and plan.notes[-1].startswith("lowering regions:")


def test_best_falls_back_to_the_lowering_that_fits(monkeypatch, stand_in_planner):
    planner = stand_in_planner
    budget = planner.problem.fixed_bytes + 10**6

    def over(self, *a, **k):
        raise CompiledBudgetError(budget, budget + 5, "knapsack", 0, 3)

    monkeypatch.setattr(CompiledPlanner, "_plan_regions", lambda self, request, resolved: _fake_plan(planner, budget - 10))
    monkeypatch.setattr(CompiledPlanner, "_plan_knapsack", over)
    plan = CompiledPlanner(planner).plan(budget_bytes=budget)
    assert plan.stats["compiled"]["lowerings"]["knapsack"] == {"fits": False, "least_measured_peak_bytes": budget + 5}
    assert any("knapsack lowering measured over the budget" in n for n in plan.notes)
    monkeypatch.setattr(CompiledPlanner, "_plan_regions", over)
    with pytest.raises(CompiledBudgetError):
        CompiledPlanner(planner).plan(budget_bytes=budget)


def test_best_resolves_the_budget_once_and_plans_regions_from_the_request(monkeypatch, stand_in_planner):
    """lowering='best': the request's budget is resolved once (in bytes, margin, clamp) for both lowerings; the
    regions side plans from that record through the Planner's typed entry, not from rebuilt keywords."""
    from ckpt_planner import api

    planner = stand_in_planner
    fixed = planner.problem.fixed_bytes
    budget = fixed + (planner.no_checkpoint_peak_bytes - fixed) // 2
    resolved, knapsack = [], _fake_plan(planner, budget - 20)  # the stand-in knapsack plan, made before counting

    def counted(real):
        def budget_of(p, request):
            resolved.append(request.budget.nbytes)
            return real(p, request)
        return budget_of

    monkeypatch.setattr(api, "budget_of", counted(api.budget_of))
    monkeypatch.setattr(compiled_mod, "budget_of", counted(compiled_mod.budget_of))
    # no compile: the plan's eager module stands in, measured at its predicted peak
    monkeypatch.setattr(CompiledPlanner, "_compiled",
                        lambda self, plan, budget=None: compiled_mod._Tried(plan.module, plan.predicted_peak_bytes, 0.0))
    monkeypatch.setattr(CompiledPlanner, "_plan_knapsack", lambda self, b, r: knapsack)
    monkeypatch.setattr(compiled_mod, "interleaved_step_times",
                        lambda mods, *a, **k: {"regions": [0.01], "knapsack": [0.02]})
    plan = CompiledPlanner(planner, max_loosen=0, timing_repeats=1).plan(budget_bytes=budget, solver="greedy")
    assert resolved == [budget]  # once, for both lowerings
    assert plan.stats["compiled"]["lowering"] == "regions" and plan.regions
    assert plan.solver == "greedy" and plan.budget_bytes == budget and plan.predicted_peak_bytes <= budget


@pytest.mark.parametrize("call", [
    lambda p: CompiledPlanner(p, lowering="knapsak"),
    lambda p: optimize(_model(), (torch.randn(4, 16),), budget_bytes=10**6, compile=True, lowering="fast",
                       profile_config=FLOP_TIMES),
    lambda p: optimize(_model(), (torch.randn(4, 16),), budget_bytes=10**6, lowering="knapsack", profile_config=FLOP_TIMES),
    lambda p: CompiledPlanner(p, lowering="knapsack", compile_options={"backend": "aot_eager"}),
])
def test_bad_lowering_is_one_clear_line(call, stand_in_planner):
    with pytest.raises(InputError) as info:
        call(stand_in_planner)
    msg = str(info.value)
    assert "lowering" in msg and "\n" not in msg


def test_cli_lowering_without_compile_is_refused(tmp_path, capsys):
    from ckpt_planner.cli.commands import main

    (tmp_path / "f.py").write_text(
        "import torch\nfrom ckpt_planner.cli.examples import MLPChain\n\n\ndef make():\n"
        "    return MLPChain(d=32, blocks=2), (torch.randn(8, 32),)\n"
    )
    code = main(["plan", f"{tmp_path}/f.py:make", "--lowering", "knapsack", "--activation-budget", "0.5"])
    err = capsys.readouterr().err
    assert code == 2 and "--compile" in err and len(err.strip().splitlines()) == 1


# -- one real compile: the partitioner asks our solver ------------------------------------------

@pytest.fixture(scope="module", autouse=True)
def _dynamo_clean():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _compiled_case():
    """The model, its input, its planner, the peak of its step compiled without a budget, its fixed bytes."""
    model = _model()
    x = torch.randn(32, 64, 16)
    planner = Planner(model, (x,), profile_config=FLOP_TIMES)
    base = measure_compiled_step(torch.compile(model, fullgraph=True), model, (x,), {})
    return model, x, planner, base, planner.problem.fixed_bytes


def test_knapsack_lowered_step_fits_trains_and_matches_compiled_gradients(tmp_path):
    model, x, planner, base, fixed = _compiled_case()
    budget = int(fixed + 0.6 * (base - fixed))
    plan = CompiledPlanner(planner, lowering="knapsack").plan(budget_bytes=budget)
    c = plan.stats["compiled"]
    k = c["knapsack"]
    assert isinstance(plan.module, CompiledPlanModule) and not plan.regions and c["lowering"] == "knapsack"
    assert plan.measured_peak_bytes <= budget < base
    assert k["candidates"] > 0 and k["saved_bytes"] <= k["target_bytes"] and k["kept_saved"] <= k["candidates"]
    assert measure_compiled_step(plan.module, model, (x,), {}) <= budget
    assert any("knapsack lowering" in n for n in plan.notes)

    for g, r in zip(step_grads(plan.module, model, x), step_grads(torch.compile(model, fullgraph=True), model, x)):
        torch.testing.assert_close(g, r, **TOL)
    assert_trains(plan.module, model, x)

    # Its file has no regions: apply and rebuild refuse it rather than return an unchanged model; compiled
    # again from the file, the same graph gets the same choice and the same measured peak.
    text = plan.summary()
    assert "compiled (knapsack lowering)" in text and "memory saved" in text
    assert "no regions: the partitioner may recompute" in text
    loaded = Plan.load(plan.save(tmp_path / "knapsack.json"))
    assert loaded.stats["compiled"]["knapsack"]["target_bytes"] == plan.stats["compiled"]["knapsack"]["target_bytes"]
    fresh = _model()
    for call in (lambda: loaded.apply(fresh), lambda: loaded.rebuild(fresh, (x,))):
        with pytest.raises(InputError, match="compile_saved_plan"):
            call()
    again = compile_saved_plan(fresh, loaded, (x,))
    assert isinstance(again, CompiledPlanModule)
    assert measure_compiled_step(again, fresh, (x,), {}) == plan.measured_peak_bytes
    with pytest.raises(InputError, match="compile=True"):
        compile_saved_plan(fresh, planner.plan(activation_budget=0.5))


@pytest.mark.slow
def test_best_lowering_sweep_is_monotone_and_within_budgets():
    model, x, planner, base, fixed = _compiled_case()
    budgets = [int(fixed + f * (base - fixed)) for f in (0.9, 0.6, 0.45)]
    plans = CompiledPlanner(planner, timing_repeats=3).sweep(budgets)
    got = [(b, p.measured_peak_bytes, p.stats["compiled"]["lowering"]) for b, p in zip(budgets, plans) if p is not None]
    assert len(got) >= 2 and all(m <= b for b, m, _ in got), got
    assert all(a[1] >= b[1] for a, b in zip(got, got[1:])), got
    for p in plans:
        if p is not None and "lowerings" in p.stats["compiled"]:
            assert p.stats["compiled"]["lowering"] in p.stats["compiled"]["lowerings"]


def test_benchmark_spreads_at_least_ten_budgets_over_compiles_peaks():
    from benchmarks import compile as bench

    peaks = [31_790_000, 28_660_000, 30_880_000, 23_920_000, 24_540_000, 24_540_000]  # two fractions tie
    got = bench.spread_budgets(peaks, 10)
    assert len(got) == 10 and got == sorted(set(got)) and set(peaks) <= set(got)
    assert len(bench.spread_budgets(peaks[:2], 10)) == 10
    # --update: a model run again replaces its earlier results; the others stay, in the benchmark's order.
    earlier = {"models": [{"model": "gpt2", "v": 1}, {"model": "unet", "v": 1}], "wall_s": 10.0}
    new = {"models": [{"model": "llama", "name": "llama", "v": 2}, {"model": "gpt2", "name": "gpt2", "v": 2}],
           "wall_s": 5.0}
    merged = bench._merge(earlier, new)
    assert [(m["model"], m["v"]) for m in merged["models"]] == [("gpt2", 2), ("llama", 2), ("unet", 1)]
    assert merged["merged"] and merged["wall_s"] == 15.0

"""Monotone budgets for dp, ilp and sweep; the knee."""

from __future__ import annotations

import random

from ckpt_planner.solvers import InfeasibleBudgetError, Solution, knee, simulate, solve, sweep
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .test_solvers_problems import chains, dags, random_chain

SETTINGS = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def budgets_for(problem, k: int = 6) -> list[int]:
    base = simulate(problem, ()).peak_bytes
    lo = problem.fixed_bytes
    return sorted({lo + (base - lo) * i // (k - 1) for i in range(k)})


def curve(problem, name, budgets):
    out = []
    for b in budgets:
        try:
            out.append(solve(problem, b, solver=name))
        except InfeasibleBudgetError:
            out.append(None)
    return out


def assert_monotone(budgets, solutions):
    """A larger budget: never infeasible where a smaller one fits, never more recompute, peak within budget."""
    seen = None
    for b, sol in zip(budgets, solutions):
        if sol is None:
            assert seen is None
            continue
        assert sol.peak_bytes <= b
        if seen is not None:
            assert sol.recompute_time <= seen.recompute_time + 1e-9
        seen = sol


@SETTINGS
@given(st.one_of(dags(1, 10), chains(1, 8)))
def test_dp_and_ilp_are_monotone_in_the_budget(problem):
    budgets = budgets_for(problem)
    for name in ("dp", "ilp"):
        assert_monotone(budgets, curve(problem, name, budgets))


@SETTINGS
@given(st.one_of(dags(1, 10), chains(1, 8)), st.sampled_from(["auto", "dp", "greedy", "ilp"]))
def test_sweep_is_monotone_and_fits(problem, solver):
    budgets = budgets_for(problem)
    solutions = sweep(problem, budgets[::-1], solver=solver)[::-1]
    assert len(solutions) == len(budgets)
    assert_monotone(budgets, solutions)
    for b, sol in zip(budgets, solutions):
        if sol is not None:
            assert sol.budget_bytes == b and simulate(problem, sol.regions).peak_bytes == sol.peak_bytes


def test_sweep_matches_single_dp_solves():
    problem = random_chain(random.Random(4), 7)
    budgets = budgets_for(problem, 8)
    swept = sweep(problem, budgets, solver="dp")
    for b, sol in zip(budgets, swept):
        single = curve(problem, "dp", [b])[0]
        assert (sol is None) == (single is None)
        if sol is not None:
            assert abs(sol.recompute_time - single.recompute_time) <= 1e-9


def make(peak, time):
    return Solution(regions=(), solver="x", peak_bytes=peak, recompute_time=time)


def test_knee_picks_the_elbow():
    points = [make(100, 50.0), make(110, 10.0), make(150, 5.0), make(200, 0.0)]
    assert knee(points).peak_bytes == 110
    assert knee([None, make(5, 1.0)]).peak_bytes == 5
    assert knee([None]) is None
    assert knee([make(10, 1.0), make(20, 0.0)]).peak_bytes == 20


def test_knee_of_a_real_sweep_fits_its_budget():
    problem = random_chain(random.Random(9), 8)
    budgets = budgets_for(problem, 8)
    chosen = knee(sweep(problem, budgets, solver="dp"))
    assert chosen is not None and chosen.peak_bytes <= chosen.budget_bytes

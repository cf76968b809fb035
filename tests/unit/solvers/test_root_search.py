"""The MILP bounded by its search nodes rather than by the clock.

* HiGHS stopped by a node limit answers with the best plan it found (pulp has no status for that stop);
  without the limit the same model is solved to optimality, never worse.
* `ilp(search_nodes=1)` on a coarsened graph returns a plan within the budget, from HiGHS itself.
* `auto` bounds the MILP by the clock (at most `COARSE_MILP_S` once coarsened) and, above `ROOT_ONLY_NODES`,
  also by its root node.
"""

from __future__ import annotations

import random
import warnings

import pytest
from ckpt_planner.solvers import SOLVERS, simulate, solve
from ckpt_planner.solvers.auto import COARSE_MILP_S, ROOT_ONLY_NODES, ilp_search_nodes, ilp_time_limit
from ckpt_planner.solvers.exact.ilp import MAX_NODES
from ckpt_planner.solvers.exact.milp_backend import _backend
from ckpt_planner.solvers.registry import SolverResult

from .test_solvers_edge import chain

pulp = pytest.importorskip("pulp")


def knapsack(n: int, seed: int):
    """A 0-1 knapsack whose root relaxation is fractional: HiGHS branches to prove its optimum."""
    rng = random.Random(seed)
    prob = pulp.LpProblem("knapsack", pulp.LpMaximize)
    make = getattr(prob, "add_variable", None)  # pulp 3.x; older ones make variables apart
    x = [make(f"x{i}", 0, 1, cat="Binary") if make else pulp.LpVariable(f"x{i}", cat="Binary") for i in range(n)]
    weights = [rng.randint(1000, 5000) for _ in range(n)]
    values = [w + rng.randint(-50, 50) for w in weights]
    prob += pulp.lpSum(v * xi for v, xi in zip(values, x))
    prob += pulp.lpSum(w * xi for w, xi in zip(weights, x)) <= sum(weights) // 2
    return prob, x, weights


def solved(prob, node_limit):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        _, solver = _backend("highs", None, 0.0, "unused.log", presolve=False, node_limit=node_limit)
        prob.solve(solver)
    return prob


def test_a_node_limit_is_an_answer():
    pytest.importorskip("highspy")
    prob, x, weights = knapsack(40, seed=1)
    solved(prob, node_limit=1)
    assert str(prob.solverModel.getModelStatus()).endswith("kSolutionLimit")  # stopped by the limit, not solved
    assert prob.sol_status == pulp.LpSolutionIntegerFeasible
    chosen = [round(v.value()) for v in x]
    assert set(chosen) <= {0, 1} and sum(w * c for w, c in zip(weights, chosen)) <= sum(weights) // 2
    limited = pulp.value(prob.objective)
    full, _, _ = knapsack(40, seed=1)
    solved(full, node_limit=None)
    assert full.sol_status == pulp.LpSolutionOptimal and pulp.value(full.objective) >= limited


def test_root_only_ilp_fits_on_a_coarsened_graph():
    pytest.importorskip("highspy")
    problem = chain(3 * MAX_NODES)  # coarsened
    base = simulate(problem, ()).peak_bytes
    budget = problem.fixed_bytes + (base - problem.fixed_bytes) // 2
    solution = solve(problem, budget, "ilp", search_nodes=1, fallback=False)
    assert solution.peak_bytes <= budget
    assert solution.stats["backend"] == "highs" and "backend_failures" not in solution.stats
    assert solution.stats["coarse_nodes"] < problem.n


def test_auto_bounds_the_milp_by_its_root_on_large_graphs():
    small, medium, large = chain(MAX_NODES // 2), chain(2 * MAX_NODES), chain(ROOT_ONLY_NODES + 1)
    assert ilp_search_nodes(small) is None and ilp_search_nodes(medium) is None
    assert ilp_search_nodes(large) == 1
    assert ilp_time_limit(medium, 60.0) <= COARSE_MILP_S  # coarsened: the clock bounds it
    assert ilp_time_limit(large, 60.0) == COARSE_MILP_S  # and the root node too, whichever ends first
    assert ilp_time_limit(large, 2.0) == 2.0  # never beyond the caller's limit


def test_auto_hands_the_bound_to_the_milp(monkeypatch):
    asked: list[dict] = []

    def milp(problem, budget_bytes=None, **options):
        asked.append(options)
        return SolverResult(regions=())

    monkeypatch.setitem(SOLVERS, "ilp", milp)
    for problem, nodes in ((chain(2 * MAX_NODES), None), (chain(ROOT_ONLY_NODES + 1), 1)):
        budget = problem.fixed_bytes + (simulate(problem, ()).peak_bytes - problem.fixed_bytes) // 2
        SOLVERS["auto"](problem, budget, solvers=("ilp",))
        assert asked[-1]["search_nodes"] == nodes

"""Solvers against brute force over the exact plan space each one searches.

* ilp: optimal over flat region plans (disjoint regions, adjacent allowed), on
  random DAGs, when not coarsened (n <= max_nodes). Brute force enumerates the
  saver-ended flat plans; `test_saver_ended_plans_reach_the_flat_optimum`
  checks they reach the optimum of all flat plans.
* dp: optimal over the rotor family (laminar regions whose last node, and the
  graph's last node, run in the enclosing context) on chains whose every node
  saves something, with single-node stages and exact memory units.
* uniform, greedy (flat) never beat the flat optimum; dp on DAGs never beats
  the nested optimum. Every solution returned fits its budget under simulate.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
from ckpt_planner.solvers import InfeasibleBudgetError, simulate, solve
from ckpt_planner.solvers.exact.bruteforce import bruteforce, enumerate_plans
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .test_solvers_problems import chains, dags, random_dag

REL = 1e-9
SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def pick_budget(problem, seed: int, space: str) -> int:
    """A budget between the lowest peak of a few plans of the space and the baseline peak."""
    rng = random.Random(seed)
    plans = list(enumerate_plans(problem, space))
    sample = rng.sample(plans, min(len(plans), 12))
    low = min(simulate(problem, p).peak_bytes for p in sample)
    base = simulate(problem, ()).peak_bytes
    return rng.randint(min(low, base), base)


def optimum(problem, budget, space):
    result = bruteforce(problem, budget, space=space)
    sim = simulate(problem, result.regions)
    return sim.recompute_time if sim.peak_bytes <= budget else None


def assert_same(a: float, b: float) -> None:
    assert abs(a - b) <= REL * max(1.0, abs(a), abs(b)), (a, b)


def solved(problem, budget, name, **options):
    try:
        solution = solve(problem, budget, solver=name, **options)
    except InfeasibleBudgetError:
        return None
    assert solution.peak_bytes <= budget
    assert solution.peak_bytes == simulate(problem, solution.regions).peak_bytes
    return solution


@SETTINGS
@given(dags(1, 9), st.integers(0, 2**32))
def test_ilp_equals_the_flat_optimum_on_dags(problem, seed):
    budget = pick_budget(problem, seed, "flat_saver_ended")
    best = optimum(problem, budget, "flat_saver_ended")
    solution = solved(problem, budget, "ilp", nested=False)
    assert (solution is None) == (best is None)
    if best is not None:
        assert_same(solution.recompute_time, best)


@pytest.mark.slow  # brute force over ~10^4 plans per example: about 20 s each
@settings(max_examples=3, deadline=None)
@given(dags(10, 12), st.integers(0, 2**32))
def test_ilp_equals_the_flat_optimum_on_twelve_node_dags(problem, seed):
    budget = pick_budget(problem, seed, "flat_saver_ended")
    best = optimum(problem, budget, "flat_saver_ended")
    solution = solved(problem, budget, "ilp", backend="highs", nested=False)
    assert (solution is None) == (best is None)
    if best is not None:
        assert_same(solution.recompute_time, best)


@SETTINGS
@given(chains(1, 6), st.integers(0, 2**32))
def test_dp_equals_the_rotor_optimum_on_chains(problem, seed):
    budget = pick_budget(problem, seed, "rotor")
    best = optimum(problem, budget, "rotor")
    for selection in ("exact", "tighten"):
        solution = solved(problem, budget, "dp", selection=selection)
        assert (solution is None) == (best is None)
        if best is not None:
            assert_same(solution.recompute_time, best)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dags(1, 6), st.integers(0, 2**32))
def test_heuristics_never_beat_brute_force(problem, seed):
    budget = pick_budget(problem, seed, "flat_saver_ended")
    flat = optimum(problem, budget, "flat")
    nested = optimum(problem, budget, "nested")
    for name in ("uniform", "greedy"):
        solution = solved(problem, budget, name)
        if solution is not None:
            assert flat is not None and solution.recompute_time >= flat - REL
    for name in ("dp", "auto"):
        solution = solved(problem, budget, name)
        if solution is not None:
            assert nested is not None and solution.recompute_time >= nested - REL


@settings(max_examples=15, deadline=None)
@given(dags(1, 7), st.integers(0, 2**32))
def test_saver_ended_plans_reach_the_flat_optimum(problem, seed):
    budget = pick_budget(problem, seed, "flat")
    a, b = optimum(problem, budget, "flat"), optimum(problem, budget, "flat_saver_ended")
    assert (a is None) == (b is None)
    if a is not None:
        assert_same(a, b)


@pytest.mark.parametrize("seed", range(3))
def test_highs_and_cbc_agree(seed):
    problem = random_dag(random.Random(seed), 9)
    budget = pick_budget(problem, seed, "flat_saver_ended")
    a, b = solved(problem, budget, "ilp", backend="cbc"), solved(problem, budget, "ilp", backend="highs")
    assert (a is None) == (b is None)
    if a is not None:
        assert_same(a.recompute_time, b.recompute_time)


def with_hooks(problem, seed: int):
    """The problem with a cost per saved tensor inside a region (the checkpoint hooks), as profiled."""
    rng = random.Random(seed)
    nodes = tuple(dataclasses.replace(n, saved_tensors=rng.randint(0, 3)) for n in problem.nodes)
    per = problem.total_time / max(1, problem.n) * rng.uniform(0.05, 1.0)  # seconds per saved tensor
    return dataclasses.replace(problem, nodes=nodes, saved_overhead_s=per)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dags(1, 8), chains(1, 6), st.integers(0, 2**32))
def test_solvers_optimal_with_hook_costs(dag, chain, seed):
    dag, chain = with_hooks(dag, seed), with_hooks(chain, seed + 1)
    budget = pick_budget(dag, seed, "flat_saver_ended")
    best = optimum(dag, budget, "flat_saver_ended")
    solution = solved(dag, budget, "ilp", nested=False)
    assert (solution is None) == (best is None)
    if best is not None:
        assert_same(solution.recompute_time, best)
    budget = pick_budget(chain, seed, "rotor")
    best = optimum(chain, budget, "rotor")
    solution = solved(chain, budget, "dp", selection="exact")
    assert (solution is None) == (best is None)
    if best is not None:
        assert_same(solution.recompute_time, best)
    # The hooks are counted: a region's recompute costs more than its nodes' forward time.
    if solution is not None and solution.regions:
        plain = simulate(dataclasses.replace(chain, saved_overhead_s=0.0), solution.regions)
        hooked = simulate(chain, solution.regions)
        assert abs(hooked.recompute_time - plain.recompute_time - hooked.hook_time) <= 1e-12
        saved = sum(chain.nodes[i].saved_tensors for s, e in solution.regions for i in range(s, e + 1))
        assert hooked.hook_time >= 0 and (saved == 0 or hooked.recompute_time >= plain.recompute_time)

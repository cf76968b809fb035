"""Each offloaded storage's copy has a fixed cost each way (`Problem.d2h_fixed_s`, `h2d_fixed_s`: the copy's launch
and round trip, the hooks' host work) beside its bytes at the link's rate. Found on an H200: priced at its bytes
alone, a copy of a few KB looked free, and the solvers offloaded dozens of them on launch-bound steps whose
measured overhead was +44 to +75 % against a predicted +0 %. Deterministic: simulated bandwidths and costs."""

from __future__ import annotations

import dataclasses
import random

import pytest
from ckpt_planner.solvers import Problem, simulate, solve
from ckpt_planner.solvers.copies import d2h_seconds, h2d_seconds, normalize_offloaded, offloadable, timing
from ckpt_planner.solvers.offload import choose_offloads

from .test_offload import INF, chain, mlp, offloading, sweeps_match_replays
from .test_solvers_problems import random_chain, random_dag
from .test_solvers_simulate import with_costs


def fixed(problem: Problem, seconds: float) -> Problem:
    return dataclasses.replace(problem, d2h_fixed_s=seconds, h2d_fixed_s=seconds)


def test_copy_seconds_are_the_fixed_cost_plus_the_bytes():
    problem = dataclasses.replace(offloading(chain(3), 100.0), d2h_fixed_s=0.5, h2d_fixed_s=0.25)
    assert d2h_seconds(problem, 100) == 0.5 + 1.0 and h2d_seconds(problem, 300) == 0.25 + 3.0
    assert d2h_seconds(offloading(chain(3), 100.0), 100) == 1.0  # none given: the bytes alone, as before


def test_exposed_copy_time_grows_by_the_fixed_cost_of_each_copy():
    """Copies of no bytes on a link of unbounded rate are free without a fixed cost. With one of F seconds
    each way, far above a node's time, the n copies queue on each stream: the forward's stream ends n x F
    after the first producer, and the prefetches wait out all but the backward's compute."""
    problem = offloading(chain(6), INF)  # nodes of 1 s: forward 6 s, backward 12 s
    offloaded = offloadable(problem)
    n, F = len(offloaded), 10.0
    assert n == 5
    free = simulate(problem, offloaded=offloaded)
    assert free.offload_time == 0.0
    priced = simulate(fixed(problem, F), offloaded=offloaded)
    _, uses = normalize_offloaded(problem, (), (), offloaded)
    schedule = timing(fixed(problem, F), (), (), uses)
    assert schedule.d2h_s == 1.0 + n * F - 6.0  # the stream starts when node 0 ends (1 s)
    assert 2 * n * F - 3 * problem.total_time <= priced.offload_time <= 2 * n * F
    assert priced.offload_time == schedule.exposed_s
    assert priced.recompute_time == free.recompute_time + priced.offload_time
    # the fetch schedule includes it: each prefetch is issued earlier than a free copy's
    assert all(schedule.fetch[t] >= timing(problem, (), (), uses).fetch[t] for t in offloaded)
    assert schedule.fetch != timing(problem, (), (), uses).fetch
    # and the forward's copies hold their device bytes until the slow stream is done with them
    assert priced.peak_bytes > free.peak_bytes


def test_a_fixed_cost_hidden_behind_compute_costs_nothing():
    """A copy's fixed cost runs on the copy streams: where compute covers it, it is not exposed."""
    problem = offloading(chain(6), INF)
    assert simulate(fixed(problem, 0.5), offloaded=[2]).offload_time == 0.0


@pytest.mark.parametrize("seed", range(12))
def test_sweep_equals_replay_with_fixed_costs(seed):
    rng = random.Random(seed)
    base = random_dag(rng, rng.randint(1, 12)) if seed % 2 else random_chain(rng, rng.randint(1, 10))
    problem = offloading(with_costs(rng, base), rng.choice([3.0, 40.0, INF]))
    problem = dataclasses.replace(problem, d2h_fixed_s=rng.choice([0.01, 0.3, 2.0]), h2d_fixed_s=rng.choice([0.05, 1.0]))
    assert len(sweeps_match_replays(rng, problem, rounds=4)) == 4


def _budget(problem: Problem) -> int:
    plain = simulate(problem, ()).peak_bytes
    return problem.fixed_bytes + (plain - problem.fixed_bytes) * 6 // 10


@pytest.mark.parametrize("solver", ["auto", "ilp_offload"])
def test_solvers_stop_offloading_tiny_storages_whose_copies_cost_more_than_a_recompute(solver):
    """A small model (nodes of 1 s) on a link of unbounded rate: copies priced at their bytes are free, so
    the budget is met by offloading alone. With a fixed cost of 50 s per copy each way, every copy costs
    more than recomputing the whole model: the solvers recompute instead and offload nothing."""
    problem = offloading(mlp(6), INF)
    budget = _budget(problem)
    free = solve(problem, budget, solver)
    assert free.offloaded and not free.regions and free.recompute_time == 0.0
    costly = solve(fixed(problem, 50.0), budget, solver)
    assert not costly.offloaded and costly.regions
    assert costly.peak_bytes <= budget
    recompute_only = solve(dataclasses.replace(problem, d2h_bytes_per_s=0.0, h2d_bytes_per_s=0.0), budget, "dp")
    assert costly.recompute_time == pytest.approx(recompute_only.recompute_time)


def test_choose_offloads_weighs_the_fixed_cost_per_copy():
    """Priced per byte on a fast link every copy is free and instant, and the plan offloads 9 storages for the
    lowest peak. With a fixed cost of one node's time per copy, the forward's stream falls behind: a copy
    frees its bytes only when the copies queued before it are done, so more copies buy no lower peak. The
    plan is the brute-force best and makes fewer copies."""
    problem = offloading(mlp(6, a=60), INF)
    budget = _budget(problem)
    free, _ = choose_offloads(problem, budget, exhaustive=12)
    priced = fixed(problem, 1.0)
    offloaded, sim = choose_offloads(priced, budget, exhaustive=12)
    best = min((simulate(priced, offloaded=s).recompute_time, simulate(priced, offloaded=s).peak_bytes)
               for s in _fitting_subsets(priced, budget))
    assert (sim.recompute_time, sim.peak_bytes) == best
    assert len(offloaded) < len(free) == 9


def _fitting_subsets(problem: Problem, budget: int):
    import itertools

    cands = [t for t in offloadable(problem) if problem.storages[t].nbytes > 0]
    for size in range(1, len(cands) + 1):
        for subset in itertools.combinations(cands, size):
            if simulate(problem, offloaded=subset).peak_bytes <= budget:
                yield subset


def test_problem_round_trip_keeps_the_fixed_costs_and_old_problems_load_without():
    problem = dataclasses.replace(offloading(chain(3), 1e10), d2h_fixed_s=2e-5, h2d_fixed_s=3e-5)
    back = Problem.from_dict(problem.to_dict())
    assert (back.d2h_fixed_s, back.h2d_fixed_s) == (2e-5, 3e-5)
    old = {k: v for k, v in problem.to_dict().items() if k not in ("d2h_fixed_s", "h2d_fixed_s")}
    assert (Problem.from_dict(old).d2h_fixed_s, Problem.from_dict(old).h2d_fixed_s) == (0.0, 0.0)
    with pytest.raises(ValueError, match="d2h_fixed_s"):
        dataclasses.replace(problem, d2h_fixed_s=-1.0)

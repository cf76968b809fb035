"""`simulate`'s interval sweep against `replay`, the event-by-event reference: the same figures, to the byte
and to the last bit of the seconds, on random graphs and plans (nested regions, kept ops, random-generator
states, call and hook costs), on the MLP fixture with the solvers' own plans, and with cached layouts reused.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import random
from pathlib import Path

import pytest
from ckpt_planner.solvers import InfeasibleBudgetError, Problem, simulate, solve
from ckpt_planner.solvers.heuristics.selective import block_regions
from ckpt_planner.solvers.problem import Cast, Node, ProblemError, Storage
from ckpt_planner.solvers.simulate import LAYOUTS_KEPT, normalize_regions, region_parents, replay

from .test_solvers_problems import random_chain, random_dag

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "mlp8_problem.json"


def figures(sim) -> tuple:
    return (sim.peak_bytes, sim.recompute_time, sim.call_time, sim.hook_time, sim.peak_phase, sim.peak_node,
            sim.breakdown)


def assert_same(problem: Problem, regions, saved=()) -> None:
    assert figures(simulate(problem, regions, saved=saved)) == figures(replay(problem, regions, saved=saved))


def with_casts(rng: random.Random, problem: Problem) -> Problem:
    """The problem with a few autocast casts of parameters, read and saved by random nodes, let go by the
    cache at the first recompute (as on autograd's device thread)."""
    casts = []
    for _ in range(rng.randint(1, 4)):
        readers = sorted(rng.sample(range(problem.n), rng.randint(1, min(4, problem.n))))
        savers = tuple(k for k in readers if rng.random() < 0.6)
        casts.append(Cast(nbytes=rng.randint(1, 9), readers=tuple(readers), savers=savers))
    return dataclasses.replace(problem, casts=tuple(casts), casts_cleared=True,
                               param_bytes=problem.param_bytes + sum(c.nbytes for c in casts))


def with_costs(rng: random.Random, problem: Problem) -> Problem:
    """The problem with random generator states, kept-op candidates, hook counts and per-call costs, and
    half the time autocast's casts (`with_casts`)."""
    nodes = tuple(
        dataclasses.replace(
            node, rng_state_bytes=rng.choice([0, 0, 0, 3]), saveable=rng.random() < 0.5,
            saved_tensors=rng.randint(0, 3), dispatch_ops=rng.randint(1, 3), time=rng.choice([node.time, rng.random()]),
        )
        for node in problem.nodes
    )
    problem = dataclasses.replace(
        problem, nodes=nodes, saved_overhead_s=rng.choice([0.0, 0.0137]), op_overhead_s=rng.choice([0.0, 0.003]),
        region_overhead_s=rng.choice([0.0, 0.1]), optimizer_bytes=rng.randint(0, 5),
    )
    return with_casts(rng, problem) if rng.random() < 0.5 else problem


def nested_plan(rng: random.Random, problem: Problem) -> tuple[tuple[int, int], ...]:
    """Random laminar regions, up to four deep, over recomputable nodes."""
    regions: list[tuple[int, int]] = []

    def fill(lo: int, hi: int, depth: int) -> None:
        pos = lo
        while pos <= hi and depth < 4:
            if rng.random() < 0.4:
                end = rng.randint(pos, hi)
                if all(problem.nodes[i].recomputable for i in range(pos, end + 1)):
                    regions.append((pos, end))
                    fill(pos + rng.randint(0, 1), end - rng.randint(0, 1), depth + 1)
                pos = end + 1
            else:
                pos += 1

    fill(0, problem.n - 1, 0)
    return normalize_regions(problem, regions)


def kept_ops(rng: random.Random, problem: Problem, regions) -> tuple[int, ...]:
    """A random subset of the saveable nodes of regions that neither nest nor are nested."""
    parents = region_parents(regions)
    nested = {p for p in parents if p >= 0} | {r for r, p in enumerate(parents) if p >= 0}
    return tuple(
        i for r, (s, e) in enumerate(regions) if r not in nested for i in range(s, e + 1)
        if problem.nodes[i].saveable and rng.random() < 0.5
    )


@pytest.mark.parametrize("seed", range(40))
def test_sweep_equals_replay_on_random_plans(seed):
    rng = random.Random(seed)
    for _ in range(25):
        n = rng.randint(1, 30)
        problem = with_costs(rng, random_chain(rng, n) if rng.random() < 0.3 else random_dag(rng, n))
        regions = nested_plan(rng, problem)
        assert_same(problem, regions)
        assert_same(problem, regions, kept_ops(rng, problem, regions))  # the same layout, reused
        outer = tuple(r for r, p in zip(regions, region_parents(regions)) if p < 0)
        assert_same(problem, outer, kept_ops(rng, problem, outer))  # flat: every region may keep ops


def test_sweep_equals_replay_on_the_solvers_plans():
    problem = Problem.from_dict(json.loads(FIXTURE.read_text())["problem"])
    problem = dataclasses.replace(problem, nodes=tuple(dataclasses.replace(node, saveable=True) for node in problem.nodes))
    base = replay(problem)
    blocks = block_regions(problem)
    assert_same(problem, ())
    assert_same(problem, blocks, [i for s, e in blocks for i in range(s, e + 1) if (i - s) % 2 == 0])
    for fraction in (0.5, 0.7, 0.9):
        budget = problem.fixed_bytes + int(fraction * (base.peak_bytes - problem.fixed_bytes))
        for solver in ("uniform", "greedy", "dp", "selective", "structured"):
            try:
                sol = solve(problem, budget, solver)
            except InfeasibleBudgetError:
                continue
            assert_same(problem, sol.regions, sol.saved)


def test_cached_layouts_stay_exact_after_eviction():
    rng = random.Random(7)
    problem = with_costs(rng, random_dag(rng, 24))
    plans = [nested_plan(rng, problem) for _ in range(3 * LAYOUTS_KEPT)]
    for regions in plans + plans[::-1]:
        assert_same(problem, regions, kept_ops(rng, problem, regions))
    assert len(problem.arrays.layouts) <= LAYOUTS_KEPT


def test_negative_sizes_are_replayed():
    rng = random.Random(3)
    problem = random_dag(rng, 12)
    nodes = tuple(dataclasses.replace(node, temp_bytes=-2 if i % 3 else 1) for i, node in enumerate(problem.nodes))
    problem = dataclasses.replace(problem, nodes=nodes)
    assert not problem.arrays.nonnegative
    regions = nested_plan(rng, problem)
    assert_same(problem, regions)


def test_problem_arrays_are_derived_not_carried():
    problem = random_dag(random.Random(5), 10)
    simulate(problem, ())
    assert "arrays" in problem.__dict__
    copy = pickle.loads(pickle.dumps(problem))
    assert copy == problem and "arrays" not in copy.__dict__
    renamed = dataclasses.replace(problem, name="other")
    assert "arrays" not in renamed.__dict__
    assert figures(simulate(copy, ())) == figures(simulate(problem, ()))


def test_casts_go_with_the_first_recompute_and_come_back_with_each_later_one():
    """Four nodes in two regions; a 100-byte cast read and saved by nodes 1 and 3. Where the first recompute
    empties autocast's cache, the cast goes after node 3's backward (its last holder), is made again by the
    second recompute at node 1, and goes after node 1's backward; held by the cache, it stays throughout."""
    nodes = tuple(Node(name=f"n{i}", time=1.0, inputs=(i - 1,) if i else (), reads=(i - 1,) if i else ())
                  for i in range(4))
    storages = tuple(Storage(producer=i, nbytes=10, last_use=min(i + 1, 3), saved_by=(i + 1,) if i < 3 else ())
                     for i in range(4))
    cleared = Problem(nodes=nodes, storages=storages, param_bytes=1000, casts=(Cast(100, (1, 3), (1, 3)),),
                      casts_cleared=True)
    held = dataclasses.replace(cleared, casts_cleared=False)
    regions = ((0, 1), (2, 3))
    before, after = (replay(p, regions, timeline=True).timeline for p in (held, cleared))
    assert [e[:2] for e in before] == [e[:2] for e in after]
    gone = [b - a for (_, _, b), (_, _, a) in zip(before, after)]
    phases = [e[:2] for e in before]
    back3 = phases.index(("backward", 3)) + 1  # after node 3's backward released what it held
    remake = phases.index(("recompute", 1))
    assert gone[:back3] == [0] * back3  # the forward, the first recompute and node 3's backward: all held
    assert set(gone[back3:remake]) == {100}  # gone until the second recompute reaches node 1
    assert gone[remake] == 0 and gone[-1] == 100  # made again there, gone again after node 1's backward
    for p in (held, cleared):
        assert_same(p, regions)
    assert_same(cleared, ())  # no recompute: the cache is never emptied
    assert simulate(cleared, ()).peak_bytes == simulate(held, ()).peak_bytes


def test_casts_survive_the_problem_file_and_bad_ones_are_named():
    rng = random.Random(3)
    problem = with_casts(rng, random_dag(rng, 12))
    back = Problem.from_dict(json.loads(json.dumps(problem.to_dict())))
    assert back.casts == problem.casts and back.casts_cleared
    regions = nested_plan(rng, problem)
    assert figures(simulate(back, regions)) == figures(simulate(problem, regions))
    data = problem.to_dict()
    assert Problem.from_dict({k: v for k, v in data.items() if k not in ("casts", "casts_cleared")}).casts == ()
    for bad in ({"nbytes": 4, "readers": [99]}, {"nbytes": -1, "readers": [0]}, {"nbytes": 4, "readers": []},
                {"nbytes": 10**9, "readers": [0]}):
        with pytest.raises(ProblemError, match="casts"):
            Problem.from_dict({**data, "casts": [bad]})
